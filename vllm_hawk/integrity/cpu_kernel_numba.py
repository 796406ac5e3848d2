"""numba code of :mod:`vllm_hawk.integrity.cpu_kernel` (imported on first use only)."""

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic


@intrinsic
def _words_at(typingctx, addr):
    """The host address ``addr`` (uint64) as a pointer to uint32 words."""
    if not isinstance(addr, types.Integer):
        return None
    ptr = types.CPointer(types.uint32)

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(ptr))

    return ptr(types.uint64), codegen


@numba.njit(cache=True, nogil=True, boundscheck=False)
def wsum(w):
    """uint32 words ``w`` -> (sum, sum of (i + 1) * w[i]), both modulo 2**64."""
    a = np.uint64(0)
    b = np.uint64(0)
    for i in range(w.size):
        x = np.uint64(w[i])
        a += x
        b += x * np.uint64(i + 1)
    return a, b


@numba.njit(cache=True, nogil=True, boundscheck=False)
def pieces_sums(addrs, nwords, word_offsets, segs, nseg):
    """Per segment, the sums of the pieces that belong to it: piece ``k`` is ``nwords[k]``
    words of host memory at ``addrs[k]``, at word offset ``word_offsets[k]`` of segment
    ``segs[k]``. Returns (a, b) uint64 arrays of ``nseg`` entries, modulo 2**64."""
    a_out = np.zeros(nseg, np.uint64)
    b_out = np.zeros(nseg, np.uint64)
    for k in range(addrs.size):
        a, b = wsum(numba.carray(_words_at(addrs[k]), (nwords[k],)))
        s = segs[k]
        a_out[s] += a
        b_out[s] += b + np.uint64(word_offsets[k]) * a
    return a_out, b_out
