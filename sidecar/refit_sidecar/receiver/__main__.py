"""`python -m refit_sidecar.receiver --config node.json`: run one receiver node in this process."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from refit_protocol.cli import STARTUP_ERROR_HELP, run_service
from refit_protocol.logs import configure_logging
from refit_sidecar.receiver.config import ReceiverConfig
from refit_sidecar.receiver.node import ReceiverNode


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m refit_sidecar.receiver", description=__doc__, epilog=STARTUP_ERROR_HELP
    )
    parser.add_argument("--config", type=Path, required=True, help="ReceiverConfig as JSON.")
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING (default INFO).")
    args = parser.parse_args(argv)
    run_service(parser.prog, lambda: serve_json(args.config.read_text(), log_level=args.log_level))


def serve_json(text: str, *, log_level: str | None = None) -> None:
    """Run the node described by a ReceiverConfig JSON document until SIGTERM."""
    configure_logging(level=log_level)
    node = ReceiverNode(ReceiverConfig.model_validate_json(text))
    asyncio.run(node.run_forever())


if __name__ == "__main__":
    main()
