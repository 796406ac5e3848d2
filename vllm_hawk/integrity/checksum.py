"""``wsum64``: the checksum of a segment of KV bytes (see :mod:`vllm_hawk.integrity`).

Definition: the bytes as little-endian uint32 words ``w_0 .. w_{n-1}`` (``n =
ceil(nbytes / 4)``, a last partial word zero-padded); ``A = sum(w_i) mod 2**64`` and ``B =
sum((i + 1) * w_i) mod 2**64``. The value sent and compared is that pair plus
:func:`seed` of the bytes' format (:func:`wire_format`), component-wise modulo 2**64.

A range of ``m`` words at word offset ``o`` inside a segment contributes ``(a, b + o * a)``
(:meth:`Sum.plus`), so a segment is the sum of its pieces in any order.

Where it runs (:func:`of_tensors`): host memory through the numba kernel
(:mod:`~vllm_hawk.integrity.cpu_kernel`), a CUDA tensor through the Triton kernel
(:mod:`~vllm_hawk.integrity.triton_kernel`), any other device (or without numba / Triton)
through torch operations on that device. The two device paths write partial sums per
chunk of :data:`CHUNK_WORDS` words, which stay below 2**63 in int64 (``C * (C + 1) / 2 *
(2**32 - 1)``), and the host adds them up modulo 2**64 (:func:`combine_chunks`).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
from typing import NamedTuple

import numpy as np
import torch

ALGORITHM = "wsum64"
WORD_NBYTES = 4
CHUNK_WORDS = 1 << 12  # device paths: words per partial sum
MASK = (1 << 64) - 1
_HAVE_TRITON = importlib.util.find_spec("triton") is not None


class Sum(NamedTuple):
    """One checksum: ``a`` = sum of the words, ``b`` = position-weighted sum (mod 2**64)."""

    a: int
    b: int

    def plus(self, other: Sum, word_offset: int = 0) -> Sum:
        """This sum and ``other``'s, ``other`` being ``word_offset`` words further on."""
        return Sum((self.a + other.a) & MASK, (self.b + other.b + word_offset * other.a) & MASK)


ZERO = Sum(0, 0)


def wire_format(kind: str, dtype) -> str:
    """The format name a segment's bytes are checked under: ``kind`` (``tt-tiles``: tiles of
    a Tenstorrent KV layout; ``vllm-blocks``: a vLLM cache's block bytes) and the element
    dtype (``bfloat8_b``, ``bfloat16``, a ``torch.dtype``...)."""
    return f"{kind}/{str(dtype).removeprefix('torch.')}"


def seed(fmt: str) -> Sum:
    """The pair a segment's sum is offset by for format ``fmt`` (BLAKE2b of the name)."""
    d = hashlib.blake2b(fmt.encode(), digest_size=16, person=b"hawk-wsum64").digest()
    return Sum(int.from_bytes(d[:8], "little"), int.from_bytes(d[8:], "little"))


def seeded(raw: Sum, fmt: str) -> Sum:
    """``raw`` (the bytes' sum) as sent or compared for format ``fmt``."""
    return raw.plus(seed(fmt))


def _word(tail: bytes) -> Sum:
    """The sum of one word of 1-4 bytes (zero-padded), as word 0."""
    w = int.from_bytes(tail + bytes(WORD_NBYTES - len(tail)), "little")
    return Sum(w, w)


def of_array(a: np.ndarray) -> Sum:
    """Unseeded sum of a 1-D uint8 host array (numba; torch operations without numba)."""
    from vllm_hawk.integrity import cpu_kernel

    if not cpu_kernel.available():
        return _torch_sum(torch.from_numpy(a))
    n4 = a.size // WORD_NBYTES
    body = a[: n4 * WORD_NBYTES]
    if body.ctypes.data % WORD_NBYTES:
        body = body.copy()  # numpy gives an aligned copy
    out = cpu_kernel.words_sum(body.view(np.uint32))
    if a.size % WORD_NBYTES:
        out = out.plus(_word(a[n4 * WORD_NBYTES :].tobytes()), n4)
    return out


def of_host(addr: int, nbytes: int) -> Sum:
    """Unseeded sum of ``nbytes`` bytes of host memory at ``addr`` (no copy)."""
    if nbytes <= 0:
        return ZERO
    return of_array(np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr)))


def impl_for(device: torch.device) -> str:
    """The kernel :func:`of_tensors` runs for tensors on ``device``: ``numba`` (host
    memory), ``triton`` (CUDA), else ``torch``."""
    from vllm_hawk.integrity import cpu_kernel

    if device.type == "cpu":
        return "numba" if cpu_kernel.available() else "torch"
    return "triton" if device.type == "cuda" and _HAVE_TRITON else "torch"


def of_tensors(xs: list[torch.Tensor]) -> list[Sum]:
    """Unseeded sums of 1-D uint8 tensors on one device, queued on the calling thread's
    current stream; returns once the results are on the host (one device -> host copy on
    CUDA; the numba kernel in host memory; torch operations elsewhere: :func:`impl_for`)."""
    for x in xs:
        if x.dtype != torch.uint8 or x.dim() != 1:
            raise ValueError(f"a checksum is taken over a 1-D uint8 tensor, got {x.dtype} of shape {tuple(x.shape)}")
    impl = impl_for(xs[0].device) if xs else "torch"
    if impl == "numba":
        return [of_array(x.contiguous().numpy()) for x in xs]
    if impl == "triton":
        from vllm_hawk.integrity import triton_kernel

        return triton_kernel.words_sums(xs)
    return [_torch_sum(x) for x in xs]


def combine_chunks(a_c: np.ndarray, b_c: np.ndarray) -> Sum:
    """The sum from per-chunk partials (chunk ``c`` holds words ``c * CHUNK_WORDS ..``;
    int64 or uint64 arrays)."""
    a_c, b_c = a_c.astype(np.uint64), b_c.astype(np.uint64)
    offs = np.arange(a_c.size, dtype=np.uint64) * np.uint64(CHUNK_WORDS)
    with np.errstate(over="ignore"):
        return Sum(int(a_c.sum(dtype=np.uint64)), int((b_c + offs * a_c).sum(dtype=np.uint64)))


def tail_bytes(x: torch.Tensor) -> bytes:
    """The bytes of ``x`` after its last whole word (0-3), on the host."""
    r = x.numel() % WORD_NBYTES
    return bytes(x[x.numel() - r :].cpu().numpy()) if r else b""


def _torch_sum(x: torch.Tensor) -> Sum:
    """torch operations on ``x``'s device: per-chunk partials, added up on the host."""
    n4 = x.numel() // WORD_NBYTES
    out = ZERO
    if n4:
        body = x[: n4 * WORD_NBYTES]
        if body.storage_offset() % WORD_NBYTES:
            body = body.clone()
        words = body.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        m = -(-n4 // CHUNK_WORDS)
        words = torch.cat([words, words.new_zeros(m * CHUNK_WORDS - n4)]).view(m, CHUNK_WORDS)
        pos = torch.arange(1, CHUNK_WORDS + 1, dtype=torch.int64, device=x.device)
        out = combine_chunks(words.sum(1).cpu().numpy(), (words * pos).sum(1).cpu().numpy())
    tail = tail_bytes(x)
    return out.plus(_word(tail), n4) if tail else out
