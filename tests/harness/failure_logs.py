"""Log tails a failed test reports (`tests/conftest.py`'s `pytest_runtest_makereport`): a CI run
on another machine keeps only the test's output, not its temporary directory."""

from __future__ import annotations

from pathlib import Path

#: Per log file: its last LINES lines, each cut to WIDTH characters (bounded output).
LINES, WIDTH = 20, 300


def tails(directory: Path, lines: int = LINES, width: int = WIDTH) -> str:
    """The last `lines` lines of every `*.log` under `directory`, by name."""
    parts: list[str] = []
    for path in sorted(directory.rglob("*.log")):
        try:
            text = path.read_text(errors="replace").splitlines()[-lines:]
        except OSError as exc:
            text = [f"(unreadable: {exc})"]
        cut = [line if len(line) <= width else line[:width] + " …" for line in text]
        parts.append(f"== {path.relative_to(directory)}\n" + "\n".join(cut))
    return "\n".join(parts) or f"(no log under {directory})"
