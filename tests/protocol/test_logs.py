"""Logging as operators expect: format and level from options or variables (an unknown one is
refused), repeated identical lines counted instead of printed, start-up settings with secrets
redacted, and HTTP requests at debug with refusals at info."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest
import structlog
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from pydantic import BaseModel, SecretStr

from refit_protocol.kit import logs
from refit_protocol.kit.http_log import request_logger


@pytest.fixture(autouse=True)
def _restore_structlog() -> Iterator[None]:
    """These tests configure structlog onto captured streams: put the previous setup back."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def test_identical_lines_within_the_window_are_counted_not_printed() -> None:
    limiter = logs.RepeatLimiter(window_s=60)
    line = {"event": "receiver.absent", "level": "info", "node": "n1"}
    assert limiter(None, "info", dict(line)) == line
    for _ in range(28):
        with pytest.raises(structlog.DropEvent):
            limiter(None, "info", dict(line))
    other = {"event": "receiver.absent", "level": "info", "node": "n2"}  # other fields: printed
    assert limiter(None, "info", dict(other)) == other
    limiter.window_s = 0  # the window has passed: printed, with the count it held back
    assert limiter(None, "info", dict(line)) == line | {"repeated": 28}
    assert limiter(None, "info", dict(line)) == line


def test_the_limiter_forgets_old_lines() -> None:
    limiter = logs.RepeatLimiter(window_s=60, max_keys=3)
    for n in range(10):
        limiter(None, "info", {"event": "e", "n": n})
    assert len(limiter._seen) == 3


def test_level_and_format_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBEREFIT_LOG_LEVEL", "WARNING")
    assert logs.chosen_level() == logging.WARNING
    assert logs.chosen_level("debug") == logging.DEBUG
    monkeypatch.setenv("KUBEREFIT_LOG_LEVEL", "verbose")
    with pytest.raises(ValueError, match="log level 'verbose'"):
        logs.chosen_level()
    monkeypatch.setenv("KUBEREFIT_LOG_FORMAT", "console")
    assert logs.chosen_format() is False
    monkeypatch.setenv("KUBEREFIT_LOG_FORMAT", "xml")
    with pytest.raises(ValueError, match="KUBEREFIT_LOG_FORMAT='xml'"):
        logs.chosen_format()


class Settings(BaseModel):
    port: int = 1
    token: SecretStr | None = None


def test_settings_line_redacts_secrets(capsys: pytest.CaptureFixture[str]) -> None:
    logs.configure_logging(json=True, level="info")
    logs.log_settings("thing", Settings(token=SecretStr("hunter2")))
    line = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert line["event"] == "thing.settings"
    assert line["settings"] == {"port": 1, "token": "**********"}


async def test_requests_at_debug_refusals_at_info(capsys: pytest.CaptureFixture[str]) -> None:
    async def ok(_: web.Request) -> web.Response:
        return web.json_response({"fine": True})

    async def refuse(_: web.Request) -> web.Response:
        return web.json_response({"error": "bad_order", "message": "order 3 taken"}, status=409)

    for level, expected in (("info", ["http.refused", "http.refused"]), ("debug", None)):
        logs.configure_logging(json=True, level=level)
        app = web.Application(middlewares=[request_logger("thing")])
        app.router.add_get("/ok", ok)
        app.router.add_get("/refuse", refuse)
        async with TestClient(TestServer(app)) as client:
            for path in ("/ok", "/refuse", "/missing"):
                await client.get(path)
        lines = [json.loads(x) for x in capsys.readouterr().err.splitlines() if x.startswith("{")]
        events = [(x["event"], x["status"], x.get("reason")) for x in lines]
        if expected is not None:
            assert [e[0] for e in events] == expected
        else:
            assert events[0] == ("http.request", 200, None)
        assert ("http.refused", 409, "order 3 taken") in events
        assert any(e[:2] == ("http.refused", 404) for e in events)


def test_errors_tracebacks_and_debug_lines_are_never_held_back() -> None:
    limiter = logs.RepeatLimiter(window_s=60)
    for method, line in (
        ("error", {"event": "receiver.http_error", "path": "/v1/flush"}),
        ("info", {"event": "x", "exc_info": True}),
        ("debug", {"event": "http.request", "path": "/v1/status"}),
    ):
        for _ in range(3):
            assert limiter(None, method, dict(line)) == line


def test_redaction_of_what_could_be_a_secret() -> None:
    settings = {
        "token": "s3cret",
        "token_file": "/etc/kuberefit/token/token",
        "token_rotation_grace_s": 300.0,
        "applier": {"options": {"api_key": "k", "log_path": "/l"}},
        "s3": {"endpoint_url": "https://user:pw@s3.local:9000/b", "region": "r"},
        "producers": ["http://127.0.0.1:8471"],
    }
    assert logs.redact(settings) == {
        "token": "**********",
        "token_file": "/etc/kuberefit/token/token",
        "token_rotation_grace_s": 300.0,
        "applier": {"options": {"api_key": "**********", "log_path": "/l"}},
        "s3": {"endpoint_url": "https://user:**********@s3.local:9000/b", "region": "r"},
        "producers": ["http://127.0.0.1:8471"],
    }
