"""numba code of :mod:`vllm_hawk.integrity.cpu_kernel` (imported on first use only)."""

import numba
import numpy as np


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
