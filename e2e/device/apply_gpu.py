"""Device check of the apply path: bit-exact sparse apply on CUDA tensors, and its throughput.

Why: receivers apply deltas inside vLLM's GPU workers (`refit_sidecar.vllm.worker_extension`),
but every test of this repository runs on CPU. Nothing has yet shown that the storage-write
hook's XOR and masked-overwrite writes leave CUDA parameters with exactly the bits a dense load
writes, nor how fast the apply runs there. This script shows both with torch alone: the device
machine has torch (and numpy) but no vLLM, ZeroMQ, pydantic, structlog, zstandard or blake3.

What it runs: a synthetic serving model whose parameters fuse q/k/v and gate/up at row offsets
(fp32 norms, and an fp32 first attention layer so 32-bit views are fused too) and whose generic
`load_weights` copies each canonical tensor into its slice. From a random checkpoint it walks a
chain of targets, one per (rate, op): each target changes `rate` of the elements (plus signed
zeros, a mask that is a NaN pattern, and NaN payloads); the changes go through the real
`ApplyContext.apply` (prewarmed, the storage-write hook) as XOR or overwrite items, and the
model is compared with a fresh model loaded densely with the target, through integer views
(`torch.equal` on int16/int32 views, never float equality). Then the post-apply checks run on
the device, a flipped bit must be found by both the comparison and the audit (COMPARE mode),
and the audit of the final state must pass.

Imports: `refit_sidecar.apply` (context, hook, placeholders, storage, prewarm, audit),
`refit_sidecar.codec` records/dtypes/errors, `refit_sidecar.bits`/`bitdiff`/`compiled` and
`refit_protocol.limits`/`tensors` (plus the codec's wire format where its package `__init__`
can run); none of them imports vllm or zmq. Where third-party modules that these import only at
module level are absent, small stand-ins are installed and listed in the output (`stand_ins`);
see `prepare_imports`. The JSON lists every repository module loaded (`repo_modules`).

    python e2e/device/apply_gpu.py --device cuda --json --out "$OUT"   # on the device machine
    python e2e/device/apply_gpu.py --device cpu                        # the dry run (seconds)

Exit status: 0 every case bit-exact, 1 a mismatch or an apply error (named on stderr), 2 usage
(e.g. `--device cuda` without CUDA), 3 stopped by the wall-clock guard (`--time-limit`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import threading
import time
import types
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from refit_sidecar.apply import ApplyContext, ApplyStats
    from refit_sidecar.codec.records import Item, Op

REPO = Path(__file__).resolve().parents[2]
EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_TIME = 0, 1, 2, 3
#: Synthetic model size by device type: on CUDA a model a few GiB large, expected (not yet
#: measured: this has not run on a GPU) to finish well inside the guard on an H200; the CPU dry
#: run takes a few seconds on two cores.
DEFAULT_SIZE_MIB = {"cuda": 4096, "cpu": 8}
DEFAULT_RATES = (0.01, 0.05)
#: The wall-clock guard: the device tool's runs are budgeted in minutes, so stop well before 5.
DEFAULT_TIME_LIMIT_S = 270.0
JSON_NAME = "apply_gpu.json"
#: Differing tensors named in a failure message (the JSON lists all of them).
MISMATCHES_SHOWN = 8
BF16, FP32 = torch.bfloat16, torch.float32
INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: canonical leaf -> (fused serving parameter, position among its parts)
FUSED = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}
#: Third-party modules the apply path's imports touch only at module level, absent on the device.
STAND_IN_MODULES = ("structlog", "pydantic")
#: What `refit_sidecar.codec.__init__` needs for the wire format (not used by the apply path).
CODEC_INIT_NEEDS = ("zstandard", "blake3")

Layout = list[tuple[str, tuple[int, ...], torch.dtype]]


class BitMismatchError(AssertionError):
    """The sparse apply left bits that differ from a dense load of the same target."""

    def __init__(self, message: str, mismatches: Sequence[Mismatch]) -> None:
        super().__init__(message)
        self.mismatches = list(mismatches)


# -- imports without vLLM, ZeroMQ or the wire-format dependencies ---------------------------------
def _missing(module: str) -> bool:
    """Whether `module` cannot be imported here (a blocked import counts as missing)."""
    if module in sys.modules:
        return False
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        return True


def _structlog_stand_in() -> types.ModuleType:
    """structlog, as far as `refit_sidecar.compiled` uses it at import: a logger that drops
    events (it logs only when encode kernels are built, which the apply path never does)."""

    class _Quiet:
        def __getattr__(self, _name: str) -> Callable[..., None]:
            return lambda *_a, **_k: None

    module = types.ModuleType("structlog")
    module.get_logger = lambda *_a, **_k: _Quiet()  # type: ignore[attr-defined]
    return module


def _pydantic_stand_in() -> types.ModuleType:
    """pydantic, as far as `refit_protocol.tensors` needs it to define its message model: the
    apply path reads only that module's dtype table. Building a model fails loudly."""

    class BaseModel:
        def __init__(self, *_a: object, **_k: object) -> None:
            raise RuntimeError("pydantic is not installed: apply_gpu.py's stand-in cannot validate")

    module = types.ModuleType("pydantic")
    module.BaseModel = BaseModel  # type: ignore[attr-defined]
    module.ConfigDict = dict  # type: ignore[attr-defined]
    module.Field = lambda *_a, **_k: None  # type: ignore[attr-defined]
    module.NonNegativeInt = int  # type: ignore[attr-defined]
    module.model_validator = lambda **_k: lambda fn: fn  # type: ignore[attr-defined]
    return module


