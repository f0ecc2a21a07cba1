"""The one token-file reader (refit_protocol.kit.tokens.read_token_file) against hostile files
(issue 34): whatever the mounted file holds, following it never raises; content that is not a
valid token list is "no valid token", logged once per distinct failure, counted by reason, and
the ring in force is kept, so every component keeps serving with it."""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import SecretStr
from structlog.testing import capture_logs

from refit_protocol.kit.auth import bearer_header, resolve_token, ring_accepts_bearer
from refit_protocol.kit.tokens import (
    MAX_TOKEN_CHARS,
    MAX_TOKEN_FILE_BYTES,
    TOKEN_FILE_REJECTIONS,
    FileTokenRing,
    TokenFileError,
    read_token_file,
    ring_accepts,
)

A, B = "token-file-a", "token-file-b"


def _ring(path: Path) -> FileTokenRing:
    path.write_text(A + "\n")
    return FileTokenRing(path, grace_s=0.0, check_every_s=3600)


def _replace(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".new")
    tmp.write_bytes(data)
    tmp.replace(path)  # atomic, as the kubelet's symlink swap


def _rejected(ring: FileTokenRing) -> int:
    return sum(ring.rejections().values())


def test_valid_files_list_tokens_newest_first(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_bytes(b"  new \r\nold\n\n\tolder\t\nold\n")
    assert read_token_file(path) == ("new", "old", "older")  # stripped, deduplicated
    path.write_bytes(b"x" * (MAX_TOKEN_FILE_BYTES - 1) + b"\n")  # the limit itself is fine
    assert read_token_file(path, max_bytes=MAX_TOKEN_FILE_BYTES, max_token_chars=1 << 21) == (
        "x" * (MAX_TOKEN_FILE_BYTES - 1),
    )


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "empty"),
        (b" \n\t\r\n", "empty"),
        (b"\xff\xfe" + A.encode(), "not_utf8"),
        (A.encode() + b"\x00\n", "invalid"),
        (A.encode() + b"\x1b[31m\n", "invalid"),
        (b"t" * (MAX_TOKEN_CHARS + 1), "invalid"),
        (b"t" * (MAX_TOKEN_FILE_BYTES + 1), "too_large"),
    ],
)
def test_invalid_content_is_refused_with_its_reason(
    tmp_path: Path, data: bytes, reason: str
) -> None:
    path = tmp_path / "token"
    path.write_bytes(data)
    with pytest.raises(TokenFileError) as refused:
        read_token_file(path)
    assert refused.value.reason == reason
    assert str(path) in str(refused.value)
    assert A not in str(refused.value)  # a refusal never echoes file content


