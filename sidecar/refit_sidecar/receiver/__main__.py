"""`python -m refit_sidecar.receiver --config FILE`: the same as `kuberefit receiver serve`."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    from refit_protocol.kit.cli import add_common_options
    from refit_sidecar.cli import receiver

    add_common_options(receiver).main(
        ["serve", *(sys.argv[1:] if argv is None else argv)],
        prog_name="python -m refit_sidecar.receiver",
    )


if __name__ == "__main__":
    main()
