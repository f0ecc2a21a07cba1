"""The balanced binary relay tree over receiver nodes (paper §7.1, Figure 7 right).

Nodes are listed in a configured order. A payload's tree is rooted at the node its producer sent
it to: positions are counted from that root, so position i forwards to positions 2i+1 and 2i+2.
Rotating the order per root spreads producers over roots while every tree stays balanced
(depth ceil(log2(n+1))).
"""

from __future__ import annotations


def position(index: int, root: int, n: int) -> int:
    """Position of node `index` in the tree rooted at node `root` (0 is the root)."""
    _check(index, root, n)
    return (index - root) % n


def children(index: int, root: int, n: int) -> list[int]:
    """Node indices that node `index` forwards to (at most two)."""
    pos = position(index, root, n)
    return [(root + c) % n for c in (2 * pos + 1, 2 * pos + 2) if c < n]


def parent(index: int, root: int, n: int) -> int | None:
    """Node index that forwards to `index` (None for the root)."""
    pos = position(index, root, n)
    return None if pos == 0 else (root + (pos - 1) // 2) % n


def depth(n: int) -> int:
    """Number of levels of a tree over `n` nodes."""
    return max(n, 0).bit_length()


def _check(index: int, root: int, n: int) -> None:
    if n <= 0 or not (0 <= index < n and 0 <= root < n):
        raise ValueError(f"node {index} / root {root} outside a tree of {n} nodes")
