"""`kuberefit plan`: projected refit latency, wire bytes and speedup for a deployment, from a
calibration fitted to this repository's bench results (heavy imports inside the command)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import click
from click.core import ParameterSource

from refit_protocol.transports import ALIASES, TRANSPORT_KINDS, TransportKind
from refit_tools.plan.files import MAX_INPUT_DEPTH, MAX_INPUT_FILE_BYTES, MAX_INPUT_NUMBER_CHARS
from refit_tools.plan.units import (
    LINK_BOUNDS_TEXT,
    MAX_COUNT,
    MAX_INPUT_CHARS,
    MAX_MODEL_TEXT,
    MIN_CHANGE_RATE,
    THROUGHPUT_BOUNDS_TEXT,
    parse_change_rate,
    parse_count,
    parse_rate,
    parse_size,
    parse_size_or_auto,
    parse_throughput,
)

if TYPE_CHECKING:
    from refit_tools.plan.sizing import ModelSize

PLAN_EXIT_HELP = (
    "Every figure printed is marked input, measured (with its bench source), assumed or "
    "projected. Exit codes: 0 projected (or calibrated); 1 --calibrate could not fit the "
    "results or write the calibration (or the shipped calibration is broken); 2 bad usage (a "
    "missing or impossible input, or a --calibration file that is missing, unreadable or not a "
    "plan calibration)."
)
_LINKS = " to ".join(LINK_BOUNDS_TEXT)
_THROUGHPUTS = " to ".join(THROUGHPUT_BOUNDS_TEXT)
PLAN_BOUNDS_HELP = (
    f"Bounds (anything outside is refused, exit 2): link rates {_LINKS}; throughputs "
    f"{_THROUGHPUTS}; sizes 1 byte to {MAX_MODEL_TEXT}; producers and nodes 1 to {MAX_COUNT}; "
    f"change rate {MIN_CHANGE_RATE:g} to 100%; each value at most {MAX_INPUT_CHARS} "
    "characters. Files (--safetensors-index, --hf-config, --calibration, bench results): at "
    f"most {MAX_INPUT_FILE_BYTES >> 20}MiB of JSON, nested at most {MAX_INPUT_DEPTH} levels, "
    f"numbers at most {MAX_INPUT_NUMBER_CHARS} characters (and finite in a calibration); a "
    "config.json's figures at most a billion each."
)


def _size(_ctx: click.Context, _param: click.Parameter, value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _size_or_auto(_ctx: click.Context, _param: click.Parameter, value: str) -> int | str:
    try:
        return parse_size_or_auto(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _link(_ctx: click.Context, _param: click.Parameter, value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return parse_rate(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _throughput(_ctx: click.Context, _param: click.Parameter, value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return parse_throughput(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _change(_ctx: click.Context, _param: click.Parameter, value: str) -> float:
    try:
        return parse_change_rate(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _count(_ctx: click.Context, param: click.Parameter, value: str) -> int:
    try:
        return parse_count(value, param.name or "")
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@click.command("plan", epilog=f"{PLAN_EXIT_HELP}\n\n{PLAN_BOUNDS_HELP}")
@click.option(
    "--model-bytes",
    metavar="SIZE",
    callback=_size,
    help="H, the canonical checkpoint's size: bytes or a unit (60GB = 60*10^9, 1.5TiB), "
    f"at most {MAX_MODEL_TEXT}. "
    "Give this, --safetensors-index or --hf-config. Its elements are taken as BF16 (2 bytes) "
    "unless --dtype-bytes says otherwise.",
)
@click.option(
    "--safetensors-index",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A model.safetensors.index.json: H is its metadata.total_size (exact). The index "
    "does not give the dtype: elements are taken as BF16 (2 bytes) unless --dtype-bytes says "
    "otherwise.",
)
@click.option(
    "--hf-config",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="A Hugging Face config.json: H is estimated from the architecture (hidden, "
    "intermediate and expert sizes, layers, attention and KV heads, vocabulary, tied "
    "embeddings, dtype) and marked as an estimate; the dtype's width (e.g. 4 bytes for "
    "float32) is the element width.",
)
@click.option(
    "--dtype-bytes",
    type=click.Choice(["1", "2", "4", "8"]),
    help="Bytes per element of the checkpoint (1 FP8, 2 BF16/FP16, 4 FP32, 8 FP64). The CPU "
    "costs are fitted per byte and per changed element, so at one change rate a wider dtype "
    "has fewer changed elements per byte. Default: 2 (BF16) with --model-bytes or "
    "--safetensors-index (shown as assumed); --hf-config takes it from the config's dtype.",
)
@click.option(
    "--change-rate",
    metavar="RATE",
    default="3%",
    show_default=True,
    callback=_change,
    help=f"Fraction of elements whose stored bits change per step: 0.03 or 3%; at least "
    f"{MIN_CHANGE_RATE:g}, at most 100%. The bench measured 1-5%; other rates are "
    "extrapolated (and said so).",
)
@click.option(
    "--producers",
    metavar="N",
    default="1",
    show_default=True,
    callback=_count,
    help="Producers (trainer-side sidecars) splitting H between them; each compares its share "
    f"(1 to {MAX_COUNT}).",
)
@click.option(
    "--cross-link",
    metavar="LINK",
    callback=_link,
    help="Rate between the training and rollout clusters, shared by all producers' flows "
    "(required): 100Mbit, 10Gbit/s, 400Gbps, 1.25GB/s (b/bit = bits, B = bytes); "
    f"{_LINKS}.",
)
@click.option(
    "--intra-link",
    metavar="LINK",
    default="100Gbit/s",
    show_default=True,
    callback=_link,
    help="Rate of each rollout node's link inside its cluster (relay-tree forwarding, or S3 "
    "downloads); same units and bounds as --cross-link. A relay hop forwards no faster than "
    "the relay hop throughput (--relay-hop-rate).",
)
@click.option(
    "--nodes",
    metavar="N",
    default="1",
    show_default=True,
    callback=_count,
    help="Rollout nodes; every one applies all of H's changes (relay: a balanced binary tree "
    f"of depth ceil(log2(nodes+1))); 1 to {MAX_COUNT}.",
)
@click.option(
    "--transport",
    type=click.Choice([*TRANSPORT_KINDS, *ALIASES]),
    default="zmq",
    show_default=True,
    help="Payload path, named as a RefitPolicy's spec.transport: zmq, the ZeroMQ relay tree "
    "(each payload crosses once; `relay` is its former name here), or s3 (every node's "
    "download crosses; needs an S3 transport bench result in the calibration).",
)
@click.option(
    "--chunk-size",
    metavar="SIZE|auto",
    default="auto",
    show_default=True,
    callback=_size_or_auto,
    help="Export chunk limit, a size or auto (the producer's rule: ~16 chunks per producer's "
    "share, 4-256 MiB). The first send waits for the first bucket's chunks.",
)
@click.option(
    "--bucket-size",
    metavar="SIZE|auto",
    default="auto",
    show_default=True,
    callback=_size_or_auto,
    help="Bucket target, bytes of H per payload, a size or auto (one chunk): sets the payload "
    "count, start-up and drain.",
)
@click.option(
    "--construction-rate",
    metavar="THROUGHPUT",
    callback=_throughput,
    help="Replace the measured construction throughput per producer (bytes of H per "
    f"second, e.g. 20GB/s; {_THROUGHPUTS}); the figure is then marked as an input.",
)
@click.option(
    "--apply-rate",
    metavar="THROUGHPUT",
    callback=_throughput,
    help="Replace the measured apply throughput per rollout node (bytes of H per second, "
    f"e.g. 50GB/s for GPU nodes; {_THROUGHPUTS}); the figure is then marked as an input.",
)
@click.option(
    "--relay-hop-rate",
    metavar="THROUGHPUT",
    callback=_throughput,
    help="Replace the measured relay hop throughput (payload bytes per second one relay node "
    f"receives, verifies and forwards; e.g. 5GB/s; {_THROUGHPUTS}). The calibration's figure "
    "is the transport bench's on its machine (the shipped one: loopback on a 2-vCPU VM, "
    "0.4-0.6 GB/s encrypted, 0.8-1.2 GB/s MAC-only), which then bounds fan-out and the "
    "full-checkpoint reference ahead of a fast --intra-link (a note says so); give your "
    "hosts' figure here. It is then marked as an input; the per-payload hop cost stays the "
    "measured one. It replaces the hop of every link, MAC-only and encrypted. Relay transport "
    "only.",
)
@click.option(
    "--intra-cluster",
    type=click.Choice(["mac", "encrypted"]),
    default="mac",
    show_default=True,
    help="The policy's spec.security.intraCluster: relay-to-relay links inside the rollout "
    "cluster MAC-only (their hop is the calibration's MAC-only one) or encrypted (CurveZMQ, "
    "as the link from the trainers always is). Relay transport only.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also write an SVG of latency and speedup vs the cross-cluster link rate (1/100x to "
    "100x the given rate) for this model.",
)
@click.option(
    "--calibrate",
    is_flag=True,
    help="Fit a fresh calibration from the bench results in --results-dir and use it; it is "
    "written to --calibration FILE, or to RESULTS_DIR/plan-calibration.json.",
)
@click.option(
    "--results-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Bench results for --calibrate (default: bench/results of this checkout, else of the "
    "current directory).",
)
@click.option(
    "--calibration",
    "calibration_file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Calibration file to use (default: the one shipped with KubeRefit, fitted from this "
    "repository's bench results); with --calibrate, where the fresh one is written.",
)
def plan(
    model_bytes: int | None,
    safetensors_index: Path | None,
    hf_config: Path | None,
    dtype_bytes: str | None,
    change_rate: float,
    producers: int,
    cross_link: float | None,
    intra_link: float | None,
    nodes: int,
    transport: str,
    chunk_size: int | str,
    bucket_size: int | str,
    construction_rate: float | None,
    apply_rate: float | None,
    relay_hop_rate: float | None,
    intra_cluster: str,
    as_json: bool,
    plot: Path | None,
    calibrate: bool,
    results_dir: Path | None,
    calibration_file: Path | None,
) -> None:
    """Project refit latency, wire bytes and speedup over a full-checkpoint transfer.

    Given the model size, change rate, producers, link rates, rollout nodes and transport, it
    prints the projected latency of one refit split into its stages (construction,
    cross-cluster transfer, fan-out, apply; start-up, drain and finalization) with the stage
    that bounds it, the bytes on the wire, the time to move the full checkpoint over the same
    links, and the speedup. The model's constants come from a calibration fitted to the
    `kuberefit bench refit/codec/transport` result files (docs/performance.md).
    """
    from refit_tools.plan import calibration as cal_mod
    from refit_tools.plan import sizing
    from refit_tools.plan.model import Deployment
    from refit_tools.plan.payloads import payload_regions
    from refit_tools.plan.projection import plan as make_plan
    from refit_tools.plan.projection import product_sizes, sweep
    from refit_tools.plan.report import Context, plot_rates, svg, table
    from refit_tools.plan.report import as_json as to_json

    sources = [
        (name, value)
        for name, value in (
            ("--model-bytes", model_bytes),
            ("--safetensors-index", safetensors_index),
            ("--hf-config", hf_config),
        )
        if value is not None
    ]
    if len(sources) > 1:
        raise click.UsageError(
            f"give the model size once: {' and '.join(n for n, _ in sources)} were both given"
        )
    if calibrate:
        where = results_dir or cal_mod.default_results_dir()
        try:
            calibration = cal_mod.fit(where)
        except cal_mod.CalibrationError as exc:
            raise click.ClickException(f"calibration failed: {exc}") from exc
        target = calibration_file or where / "plan-calibration.json"
        try:
            cal_mod.write(calibration, target)
        except OSError as exc:
            # mkdir of a parent that is a file says "File exists": say what is wrong instead.
            reason = (
                f"{exc.filename} is not a directory"
                if isinstance(exc, FileExistsError)
                else exc.strerror or str(exc)
            )
            raise click.ClickException(
                f"cannot write the calibration to {target}: {reason}"
            ) from None
        cal_path = str(target)
        used = [s.file for s in calibration.sources if s.used]
        click.echo(f"calibration written to {target} ({len(used)} bench results)", err=True)
        if not sources:
            click.echo(calibration.model_dump_json(indent=2) if as_json else _summary(calibration))
            return
    else:
        try:
            calibration = cal_mod.load(calibration_file)
        except cal_mod.CalibrationError as exc:
            if calibration_file is None:  # the package's own file: not the user's doing
                raise click.ClickException(str(exc)) from None
            raise click.BadParameter(str(exc), param_hint="'--calibration'") from None
        cal_path = str(calibration_file) if calibration_file else "shipped calibration"
    if not sources:
        raise click.UsageError(
            "give the model size: --model-bytes, --safetensors-index or --hf-config"
        )
    if cross_link is None:
        raise click.UsageError("--cross-link is required (e.g. --cross-link 10Gbit/s)")
    name, _ = sources[0]
    try:
        if safetensors_index is not None:
            size = sizing.from_safetensors_index(safetensors_index)
        elif hf_config is not None:
            size = sizing.from_hf_config(hf_config)
        else:
            assert model_bytes is not None
            size = sizing.ModelSize(model_bytes, None, True, "given")
    except sizing.SizingError as exc:
        raise click.BadParameter(str(exc), param_hint=f"'{name}'") from None
    element_bytes, element_how = _element_width(dtype_bytes, size)
    if transport == "s3" and (calibration.s3_upload is None or calibration.s3_download is None):
        raise click.BadParameter(
            "s3 is not calibrated: the calibration has no S3 upload/download throughput. Run "
            "`kuberefit bench transport --s3-endpoint-url URL --s3-bucket BUCKET` so its result "
            "lands in bench/results, then `kuberefit plan --calibrate`.",
            param_hint="'--transport'",
        )
    if transport == "s3" and relay_hop_rate is not None:
        raise click.BadParameter(
            "it sets the relay tree's hop throughput: give it with --transport zmq",
            param_hint="'--relay-hop-rate'",
        )
    chunk_bytes, bucket_bytes, _, split_bytes = product_sizes(
        size.model_bytes, producers, chunk_size, bucket_size
    )
    sizes_how = (
        "as given"
        if isinstance(chunk_size, int) and isinstance(bucket_size, int)
        else "auto: the producer's rule for this H and producer count"
    )
    deployment = Deployment(
        model_bytes=size.model_bytes,
        change_rate=change_rate,
        producers=producers,
        nodes=nodes,
        cross_bytes_s=cross_link,
        intra_bytes_s=intra_link,
        chunk_bytes=chunk_bytes,
        bucket_bytes=bucket_bytes,
        transport=cast(TransportKind, ALIASES.get(transport, transport)),
        split_bytes=split_bytes,
        last_tensor_bytes=size.last_tensor_bytes,
        first_tensor_bytes=size.first_tensor_bytes,
        regions=(
            payload_regions(size.tensor_bytes, producers, chunk_bytes, bucket_bytes, split_bytes)
            if size.tensor_bytes
            else None
        ),
        element_bytes=element_bytes,
        intra_cluster="encrypted" if intra_cluster == "encrypted" else "mac",
    )
    result = make_plan(
        deployment,
        calibration,
        construction_bytes_s=construction_rate,
        apply_bytes_s=apply_rate,
        relay_hop_bytes_s=relay_hop_rate,
    )
    overridden = frozenset(
        n
        for n, v in (
            ("construction", construction_rate),
            ("apply", apply_rate),
            ("relay_hop", relay_hop_rate),
        )
        if v
    )
    source = click.get_current_context().get_parameter_source("intra_link")
    defaulted = {"intra_link"} if source is ParameterSource.DEFAULT else set()
    if dtype_bytes is None and hf_config is None:
        defaulted.add("dtype_bytes")
    ctx = Context(
        calibration,
        cal_path,
        size.how,
        size.exact,
        overridden,
        sizes_how,
        frozenset(defaulted),
        element_how,
    )
    out: dict[str, Any] = to_json(result, ctx)
    try:  # the bounds keep every figure finite; this guard keeps Infinity and NaN out regardless
        text = json.dumps(out, allow_nan=False)
    except ValueError:
        raise click.UsageError(
            "the projection is not finite for these inputs (a figure of the calibration or an "
            "input is too extreme)"
        ) from None
    if plot is not None:
        rates = plot_rates(cross_link)
        try:
            plot.write_text(svg(result, rates, sweep(result, rates)))
        except OSError as exc:
            raise click.BadParameter(
                f"cannot write {plot}: {exc.strerror}", param_hint="'--plot'"
            ) from None
        click.echo(f"plot written to {plot}", err=True)
    if as_json:
        click.echo(text)
    else:
        click.echo(table(result, ctx))


def _element_width(given: str | None, size: ModelSize) -> tuple[int, str]:
    """(bytes per element, where that comes from): --dtype-bytes, the config's dtype, else
    BF16."""
    from refit_tools.plan.model import ELEMENT_BYTES

    known = size.element_bytes
    if given is not None:
        if known is not None and int(given) != known:
            raise click.BadParameter(
                f"{given} bytes, but --hf-config's dtype {size.dtype} is {known} bytes per "
                "element: give one of them",
                param_hint="'--dtype-bytes'",
            )
        return int(given), "--dtype-bytes"
    if known is not None:
        return known, f"{size.dtype}, from --hf-config"
    return ELEMENT_BYTES, "BF16, the default: give --dtype-bytes"


def _summary(calibration: Any) -> str:
    """The fitted constants, one line each (after `--calibrate` with no model)."""
    lines = [f"calibration fitted {calibration.created} from {calibration.results_dir}:"]
    for s in calibration.sources:
        lines.append(f"  {'used' if s.used else 'skipped':7} {s.file}: {s.why}")
    for field in (
        "link_overhead",
        "payload_overhead_s",
        "stream_fixed_s",
        "startup_fixed_s",
        "relay_hop",
        "relay_hop_payload_s",
        "relay_hop_mac",
        "s3_upload",
        "s3_download",
    ):
        fig = getattr(calibration, field)
        lines.append(
            f"  {field}: "
            + (f"{fig.value:.4g} {fig.unit} ({fig.kind})" if fig else "not measured (assumed)")
        )
    v = calibration.v_over_h
    lines.append(f"  V_payload / H = {v.coefficient:.4g} x rate^{v.exponent:.4f}")
    for field in ("construction", "apply", "drain", "finalization"):
        c = getattr(calibration, field)
        lines.append(
            f"  {field}: {c.fixed_s * 1e3:.3g} ms + {c.s_per_byte * 1e9:.3g} s/GB of H + "
            f"{c.s_per_changed * 1e9:.3g} ns/changed element + {c.s_per_payload * 1e3:.3g} "
            f"ms/payload ({c.kind}, {c.points} points, rms {c.rms_error:.0%}); at 1/3/5%: "
            + ", ".join(f"{c.bytes_s(r) / 1e9:.3g}" for r in (0.01, 0.03, 0.05))
            + " GB/s"
        )
    iso = calibration.construction_isolated
    pts = ", ".join(f"{r:.3g}: {val / 1e9:.3g} GB/s" for r, val in iso.points) if iso else None
    lines.append(f"  construction_isolated: {pts or 'not measured'}")
    return "\n".join(lines)