def _bare_codec_package() -> None:
    """`refit_sidecar.codec` registered without running its `__init__` (which imports the wire
    format: zstandard, blake3), so its submodules `records`, `dtypes`, `errors` import alone."""
    import refit_sidecar

    path = Path(refit_sidecar.__file__).parent / "codec"
    spec = importlib.util.spec_from_file_location(
        "refit_sidecar.codec", path / "__init__.py", submodule_search_locations=[str(path)]
    )
    assert spec is not None
    module = importlib.util.module_from_spec(spec)  # not executed
    sys.modules["refit_sidecar.codec"] = module
    refit_sidecar.codec = module


def prepare_imports() -> list[str]:
    """Make the apply path importable from this checkout with torch (and numpy) alone; returns
    what it stood in for. Only module-level needs are stood in: any real use fails loudly."""
    for sub in ("protocol", "sidecar"):
        path = str(REPO / sub)
        if path not in sys.path:
            sys.path.insert(0, path)  # this checkout's packages, installed or not
    stood_in = []
    makers = {"structlog": _structlog_stand_in, "pydantic": _pydantic_stand_in}
    for name in STAND_IN_MODULES:
        if _missing(name):
            sys.modules[name] = makers[name]()
            stood_in.append(name)
    if "refit_sidecar.codec" not in sys.modules and any(_missing(m) for m in CODEC_INIT_NEEDS):
        _bare_codec_package()
        stood_in.append("refit_sidecar.codec.__init__")
    return stood_in


# -- the synthetic serving model ----------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """Dimensions of a dense decoder (grouped KV heads, gated MLP)."""

    hidden: int
    ffn: int
    kv: int
    vocab: int

    def layer(self, i: int) -> Layout:
        """Canonical tensors of layer `i`; layer 0's attention is fp32 (32-bit fused views)."""
        d, f, kv, p = self.hidden, self.ffn, self.kv, f"model.layers.{i}."
        attn = FP32 if i == 0 else BF16
        return [
            (p + "input_layernorm.weight", (d,), FP32),
            (p + "self_attn.q_proj.weight", (d, d), attn),
            (p + "self_attn.k_proj.weight", (kv, d), attn),
            (p + "self_attn.v_proj.weight", (kv, d), attn),
            (p + "self_attn.o_proj.weight", (d, d), attn),
            (p + "post_attention_layernorm.weight", (d,), FP32),
            (p + "mlp.gate_proj.weight", (f, d), BF16),
            (p + "mlp.up_proj.weight", (f, d), BF16),
            (p + "mlp.down_proj.weight", (d, f), BF16),
        ]


