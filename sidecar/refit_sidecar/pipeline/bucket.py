"""Bucket coalescing: pack the records of chunks, and of parts of large tensors (`parts`), into
payload-sized buckets.

A bucket counts the full input size of each chunk that has records (of a split chunk, the bytes
of its changed tensors); a chunk without records adds nothing (the bucket continues past it). A
bucket is closed before a unit that would push it past the target, and as soon as it reaches the
target, so a chunk larger than the target travels alone. It is also closed before a part of a
tensor it already holds: a payload names a tensor once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from refit_sidecar.baseline.source import ChunkDelta
from refit_sidecar.codec.encode import PreparedItem, prepare_item


@dataclass
class Bucket:
    """Records of one future payload."""

    chunks: list[int] = field(default_factory=list)
    nbytes: int = 0
    items: list[PreparedItem] = field(default_factory=list)
    names: set[str] = field(default_factory=set)


class Bucketer:
    """Coalesces chunk deltas, in order, into buckets of about `target_bytes` input bytes."""

    def __init__(self, target_bytes: int) -> None:
        if target_bytes < 1:
            raise ValueError("target_bytes must be positive")
        self.target = target_bytes
        self._current = Bucket()

    def add(self, delta: ChunkDelta, prepared: list[PreparedItem] | None = None) -> list[Bucket]:
        """Add one chunk's records, or one part's (optionally already prepared for the wire).

        Returns the buckets this closed (zero, one or two).
        """
        if not delta.items:
            return []
        closed: list[Bucket] = []
        cur = self._current
        names = {item.meta.name for item in delta.items}
        if cur.chunks and (
            cur.nbytes + delta.nbytes > self.target or not names.isdisjoint(cur.names)
        ):
            closed.append(cur)
            cur = self._current = Bucket()
        cur.chunks.append(delta.index)
        cur.nbytes += delta.nbytes
        cur.names |= names
        cur.items.extend(prepared if prepared is not None else map(prepare_item, delta.items))
        if cur.nbytes >= self.target:
            closed.append(cur)
            self._current = Bucket()
        return closed

    def finish(self) -> Bucket | None:
        """The last, partly filled bucket (None if empty)."""
        cur, self._current = self._current, Bucket()
        return cur if cur.chunks else None
