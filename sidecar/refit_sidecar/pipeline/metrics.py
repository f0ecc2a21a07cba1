"""Counters and per-stage timings of one pipeline run (what RefitTransition.status mirrors)."""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, field, fields
from typing import Any

STAGES = ("intake", "compare", "coalesce", "compress", "send")


@dataclass
class StageStats:
    """Time a stage spent working (not waiting on its neighbours) and how many units it did."""

    busy_s: float = 0.0
    units: int = 0


@dataclass
class PipelineMetrics:
    """Totals of one run. Counters are updated under `lock` by concurrent stages."""

    attempt: str
    mode: str
    chunks_seen: int = 0
    chunks_compared: int = 0
    canonical_bytes: int = 0
    total_elements: int = 0
    changed_elements: int = 0
    items: int = 0
    raw_bytes: int = 0
    payload_bytes: int = 0
    payloads: int = 0
    max_chunks_held: int = 0
    wall_s: float = 0.0
    stages: dict[str, StageStats] = field(default_factory=lambda: {s: StageStats() for s in STAGES})
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add_time(self, stage: str, seconds: float, units: int = 1) -> None:
        with self.lock:
            st = self.stages[stage]
            st.busy_s += seconds
            st.units += units

    @property
    def change_rate(self) -> float:
        """Changed / compared elements (the element change rate of this producer)."""
        return self.changed_elements / self.total_elements if self.total_elements else 0.0

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("lock", "stages")
        }
        out["stages"] = {k: asdict(v) for k, v in self.stages.items()}
        out["change_rate"] = self.change_rate
        return out
