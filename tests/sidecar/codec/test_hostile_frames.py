"""Issue 15 (hostile input), part B: a zstd frame costs what it decodes, never what it claims.

- A 2 KiB payload whose frame header claims 64 MiB used to raise peak RSS by 64 MiB before
  failing (the output buffer was allocated at the claimed size): now memory follows output.
- With the receiver's canonical tensors (`known`) a raw size they cannot need is refused before
  anything is decompressed.
- A frame of 22 M empty blocks took 5-8 s to reject (a Python walk over every block header):
  now blocks are held to what the decoded bytes justify, and it is refused at once.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
import zstandard

from refit_sidecar.codec import (
    DecodeLimits,
    DecompressionError,
    Item,
    Op,
    SizeLimitExceeded,
    TensorMeta,
    TruncatedPayload,
    decode_payload,
    encode_payload,
    seal_body,
)
from refit_sidecar.codec.decode import raw_bound
from tests.sidecar.codec.craft import (
    HEADER,
    body_offset,
    claim_frame,
    frame_header,
    payload,
    raw_block,
    rle_block,
)

REPO = Path(__file__).resolve().parents[3]
MIB = 1 << 20
KNOWN = {"w": TensorMeta("w", (1000,), torch.bfloat16)}


def _real_body() -> bytes:
    """The raw body of a valid one-item payload (what a claim frame carries)."""
    p = encode_payload(
        HEADER, [Item(KNOWN["w"], Op.OVERWRITE, 0, None, torch.arange(1000).short())]
    )
    return zstandard.ZstdDecompressor().decompress(p.body[body_offset(p.body) :])


# The child builds the hostile payload itself, so the test process's memory plays no part. A
# process's ru_maxrss starts at its parent's peak (the kernel carries it across fork and exec),
# so the child forks first, while it is still small, and measures in the grandchild: warm-up
# on a valid payload, then ru_maxrss before and after the one decode that matters.
_RSS_CHILD = textwrap.dedent(
    """
    import os, sys
    if os.fork():
        sys.exit(os.waitstatus_to_exitcode(os.wait()[1]))
    import json, resource
    from refit_sidecar.codec import CodecError, decode_payload
    from tests.sidecar.codec.craft import claim_frame, payload
    from tests.sidecar.codec.test_hostile_frames import _real_body

    real = _real_body()
    decode_payload(payload(claim_frame(len(real), real), len(real)))  # warm-up, valid
    hostile = payload(claim_frame(64 << 20, real), 64 << 20)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        decode_payload(hostile)
        error = None
    except CodecError as exc:
        error = type(exc).__name__
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"size": len(hostile), "growth_kib": after - before, "error": error}))
    sys.stdout.flush()
    os._exit(0)
    """
)


def test_a_64_mib_claim_in_a_2_kib_payload_costs_no_memory() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _RSS_CHILD],
        cwd=REPO,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([os.environ.get("PYTHONPATH", ""), str(REPO)]),
        },
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["size"] < 2200
    assert result["error"] == "DecompressionError"
    assert result["growth_kib"] < 8 * 1024, result


def test_a_claim_beyond_what_the_known_tensors_need_is_refused_before_decompressing() -> None:
    real = _real_body()
    hostile = payload(claim_frame(64 * MIB, real), 64 * MIB)
    with pytest.raises(SizeLimitExceeded, match="canonical tensors"):
        decode_payload(hostile, known=KNOWN)
    # The bound is about the tensors, not the frame: a valid body of the same tensor passes it.
    assert decode_payload(payload(claim_frame(len(real), real), len(real)), known=KNOWN).items


def test_raw_bound_holds_for_the_largest_valid_payload() -> None:
    """Every element changed, each as a gap of the widest width: the most bytes a payload of a
    known tensor can take. It decodes, and its raw size is within the bound."""
    meta = TensorMeta("w", (37,), torch.bfloat16)
    n = meta.numel
    row = struct.pack("<HBBBBBxQQQQ", 1, 8, 2, 1, 8, 1, n, 0, 0, 0) + struct.pack("<Q", n) + b"w"
    head = struct.pack("<4sHIQQIBBH", b"KRB1", 3, 2, 9, 4, 1, 1, 1, 0) + b"att"
    head += struct.pack("<BB6xQ", 8, 0, n - 1) + struct.pack("<BB6xQ", 8, 0, n) + row
    pad = lambda b: b + bytes(-len(b) % 8)  # noqa: E731
    raw = pad(head) + pad(bytes(8 * (n - 1))) + pad(bytes(2 * n))
    [item] = decode_payload(seal_body(HEADER, [raw]).body, known={"w": meta}).items
    assert item.count == n
    assert len(raw) <= raw_bound({"w": meta}, len(b"att"))
    assert raw_bound({"w": meta}, 3) < len(raw) + 2048  # and not far above it


def test_a_frame_of_22m_empty_blocks_is_refused_well_under_a_second() -> None:
    blocks = 22_000_000
    comp = frame_header(64 * MIB) + bytes(3 * blocks) + raw_block(b"", last=True)
    data = payload(comp, 64 * MIB)
    t0 = time.thread_time()  # CPU time of this thread: what the refusal costs, under any load
    with pytest.raises(DecompressionError, match="blocks"):
        decode_payload(data)
    elapsed = time.thread_time() - t0
    assert elapsed < 3.0, f"{elapsed:.2f} s"  # incl. hashing 66 MB; the block walk took 6.5 s


def test_output_never_runs_more_than_a_block_past_the_declared_size() -> None:
    """A multi-segment frame whose blocks decode to far more than its header declares (zstd
    itself notices only at the last block) is stopped as soon as the output passes raw_len."""
    real = zstandard.ZstdCompressor(level=1).compress(bytes(range(256)) * (64 * 1024))  # 16 MiB
    declared = MIB
    frame = bytearray(real)
    fhd = frame[4]
    assert not fhd & 0x20  # a window descriptor: multi-segment
    assert fhd >> 6 == 2  # a 4-byte content size at offset 6
    struct.pack_into("<I", frame, 6, declared)
    tracemalloc.start()
    try:
        with pytest.raises(DecompressionError, match="more than"):
            decode_payload(payload(bytes(frame), declared))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < declared + 3 * (128 << 10) + (1 << 20)


@pytest.mark.parametrize(
    "tail",
    [
        b"x",
        zstandard.ZstdCompressor().compress(b""),  # an empty frame decodes to nothing
        b"\x50\x2a\x4d\x18" + struct.pack("<I", 4) + b"skip",  # a skippable frame
    ],
)
def test_nothing_may_follow_the_frame(tail: bytes) -> None:
    real = _real_body()
    comp = zstandard.ZstdCompressor(level=1).compress(real) + tail
    with pytest.raises(DecompressionError):
        decode_payload(payload(comp, len(real)))


def test_hand_built_frames_decode_and_their_truncations_are_typed() -> None:
    real = _real_body()
    half = len(real) // 2
    good = frame_header(len(real)) + raw_block(real[:half]) + raw_block(real[half:], last=True)
    assert decode_payload(payload(good, len(real))).items
    for cut in range(1, len(good)):
        with pytest.raises((TruncatedPayload, DecompressionError)):
            decode_payload(payload(good[:cut], len(real)))
    # an RLE block decodes to its run: 300 bytes more than the body, so the frame is refused
    rle = frame_header(len(real)) + raw_block(real) + rle_block(7, 300, last=True)
    with pytest.raises(DecompressionError):
        decode_payload(payload(rle, len(real)))


def test_the_configured_limit_still_applies() -> None:
    real = _real_body()
    with pytest.raises(SizeLimitExceeded):
        decode_payload(
            payload(claim_frame(len(real), real), len(real)),
            limits=DecodeLimits(max_raw_bytes=len(real) - 1),
        )
