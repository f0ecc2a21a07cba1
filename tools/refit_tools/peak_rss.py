"""Peak resident memory of process trees while a block of code runs (benchmark figures)."""

from __future__ import annotations

import os
import threading
from pathlib import Path


class PeakRss:
    """The resident set of `pids` and all their descendants, summed and sampled every
    `every_s` seconds from /proc while the block runs: `extra` is the peak minus the start."""

    def __init__(self, pids: list[int] | None = None, *, every_s: float = 0.002) -> None:
        self.pids = pids if pids is not None else [os.getpid()]
        self.every_s = every_s
        self.start = self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.peak = max(self.peak, self.total())

    def total(self) -> int:
        """Resident bytes of the trees now (processes that vanish meanwhile count 0)."""
        pages, todo = 0, list(self.pids)
        while todo:
            pid = todo.pop()
            try:
                pages += int(Path(f"/proc/{pid}/statm").read_text().split()[1])
                for task in Path(f"/proc/{pid}/task").iterdir():
                    todo += [int(c) for c in (task / "children").read_text().split()]
            except (OSError, ValueError):
                continue
        return pages * os.sysconf("SC_PAGE_SIZE")

    def __enter__(self) -> PeakRss:
        self.start = self.peak = self.total()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.total())

    @property
    def extra(self) -> int:
        return max(self.peak - self.start, 0)
