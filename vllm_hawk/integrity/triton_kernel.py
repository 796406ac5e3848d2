"""The ``wsum64`` kernel for CUDA tensors (Triton; see :mod:`vllm_hawk.integrity.checksum`).

One program per chunk of :data:`~vllm_hawk.integrity.checksum.CHUNK_WORDS` words: it loads
the chunk's words (masked past the end), widens them to int64 and writes the chunk's two
partial sums, ``sum(w)`` and ``sum((j + 1) * w)`` over its words ``j``; the host adds the
partials up modulo 2**64 (:func:`~vllm_hawk.integrity.checksum.combine_chunks`). One read
of the bytes and a few kilobytes written back: bounded by memory bandwidth. The launch is
queued on the calling thread's current stream (a prefill worker's own), and the copy of
the partials to the host waits for it.

Written against Triton's public API; CI runs it under Triton's interpreter
(``TRITON_INTERPRET=1``, CPU tensors) against the numba kernel. Not exercised on a GPU in CI.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_hawk.integrity.checksum import CHUNK_WORDS, WORD_NBYTES, Sum, _word, combine_chunks, tail_bytes


@triton.jit(do_not_specialize=["n_words"])  # one compiled variant for every segment size
def chunk_sums(words, n_words, a_out, b_out, CHUNK: tl.constexpr):
    c = tl.program_id(0)
    j = tl.arange(0, CHUNK)
    idx = c.to(tl.int64) * CHUNK + j
    w = tl.load(words + idx, mask=idx < n_words, other=0).to(tl.int64) & 0xFFFFFFFF
    tl.store(a_out + c, tl.sum(w, axis=0))
    tl.store(b_out + c, tl.sum(w * (j + 1).to(tl.int64), axis=0))


def words_sums(xs: list[torch.Tensor]) -> list[Sum]:
    """Unseeded sums of 1-D uint8 tensors on one device (CUDA, or CPU under the
    interpreter): one launch each into one partials buffer, one copy to the host."""
    if not xs:
        return []
    n4s = [x.numel() // WORD_NBYTES for x in xs]
    ms = [triton.cdiv(n, CHUNK_WORDS) for n in n4s]
    ms = [m + m % 2 for m in ms]  # each view's partials 16-byte aligned: the warm-up's variant serves them all
    parts = torch.empty(2, max(1, sum(ms)), dtype=torch.int64, device=xs[0].device)
    at = 0
    for x, n4, m in zip(xs, n4s, ms, strict=True):
        if n4:
            body = x[: n4 * WORD_NBYTES]
            if body.storage_offset() % WORD_NBYTES:
                body = body.clone()
            chunk_sums[(m,)](body.view(torch.int32), n4, parts[0, at:], parts[1, at:], CHUNK=CHUNK_WORDS)
        at += m
    host = parts.cpu().numpy()
    out, at = [], 0
    for x, n4, m in zip(xs, n4s, ms, strict=True):
        s = combine_chunks(host[0, at : at + m], host[1, at : at + m])
        tail = tail_bytes(x)
        out.append(s.plus(_word(tail), n4) if tail else s)
        at += m
    return out
