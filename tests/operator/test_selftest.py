"""`kuberefit operator selftest` (the chart's `helm test`): what counts as a pass, and every
failure named in one line. The pass against the chart's real webhook, through the route and
certificate the chart configures, runs in tests/test_helm_journey.py."""

from __future__ import annotations

import base64
import json
import socket
import ssl
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from refit_operator.cli import commands
from refit_operator.injection import InjectionConfig, PolicyFacts, inject
from refit_operator.injection.config import TokenSecretRef
from refit_operator.selftest import check_answer, run_selftest, sample_review
from tests.harness.pki import TestCA


def _answer(uid: str, allowed: bool, patch: list[dict[str, Any]] | None) -> dict[str, Any]:
    response: dict[str, Any] = {"uid": uid, "allowed": allowed}
    if patch is not None:
        response["patch"] = base64.b64encode(json.dumps(patch).encode()).decode()
    if not allowed:
        response["status"] = {"message": "the pod is malformed: spec.containers"}
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}


def test_the_sample_review_is_injected_by_the_real_injection() -> None:
    review = sample_review("rl")
    pod = review["request"]["object"]
    facts = PolicyFacts(exists=False, token_secret=TokenSecretRef(name="kuberefit-token"))
    injection = inject(pod, InjectionConfig(), facts)
    assert injection.denied is None
    uid = review["request"]["uid"]
    answer = _answer(uid, True, injection.patch)
    answer["response"]["warnings"] = injection.warnings
    result = check_answer(answer, uid)
    assert result.ok, result.lines
    assert result.lines[0] == "ok   the webhook injects kuberefit-sidecar into an opted-in pod"
    assert any(line.startswith("note RefitPolicy kuberefit-selftest") for line in result.lines)


@pytest.mark.parametrize(
    ("answer", "said"),
    [
        (_answer("other", True, []), "FAIL the answer's uid is 'other'"),
        (_answer("u", False, None), "FAIL the sample pod was refused: the pod is malformed"),
        (_answer("u", True, None), "FAIL the answer does not add kuberefit-sidecar"),
        (
            _answer(
                "u", True, [{"op": "add", "path": "/spec/containers/-", "value": {"name": "x"}}]
            ),
            "FAIL the answer does not add kuberefit-sidecar",
        ),
    ],
)
def test_an_answer_without_the_sidecar_fails(answer: dict[str, Any], said: str) -> None:
    result = check_answer(answer, "u")
    assert not result.ok
    assert result.lines[0].startswith(said)


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # an HTTPS server that is not a webhook
        self.send_response(404)
        self.end_headers()

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[str, TestCA]]:
    ca = TestCA(tmp_path / "pki")
    pair = ca.issue("webhook")
    server = HTTPServer(("127.0.0.1", 0), _Handler)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(pair.cert_path, pair.key_path)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}/mutate-pods", ca
    finally:
        server.shutdown()
        server.server_close()


def test_route_certificate_and_status_failures_are_named(
    tls_server: tuple[str, TestCA], tmp_path: Path
) -> None:
    url, ca = tls_server
    answered = run_selftest(url, ca.cert_path, "rl", 5)
    assert answered.lines == ["FAIL the webhook answered HTTP 404: Not Found"]
    other_ca = TestCA(tmp_path / "other", name="another-ca")
    untrusted = run_selftest(url, other_ca.cert_path, "rl", 5)
    assert not untrusted.ok
    assert "CERTIFICATE_VERIFY_FAILED" in untrusted.lines[0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    refused = run_selftest(f"https://127.0.0.1:{closed}/mutate-pods", ca.cert_path, "rl", 5)
    assert refused.lines[0].startswith(f"FAIL no answer from https://127.0.0.1:{closed}")
    missing = run_selftest(url, tmp_path / "nothing.crt", "rl", 5)
    assert missing.lines[0].startswith("FAIL cannot read the CA bundle")


def test_the_command_exits_1_on_a_failure_and_2_on_a_plain_http_url(
    tls_server: tuple[str, TestCA],
) -> None:
    url, ca = tls_server
    runner = CliRunner()
    args = ["operator", "selftest", "--ca-file", str(ca.cert_path)]
    failed = runner.invoke(commands, [*args, "--webhook", url], prog_name="kuberefit")
    assert failed.exit_code == 1
    assert failed.output.startswith("FAIL the webhook answered HTTP 404")
    plain = runner.invoke(
        commands, [*args, "--webhook", url.replace("https", "http")], prog_name="kuberefit"
    )
    assert plain.exit_code == 2
    assert "https only" in plain.output
