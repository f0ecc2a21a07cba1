"""Optional numba compilation of the producer's hot loops (change detection, gap encoding).

numpy has no fused kernels for "compare and emit" or "check order and narrow", so those loops are
compiled with numba (GIL released, so compare threads scale). Every compiled kernel has a numpy
formulation that gives the same result: it is used when numba is missing or when
`KUBEREFIT_KERNELS=numpy` is set, and the tests use it as an independent oracle. Kernels are
built on first use, so processes that never encode (receivers) do not import numba.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from refit_protocol.kit.loggers import get_logger

log = get_logger("kuberefit.compiled")

#: Set to "numpy" to use the numpy formulations instead of the compiled kernels.
KERNELS_ENV = "KUBEREFIT_KERNELS"


def enabled() -> bool:
    """Whether compiled kernels are wanted and numba can be imported."""
    if os.environ.get(KERNELS_ENV, "numba") == "numpy":
        return False
    try:
        import numba  # noqa: F401
    except ImportError:  # pragma: no cover - numba is a declared sidecar dependency
        log.warning("compiled.numba_missing", fallback="numpy")
        return False
    return True


def njit(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` compiled with the GIL released, cached on disk when a cache location is writable."""
    import numba

    try:
        return numba.njit(nogil=True, cache=True)(fn)  # type: ignore[no-any-return]
    except RuntimeError as exc:  # no writable cache location (read-only image, non-root user)
        log.info("compiled.cache_unavailable", kernel=fn.__name__, error=str(exc))
        return numba.njit(nogil=True)(fn)  # type: ignore[no-any-return]
