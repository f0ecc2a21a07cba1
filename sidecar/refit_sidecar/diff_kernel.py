"""The compiled change-detection kernel of `bitdiff.diff_bits` (imports numba; loaded lazily).

It lives at module level, not in a closure: numba keys its on-disk cache for a closure by the
closure's cell contents, which differ in every process, so a closure was recompiled (~0.7 s) by
every process and added a new entry to the cache each time (hundreds of files in a test run).
"""

from __future__ import annotations

import numpy as np
from numba.cpython.unsafe.numbers import trailing_zeros  # an LLVM cttz intrinsic


def diff_words(old_w, new_w, per, word, offset, locs, news, xors):  # type: ignore[no-untyped-def]
    """Scan 64-bit words from `word`; emit each changed element until the output is full.

    Words go in groups of 64. First a 64-bit mask of the group's changed words is built from
    four independent 16-word accumulators: no branches and no stores, so LLVM vectorizes it
    and this pass runs at about the speed of memory. Then the set bits of the mask are
    visited lowest first (count-trailing-zeros), and for each changed word a SWAR test marks
    the top bit of every nonzero lane of the XOR, so only those lanes are visited: at 1-5%
    of BF16 elements a changed word nearly always has one changed lane. (The previous
    version compacted changed-word indices through a buffer; the mask is ~1.6x faster,
    docs/performance.md.) Positions are counted from `offset`. Returns (next word to
    scan, elements written)."""
    n_words = old_w.size
    cap = locs.size
    k = 0
    bits = 64 // per
    lane_shift = 3  # log2(bits): a bit position >> lane_shift is its lane
    while (1 << lane_shift) < bits:
        lane_shift += 1
    full = np.uint64(0xFFFFFFFFFFFFFFFF)
    lane_mask = full if per == 1 else (np.uint64(1) << np.uint64(bits)) - np.uint64(1)
    top = np.uint64(0)  # the top bit of every lane
    for lane in range(per):
        top |= np.uint64(1) << np.uint64(lane * bits + bits - 1)
    below = ~top
    one = np.uint64(1)
    while word < n_words:
        stop = min(word + 64, n_words)
        if k + (stop - word) * per > cap:  # a worst-case group must fit
            room = (cap - k) // per
            if room <= 0:
                break
            stop = word + room
        ow = old_w[word:stop]
        nw = new_w[word:stop]
        if stop - word == 64:
            m0 = np.uint64(0)
            m1 = np.uint64(0)
            m2 = np.uint64(0)
            m3 = np.uint64(0)
            for j in range(16):
                s = np.uint64(j)
                m0 |= np.uint64(ow[j] != nw[j]) << s
                m1 |= np.uint64(ow[j + 16] != nw[j + 16]) << s
                m2 |= np.uint64(ow[j + 32] != nw[j + 32]) << s
                m3 |= np.uint64(ow[j + 48] != nw[j + 48]) << s
            m = m0 | (m1 << np.uint64(16)) | (m2 << np.uint64(32)) | (m3 << np.uint64(48))
        else:
            m = np.uint64(0)
            for j in range(stop - word):
                m |= np.uint64(ow[j] != nw[j]) << np.uint64(j)
        while m:
            j = trailing_zeros(m)
            b = nw[j]
            x = ow[j] ^ b
            # a lane is nonzero iff its top bit is set or its lower bits carry into it
            nonzero = (((x & below) + below) | x) & top
            base = (word + j) * per + offset
            while nonzero:
                lane = trailing_zeros(nonzero) >> lane_shift
                shift = np.uint64(lane * bits)
                locs[k] = base + lane
                news[k] = (b >> shift) & lane_mask
                xors[k] = (x >> shift) & lane_mask
                k += 1
                nonzero &= nonzero - one
            m &= m - one
        word = stop
    return word, k
