"""A tiny native-loader model, payload builders and appliers for receiver/transport tests.

`recording_applier` / `slow_applier` are applier factories the node processes load by name
(`applier.kind = "factory"`). `SlowFakeApplier` is a fault injector: a device that applies slowly.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from refit_protocol.tensors import TensorMetaModel
from refit_sidecar.codec.encode import encode_payload
from refit_sidecar.codec.records import Item, Op, TensorMeta, diff_item
from refit_sidecar.codec.wire import CODEC_VERSION, EncodedPayload, PayloadHeader
from refit_sidecar.fingerprint import module_fingerprint
from refit_sidecar.receiver.appliers.base import ApplyReport, StagedPayload
from refit_sidecar.receiver.appliers.inprocess import InProcessApplier
from tests.harness.receivers import HARNESS_MAC_KEY

#: The token of the in-process receiver node of the service tests (conftest.py).
NODE_TOKEN = "s3cr3t-token"


def canonical(seed: int, tensors: int = 8, numel: int = 4096) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}.weight": torch.randn(numel, generator=g) for i in range(tensors)}


def perturb(
    state: dict[str, torch.Tensor], seed: int, fraction: float = 0.1
) -> dict[str, torch.Tensor]:
    """New bits at about `fraction` of every tensor's elements."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state.items():
        mask = torch.rand(t.shape, generator=g) < fraction
        mask.view(-1)[0] = True  # every tensor changes
        out[name] = torch.where(mask, torch.randn(t.shape, generator=g), t)
    return out


def metas(state: dict[str, torch.Tensor]) -> list[TensorMetaModel]:
    return [
        TensorMetaModel(name=n, shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."))
        for n, t in state.items()
    ]


class TinyModel(nn.Module):
    """One parameter per canonical tensor; `load_weights` copies (the native loader)."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.p = nn.ParameterDict(
            {_pname(n): nn.Parameter(t.clone(), requires_grad=False) for n, t in state.items()}
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = set()
        for name, w in weights:
            self.p[_pname(name)].data.copy_(w)
            loaded.add(f"p.{_pname(name)}")
        return loaded


def _pname(name: str) -> str:
    return name.replace(".", "_")


def fingerprint(state: dict[str, torch.Tensor]) -> str:
    return module_fingerprint(TinyModel(state))


def payloads(
    attempt: str,
    producer: int,
    old: dict[str, torch.Tensor],
    new: dict[str, torch.Tensor],
    *,
    op: Op = Op.XOR,
    names: Sequence[str] | None = None,
    per_payload: int = 1,
    mac_key: bytes | None = HARNESS_MAC_KEY,
) -> list[EncodedPayload]:
    """Payloads carrying the changes of `names` (one or more tensors each), orders 0..n-1,
    signed with the harness receivers' key (`mac_key=None`: unsigned)."""
    items: list[Item] = []
    for name in names if names is not None else list(new):
        item = diff_item(name, old[name], new[name], op)
        assert item is not None, name
        items.append(item)
    out = []
    for i in range(0, len(items), per_payload):
        pid = len(out)
        header = PayloadHeader(CODEC_VERSION, attempt, producer, pid, pid)
        out.append(encode_payload(header, items[i : i + per_payload], mac_key=mac_key))
    return out


def overwrite_payload(
    attempt: str,
    producer: int,
    payload_id: int,
    order: int,
    meta: TensorMeta,
    values: torch.Tensor,
    *,
    mac_key: bytes | None = HARNESS_MAC_KEY,
) -> EncodedPayload:
    """One payload overwriting every element of a tensor (values as its integer view), signed
    with the harness receivers' key."""
    item = Item(meta, Op.OVERWRITE, 0, None, values)
    return encode_payload(
        PayloadHeader(CODEC_VERSION, attempt, producer, payload_id, order), [item], mac_key=mac_key
    )


class RecordingApplier(InProcessApplier):
    """The real in-process applier; also appends what it applied (and the model's fingerprint)
    to a JSON-lines file the test reads."""

    def __init__(self, model: TinyModel, log_path: str, with_fingerprint: bool = True) -> None:
        super().__init__(model)
        self.log_path = Path(log_path)
        self.with_fingerprint = with_fingerprint

    def apply(self, batch: Sequence[StagedPayload], check_samples: int) -> ApplyReport:
        report = super().apply(batch, check_samples)
        fp = module_fingerprint(self.model) if self.with_fingerprint else ""  # type: ignore[arg-type]
        with self.log_path.open("a") as fh:
            for s in batch:
                h = s.header
                fh.write(
                    json.dumps(
                        {
                            "attempt": h.attempt,
                            "producer": h.producer,
                            "payload_id": h.payload_id,
                            "order": h.order,
                            "fingerprint": fp,
                        }
                    )
                    + "\n"
                )
        return report


class SlowFakeApplier(RecordingApplier):
    """Fault injection: a device that needs `delay_s` per payload (backpressure tests). With
    `hold_path`, the first apply also stalls until that file exists (at most `HOLD_MAX_S`): the
    test releases it once it has seen what a full queue does, however fast this machine is."""

    HOLD_MAX_S = 180.0

    def __init__(
        self,
        model: TinyModel,
        log_path: str,
        delay_s: float,
        hold_path: str | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(model, log_path, **kw)
        self.delay_s = delay_s
        self.hold = Path(hold_path) if hold_path else None

    def apply(self, batch: Sequence[StagedPayload], check_samples: int) -> ApplyReport:
        if self.hold is not None:
            deadline = time.monotonic() + self.HOLD_MAX_S
            while not self.hold.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            self.hold = None
        time.sleep(self.delay_s * len(batch))
        return super().apply(batch, check_samples)


def recording_applier(
    log_path: str, seed: int = 0, tensors: int = 8, numel: int = 4096, with_fingerprint: bool = True
) -> RecordingApplier:
    return RecordingApplier(TinyModel(canonical(seed, tensors, numel)), log_path, with_fingerprint)


def recording_settings(i: int, log: Path) -> dict[str, object]:
    """Applier settings of node `i` of a test cluster (`tests.harness.receivers.start_cluster`): the
    recording applier, logging to `log`."""
    return {
        "kind": "factory",
        "factory": "tests.sidecar.receiver.models:recording_applier",
        "options": {"log_path": str(log), "seed": 0},
    }


def slow_applier(
    log_path: str,
    delay_s: float,
    seed: int = 0,
    tensors: int = 1,
    numel: int = 4096,
    hold_path: str | None = None,
) -> SlowFakeApplier:
    model = TinyModel(canonical(seed, tensors, numel))
    return SlowFakeApplier(model, log_path, delay_s, hold_path, with_fingerprint=False)


def read_applied(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