#: Largest first; the model takes the largest shape of which 4 layers fit the size asked.
SHAPES = (
    Shape(hidden=4096, ffn=14336, kv=1024, vocab=32000),
    Shape(hidden=2048, ffn=5632, kv=512, vocab=32000),
    Shape(hidden=1024, ffn=2816, kv=256, vocab=16000),
    Shape(hidden=256, ffn=704, kv=64, vocab=2000),
    Shape(hidden=64, ffn=176, kv=16, vocab=512),
)


def _nbytes(layout: Layout) -> int:
    return sum(math.prod(s) * torch.empty((), dtype=dt).element_size() for _, s, dt in layout)


def build_layout(size_bytes: int) -> tuple[Shape, Layout]:
    """Canonical tensors in export order: enough layers (at least 2) to reach `size_bytes`."""
    for shape in SHAPES:
        head = [("model.embed_tokens.weight", (shape.vocab, shape.hidden), BF16)]
        tail = [
            ("model.norm.weight", (shape.hidden,), FP32),
            ("lm_head.weight", (shape.vocab, shape.hidden), BF16),
        ]
        fixed, per_layer = _nbytes(head + tail), _nbytes(shape.layer(1))
        if fixed + 4 * per_layer <= size_bytes or shape is SHAPES[-1]:
            layers = max(2, math.ceil((size_bytes - fixed) / per_layer))
            return shape, head + [t for i in range(layers) for t in shape.layer(i)] + tail
    raise AssertionError("unreachable")


class FusedServingModel(torch.nn.Module):
    """Parameters in a serving layout (q/k/v and gate/up fused at row offsets); the only way in
    is a generic `load_weights` that copies each canonical tensor into its slice."""

    def __init__(self, layout: Layout, device: torch.device) -> None:
        """Every byte starts as 0xFF (a NaN pattern), so a position no load wrote is seen."""
        super().__init__()
        self.slots: dict[str, tuple[str, int, int]] = {}  # canonical -> (param, offset, rows)
        groups: dict[str, list[tuple[str, tuple[int, ...], torch.dtype]]] = {}
        for name, shape, dtype in layout:
            prefix, _, leaf = name.removesuffix(".weight").rpartition(".")
            target = f"{prefix}.{FUSED[leaf]}" if leaf in FUSED else name.removesuffix(".weight")
            groups.setdefault(target, []).append((name, shape, dtype))
        self.params = torch.nn.ParameterDict()
        for target, parts in groups.items():
            dtypes = {dt for _, _, dt in parts}
            assert len(dtypes) == 1, f"{target}: fused parts of different dtypes {dtypes}"
            rows = sum(s[0] for _, s, _ in parts)
            data = torch.empty((rows, *parts[0][1][1:]), dtype=parts[0][2], device=device)
            int_view(data).fill_(-1)
            key = target.replace(".", "__")
            self.params[key] = torch.nn.Parameter(data, requires_grad=False)
            offset = 0
            for name, s, _ in parts:
                self.slots[name] = (key, offset, s[0])
                offset += s[0]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """What a runtime's loader does: look up the slice, `copy_` into it, report the param."""
        loaded = set()
        for name, w in weights:
            key, offset, _ = self.slots[name]
            self.params[key].data.narrow(0, offset, w.shape[0]).copy_(w)
            loaded.add(f"params.{key}")
        return loaded

    def canonical_view(self, name: str) -> torch.Tensor:
        """The slice of a fused parameter that holds canonical tensor `name`."""
        key, offset, rows = self.slots[name]
        param: torch.Tensor = self.params[key]
        return param.data.narrow(0, offset, rows)


# -- bit comparison (integer views only) -----------------------------------------------------------
def int_view(t: torch.Tensor) -> torch.Tensor:
    """Same-shape integer view of `t`'s stored bits: +0.0 and -0.0 differ, equal NaNs match."""
    return t.view(INT_VIEW[t.element_size()])


def count_differing(got: torch.Tensor, want: torch.Tensor) -> int:
    """Elements whose stored bits differ (never a float comparison)."""
    if got.shape != want.shape or got.element_size() != want.element_size():
        raise ValueError(f"cannot compare {got.dtype}{tuple(got.shape)} with {want.dtype}")
    a, b = int_view(got), int_view(want)
    return 0 if torch.equal(a, b) else int((a != b).sum())


