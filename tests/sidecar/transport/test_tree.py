"""The balanced binary relay tree: every node reached exactly once from any root, depth log2."""

from __future__ import annotations

import pytest

from refit_sidecar.transport.relay import tree


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 33])
def test_every_root_reaches_every_node_once(n: int) -> None:
    for root in range(n):
        seen = [root]
        frontier = [root]
        levels = 1
        while frontier:
            nxt = [c for node in frontier for c in tree.children(node, root, n)]
            assert all(len(tree.children(node, root, n)) <= 2 for node in frontier)
            seen += nxt
            frontier = nxt
            levels += bool(nxt)
        assert sorted(seen) == list(range(n))  # no node twice, none missed
        assert levels == tree.depth(n)
        for node in range(n):
            parent = tree.parent(node, root, n)
            assert (parent is None) == (node == root)
            if parent is not None:
                assert node in tree.children(parent, root, n)


def test_seven_nodes_from_root_zero() -> None:
    assert [tree.children(i, 0, 7) for i in range(7)] == [[1, 2], [3, 4], [5, 6], [], [], [], []]
    assert tree.children(3, 3, 7) == [4, 5]  # rotated: root 3's tree starts at 3


def test_rejects_nodes_outside_the_tree() -> None:
    with pytest.raises(ValueError, match="outside"):
        tree.children(7, 0, 7)
