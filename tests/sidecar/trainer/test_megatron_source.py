"""MegatronBridgeSource without Megatron installed: importing the trainer package imports nothing
of Megatron, and anything without `export_hf_weights` is refused as a bridge.

Owned chunking over the real bridge (every rank drives the whole export, only owners keep their
own copies) is checked in the real Megatron ranks: megatron_publish.py `bridge_checks`, asserted
by test_megatron.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from refit_sidecar.trainer import MegatronBridgeSource


def test_importing_the_trainer_package_imports_no_megatron() -> None:
    code = (
        "import sys, refit_sidecar.trainer, refit_sidecar.trainer.megatron;"
        "bad=[m for m in sys.modules if m.startswith(('megatron','transformer_engine'))];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_not_a_bridge() -> None:
    with pytest.raises(TypeError, match="export_hf_weights"):
        MegatronBridgeSource(object(), "model-chunks")
