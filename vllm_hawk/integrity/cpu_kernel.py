"""The ``wsum64`` kernel for host memory (numba; see :mod:`vllm_hawk.integrity.checksum`).

One pass over the words with a 64-bit multiply-add each, in one thread and without the
GIL (``nogil``): a pull thread verifying a landing and a prefill worker producing one run
beside the engine. numba is imported on first use only (vLLM's CPU worker trips over an
llvmlite object when numba is loaded before its model runner starts; see
:mod:`vllm_hawk.transform.cpu_kernel`), and its compiled code is cached in the same folder
as the transform kernels' (``$HAWK_CACHE/numba``, ``NUMBA_CACHE_DIR`` overrides).
"""

from __future__ import annotations

import importlib.util
import threading

import numpy as np

_HAVE_NUMBA = importlib.util.find_spec("numba") is not None
_lock = threading.Lock()
_kernels = None


def available() -> bool:
    return _HAVE_NUMBA


def loaded() -> bool:
    """The kernels are loaded in this process (a start-up need not compile them again)."""
    return _kernels is not None


def _compile():
    global _kernels
    with _lock:
        if _kernels is None:
            from vllm_hawk import envs

            envs.use_numba_cache()  # the transform kernels' folder
            from vllm_hawk.integrity import cpu_kernel_numba

            _kernels = cpu_kernel_numba
    return _kernels


def words_sum(words: np.ndarray):
    """``Sum`` of a 1-D uint32 array (see :mod:`~vllm_hawk.integrity.checksum`)."""
    from vllm_hawk.integrity.checksum import Sum

    a, b = (_kernels or _compile()).wsum(words)
    return Sum(int(a), int(b))


def pieces_sums(addrs: np.ndarray, nwords: np.ndarray, word_offsets: np.ndarray, segs: np.ndarray, nseg: int):
    """Per segment, (a, b) uint64 arrays of the pieces of host memory that belong to it
    (piece ``k``: ``nwords[k]`` words at address ``addrs[k]``, at word offset
    ``word_offsets[k]`` of segment ``segs[k]``): one call for a whole landing."""
    u64 = lambda x: np.ascontiguousarray(x, dtype=np.uint64)  # noqa: E731
    return (_kernels or _compile()).pieces_sums(u64(addrs), u64(nwords), u64(word_offsets), u64(segs), nseg)


def warm() -> None:
    """Compile (or load from the cache) the kernels before the first request."""
    w = np.zeros(4, dtype=np.uint32)
    words_sum(w)
    pieces_sums(np.array([w.ctypes.data]), np.array([4]), np.array([0]), np.array([0]), 1)