@dataclass(frozen=True)
class Mismatch:
    """One canonical tensor whose bits differ from the dense reference."""

    tensor: str
    parameter: str
    count: int
    numel: int


def compare_bits(got: FusedServingModel, want: FusedServingModel) -> list[Mismatch]:
    """Every canonical slice of `got` against `want` (the slices tile every parameter)."""
    out = []
    for name, (key, _, _) in got.slots.items():
        a, b = got.canonical_view(name), want.canonical_view(name)
        n = count_differing(a, b)
        if n:
            out.append(Mismatch(name, f"params.{key}", n, a.numel()))
    return out


def require_exact(case: str, mismatches: Sequence[Mismatch]) -> None:
    """Raise `BitMismatchError` naming each differing tensor and its count."""
    if mismatches:
        parts = [f"{m.tensor} ({m.parameter}): {m.count} of {m.numel}" for m in mismatches]
        if len(parts) > MISMATCHES_SHOWN:
            parts[MISMATCHES_SHOWN:] = [f"and {len(parts) - MISMATCHES_SHOWN} more tensors"]
        total = sum(m.count for m in mismatches)
        raise BitMismatchError(
            f"{case}: {total} element(s) differ from a dense load in {len(mismatches)} "
            "tensor(s): " + "; ".join(parts),
            mismatches,
        )


def dense_reference(
    layout: Layout, state: dict[str, torch.Tensor], device: torch.device
) -> FusedServingModel:
    """A fresh model (poisoned) loaded densely with `state`: what a full refit writes."""
    model = FusedServingModel(layout, device)
    model.load_weights(state.items())
    return model


# -- checkpoints and updates ----------------------------------------------------------------------
#: Forced changes at fixed positions, as XOR masks on the integer view: in the first bf16 tensor
#: +0.0 <-> -0.0 and 1.0 <-> 3.0 (the mask 0x7FC0 is a NaN pattern in scratch); in the first
#: fp32 tensor a NaN whose payload changes (overwrite items then carry a NaN value, so the
#: exact-bit placeholder is used instead of NaN).
SPECIAL_MASKS: dict[torch.dtype, list[tuple[int, int]]] = {
    BF16: [(0, -0x8000), (1, 0x7FC0)],
    FP32: [(0, 0x1)],
}


def _special_names(layout: Layout) -> dict[str, torch.dtype]:
    """The first tensor of each dtype in SPECIAL_MASKS."""
    out: dict[str, torch.dtype] = {}
    for name, _, dtype in layout:
        if dtype in SPECIAL_MASKS and dtype not in out.values():
            out[name] = dtype
    return out


