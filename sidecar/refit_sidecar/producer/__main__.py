"""`python -m refit_sidecar.producer --config FILE`: the same as `kuberefit producer serve`."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    from refit_protocol.kit.cli import add_common_options
    from refit_sidecar.cli import producer

    add_common_options(producer).main(
        ["serve", *(sys.argv[1:] if argv is None else argv)],
        prog_name="python -m refit_sidecar.producer",
    )


if __name__ == "__main__":
    main()