def test_only_regular_files_are_read_and_never_more_than_the_limit(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # no writer: opening it to read would block for ever
    directory = tmp_path / "dir"
    directory.mkdir()
    zero = tmp_path / "zero"
    zero.symlink_to("/dev/zero")  # endless
    for path in (fifo, directory, zero):
        with pytest.raises(TokenFileError) as refused:
            read_token_file(path)
        assert refused.value.reason == "not_regular", path
    with pytest.raises(FileNotFoundError):
        read_token_file(tmp_path / "missing")


def test_at_start_a_bad_file_is_a_configuration_error(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_bytes(b"\xff")
    with pytest.raises(ValueError, match="not UTF-8"):
        FileTokenRing(path)
    with pytest.raises(ValueError, match="not UTF-8"):
        resolve_token(None, path)
    path.write_text(f"{B}\n{A}\n")
    assert resolve_token(None, path) == B  # the newest listed
    assert resolve_token(SecretStr(A), path) == A


def test_a_bad_file_later_keeps_the_ring_is_logged_once_and_counted(tmp_path: Path) -> None:
    path = tmp_path / "token"
    ring = _ring(path)
    assert set(ring.rejections()) == set(TOKEN_FILE_REJECTIONS)
    with capture_logs() as logs:
        for garbage in (b"\xff\xfe", b"\xff\xfe", b"\xff\xff\xff"):
            _replace(path, garbage)
            assert not ring.refresh(force=True)
            assert ring.accepted() == (A,)
            assert ring.sending() == A
            assert ring_accepts_bearer(ring, bearer_header(A)["Authorization"])  # HTTP: no 500
        path.unlink()
        for _ in range(3):
            assert not ring.refresh(force=True)
    rejected = [e for e in logs if e["event"] == "token.file_rejected"]
    assert [e["reason"] for e in rejected] == ["not_utf8", "unreadable"]  # once per failure
    assert all(A not in str(e) for e in logs)
    assert ring.rejections()["not_utf8"] == 3
    assert ring.rejections()["unreadable"] == 1
    _replace(path, f"{B}\n".encode())
    assert ring.refresh(force=True)
    assert ring.accepted() == (B,)
    with capture_logs() as logs:  # fixed, then broken again: said again
        _replace(path, b"\xff")
        ring.refresh(force=True)
    assert [e["event"] for e in logs] == ["token.file_rejected"]
    assert ring.accepted() == (B,)


def test_a_reader_never_blocks_on_a_fifo_swapped_in(tmp_path: Path) -> None:
    path = tmp_path / "token"
    ring = _ring(path)
    path.unlink()
    os.mkfifo(path)
    done = threading.Event()

    def look() -> None:
        ring.refresh(force=True)
        done.set()

    threading.Thread(target=look, daemon=True).start()
    assert done.wait(5), "the reader blocked on a FIFO"
    assert ring.accepted() == (A,)
    assert ring.rejections()["not_regular"] == 1


# -- the property: whatever the file holds ---------------------------------------------------------
def _valid(data: bytes) -> tuple[str, ...] | None:
    """The oracle: the tokens a file of `data` lists, or None when it lists no valid one."""
    if len(data) > MAX_TOKEN_FILE_BYTES:
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines or any(not t.isprintable() or len(t) > MAX_TOKEN_CHARS for t in lines):
        return None
    return tuple(dict.fromkeys(lines))


TOKEN = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=40)
CONTENT = st.one_of(
    st.binary(max_size=256),  # mostly invalid UTF-8
    st.text(max_size=128).map(lambda s: s.encode("utf-8", "surrogatepass")),  # any text
    st.lists(TOKEN, min_size=1, max_size=50).map(lambda ts: "\n".join(ts).encode()),  # valid
    st.lists(st.sampled_from(["", " ", "\t", "\r", "\x00", "\x0b", "\u2028"]), max_size=20).map(
        lambda ws: "\n".join(ws).encode()  # whitespace, NUL, odd line breaks
    ),
    st.tuples(st.sampled_from([b"t", b"\n", b"\x00", b"\xff"]), st.integers(0, 8)).map(
        # around the size limit, and far beyond it
        lambda c: c[0] * (MAX_TOKEN_FILE_BYTES - 4 + c[1] * (1 + c[1] * 10000))
    ),
    st.integers(1, 3000).map(lambda n: "\n".join(f"tok-{i}" for i in range(n)).encode()),  # lines
)
SPECIAL = st.sampled_from(["fifo", "directory", "dev_zero", "missing", "dangling"])


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="token-file-") as root:
        yield Path(root)


@settings(max_examples=100)
@given(content=st.one_of(CONTENT, SPECIAL))
def test_following_any_file_never_raises_and_keeps_serving(
    scratch: Path, content: bytes | str
) -> None:
    workdir = Path(tempfile.mkdtemp(dir=scratch))
    path = workdir / "token"
    ring = _ring(path)
    path.unlink()
    if isinstance(content, bytes):
        path.write_bytes(content)
        expected = _valid(content)
    else:
        expected = None
        if content == "fifo":
            os.mkfifo(path)
        elif content == "directory":
            path.mkdir()
        elif content == "dev_zero":
            path.symlink_to("/dev/zero")
        elif content == "dangling":
            path.symlink_to(workdir / "nowhere")
    before = _rejected(ring)
    ring.refresh(force=True)  # never raises
    if expected is None:
        assert ring.accepted() == (A,)  # the ring in force is kept ...
        assert ring_accepts(ring, A)  # ... and serves
        assert _rejected(ring) == before + 1
    else:
        assert ring.newest() == expected[0]
        assert set(ring.accepted()) == set(expected)
        assert _rejected(ring) == before