def initial_state(
    layout: Layout, device: torch.device, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """N(0, 0.02) matrices and norms near 1, drawn on the device, with the special values."""
    out = {}
    specials = _special_names(layout)
    for name, shape, dtype in layout:
        t = torch.randn(shape, generator=generator, device=device, dtype=FP32)
        t = (t * 0.1 + 1.0) if len(shape) == 1 else (t * 0.02)
        t = t.to(dtype).contiguous()
        flat = t.view(-1)
        if specials.get(name) == BF16:
            flat[0], flat[1] = 0.0, 1.0
        elif specials.get(name) == FP32:
            flat[0] = float("nan")
        out[name] = t
    return out


def perturb(
    state: dict[str, torch.Tensor], rate: float, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """A new target: `rate` of each tensor's elements get new low mantissa bits (values stay
    finite), plus the forced special changes."""
    out = {}
    specials = _special_names([(n, tuple(t.shape), t.dtype) for n, t in state.items()])
    for name, t in state.items():
        bits = int_view(t).reshape(-1)
        pick = torch.rand(bits.shape, generator=generator, device=t.device) < rate
        mask = torch.randint(
            1, 128, bits.shape, generator=generator, device=t.device, dtype=bits.dtype
        )
        new = torch.where(pick, bits ^ mask, bits)
        if name in specials:
            for pos, m in SPECIAL_MASKS[specials[name]]:
                new[pos] = bits[pos] ^ m
        out[name] = new.view(t.dtype).reshape(t.shape)
    return out


def build_items(
    old: dict[str, torch.Tensor],
    new: dict[str, torch.Tensor],
    op: Op,
    stage: torch.device,
) -> tuple[list[Item], int]:
    """Items that turn `old` into `new` (XOR masks or new bits at the changed positions), held
    on `stage` (the host, as a vLLM worker reads them from the decoded payload file)."""
    from refit_sidecar.codec.records import Item, Op, TensorMeta

    items, values = [], 0
    for name, t in new.items():
        o, n = int_view(old[name]).reshape(-1), int_view(t).reshape(-1)
        locs = torch.nonzero(o != n).reshape(-1)
        if locs.numel() == 0:
            continue
        vals = (o[locs] ^ n[locs]) if op is Op.XOR else n[locs]
        meta = TensorMeta(name, tuple(t.shape), t.dtype)
        items.append(Item(meta, op, None, locs.to(stage), vals.to(stage)))
        values += int(locs.numel())
    return items, values


# -- apply cases ----------------------------------------------------------------------------------
@dataclass
class CaseResult:
    """One (rate, op) step of the chain: timings, figures, and the bit-exact verdict."""

    rate: float
    op: str
    check_samples: int
    items: int = 0
    values: int = 0
    canonical_bytes: int = 0
    wall_s: list[float] = field(default_factory=list)
    device_s: list[float] = field(default_factory=list)
    checks: int = 0
    bit_exact: bool = False
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    error: str = ""

    @property
    def name(self) -> str:
        return f"rate {self.rate:g} {self.op}" + (" +checks" if self.check_samples else "")

    def to_json(self) -> dict[str, Any]:
        wall = statistics.median(self.wall_s) if self.wall_s else 0.0
        out = asdict(self) | {"median_wall_s": wall}
        out["values_per_s"] = self.values / wall if wall else 0.0
        out["canonical_gbps"] = self.canonical_bytes / wall / 1e9 if wall else 0.0
        out["median_device_s"] = statistics.median(self.device_s) if self.device_s else None
        return out


def _timing_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def timed_apply(
    ctx: ApplyContext, items: Sequence[Item], check_samples: int
) -> tuple[ApplyStats, float, float | None]:
    """One `ctx.apply`: wall seconds (device synchronized before and after, as the worker
    synchronizes before it acknowledges) and, on CUDA, the event time of the same span."""
    if ctx.device.type != "cuda":
        t0 = time.perf_counter()
        stats = ctx.apply(items, check_samples=check_samples)
        return stats, time.perf_counter() - t0, None
    start, end = _timing_event(), _timing_event()
    torch.cuda.synchronize(ctx.device)
    t0 = time.perf_counter()
    start.record()
    stats = ctx.apply(items, check_samples=check_samples)
    end.record()
    torch.cuda.synchronize(ctx.device)
    return stats, time.perf_counter() - t0, start.elapsed_time(end) / 1e3


def run_case(
    ctx: ApplyContext,
    model: FusedServingModel,
    layout: Layout,
    target: dict[str, torch.Tensor],
    items: Sequence[Item],
    result: CaseResult,
    repeats: int,
) -> None:
    """Apply, compare with a dense load of `target`, then repeat for timing (XOR alternates
    back and forth, overwrite is idempotent) and compare again; fills `result`."""
    from refit_sidecar.codec.records import Op

    ref = dense_reference(layout, target, ctx.device)
    for i in range(repeats):
        stats, wall, dev = timed_apply(ctx, items, result.check_samples)
        result.wall_s.append(wall)
        if dev is not None:
            result.device_s.append(dev)
        result.checks += stats.checks
        result.canonical_bytes = stats.canonical_bytes
        if i == 0:
            require_exact(result.name, compare_bits(model, ref))
    if result.op == Op.XOR.name.lower() and repeats % 2 == 0:
        ctx.apply(items)  # back to the target after an even number of XOR applies
    require_exact(f"{result.name} after {repeats} applies", compare_bits(model, ref))
    result.bit_exact = True


def warm_up(ctx: ApplyContext, state: dict[str, torch.Tensor], generator: torch.Generator) -> None:
    """Load the kernels both ops use without changing a bit: XOR items twice, then overwrite
    items that write the bits already held."""
    from refit_sidecar.codec.records import Op

    other = perturb(state, 0.001, generator)
    stage = torch.device("cpu")
    xor, _ = build_items(state, other, Op.XOR, stage)
    same, _ = build_items(other, state, Op.OVERWRITE, stage)
    ctx.apply(xor)
    ctx.apply(xor)
    ctx.apply(same)


def negative_control(
    ctx: ApplyContext,
    model: FusedServingModel,
    layout: Layout,
    state: dict[str, torch.Tensor],
) -> dict[str, Any]:
    """One flipped bit in a fused slice must be found by `compare_bits` and by the audit
    (COMPARE mode on the device); restored, the audit of the final state must pass."""
    from refit_sidecar.apply.audit import audit

    name = next(n for n, _, dt in reversed(layout) if n.endswith("k_proj.weight") and dt == BF16)
    cell = int_view(model.canonical_view(name)).view(-1)[3:4]
    cell.bitwise_xor_(torch.ones_like(cell))
    ref = dense_reference(layout, state, cell.device)
    found = compare_bits(model, ref)
    flipped = audit(ctx, state.items())
    cell.bitwise_xor_(torch.ones_like(cell))
    t0 = time.perf_counter()
    clean = audit(ctx, state.items())
    if cell.device.type == "cuda":
        torch.cuda.synchronize(cell.device)
    audit_s = time.perf_counter() - t0
    out = {
        "flipped_tensor": name,
        "compare_found": [asdict(m) for m in found],
        "audit_found": [(m.name, m.count) for m in flipped.mismatches],
        "audit_elements": clean.elements,
        "audit_s": audit_s,
        "final_audit_ok": clean.ok,
    }
    out["ok"] = (
        [(m.tensor, m.count) for m in found] == [(name, 1)]
        and out["audit_found"] == [(name, 1)]
        and clean.ok
        and not compare_bits(model, ref)
    )
    return out


# -- the run --------------------------------------------------------------------------------------
def say(msg: str) -> None:
    print(f"[apply_gpu] {msg}", file=sys.stderr, flush=True)


def device_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "device": str(device),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if device.type == "cuda":
        info |= {"device_name": torch.cuda.get_device_name(device), "cuda": torch.version.cuda}
    else:
        info |= {
            "device_name": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
        }
    return info


def run(args: argparse.Namespace, report: dict[str, Any]) -> int:
    """Everything after argument checks; fills `report` as it goes (the guard may dump it)."""
    report["stand_ins"] = prepare_imports()
    from refit_sidecar.apply import ApplyContext, ApplyError, prewarm
    from refit_sidecar.codec.records import Op, TensorMeta

    report["repo_modules"] = sorted(m for m in sys.modules if m.startswith("refit_"))
    device = torch.device(args.device)
    stage = device if args.stage == "device" else torch.device("cpu")
    generator = torch.Generator(device=device).manual_seed(args.seed)
    shape, layout = build_layout(args.size_mib << 20)
    report["model"] = {
        "size_bytes": _nbytes(layout),
        "shape": asdict(shape),
        "tensors": len(layout),
        "fp32_tensors": sum(dt == FP32 for _, _, dt in layout),
    }
    say(f"{_nbytes(layout) / 2**20:.0f} MiB synthetic model, {len(layout)} tensors, {shape}")
    state = initial_state(layout, device, generator)
    model = dense_reference(layout, state, device)
    ctx = ApplyContext(model, {n: TensorMeta(n, s, dt) for n, s, dt in layout}, device=device)
    t0 = time.perf_counter()
    prewarmed = prewarm(ctx)
    report["prewarm"] = prewarmed.to_json() | {"seconds": time.perf_counter() - t0}
    if prewarmed.unsupported or prewarmed.xor_incompatible or prewarmed.skipped:
        report["failures"] = [f"prewarm: loader not fully XOR-compatible: {prewarmed.to_json()}"]
        return EXIT_FAIL
    warm_up(ctx, state, generator)
    plan = [(r, op, args.check_samples) for r in args.rates for op in (Op.XOR, Op.OVERWRITE)]
    plan += [(min(args.rates), op, -1) for op in (Op.XOR, Op.OVERWRITE)]  # post-apply checks
    cases: list[dict[str, Any]] = report.setdefault("cases", [])
    failures = []
    for rate, op, checks in plan:
        target = perturb(state, rate, generator)
        items, values = build_items(state, target, op, stage)
        result = CaseResult(rate, op.name.lower(), checks, len(items), values)
        try:
            run_case(ctx, model, layout, target, items, result, args.repeats if checks >= 0 else 1)
        except (BitMismatchError, ApplyError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, BitMismatchError):
                result.mismatches = [asdict(m) for m in exc.mismatches]
            failures.append(result.error)
            say(f"FAIL: {result.error}")
            model.load_weights(target.items())  # resynchronize; the chain goes on
        cases.append(result.to_json())
        say(_row(cases[-1]))
        state = target
    report["negative_control"] = negative_control(ctx, model, layout, state)
    if not report["negative_control"]["ok"]:
        failures.append(f"negative control: {report['negative_control']}")
        say(f"FAIL: a flipped bit was not found exactly once: {report['negative_control']}")
    report["bit_exact"] = not failures
    report["failures"] = failures
    return EXIT_FAIL if failures else EXIT_OK


TABLE_HEADER = (
    f"{'case':<27} {'items':>6} {'values':>12} {'median ms':>10} {'M values/s':>11} "
    f"{'canon. GB/s':>11} {'checks':>7}  bit-exact"
)


def _row(case: dict[str, Any]) -> str:
    name = f"rate {case['rate']:g} {case['op']}" + (" +checks" if case["check_samples"] else "")
    return (
        f"{name:<27} {case['items']:>6} {case['values']:>12,} {case['median_wall_s'] * 1e3:>10.2f} "
        f"{case['values_per_s'] / 1e6:>11.1f} {case['canonical_gbps']:>11.2f} {case['checks']:>7}"
        f"  {'yes' if case['bit_exact'] else 'NO'}"
    )


def format_table(report: dict[str, Any]) -> str:
    """The human summary: device, model, one row per case, the negative control."""
    info, model = report.get("info", {}), report.get("model", {})
    lines = [
        f"apply_gpu on {info.get('device')} ({info.get('device_name')}), torch {info.get('torch')}"
        f", {model.get('size_bytes', 0) / 2**20:.0f} MiB, {model.get('tensors')} tensors "
        f"({model.get('fp32_tensors')} fp32), items staged on {report.get('stage')}, "
        f"stand-ins: {', '.join(report.get('stand_ins', [])) or 'none'}",
        TABLE_HEADER,
        *(_row(c) for c in report.get("cases", [])),
    ]
    neg = report.get("negative_control")
    if neg:
        lines.append(
            f"negative control, 1 flipped bit in {neg['flipped_tensor']}: "
            f"compare found {[(m['tensor'], m['count']) for m in neg['compare_found']]}, "
            f"audit found {neg['audit_found']}; final audit "
            f"{'ok' if neg['final_audit_ok'] else 'FAILED'} "
            f"({neg['audit_elements']:,} elements, {neg['audit_s']:.2f} s)"
        )
    lines.append(f"bit-exact: {report.get('bit_exact')}, {report.get('elapsed_s', 0):.1f} s")
    return "\n".join(lines)


def write_json(report: dict[str, Any], out: Path | None, to_stdout: bool) -> None:
    text = json.dumps(report, sort_keys=True, default=str)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / JSON_NAME).write_text(text + "\n")
    if to_stdout:
        print(text, flush=True)


def start_guard(
    limit_s: float, report: dict[str, Any], args: argparse.Namespace
) -> threading.Timer:
    """The hard wall-clock guard: a daemon timer that reports and ends the process, even while
    the main thread is inside a long device call."""

    def expire() -> None:
        msg = (
            f"apply_gpu: stopped by the wall-clock guard after {limit_s:g} s (--time-limit); "
            f"{len(report.get('cases', []))} cases finished; partial JSON has completed=false"
        )
        print(msg, file=sys.stderr, flush=True)
        try:
            partial = json.loads(json.dumps(report, default=str))
            partial |= {"completed": False, "stopped_by": "time limit", "bit_exact": False}
            write_json(partial, args.out, args.json)
        finally:
            os._exit(EXIT_TIME)

    timer = threading.Timer(limit_s, expire)
    timer.daemon = True
    timer.start()
    return timer


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="apply_gpu.py",
        description=(
            "Check that KubeRefit's sparse apply (XOR and overwrite through the storage-write "
            "hook, synthetic fused loader) leaves exactly the bits of a dense load, on CUDA or "
            "CPU, and measure its throughput. Needs torch only (no vLLM)."
        ),
        epilog="Exit: 0 bit-exact, 1 mismatch/apply error, 2 usage or no CUDA, 3 time limit.",
    )
    p.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (the dry run)")
    p.add_argument(
        "--size-mib",
        type=int,
        default=None,
        help=f"synthetic model size (default {DEFAULT_SIZE_MIB['cuda']} on cuda, "
        f"{DEFAULT_SIZE_MIB['cpu']} on cpu)",
    )
    p.add_argument(
        "--rates",
        type=_rates,
        default=DEFAULT_RATES,
        help="comma-separated change rates (default 0.01,0.05)",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed applies per case (default 3)")
    p.add_argument(
        "--stage",
        choices=("host", "device"),
        default="host",
        help="where items live before apply: host, as a vLLM worker reads them (default), "
        "or already on the device",
    )
    p.add_argument(
        "--check-samples",
        type=int,
        default=0,
        help="post-apply checks per apply in the timed cases (default 0, the receiver's "
        "default); two extra cases always run with every element checked (-1)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of every draw (default 0)")
    p.add_argument(
        "--time-limit",
        type=float,
        default=DEFAULT_TIME_LIMIT_S,
        help=f"wall-clock guard in seconds (default {DEFAULT_TIME_LIMIT_S:.0f}): exit 3 after it",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--out", type=Path, default=None, help=f"write {JSON_NAME} into this folder")
    args = p.parse_args(argv)
    if (
        args.repeats < 1
        or args.time_limit <= 0
        or (args.size_mib is not None and args.size_mib < 1)
    ):
        p.error("--repeats, --time-limit and --size-mib must be positive")
    return args


def _rates(text: str) -> tuple[float, ...]:
    rates = tuple(float(r) for r in text.split(",") if r.strip())
    if not rates or not all(0 < r < 1 for r in rates):
        raise argparse.ArgumentTypeError("rates must be in (0, 1), e.g. 0.01,0.05")
    return rates


def check_device(name: str) -> str | None:
    """None when `name` can run here; else the one-line reason."""
    try:
        device = torch.device(name)
    except RuntimeError:
        return f"apply_gpu: unknown device {name!r} (use cuda, cuda:N or cpu)"
    if device.type not in ("cuda", "cpu"):
        return f"apply_gpu: unsupported device {name!r} (use cuda, cuda:N or cpu)"
    if device.type == "cuda":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            available = torch.cuda.is_available()
        if not available:
            return (
                f"apply_gpu: --device {name} but CUDA is not available (torch {torch.__version__}"
                f", built for CUDA {torch.version.cuda}); use --device cpu for the dry run"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            return f"apply_gpu: {name} does not exist ({torch.cuda.device_count()} CUDA devices)"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    problem = check_device(args.device)
    if problem:
        print(problem, file=sys.stderr)
        return EXIT_USAGE
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    if args.size_mib is None:
        args.size_mib = DEFAULT_SIZE_MIB[device.type]
    report: dict[str, Any] = {
        "script": "e2e/device/apply_gpu.py",
        "info": device_info(device),
        "rates": list(args.rates),
        "repeats": args.repeats,
        "stage": args.stage,
        "completed": False,
        "bit_exact": False,
    }
    guard = start_guard(args.time_limit, report, args)
    t0 = time.perf_counter()
    try:
        code = run(args, report)
    except Exception as exc:  # report what ran, then fail: device time is too scarce to lose
        report.setdefault("failures", []).append(f"{type(exc).__name__}: {exc}")
        report["bit_exact"] = False
        code = EXIT_FAIL
    guard.cancel()  # finished: the guard must not overwrite the complete report
    report["elapsed_s"] = time.perf_counter() - t0
    report["completed"] = True
    print(format_table(report), file=sys.stderr if args.json else sys.stdout, flush=True)
    write_json(report, args.out, args.json)
    for failure in report.get("failures", []):
        print(f"apply_gpu: FAIL {failure}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
