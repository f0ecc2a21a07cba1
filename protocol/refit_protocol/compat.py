"""Standard-library names newer than the oldest Python KubeRefit runs on (3.10).

The vLLM bundle and the trainer client run on the user's Python, not ours (docs/scope.md), so
code they import may use only what 3.10 has; `tests/test_python_versions.py` checks it.
"""

from __future__ import annotations

import enum
import sys

if sys.version_info >= (3, 11):
    from enum import StrEnum  # novermin (guarded by the version check)
else:  # pragma: no cover - only 3.11 runs the tests

    class StrEnum(str, enum.Enum):
        """3.11's `enum.StrEnum`: members are strings, and `str()`/`format()` give the value."""

        def __str__(self) -> str:
            return str(self.value)

        def __format__(self, spec: str) -> str:
            return str(self.value).__format__(spec)


__all__ = ["StrEnum"]
