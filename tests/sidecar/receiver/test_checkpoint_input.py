"""Issue 34, item 3 (hostile input): `POST /v1/audit` and `POST /v1/restore` over checkpoint
files that are not what they claim, through the real HTTP control plane.

Random bytes, a header length of 2**62, a truncated file, a symlink to /dev/zero, a FIFO named
`model.safetensors`: each is a typed refusal (HTTP 422, code `bad_checkpoint`, the message names
the file and what is wrong), never a 500 and never a control plane blocked on a read: a prepare
sent meanwhile gets its answer, also while a long (legitimate) checkpoint read is running. A
seeded, bounded property test over mutated, truncated and spliced valid files, random header JSON
and huge lengths checks the same for every example, and that the node keeps answering.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import itertools
import json
import os
import random
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from safetensors.torch import save

from refit_protocol.tensors import SAFETENSORS_DTYPES
from refit_sidecar.receiver.node import ReceiverNode
from tests.sidecar.receiver.models import NODE_TOKEN, canonical, metas

AUTH = {"Authorization": f"Bearer {NODE_TOKEN}"}
STATE = canonical(0)  # what the `node` fixture's model holds (conftest.py)
METAS = [m.model_dump(mode="json") for m in metas(STATE)]
#: A valid checkpoint of a few of the node's tensors, other values (bytes of one file).
VALID = bytes(save({n: t + 1 for n, t in list(STATE.items())[:2]}))
#: Bound on one answer: every case here is refused after reading a few KiB at most.
ANSWER_S = 5.0


def _file(ckpt: Path) -> Path:
    ckpt.mkdir(exist_ok=True)
    return ckpt / "model.safetensors"


def random_bytes(ckpt: Path) -> None:
    _file(ckpt).write_bytes(random.Random(34).randbytes(4096))


def header_length_2_62(ckpt: Path) -> None:
    _file(ckpt).write_bytes(struct.pack("<Q", 2**62) + b'{"t0.weight": {}}')


def truncated(ckpt: Path) -> None:
    _file(ckpt).write_bytes(VALID[: len(VALID) // 2])


def symlink_to_dev_zero(ckpt: Path) -> None:
    _file(ckpt).symlink_to("/dev/zero")


def body(endpoint: str, ckpt: Path) -> dict[str, Any]:
    if endpoint == "audit":
        return {"checkpoint": str(ckpt), "version": 0}
    return {"version": 0, "source": str(ckpt), "metas": METAS}


async def post(
    node: ReceiverNode,
    session: aiohttp.ClientSession,
    path: str,
    data: dict[str, Any],
    timeout: float = ANSWER_S,
) -> tuple[int, dict[str, Any]]:
    url = f"http://127.0.0.1:{node.port}/v1{path}"
    limit = aiohttp.ClientTimeout(total=timeout)
    async with session.post(url, json=data, headers=AUTH, timeout=limit) as resp:
        return resp.status, await resp.json()


async def prewarm(node: ReceiverNode, session: aiohttp.ClientSession) -> None:
    status, answer = await post(node, session, "/prewarm", {"metas": METAS})
    assert status == 200, answer


PREPARE = {
    "attempt": "a1",
    "from_version": 0,
    "target_version": 1,
    "mode": "mixed",
    "producers": [0],
}


@pytest.mark.parametrize("endpoint", ["audit", "restore"])
@pytest.mark.parametrize(
    ("make", "why"),
    [
        (random_bytes, "header length"),
        (header_length_2_62, "header length 4611686018427387904"),
        (truncated, "bytes of tensor data"),
        (symlink_to_dev_zero, "not a regular file (a character device)"),
    ],
)
async def test_a_broken_checkpoint_file_is_a_typed_refusal(
    node: ReceiverNode,
    session: aiohttp.ClientSession,
    tmp_path: Path,
    endpoint: str,
    make: Callable[[Path], None],
    why: str,
) -> None:
    await prewarm(node, session)
    ckpt = tmp_path / "ckpt"
    make(ckpt)
    t0 = time.monotonic()
    status, answer = await post(node, session, f"/{endpoint}", body(endpoint, ckpt))
    assert status == 422, answer
    assert answer["code"] == "bad_checkpoint"
    assert f"{ckpt}/model.safetensors" in answer["error"]
    assert why in answer["error"]
    assert time.monotonic() - t0 < ANSWER_S
    status, _ = await post(node, session, "/prepare", PREPARE)
    assert status == 200  # the control plane keeps answering


#: Unblocks a reader stuck in open() of the FIFO `argv[1]` after `argv[2]` seconds. A process:
#: the code before the fix blocked in open() holding the GIL, so nothing in this process ran.
WATCHDOG = """
import os, sys, time
time.sleep(float(sys.argv[2]))
for _ in range(100):
    try:
        os.close(os.open(sys.argv[1], os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        time.sleep(0.1)
"""


@pytest.mark.parametrize("endpoint", ["audit", "restore"])
async def test_a_fifo_is_refused_and_a_concurrent_prepare_is_answered(
    node: ReceiverNode, session: aiohttp.ClientSession, tmp_path: Path, endpoint: str
) -> None:
    await prewarm(node, session)
    ckpt = tmp_path / "ckpt"
    fifo = _file(ckpt)
    os.mkfifo(fifo)
    watchdog = subprocess.Popen([sys.executable, "-c", WATCHDOG, str(fifo), str(ANSWER_S + 2)])
    call = asyncio.ensure_future(post(node, session, f"/{endpoint}", body(endpoint, ckpt)))
    try:
        await asyncio.sleep(0.3)  # the audit/restore has started
        t0 = time.monotonic()
        status, answer = await post(node, session, "/prepare", PREPARE)
        assert status == 200, answer
        assert time.monotonic() - t0 < ANSWER_S
        status, answer = await call
        assert status == 422, answer
        assert answer["code"] == "bad_checkpoint"
        assert f"{fifo}: not a regular file (a FIFO)" in answer["error"]
    finally:
        watchdog.kill()
        watchdog.wait()
        call.cancel()
        with contextlib.suppress(BaseException):
            await call


async def test_a_prepare_is_answered_while_a_long_checkpoint_read_runs(
    node: ReceiverNode, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """A legitimate audit may read for minutes under the control lock: a prepare meanwhile is
    refused at once (retry later), never left waiting for the read."""
    await prewarm(node, session)
    started, release = threading.Event(), threading.Event()
    applier = node.applier
    real = applier.audit

    def slow_audit(source: str) -> list[dict[str, Any]]:
        started.set()
        release.wait(30)
        return real(source)

    applier.audit = slow_audit  # type: ignore[method-assign]
    ckpt = tmp_path / "ckpt"
    _file(ckpt).write_bytes(VALID)
    call = asyncio.ensure_future(post(node, session, "/audit", body("audit", ckpt), timeout=30))
    try:
        assert await asyncio.to_thread(started.wait, ANSWER_S)
        status, answer = await post(node, session, "/prepare", PREPARE)
        assert status == 200, answer
        assert not answer["accepted"]
        assert f"an audit of v0 against {ckpt} is in progress" in answer["reason"]
        status, answer = await post(node, session, "/audit", body("audit", ckpt))
        assert status == 409, answer
        assert "is in progress" in answer["error"]
        release.set()
        status, answer = await call
        assert status == 200, answer
        assert not answer["ok"]  # other values: a mismatch
    finally:
        release.set()
        call.cancel()
        with contextlib.suppress(BaseException):
            await call


# -- the property ------------------------------------------------------------------------------

TAGS = sorted(SAFETENSORS_DTYPES)
NAMES = list(STATE)


def _with_header(header: bytes, data: bytes) -> bytes:
    return struct.pack("<Q", len(header)) + header + data


def _header_len(raw: bytes) -> int:
    return 8 + int(struct.unpack("<Q", raw[:8])[0])


@st.composite
def valid_files(draw: st.DrawFn) -> bytes:
    """A valid file: some of the node's tensors, or other dtypes/shapes, with other values."""
    names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=3, unique=True))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for n in names:
        if draw(st.booleans()):
            tensors[n] = torch.randn(STATE[n].shape, generator=g)
        else:  # not the canonical dtype or shape
            shape = draw(st.lists(st.integers(0, 5), max_size=3))
            dtype = draw(st.sampled_from([torch.float16, torch.int8, torch.bool, torch.float64]))
            tensors[n] = torch.zeros(shape, dtype=dtype)
    return bytes(save(tensors))


