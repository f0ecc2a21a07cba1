"""`kuberefit verify`'s verdicts (refit_operator.verify): exit codes and what a person reads.
The audit itself runs against real receivers in test_coordinator_on_real_parts.py."""

from __future__ import annotations

from refit_operator.verify import (
    EXIT_INCOMPLETE,
    EXIT_MISMATCH,
    EXIT_OK,
    NodeAudit,
    exit_code,
    render,
)
from refit_protocol.receiver_api import AuditMismatch, AuditResponse, RankAudit


def _answer(node: str, *, ok: bool = True, moved: bool = False) -> AuditResponse:
    mismatches = [] if ok else [AuditMismatch(name="w", storages=["p"], count=1, positions=[7],
                                              held_bits=[5], expected_bits=[4])]  # fmt: skip
    rank = RankAudit(rank=0, ok=ok, tensors=3, elements=30, copies=3, mismatches=mismatches)
    return AuditResponse(
        node=node,
        version=4,
        held_version=3 if moved else 4,
        version_moved=moved,
        ok=ok and not moved,
        seconds=0.5,
        ranks=[] if moved else [rank],
    )


def test_exit_codes() -> None:
    ok, bad = NodeAudit("u0", _answer("n0")), NodeAudit("u1", _answer("n1", ok=False))
    moved, gone = NodeAudit("u2", _answer("n2", moved=True)), NodeAudit("u3", error="refused")
    assert exit_code([ok]) == EXIT_OK
    assert exit_code([ok, bad, moved, gone]) == EXIT_MISMATCH  # other bits outrank the rest
    assert exit_code([ok, moved]) == EXIT_INCOMPLETE
    assert exit_code([ok, gone]) == EXIT_INCOMPLETE
    assert exit_code([]) == EXIT_INCOMPLETE  # no node is no proof
    assert render([]) == ["no rollout node to audit"]


def test_render_names_tensor_position_and_both_patterns() -> None:
    lines = render(
        [
            NodeAudit("u1", _answer("n1", ok=False)),
            NodeAudit("u2", _answer("n2", moved=True)),
            NodeAudit("u3", error="HTTP 401"),
        ]
    )
    assert lines[0].startswith("n1: MISMATCH v4: 1 rank(s), 3 tensors, 30 elements")
    assert lines[1] == (
        "  rank 0 w -> p: 1 element(s) differ, first at [7] (holds [5], dense load writes [4])"
    )
    assert lines[2] == "n2: holds v3, not v4: not compared"
    assert lines[3] == "u3: not audited: HTTP 401"


def test_a_multi_host_server_is_reported_per_rank_and_host() -> None:
    """The leader's audit names the host of each rank; another host's receiver says its ranks
    are in the leader's audit (it compared nothing itself)."""
    leader = _answer("big-0", ok=False)
    leader = leader.model_copy(
        update={"ranks": [leader.ranks[0].model_copy(update={"rank": 1, "host": "big-0-1"})]}
    )
    host = AuditResponse(
        node="big-0-1", version=4, held_version=4, version_moved=False, ok=True, seconds=0.0,
        audited_by_leader=True,
    )  # fmt: skip
    lines = render([NodeAudit("u0", leader), NodeAudit("u1", host)])
    assert lines[1].startswith("  rank 1 on big-0-1 w -> p: 1 element(s) differ")
    assert lines[2] == "big-0-1: a server's other host: its ranks are in its leader's audit"
    assert exit_code([NodeAudit("u1", host)]) == EXIT_INCOMPLETE  # its leader is the proof
    fine = _answer("big-0")
    assert exit_code([NodeAudit("u0", fine), NodeAudit("u1", host)]) == EXIT_OK
