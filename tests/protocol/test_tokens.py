"""The token ring's rules (refit_protocol.kit.tokens): what is accepted and what is sent while a
rotated Secret reaches pods at different moments. Time is a clock the test advances."""

from __future__ import annotations

from pathlib import Path

import pytest

from refit_protocol.kit.auth import bearer_header, ring_accepts_bearer
from refit_protocol.kit.tokens import FileTokenRing, TokenRing, as_ring, key_id, ring_accepts

A, B, C = "token-a", "token-b", "token-c"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_fixed_token_or_none() -> None:
    ring = as_ring(A)
    assert ring.sending() == A
    assert ring.accepted() == (A,)
    assert ring_accepts(ring, A)
    assert not ring_accepts(ring, B)
    assert not ring_accepts(ring, None)
    empty = as_ring(None)
    assert not empty
    assert empty.sending() is None
    assert empty.accepted() == ()
    assert ring_accepts(empty, None)  # no token configured: nothing is required
    assert as_ring(ring) is ring


def test_rotation_accepts_both_at_once_and_sends_the_new_token_after_the_grace() -> None:
    clock = Clock()
    ring = TokenRing(A, grace_s=10, clock=clock)
    gen = ring.current_generation()
    assert ring.update(B)
    assert ring.current_generation() > gen
    assert ring.accepted() == (A, B)  # both, the sending one first
    assert ring.sending() == A  # pods that have not seen B yet still accept A
    assert ring.newest() == B  # a peer in the same pod reads the same file
    clock.now += 9.9
    assert ring.sending() == A
    clock.now += 0.2
    assert ring.sending() == B
    assert ring.accepted() == (B, A)  # A still accepted: others may still send it
    clock.now += 10
    assert ring.accepted() == (B,)  # 2 x grace after B was seen: A is refused
    assert not ring_accepts(ring, A)
    assert not ring.update(B)  # the same content again changes nothing


def test_a_second_rotation_within_the_grace_keeps_the_last_two() -> None:
    clock = Clock()
    ring = TokenRing(A, grace_s=10, clock=clock)
    ring.update(B)
    clock.now += 5
    ring.update(C)
    assert ring.sending() == B  # the token C replaced
    assert ring.accepted() == (B, C)  # A is gone: at most the newest and the one it replaced


def test_a_listed_overlap_is_accepted_while_listed_and_sent_first_by_a_new_process() -> None:
    clock = Clock()
    ring = TokenRing(f"{B}\n{A}\n", grace_s=10, clock=clock)  # a pod started mid-rotation
    assert ring.sending() == A
    assert ring.accepted() == (A, B)
    clock.now += 100
    assert ring.sending() == B
    assert ring.accepted() == (B, A)  # the file still lists A
    ring.update(B)
    assert ring.accepted() == (B,)


def test_an_empty_source_is_refused_at_start_and_ignored_later() -> None:
    with pytest.raises(ValueError, match="empty"):
        TokenRing("\n \n")
    ring = TokenRing(A)
    assert not ring.update("")  # a file caught mid-rewrite
    assert ring.accepted() == (A,)


def test_a_token_file_is_followed_and_read_again_at_once_on_a_miss(tmp_path: Path) -> None:
    clock = Clock()
    path = tmp_path / "token"
    path.write_text(A + "\n")
    ring = FileTokenRing(path, grace_s=10, check_every_s=60, clock=clock)
    assert ring.accepted() == (A,)
    new = tmp_path / "token.new"
    new.write_text(B + "\n")
    new.replace(path)  # the kubelet swaps the file atomically
    assert ring.accepted() == (A,)  # not looked at again yet (check_every_s)
    # A peer in the same pod already sends B: a miss reads the file again at once.
    assert ring_accepts_bearer(ring, bearer_header(B)["Authorization"])
    assert ring.accepted() == (A, B)
    path.unlink()  # a vanished file keeps the tokens in force
    clock.now += 61  # past the check interval, and past 2 x grace: B alone
    assert ring.accepted() == (B,)
    assert ring.sending() == B
    (tmp_path / "empty").write_text("")
    with pytest.raises(ValueError, match="empty"):
        FileTokenRing(tmp_path / "empty")


def test_key_ids_are_short_public_fingerprints() -> None:
    assert key_id(A) != key_id(B)
    assert len(key_id(A)) == 12
    assert A not in key_id(A)