def _mutate(raw: bytes, draw: st.DrawFn) -> bytes:
    out = bytearray(raw)
    head = _header_len(raw)
    for _ in range(draw(st.integers(1, 8))):
        # Mostly in the length field and JSON header, where the parser branches.
        hi = head - 1 if draw(st.integers(0, 3)) else len(out) - 1
        out[draw(st.integers(0, hi))] = draw(st.integers(0, 255))
    return bytes(out)


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=8,
)
_ints = st.integers(-2, 70) | st.sampled_from([2**31, 2**62, 2**64 - 1, 2**70])


@st.composite
def header_entries(draw: st.DrawFn) -> object:
    if draw(st.integers(0, 4)) == 0:
        return draw(_json)
    entry: dict[str, object] = {
        "dtype": draw(st.sampled_from(TAGS) | st.text(max_size=6) | _json),
        "shape": draw(st.lists(_ints, max_size=3) | _json),
        "data_offsets": draw(st.lists(_ints, min_size=2, max_size=2) | _json),
    }
    if draw(st.integers(0, 5)) == 0:
        entry.pop(draw(st.sampled_from(sorted(entry))))
    return entry


@st.composite
def random_headers(draw: st.DrawFn) -> bytes:
    names = st.sampled_from(NAMES) | st.text(max_size=12)
    header: object = draw(st.dictionaries(names, header_entries(), max_size=4))
    if draw(st.integers(0, 6)) == 0:
        header = draw(_json)
    raw = json.dumps(header).encode()
    return _with_header(raw, draw(st.binary(max_size=256)))


