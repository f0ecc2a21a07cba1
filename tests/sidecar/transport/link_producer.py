"""A producer process for the link test: run inside the trainer namespace, it sends
incompressible overwrite payloads to its root relay and prints timings as one JSON line."""

from __future__ import annotations

import argparse
import json
import time

import torch
from pydantic import SecretStr

from refit_sidecar.codec.records import TensorMeta
from refit_sidecar.codec.wire import EncodedPayload
from refit_sidecar.transport.relay.config import RootDealerConfig
from refit_sidecar.transport.relay.transport import RelayTransport, RelayTransportConfig
from tests.sidecar.receiver.models import canonical, overwrite_payload


def link_values(seed: int, tensors: int, numel: int) -> dict[str, torch.Tensor]:
    """Random new bits (int32 views) for every tensor: what the payloads overwrite."""
    g = torch.Generator().manual_seed(seed)
    return {
        f"t{i}.weight": torch.randint(-(2**31), 2**31 - 1, (numel,), generator=g, dtype=torch.int32)
        for i in range(tensors)
    }


def link_target(seed: int, tensors: int, numel: int) -> dict[str, torch.Tensor]:
    base = canonical(0, tensors, numel)
    return base | {n: v.view(torch.float32) for n, v in link_values(seed, tensors, numel).items()}


def link_payloads(attempt: str, seed: int, tensors: int, numel: int) -> list[EncodedPayload]:
    return [
        overwrite_payload(attempt, 0, i, i, TensorMeta(name, (numel,), torch.float32), v)
        for i, (name, v) in enumerate(link_values(seed, tensors, numel).items())
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--token", required=True)
    ap.add_argument("--attempt", required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tensors", type=int, default=4)
    ap.add_argument("--numel", type=int, default=2 << 20)
    args = ap.parse_args()
    ps = link_payloads(args.attempt, args.seed, args.tensors, args.numel)
    t = RelayTransport(
        RelayTransportConfig(
            root=args.root,
            token=SecretStr(args.token),
            client=RootDealerConfig(ack_timeout_s=30, min_bandwidth_bytes_s=1e6),
        )
    )
    t0 = time.monotonic()
    try:
        for p in ps:
            t.send(args.attempt, p)
        summary = t.stop_and_wait(args.attempt)
    finally:
        t.close()
    t1 = time.monotonic()
    print(
        json.dumps(
            {
                "t_start": t0,
                "t_acked": t1,
                "payloads": len(ps),
                "bytes": sum(p.size for p in ps),
                "acknowledged": summary.payloads_acknowledged,
                "errors": list(summary.errors),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
