"""`get_logger` for modules that also run inside someone else's process (the vLLM bundle).

KubeRefit's own processes log through structlog (`refit_protocol.kit.logs`). Code in the vLLM
bundle runs in the user's vLLM image, which need not have structlog: there the same calls go
to the standard library's `logging` (vLLM configures its handlers), as one line
`event key=value ...`.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol


class KeyValueLogger(Protocol):
    """The part of structlog's bound logger that KubeRefit's bundle code calls."""

    def debug(self, event: str, **fields: Any) -> Any: ...
    def info(self, event: str, **fields: Any) -> Any: ...
    def warning(self, event: str, **fields: Any) -> Any: ...
    def error(self, event: str, **fields: Any) -> Any: ...


class StdlibKeyValueLogger:
    """structlog's call shape over a standard-library logger."""

    def __init__(self, name: str) -> None:
        self._log = logging.getLogger(name)

    def _emit(self, level: int, event: str, fields: dict[str, Any]) -> None:
        if self._log.isEnabledFor(level):
            tail = " ".join(f"{k}={v!r}" for k, v in sorted(fields.items()))
            self._log.log(level, "%s %s" % (event, tail) if tail else event)  # noqa: UP031

    def debug(self, event: str, **fields: Any) -> None:
        self._emit(logging.DEBUG, event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._emit(logging.INFO, event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._emit(logging.WARNING, event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._emit(logging.ERROR, event, fields)


def get_logger(name: str) -> KeyValueLogger:
    """structlog's logger where structlog is installed, else the standard library's."""
    try:
        import structlog
    except ImportError:
        return StdlibKeyValueLogger(name)
    logger: KeyValueLogger = structlog.get_logger(name)
    return logger
