"""The ``wsum64`` kernel for host memory (numba; see :mod:`vllm_hawk.integrity.checksum`).

One pass over the words with a 64-bit multiply-add each, in one thread and without the
GIL (``nogil``): a pull thread verifying a landing and a prefill worker producing one run
beside the engine. numba is imported on first use only (vLLM's CPU worker trips over an
llvmlite object when numba is loaded before its model runner starts; see
:mod:`vllm_hawk.transform.cpu_kernel`), and its compiled code is cached in the same folder
as the transform kernels' (``$HAWK_CACHE/numba``, ``NUMBA_CACHE_DIR`` overrides).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import threading

import numpy as np

_HAVE_NUMBA = importlib.util.find_spec("numba") is not None
_lock = threading.Lock()
_kernel = None


def available() -> bool:
    return _HAVE_NUMBA


def _compile():
    global _kernel
    with _lock:
        if _kernel is None:
            from vllm_hawk import envs

            if "NUMBA_CACHE_DIR" not in os.environ:  # the transform kernels' folder (cpu_kernel.numba_cache_dir)
                d = envs.cache_dir() / "numba"
                with contextlib.suppress(OSError):  # numba falls back to its own locations
                    d.mkdir(parents=True, exist_ok=True)
                    os.environ["NUMBA_CACHE_DIR"] = str(d)
            from vllm_hawk.integrity import cpu_kernel_numba

            _kernel = cpu_kernel_numba.wsum
    return _kernel


def words_sum(words: np.ndarray):
    """``Sum`` of a 1-D uint32 array (see :mod:`~vllm_hawk.integrity.checksum`)."""
    from vllm_hawk.integrity.checksum import Sum

    a, b = (_kernel or _compile())(words)
    return Sum(int(a), int(b))


def warm() -> None:
    """Compile (or load from the cache) the kernel before the first request."""
    words_sum(np.zeros(4, dtype=np.uint32))