@st.composite
def checkpoint_bytes(draw: st.DrawFn) -> bytes:
    kind = draw(
        st.sampled_from(["valid", "mutated", "truncated", "spliced", "length", "header", "bytes"])
    )
    if kind == "valid":
        return draw(valid_files())
    if kind == "mutated":
        return _mutate(draw(valid_files()), draw)
    if kind == "truncated":
        raw = draw(valid_files())
        return raw[: draw(st.integers(0, len(raw) - 1))]
    if kind == "spliced":
        a, b = draw(valid_files()), draw(valid_files())
        return a[: draw(st.integers(0, len(a)))] + b[draw(st.integers(0, len(b))) :]
    if kind == "length":
        raw = draw(valid_files())
        length = draw(
            st.sampled_from([2**62, 2**63, 2**64 - 1, 100_000_001, len(raw) - 7, len(raw)])
            | st.integers(0, 2**64 - 1)
        )
        return struct.pack("<Q", length) + raw[8:]
    if kind == "header":
        return draw(random_headers())
    return draw(st.binary(max_size=512))


class _Http:
    """A blocking client of the node (the property runs in a worker thread)."""

    def __init__(self, port: int) -> None:
        self.port = port

    def call(self, method: str, path: str, data: object = None) -> tuple[int, dict[str, Any]]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=ANSWER_S * 2)
        try:
            t0 = time.monotonic()
            payload = None if data is None else json.dumps(data).encode()
            headers = {**AUTH, "Content-Type": "application/json"}
            conn.request(method, f"/v1{path}", body=payload, headers=headers)
            resp = conn.getresponse()
            answer = json.loads(resp.read())
            assert time.monotonic() - t0 < ANSWER_S, (path, "answered too late")
            return resp.status, answer
        finally:
            conn.close()


async def test_no_checkpoint_file_gets_a_500_or_a_hang(
    node: ReceiverNode, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    await prewarm(node, session)
    http_ = _Http(node.port)
    counter = itertools.count()

    @seed(34)  # the same examples outside CI too (the ci profile derandomizes)
    @settings(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(raw=checkpoint_bytes(), endpoint=st.sampled_from(["audit", "restore"]))
    def every_file_is_answered(raw: bytes, endpoint: str) -> None:
        ckpt = tmp_path / f"c{next(counter)}"
        _file(ckpt).write_bytes(raw)
        status, answer = http_.call("POST", f"/{endpoint}", body(endpoint, ckpt))
        assert status < 500, answer
        if status != 200:
            assert 400 <= status < 500, answer
            assert answer["error"], answer
            assert answer["code"] in {"bad_checkpoint", "conflict"}, answer
            if answer["code"] == "bad_checkpoint":
                assert str(ckpt) in answer["error"], answer
        status, answer = http_.call("GET", "/status")
        assert status == 200, answer
        if answer["held_version"] != 0:
            # An audit mismatch or a failed restore forgets the version: the next example
            # starts from v0 again (a dense commit notice), or it would not be compared.
            status, answer = http_.call(
                "POST", "/commit", {"attempt": "reset", "version": 0, "dense": True}
            )
            assert status == 200, answer

    await asyncio.to_thread(every_file_is_answered)
