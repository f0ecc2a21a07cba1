"""Start local processes with bounded start-up, logs on disk and teardown by process group.

Used by `kuberefit demo` (local mode) and by the test harness."""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path


class ComponentError(RuntimeError):
    """A real component could not be started or stopped; the message carries its log tail."""


def http_ok(url: str) -> bool:
    """A readiness check: GET `url` answers 200 (errors propagate; `wait_ready` retries)."""
    with urllib.request.urlopen(url, timeout=2) as resp:  # noqa: S310 - loopback only
        return bool(resp.status == 200)


#: Ports handed to child processes come from below Linux's ephemeral range (32768-60999 by
#: default): the kernel never gives these to an outgoing connection or to a bind of port 0, so
#: a port stays free between the check here and the child's own bind.
PORT_RANGE = (20000, 32768)
_handed_out: set[int] = set()
_rng = random.Random(os.getpid())  # noqa: S311 - spreads processes apart, no secret


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now and that no earlier call in this process
    returned (see `PORT_RANGE`)."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """`n` distinct ports as `free_port` gives them."""
    low, high = PORT_RANGE
    chosen: list[int] = []
    start = _rng.randrange(low, high)
    for port in itertools.chain(range(start, high), range(low, start)):
        if port in _handed_out or not _bindable(port):
            continue
        _handed_out.add(port)
        chosen.append(port)
        if len(chosen) == n:
            return chosen
    raise ComponentError(f"no {n} free ports left in {low}-{high - 1}")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


class ManagedProcess:
    """One real process in its own process group, logging to `log_path`.

    `start()` waits for `ready()` to return True within `timeout` seconds, else kills the process
    and raises ComponentError with the log tail. `stop()` sends SIGTERM to the whole group, then
    SIGKILL after `grace` seconds, so nothing is left running.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.env = dict(os.environ if env is None else env)
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"{self.name} not started"
        return self.proc.pid

    def start(self, ready: Callable[[], bool], *, timeout: float) -> ManagedProcess:
        """Launch and wait until `ready()`; on failure the process is stopped and its log shown."""
        self.launch()
        return self.wait_ready(ready, timeout=timeout)

    def launch(self) -> ManagedProcess:
        """Start the process without waiting (several can then boot in parallel)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        try:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
            )
        except OSError as exc:
            raise ComponentError(f"{self.name}: cannot execute {self.argv[0]}: {exc}") from exc
        finally:
            log.close()
        return self

    def wait_ready(self, ready: Callable[[], bool], *, timeout: float) -> ManagedProcess:
        assert self.proc is not None, f"{self.name} not launched"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ComponentError(
                    f"{self.name} exited with code {self.proc.returncode} during start-up; "
                    f"log {self.log_path}:\n{log_tail(self.log_path)}"
                )
            with contextlib.suppress(Exception):
                if ready():
                    return self
            time.sleep(0.1)
        self.stop()
        raise ComponentError(
            f"{self.name} not ready within {timeout:.0f}s; log {self.log_path}:\n"
            f"{log_tail(self.log_path)}"
        )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (SIGKILL by default), as a crash would."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def stop(self, grace: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.kill(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.kill(signal.SIGKILL)
                self.proc.wait(timeout=grace)
        # Children that outlived the leader still belong to the group.
        self.kill(signal.SIGKILL)


def shm_segments() -> set[str]:
    """Names of the POSIX shared-memory segments (vLLM's message queues) that exist now."""
    shm = Path("/dev/shm")
    return {p.name for p in shm.glob("psm_*")} if shm.is_dir() else set()


def sweep_orphaned_shm(existing_before: set[str]) -> int:
    """Unlink segments created since `existing_before` that no live process maps any more.

    A SIGKILLed vLLM process cannot unlink its message-queue segments; only ones nobody maps
    are removed, so a running engine is never affected. Returns how many were removed.
    """
    candidates = shm_segments() - existing_before
    if not candidates:
        return 0
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            for line in maps.read_text().splitlines():
                if "/dev/shm/psm_" in line:
                    mapped.add(line.split("/dev/shm/", 1)[1].split()[0])
    removed = 0
    for name in candidates - mapped:
        with contextlib.suppress(OSError):
            (Path("/dev/shm") / name).unlink()
            removed += 1
    return removed
