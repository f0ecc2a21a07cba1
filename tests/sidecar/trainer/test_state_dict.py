"""StateDictSource over modules, dicts and DTensor/FSDP2 shards (a real 2-process gloo group)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from refit_sidecar.bits import int_view
from refit_sidecar.trainer.export import plan_owned
from refit_sidecar.trainer.state_dict import StateDictSource
from tests.harness.procs import free_port


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(32, 8)
        self.proj = torch.nn.Linear(8, 8)
        self.lm_head = torch.nn.Linear(8, 32, bias=False)
        self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("scale", torch.ones(8))


def test_module_order_dedupe_and_copies() -> None:
    m = Tied().to(torch.bfloat16)
    entries = list(StateDictSource(m).entries())
    assert [e.name for e in entries] == ["scale", "embed_tokens.weight", "proj.weight", "proj.bias"]
    assert [e.name for e in StateDictSource(m, dedupe_shared=False).entries()][-1] == (
        "lm_head.weight"
    )
    got = {e.name: e.fetch(True) for e in StateDictSource(m).entries()}
    w = got["proj.weight"]
    assert w is not None
    assert torch.equal(int_view(w), int_view(m.proj.weight.detach()))
    with torch.no_grad():
        m.proj.weight.add_(1)  # the fetched tensor is a copy, not a view of the live weight
    assert not torch.equal(int_view(w), int_view(m.proj.weight.detach()))


def test_plain_state_dict() -> None:
    sd = {"a": torch.arange(6, dtype=torch.int32).reshape(2, 3), "b": torch.tensor([-0.0])}
    got = {e.name: e.fetch(True) for e in StateDictSource(sd).entries()}
    assert got.keys() == sd.keys()
    b = got["b"]
    assert b is not None
    assert int_view(b).item() == int_view(sd["b"]).item()


def _rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 7), torch.nn.Linear(7, 5), torch.nn.Linear(5, 3)
        ).to(torch.bfloat16)
        fully_shard(model, mesh=mesh)  # FSDP2: every parameter a Shard(0) DTensor
        sd = dict(model.state_dict())
        sd["replicated"] = distribute_tensor(
            torch.ones(4, dtype=torch.bfloat16), mesh, [Replicate()]
        )
        owned = {}
        for planned in plan_owned(StateDictSource(sd).entries(), 100, rank, 2):
            if planned.chunk is not None:
                owned.update(planned.chunk.tensors)
        save_file(owned, os.path.join(out, f"rank{rank}.safetensors"))
        full = {k: v.full_tensor() for k, v in sd.items()}  # a collective: both ranks
        if rank == 0:
            save_file(full, os.path.join(out, "full.safetensors"))
        dist.barrier()  # both ranks are done with every collective
    except BaseException:
        dist.destroy_process_group()
        raise
    # Leave without tearing gloo down: its teardown sometimes aborts the process ("terminate
    # called without an active exception", seen in CI with and without a barrier first). The
    # results are written and closed; the OS closes the sockets.
    os._exit(0)


def test_fsdp2_dtensors_gathered_for_owners(tmp_path: Path) -> None:
    mp.start_processes(_rank, args=(free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    full = load_file(str(tmp_path / "full.safetensors"))
    parts = [load_file(str(tmp_path / f"rank{r}.safetensors")) for r in (0, 1)]
    assert parts[0]
    assert parts[1]
    assert not parts[0].keys() & parts[1].keys()
    union = {**parts[0], **parts[1]}
    assert union.keys() == full.keys()
    for name, t in union.items():
        assert t.shape == full[name].shape, name
        assert torch.equal(int_view(t), int_view(full[name])), name
