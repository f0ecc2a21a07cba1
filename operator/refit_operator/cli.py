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


if __name__ == "__main__":
    main()
