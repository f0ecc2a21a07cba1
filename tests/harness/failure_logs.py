"""Log tails a failed test reports (`tests/conftest.py`'s `pytest_runtest_makereport`): a CI run
on another machine keeps only the test's output, not its temporary directory."""

from __future__ import annotations

from pathlib import Path

from tests.harness.procs import log_tail

#: Per log file: its last LINES lines, each cut to WIDTH characters (bounded output).
LINES, WIDTH = 20, 300


def tails(directory: Path, lines: int = LINES, width: int = WIDTH) -> str:
    """The last `lines` lines of every `*.log` under `directory`, by name."""
    parts: list[str] = []
    for path in sorted(directory.rglob("*.log")):
        cut = [
            line if len(line) <= width else line[:width] + " …"
            for line in log_tail(path, lines).splitlines()
        ]
        parts.append(f"== {path.relative_to(directory)}\n" + "\n".join(cut))
    return "\n".join(parts) or f"(no log under {directory})"
