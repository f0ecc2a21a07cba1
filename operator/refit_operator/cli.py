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
    default=2,
    show_default=True,
    type=click.IntRange(1, 100),
    help="Number of training steps, one version transition each.",
)
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Where checkpoints and logs go (default: a new temp directory).",
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print a JSON summary as the last line of stdout."
)
def demo(steps: int, workdir: Path | None, as_json: bool) -> None:
    """Run KubeRefit locally end to end on a tiny model (no cluster needed)."""
    from refit_sidecar.demo import format_report, report_json, run_demo

    def say(msg: str) -> None:
        click.echo(msg, err=as_json)

    report = run_demo(steps=steps, workdir=workdir, say=say)
    click.echo(format_report(report), err=as_json)
    if as_json:
        click.echo(report_json(report))
    if not report.bit_exact:
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


if __name__ == "__main__":
    main()
