"""structlog setup shared by every KubeRefit process: JSON in pods, readable on a terminal.

Format and level come from `--log-format`/`--log-level` (which set the variables, so child
processes inherit them) or $KUBEREFIT_LOG_FORMAT / $KUBEREFIT_LOG_LEVEL. A line repeated with
the same event and fields within `REPEAT_WINDOW_S` is held back and counted: the next one
that is printed carries `repeated=N`, so a peer that stays down costs one line per window.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import MutableMapping
from typing import Any

import structlog
from pydantic import BaseModel

from refit_protocol.pod_contract import LOG_FORMAT_ENV, LOG_LEVEL_ENV

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("json", "console")
#: Identical lines within this many seconds are counted, not printed.
REPEAT_WINDOW_S = 10.0
_LIMITED = frozenset({"info", "warning", "warn"})
_VOLATILE = frozenset({"timestamp", "waited_s", "elapsed_s", "age_s"})


class RepeatLimiter:
    """structlog processor: drop an info or warning line identical (level, event, fields) to
    one printed less than `window_s` ago; the next printed copy says how many were dropped
    (`repeated`). Debug lines (asked for) and errors or tracebacks (each may differ in what the
    fields do not show) are never dropped."""

    def __init__(self, window_s: float = REPEAT_WINDOW_S, max_keys: int = 512) -> None:
        self.window_s, self.max_keys = window_s, max_keys
        self._seen: OrderedDict[str, tuple[float, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(
        self, _: Any, method: str, event: MutableMapping[str, Any]
    ) -> MutableMapping[str, Any]:
        if method not in _LIMITED or event.get("exc_info"):
            return event
        key = repr(sorted((k, repr(v)) for k, v in event.items() if k not in _VOLATILE))
        now = time.monotonic()
        with self._lock:
            printed, dropped = self._seen.pop(key, (float("-inf"), 0))
            if now - printed < self.window_s:
                self._seen[key] = (printed, dropped + 1)
                raise structlog.DropEvent
            self._seen[key] = (now, 0)
            while len(self._seen) > self.max_keys:
                self._seen.popitem(last=False)
        if dropped:
            event["repeated"] = dropped
        return event


def chosen_format() -> bool:
    """True for JSON: $KUBEREFIT_LOG_FORMAT, else JSON in a pod or when stderr is not a tty."""
    chosen = os.environ.get(LOG_FORMAT_ENV, "").strip().lower()
    if chosen and chosen not in FORMATS:
        raise ValueError(f"${LOG_FORMAT_ENV}={chosen!r}: expected one of {', '.join(FORMATS)}")
    if chosen:
        return chosen == "json"
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST")) or not sys.stderr.isatty()


def chosen_level(level: str | None = None, default: str = "info") -> int:
    """The level: `level`, else $KUBEREFIT_LOG_LEVEL, else `default` (an unknown name is
    refused)."""
    name = (level or os.environ.get(LOG_LEVEL_ENV, "") or default).strip().lower()
    if name not in LEVELS:
        raise ValueError(f"log level {name!r} (${LOG_LEVEL_ENV}): expected one of {LEVELS}")
    return int(getattr(logging, name.upper()))


def configure_logging(
    *, json: bool | None = None, level: str | None = None, default_level: str = "info"
) -> None:
    """Configure structlog once per process (`json`/`level` override the environment;
    `default_level` applies when neither is given: the tools print progress, not logs)."""
    json = chosen_format() if json is None else json
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            RepeatLimiter(),
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(chosen_level(level, default_level)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def log_settings(component: str, settings: BaseModel) -> None:
    """The start-up line: every setting in effect, secrets shown as '**********' (SecretStr
    fields, values of keys that name a secret, and passwords in URLs)."""
    structlog.get_logger(f"kuberefit.{component}").info(
        f"{component}.settings", settings=redact(settings.model_dump(mode="json"))
    )


_SECRET_KEY = re.compile(r"token|secret|password|passwd|credential|api_?key", re.IGNORECASE)
_URL_PASSWORD = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)(?P<user>[^:@/\s]*):[^@/\s]*@")


def redact(value: Any, key: str = "") -> Any:
    """`value` with what could be a secret masked (for logs)."""
    if isinstance(value, dict):
        return {k: redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v, key) for v in value]
    if isinstance(value, str):
        if value and _SECRET_KEY.search(key) and not key.endswith(("_file", "_s")):
            return "**********"
        return _URL_PASSWORD.sub(r"\g<scheme>\g<user>:**********@", value)
    return value
