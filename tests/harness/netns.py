"""The harness uses the product's emulated clusters (`kuberefit bench refit` creates them too)."""

from refit_tools.bench.netns import (
    Link,
    NetnsError,
    create_link,
    require_netns_tools,
    run_checked,
)

__all__ = ["Link", "NetnsError", "create_link", "require_netns_tools", "run_checked"]
