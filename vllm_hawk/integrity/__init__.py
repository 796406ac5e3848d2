"""End-to-end integrity of the KV that crosses from prefill to decode (fail closed).

The prefill computes a checksum of every segment it announces in KVReady, over the bytes
exactly as the decode will read them (G' per bank in the ring, a gathered layer stream,
or the block runs of its cache served in place), on the device that produced them, after
they were produced and before the KVReady leaves. The decode recomputes it over the bytes
where they landed (the receive buffer, the KV pages or the vLLM cache) before the request
is reported finished; a mismatch is a load failure (:mod:`vllm_hawk.kvflow.decode`).

**The checksum, ``wsum64``** (:mod:`~vllm_hawk.integrity.checksum`): the bytes as
little-endian 32-bit words ``w_0 .. w_{n-1}`` (a last partial word zero-padded), and the
pair ``A = sum(w_i)``, ``B = sum((i + 1) * w_i)``, both modulo 2**64: a Fletcher-style
position-weighted sum, 128 bits on the wire, plus a seed derived from the format of the
bytes (``tt-tiles/bfloat8_b``, ``vllm-blocks/bfloat16``, ...), so that bytes of another
format than the one the decode asked for never verify, even when the sizes agree.

Why this one and not CRC32C or xxHash:

* it is linear and position-weighted, so a segment's sum is the sum of its pieces'
  sums, each shifted by its word offset (``B += b + offset * a``): the decode verifies a
  segment that landed scattered over KV pages or cache blocks, in any order, without
  copying it together; a GPU computes it as one reduction (partial sums per chunk of
  :data:`~vllm_hawk.integrity.checksum.CHUNK_WORDS` words, combined on the host), one read
  of the bytes, so at memory speed. CRC32C and xxHash are sequential over the bytes: a
  GPU needs a chunked CRC plus a GF(2) combine per chunk, and xxHash cannot be combined
  from pieces at all;
* on a CPU one read with a multiply-add per word: 20-35 GB/s on one core here (numba,
  ``hawk bench transfer`` measures its cost), against ~7 GB/s for zlib's CRC-32;
* it detects every single-bit error (``A`` changes by a power of two), every error
  confined to one word, any swap of two different words, and a replaced range (a block
  freed and reused, a stale READ) except with a probability near 2**-64 for unrelated
  data. It is not a MAC: it finds accidents (bit flips, reused or stale blocks, wrong
  formats), not a forger (the KVReady that carries it is authenticated; the bytes are
  not, see docs/security.md).

Kernels: :mod:`~vllm_hawk.integrity.cpu_kernel` (numba, host memory),
:mod:`~vllm_hawk.integrity.triton_kernel` (CUDA; not exercised in CI, checked under
Triton's interpreter), torch operations on any other device.
"""

from vllm_hawk.integrity.checksum import (
    ALGORITHM,
    CHUNK_WORDS,
    Sum,
    of_array,
    of_host,
    of_tensors,
    seed,
    seeded,
    wire_format,
)
from vllm_hawk.integrity.verify import Mismatch, check_segments, landed_sums

__all__ = [
    "ALGORITHM",
    "CHUNK_WORDS",
    "Mismatch",
    "Sum",
    "check_segments",
    "landed_sums",
    "of_array",
    "of_host",
    "of_tensors",
    "seed",
    "seeded",
    "wire_format",
]
