"""structlog setup shared by every KubeRefit process: JSON in pods, readable on a terminal."""

from __future__ import annotations

import logging
import os
import sys

import structlog

from refit_protocol.pod_contract import LOG_FORMAT_ENV


def configure_logging(*, json: bool | None = None, level: str | None = None) -> None:
    """Configure structlog once per process.

    `json=None` follows $KUBEREFIT_LOG_FORMAT (json or console), else picks JSON when stderr
    is not a terminal or when running inside a pod (KUBERNETES_SERVICE_HOST is set), so
    `kubectl logs` gets one object per line.
    """
    if json is None:
        chosen = os.environ.get(LOG_FORMAT_ENV, "").strip().lower()
        if chosen in ("json", "console"):
            json = chosen == "json"
        else:
            json = bool(os.environ.get("KUBERNETES_SERVICE_HOST")) or not sys.stderr.isatty()
    level_name = (level or os.environ.get("KUBEREFIT_LOG_LEVEL", "INFO")).upper()
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping().get(level_name, logging.INFO)
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
