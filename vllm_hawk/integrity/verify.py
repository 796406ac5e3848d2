"""The decode's side of ``wsum64``: a KVReady's segments checked where their bytes landed.

A READ batch is a list of entries ``(local_addr, remote_addr, nbytes)``: entry ``i`` copied
the prefill's bytes ``[remote_addr, remote_addr + nbytes)`` to ``local_addr``. Remote
addresses are ``remote_base + segment.offset_bytes + offset in the segment``, so each
landed piece is attributed to its segment and word offset, and a segment's sum is
composed from its pieces wherever they landed (receive buffer, KV pages, cache blocks; an
entry may span two adjacent segments). A piece must start on a word boundary of its
segment (every layout here is made of whole words); one that does not is reported, never
guessed around.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vllm_hawk.integrity import cpu_kernel
from vllm_hawk.integrity.checksum import WORD_NBYTES, ZERO, Sum, of_host, seeded

Entry = tuple[int, int, int]  # (local_addr, remote_addr, nbytes)


@dataclass(frozen=True)
class Mismatch:
    """Segment ``index`` of a KVReady (bank ``bank``: a DRAM bank, or a layer for vLLM
    streams) did not verify: ``want`` as announced, ``got`` as landed (both seeded);
    ``landed_nbytes`` of its ``nbytes`` were landed."""

    index: int
    bank: int
    want: Sum
    got: Sum
    landed_nbytes: int
    nbytes: int

    def describe(self) -> str:
        if self.landed_nbytes != self.nbytes:
            return f"segment {self.index} (bank {self.bank}): {self.landed_nbytes} of its {self.nbytes} bytes landed"
        return (
            f"segment {self.index} (bank {self.bank}, {self.nbytes} bytes): checksum "
            f"{self.got.a:016x}:{self.got.b:016x} as landed, {self.want.a:016x}:{self.want.b:016x} as sent"
        )


def _pieces(segments, order, starts, i: int, rem: int, n: int):
    """``(segment, offset in it, offset in the entry, bytes)`` of entry ``i``'s remote range
    ``[rem, rem + n)``, split at segment boundaries; ValueError outside every segment or
    off a word boundary."""
    done = 0
    while done < n:
        j = bisect.bisect_right(starts, rem + done) - 1
        k = order[j] if j >= 0 else -1
        off = rem + done - starts[j] if j >= 0 else -1
        if k < 0 or off >= segments[k].nbytes:
            raise ValueError(f"READ {i} covers remote address {rem + done:#x}, inside no segment of the KVReady")
        if off % WORD_NBYTES:
            raise ValueError(f"READ {i} lands segment {k} from byte {off}, not on a {WORD_NBYTES}-byte word")
        take = min(n - done, segments[k].nbytes - off)
        yield k, off, done, take
        done += take


def landed_sums(segments: Sequence, remote_base: int, entries: Sequence[Entry]) -> tuple[list[Sum], list[int]]:
    """Per segment, the unseeded sum of its bytes as ``entries`` landed them in host memory
    (one kernel call for the whole landing), and how many bytes landed. Raises ValueError
    for a piece outside every segment or not on a word boundary of its segment."""
    order = sorted(range(len(segments)), key=lambda k: segments[k].offset_bytes)
    starts = [remote_base + segments[k].offset_bytes for k in order]
    sums, landed = [ZERO] * len(segments), [0] * len(segments)
    host: list[tuple[int, int, int, int]] = []  # (address, words, word offset, segment): one kernel call
    batch = cpu_kernel.available()
    for i, (loc, rem, n) in enumerate(entries):
        for k, off, done, take in _pieces(segments, order, starts, i, rem, n):
            landed[k] += take
            words, tail = divmod(take, WORD_NBYTES) if batch else (0, take)
            if words:
                host.append((loc + done, words, off // WORD_NBYTES, k))
            if tail:  # the segment's last, partial word (or every piece without numba)
                at = words * WORD_NBYTES
                sums[k] = sums[k].plus(of_host(loc + done + at, tail), (off + at) // WORD_NBYTES)
    if host:
        a, b = cpu_kernel.pieces_sums(*np.array(host, dtype=np.uint64).T, len(segments))
        sums = [s.plus(Sum(int(x), int(y))) for s, x, y in zip(sums, a, b, strict=True)]
    return sums, landed


def check_segments(
    segments: Sequence,
    checksums: Sequence,
    fmt: str,
    remote_base: int,
    entries: Sequence[Entry],
) -> list[Mismatch]:
    """The segments whose landed bytes do not match ``checksums`` (one ``(a, b)`` per
    segment, seeded by the producer's format) for format ``fmt``, the one the decode asked
    for; [] when every one verifies."""
    got, landed = landed_sums(segments, remote_base, entries)
    bad = []
    for k, (s, want) in enumerate(zip(segments, checksums, strict=True)):
        g = seeded(got[k], fmt)
        if landed[k] != s.nbytes or (g.a, g.b) != (want.a, want.b):
            bad.append(Mismatch(k, s.bank, Sum(want.a, want.b), g, landed[k], s.nbytes))
    return bad
