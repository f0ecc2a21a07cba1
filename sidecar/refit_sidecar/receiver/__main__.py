"""`python -m refit_sidecar.receiver --config node.json`: run one receiver node in this process."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from refit_protocol.logs import configure_logging
from refit_sidecar.receiver.config import load_config
from refit_sidecar.receiver.node import ReceiverNode


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m refit_sidecar.receiver", description=__doc__)
    parser.add_argument("--config", type=Path, required=True, help="ReceiverConfig as JSON.")
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING (default INFO).")
    args = parser.parse_args(argv)
    configure_logging(level=args.log_level)
    node = ReceiverNode(load_config(args.config))
    asyncio.run(node.run_forever())


if __name__ == "__main__":
    main()
