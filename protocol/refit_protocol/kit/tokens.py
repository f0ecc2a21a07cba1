"""The policy's token over time: live rotation without restarting any component.

A Kubernetes Secret mounted as a volume is updated in place by the kubelet, on each pod at its
own moment (up to the kubelet's sync period plus its cache TTL after the change, about a minute
or two by default). A `TokenRing` follows that file and keeps every component of a policy
interoperable while pods see the change at different times:

- **Accepted** (inbound: HTTP bearers, relay frame tokens, Curve client keys, payload MACs): the
  newest token and the one it replaced, until `2 x grace` after the change was seen. A token file
  may also list older tokens on further lines ("new\\nold"): those are accepted as long as the
  file lists them (an explicit overlap, e.g. for pods started during a rotation).
- **Sending** (outbound: bearers, frame tokens, Curve keys a relay serves with, MACs a producer
  seals with): the previous token for `grace` after the change was seen, then the new one. With
  `grace` longer than the slowest pod's propagation delay, every receiver accepts the new token
  before any sender uses it, and still accepts the old one until every sender has switched.

`generation` counts changes of either set, so holders of derived state (a relay's Curve server
keys, a DEALER's connections) know when to rebuild it.

The file is read by one reader, `read_token_file`, bounded and strict: a regular file (never a
FIFO, device or directory, which could block or never end), at most `MAX_TOKEN_FILE_BYTES`
(never more than that plus one byte is read), UTF-8, one token per line, each printable and at
most `MAX_TOKEN_CHARS` long. At start anything else is a configuration error; later it is "no
valid token": the ring in force is kept, the failure is logged once (until it changes or the file
is valid again) and counted by reason (`FileTokenRing.rejections`, exported by the receiver's
relay as `kuberefit_token_file_rejected_total{reason}`). Nothing in a token file can make a
reader raise after start.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from refit_protocol.kit.loggers import get_logger

log = get_logger("kuberefit.tokens")

#: Default for `grace` (seconds): well above the kubelet's default Secret propagation delay.
DEFAULT_ROTATION_GRACE_S = 300.0
#: The file is looked at (one stat) at most this often; an authentication failure looks at once.
DEFAULT_CHECK_EVERY_S = 2.0
#: Largest token file read (bytes): the size limit of a Kubernetes Secret (1 MiB), so no file a
#: Secret can hold is refused. A larger file is refused after reading this many bytes plus one.
MAX_TOKEN_FILE_BYTES = 1 << 20
#: Longest token (characters): what a relay frame's metadata can carry (`FrameMeta.token`).
MAX_TOKEN_CHARS = 4096
#: Why a token file was refused, the `reason` label of `kuberefit_token_file_rejected_total`:
#: it could not be opened or read (missing, vanished, permissions), is no regular file (FIFO,
#: device, directory), is larger than `MAX_TOKEN_FILE_BYTES`, is not UTF-8, has a line that is no
#: token (control characters, NUL, longer than `MAX_TOKEN_CHARS`), or lists no token at all.
TOKEN_FILE_REJECTIONS = ("unreadable", "not_regular", "too_large", "not_utf8", "invalid", "empty")


class TokenFileError(ValueError):
    """A token file that holds no valid token list; `reason` is one of TOKEN_FILE_REJECTIONS.
    The message names the file and what is wrong, never the file's content."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def read_token_file(
    path: Path,
    *,
    max_bytes: int = MAX_TOKEN_FILE_BYTES,
    max_token_chars: int = MAX_TOKEN_CHARS,
) -> tuple[str, ...]:
    """The tokens a token file lists, newest first (stripped, blank lines skipped, duplicates
    dropped): the one reader of token files. Raises `TokenFileError` for content that is no
    valid token list, `OSError` (with the file name) when it cannot be opened or read.

    Only a regular file is opened (symlinks followed, as the kubelet's `..data` swap needs), and
    checked again once open; it is opened non-blocking, so a FIFO swapped in between can
    neither block the reader nor be read; at most `max_bytes + 1` bytes are read."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise TokenFileError("not_regular", f"token file {path} is not a regular file")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise TokenFileError("not_regular", f"token file {path} is not a regular file")
        chunks: list[bytes] = []
        left = max_bytes + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:
        raise TokenFileError(
            "too_large", f"token file {path} is larger than {max_bytes} bytes (the limit)"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TokenFileError(
            "not_utf8", f"token file {path} is not UTF-8 (at byte {exc.start})"
        ) from None
    tokens: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        token = line.strip()
        if not token:
            continue
        if not token.isprintable() or len(token) > max_token_chars:
            raise TokenFileError(
                "invalid",
                f"token file {path}: line {number} is not a token (printable characters, "
                f"at most {max_token_chars})",
            )
        tokens.append(token)
    if not tokens:
        raise TokenFileError("empty", f"token file {path} is empty")
    return tuple(dict.fromkeys(tokens))


@dataclass
class _Seen:
    token: str
    since: float  # monotonic time this ring first saw the token as the newest one


class TokenRing:
    """Thread-safe view of a policy's token(s); see the module docstring for the rules."""

    def __init__(
        self,
        text: str | None = None,
        *,
        grace_s: float = DEFAULT_ROTATION_GRACE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.grace_s = grace_s
        self._clock = clock
        self._lock = threading.RLock()
        self._listed: list[str] = []  # the source's tokens, newest first
        self._newest: _Seen | None = None
        self._previous: _Seen | None = None  # the token the newest one replaced
        self._state: tuple[str | None, tuple[str, ...]] = (None, ())
        self.generation = 0
        if text is not None:
            self.update(text, first=True)

    # -- feeding -------------------------------------------------------------------------------
    def update(self, text: str, *, first: bool = False) -> bool:
        """Take the source's current content (one token per line, newest first). Returns True
        when the accepted or sending set changed. An empty text is ignored (a file caught in the
        middle of a rewrite), except at first, where it is an error."""
        tokens = [line.strip() for line in text.splitlines() if line.strip()]
        if not tokens:
            if first:
                raise ValueError("the token source is empty")
            log.warning("token.empty_source_ignored")
            return False
        return self._take(tokens)

    def _take(self, tokens: list[str] | tuple[str, ...]) -> bool:
        """Take a non-empty token list (newest first); see `update`."""
        with self._lock:
            now = self._clock()
            newest = tokens[0]
            if self._newest is None:
                # A process that starts with one token sends with it at once. One that starts
                # with an overlap listed ("new\nold": a pod created during a rotation) sends the
                # older one for `grace` first, as the pods that saw the change do.
                if len(tokens) > 1:
                    self._newest, self._previous = _Seen(newest, now), _Seen(tokens[1], now)
                else:
                    self._newest = _Seen(newest, now - self.grace_s)
            elif newest != self._newest.token:
                self._previous = self._newest
                self._previous.since = now
                self._newest = _Seen(newest, now)
                log.info(
                    "token.rotated",
                    new=key_id(newest),
                    previous=key_id(self._previous.token),
                    grace_s=self.grace_s,
                )
            self._listed = list(tokens)
            return self._refresh(now)

    def _refresh(self, now: float) -> bool:
        state = (self._sending(now), self._accepted(now))
        if state != self._state:
            self._state = state
            self.generation += 1
            return True
        return False

    # -- reading ---------------------------------------------------------------------------------
    def sending(self) -> str | None:
        """The token to send with now (None without any token)."""
        with self._lock:
            self._refresh(self._clock())
            return self._state[0]

    def newest(self) -> str | None:
        """The newest token seen, with no grace: what a client sends to a server in its own pod,
        which reads the same file (and reads it again at once on a miss)."""
        with self._lock:
            return self._newest.token if self._newest is not None else None

    def accepted(self) -> tuple[str, ...]:
        """Tokens accepted now, the sending one first (empty without any token)."""
        with self._lock:
            self._refresh(self._clock())
            return self._state[1]

    def current_generation(self) -> int:
        """`generation` after applying the passage of time (a grace that just ended)."""
        with self._lock:
            self._refresh(self._clock())
            return self.generation

    def likely(self) -> tuple[str, ...]:
        """The accepted tokens a peer of the policy most likely serves with now, at most four,
        the sending one first: the sending one, the newest, the one it replaced, and the second
        listed (what a process started with an overlap list sends during its grace). A client
        connects with these, and tries the rest of `accepted()` only when a peer refuses them
        all, so its connections do not grow with the number of listed tokens."""
        with self._lock:
            self._refresh(self._clock())
            accepted = self._state[1]
            picks = [
                self._state[0],
                self._newest.token if self._newest is not None else None,
                self._previous.token if self._previous is not None else None,
                self._listed[1] if len(self._listed) > 1 else None,
            ]
            return tuple(dict.fromkeys(t for t in picks if t is not None and t in accepted))

    def __bool__(self) -> bool:
        return self._newest is not None

    def _sending(self, now: float) -> str | None:
        if self._newest is None:
            return None
        if self._in_grace(now) and self._previous is not None:
            return self._previous.token
        return self._newest.token

    def _in_grace(self, now: float) -> bool:
        return self._newest is not None and now - self._newest.since < self.grace_s

    def _accepted(self, now: float) -> tuple[str, ...]:
        sending = self._sending(now)
        out: list[str] = [sending] if sending else []
        out += self._listed
        newest_since = self._newest.since if self._newest is not None else now
        if self._previous is not None and now - newest_since < 2 * self.grace_s:
            out.append(self._previous.token)
        return tuple(dict.fromkeys(out))  # first occurrence kept; linear in a long list

    # -- sources -------------------------------------------------------------------------------
    def refresh(self, *, force: bool = False) -> bool:
        """Re-read the source if it has one (see `FileTokenRing`); True when something changed."""
        return False


class FileTokenRing(TokenRing):
    """A `TokenRing` that follows a file (a mounted Secret), re-read when it changes.

    At start the file must hold a valid token list (`read_token_file`: `TokenFileError` or
    `OSError` otherwise). Later, a file that vanished, cannot be read or holds no valid token
    list keeps the tokens in force: `refresh` never raises."""

    def __init__(
        self,
        path: Path,
        *,
        grace_s: float = DEFAULT_ROTATION_GRACE_S,
        check_every_s: float = DEFAULT_CHECK_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self.check_every_s = check_every_s
        self._stat: tuple[int, int, int] | None = None
        self._checked = float("-inf")
        self._rejections = dict.fromkeys(TOKEN_FILE_REJECTIONS, 0)
        self._failure: tuple[str, str] | None = None  # the last failure logged
        super().__init__(None, grace_s=grace_s, clock=clock)
        # Stat before reading: a swap in between is then seen as a change at the next look.
        self._stat = self._signature()
        tokens = read_token_file(path)
        self._checked = clock()
        self._take(tokens)

    def rejections(self) -> dict[str, int]:
        """How often the file was refused since start, by reason (every reason present)."""
        with self._lock:
            return dict(self._rejections)

    def _signature(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)  # follows the kubelet's ..data symlink swap
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def refresh(self, *, force: bool = False) -> bool:
        """Look at the file (at most every `check_every_s` unless `force`); re-read on change.
        Never raises: a file that vanished, cannot be read or holds no valid token list keeps
        the tokens in force (logged once per distinct failure, counted by reason)."""
        with self._lock:
            now = self._clock()
            if not force and now - self._checked < self.check_every_s:
                return False
            self._checked = now
            try:
                return self._reread()
            except Exception as exc:  # a reader bug: keep the ring in force, say so
                self._reject("unreadable", f"token file {self.path}: {type(exc).__name__}")
                return False

    def _reread(self) -> bool:
        sig = self._signature()
        if sig is None:
            if self._stat is not None:  # counted when it goes, logged once
                self._stat = None
                self._reject("unreadable", f"token file {self.path} cannot be read (missing)")
            return False
        if sig == self._stat:
            return False
        # Remembered before reading: a refused version is read once, not at every look.
        self._stat = sig
        try:
            tokens = read_token_file(self.path)
        except TokenFileError as exc:
            self._reject(exc.reason, str(exc))
            return False
        except OSError as exc:
            self._reject("unreadable", f"token file {self.path} cannot be read ({exc.strerror})")
            return False
        if self._failure is not None:
            log.info("token.file_valid_again", path=str(self.path))
            self._failure = None
        return self._take(tokens)

    def _reject(self, reason: str, message: str) -> None:
        self._rejections[reason] = self._rejections.get(reason, 0) + 1
        if self._failure != (reason, message):
            self._failure = (reason, message)
            log.warning(
                "token.file_rejected",
                path=str(self.path),
                reason=reason,
                error=message,
                kept=key_id(self._newest.token) if self._newest is not None else None,
            )

    def sending(self) -> str | None:
        self.refresh()
        return super().sending()

    def accepted(self) -> tuple[str, ...]:
        self.refresh()
        return super().accepted()

    def newest(self) -> str | None:
        self.refresh()
        return super().newest()

    def current_generation(self) -> int:
        self.refresh()
        return super().current_generation()

    def likely(self) -> tuple[str, ...]:
        self.refresh()
        return super().likely()


def key_id(token: str) -> str:
    """A short public fingerprint of a token (logs, status): reveals nothing about it."""
    return hashlib.blake2b(token.encode(), digest_size=6, person=b"kr-key-id").hexdigest()


def as_ring(token: str | TokenRing | None) -> TokenRing:
    """A ring for a fixed token (or none), or the ring itself."""
    return token if isinstance(token, TokenRing) else TokenRing(token or None)


def ring_accepts(
    ring: TokenRing,
    given: str | None,
    *,
    forms: Callable[[str], tuple[str, ...]] = lambda token: (token,),
) -> bool:
    """True when `ring` requires no token, or `given` equals one of the `forms` of an accepted
    token (the token itself by default), compared in constant time. On a miss the source is
    looked at once more at once: a peer in the same pod may have read a rotated file a moment
    earlier."""
    for attempt in range(2):
        tokens = ring.accepted()
        if not tokens:
            return True
        if given is not None:
            for token in tokens:
                for expected in forms(token):
                    if hmac.compare_digest(expected.encode(), given.encode()):
                        return True
        if attempt == 0 and not ring.refresh(force=True):
            return False
    return False
