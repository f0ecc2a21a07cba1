"""The commit record K = (version, baseline_id) and the mode of an attempt (paper §6.3).

The coordinator publishes K with a compare-and-set; producers bind their source baseline to it
and receivers learn from it which version their bits are. Both sides need these two names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: "mixed": the first attempt of a transition (XOR where allowed, overwrite elsewhere);
#: "overwrite": every retry after admission (repairs partial writes in place).
AttemptMode = Literal["mixed", "overwrite"]


@dataclass(frozen=True)
class CommitRecord:
    """K = (version, baseline_id): the published version and the baseline bound to it."""

    version: int
    baseline_id: str
