"""``scripts/gpu_check.py --suite full``, section ``checksum``: the integrity checksum
(``wsum64``, :mod:`vllm_hawk.integrity`) taken on the device against the host kernel, and
its speed against a device copy of the same bytes.

Per size (bytes of one segment: a bank's G' of a 70B request at TP4 is ~20 MB): random
bytes on the device; ``of_tensors`` there (the Triton kernel on CUDA, torch operations on
other devices) must equal the numba kernel over a host copy; then its GB/s and the copy's
(``ratio`` = copy time / checksum time, 1 = copy speed), timed as the transform's speed
rows are (:class:`~vllm_hawk.bench.gpu_speed._Clock`: CUDA events, else perf_counter).
"""

from __future__ import annotations

import statistics

import numpy as np
import torch

from vllm_hawk.bench.gpu_speed import _Clock
from vllm_hawk.integrity import of_array, of_tensors
from vllm_hawk.integrity.checksum import impl_for


def checksum_rows(device: torch.device, sizes: list[int], repeats: int) -> list[dict]:
    """One row per size in ``sizes`` (bytes): equality with the host kernel, GB/s of the
    checksum and of a device copy, their ratio, and which implementation ran."""
    clock, rows = _Clock(device), []
    rng = np.random.default_rng(11)
    for n in sizes:
        host = rng.integers(0, 256, n, dtype=np.uint8)
        x = torch.from_numpy(host).to(device)
        y = torch.empty_like(x)
        equal = of_tensors([x])[0] == of_array(host)
        ck = [clock(lambda x=x: of_tensors([x]))[0] for _ in range(repeats)]
        cp = [clock(lambda x=x, y=y: y.copy_(x))[0] for _ in range(repeats)]
        t_ck, t_cp = statistics.median(ck), statistics.median(cp)
        rows.append(
            {
                "nbytes": n,
                "impl": impl_for(device),
                "equal_host": bool(equal),
                "checksum_gbps": n / t_ck / 1e9,
                "copy_gbps": n / t_cp / 1e9,
                "ratio": t_cp / t_ck,
                "timer": clock.name,
            }
        )
    return rows
