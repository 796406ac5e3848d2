"""Debug output of HawkConnector, on only when ``HAWK_DEBUG_DIR`` is set (see
:mod:`vllm_hawk.envs`); nothing here runs on the serving path otherwise.

* ``state-<prefill|decode>-<pid>.json``: the worker's :meth:`snapshot` twice a second
  (servers run in other processes; tests read it for the idle check);
* GN-HAWK: ``prefill-<req>.pt`` (the logical K/V of the source blocks sent, before the
  transform) and ``decode-<req>.pt`` (the bank bytes of the destination blocks filled,
  after the transfer), so a test can check the bytes end to end;
* tensor parallelism (GG): ``prefill-<req>-r<rank>.pt`` as above per prefill rank, and
  ``decode-<req>[-r<rank>].pt`` with the logical K/V of the destination blocks filled.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

logger = logging.getLogger("vllm.hawk.debug")


def _safe(rid: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in rid)


def _save(d: Path, name: str, obj) -> None:
    import torch

    d.mkdir(parents=True, exist_ok=True)
    tmp = d / f".{name}.tmp"
    torch.save(obj, tmp)
    tmp.rename(d / name)


def prefill_dumper(d: Path, source, tag: str = "", when=None):
    """An ``observer`` for :class:`~vllm_hawk.kvflow.PrefillEndpoint`: saves the K/V sent,
    all of this rank's heads (``source``: the :class:`~vllm_hawk.layout.vllm_kv.TransformSource`
    of the cache; ``tag``: file name suffix, e.g. the TP rank; ``when(msg)``: only those
    KVRequests, e.g. shares of a tensor-parallel pull)."""
    import torch

    def observe(rid, msg, src_blocks) -> None:
        if when is not None and not when(msg):
            return
        views, sel = source.select(src_blocks)
        ids = torch.as_tensor(sel)
        _save(
            d,
            f"prefill-{_safe(rid)}{tag}.pt",
            {
                "src_blocks": src_blocks.tolist(),
                "dst_blocks": list(msg.dst_block_ids),
                "num_tokens": msg.num_tokens,
                "dtype": msg.dst_layout.dtype,
                "kv": [(k.index_select(0, ids).clone(), v.index_select(0, ids).clone()) for k, v in views],
            },
        )

    return observe


def dump_landed(d: Path, key: str, cache, dst_blocks, scan: bool = False) -> None:
    """Save the bank bytes of ``dst_blocks`` of a Tenstorrent cache after a pull (a mesh:
    the bytes of all heads, as one chip holding them all would have them); with ``scan``
    also the blocks of the whole cache that hold any non-zero byte (``nonzero_blocks``:
    the worker asks it at its first pull, when no other request can have written)."""
    import torch

    blocks = [int(b) for b in dst_blocks]

    def read(layer: int, kv: int):
        return torch.as_tensor(cache.read_block_bytes(layer, kv, blocks)).clone()

    _save(
        d,
        f"decode-{_safe(key)}.pt",
        {
            "dst_blocks": blocks,
            "dtype": cache.spec.dtype,
            "device": cache.chips[0].device.profile.name,
            "bytes": [(read(i, 0), read(i, 1)) for i in range(cache.spec.num_layers)],
            "nonzero_blocks": cache.nonzero_blocks() if scan else None,
        },
    )


def dump_landed_kv(d: Path, key: str, source, dst_blocks) -> None:
    """Save the logical K/V ``[n, heads, block_size, head_dim]`` of ``dst_blocks`` of a
    vLLM cache after a pull (``source``: its TransformSource)."""
    import torch

    blocks = [int(b) for b in dst_blocks]
    views, sel = source.select(blocks)
    ids = torch.as_tensor(sel)
    _save(
        d,
        f"decode-{_safe(key)}.pt",
        {
            "dst_blocks": blocks,
            "kv": [(k.index_select(0, ids).clone(), v.index_select(0, ids).clone()) for k, v in views],
        },
    )


def start_state_writer(d: Path, role: str, snapshot, alive) -> None:
    """Write ``snapshot()`` to ``state-<role>-<pid>.json`` twice a second while ``alive()``."""
    import os

    path = d / f"state-{role}-{os.getpid()}.json"
    d.mkdir(parents=True, exist_ok=True)

    def loop() -> None:
        while alive():
            try:
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps({"t": time.time(), **snapshot()}))
                tmp.rename(path)
            except Exception as e:  # noqa: BLE001 - debugging aid only
                logger.debug("state writer: %s", e)
            time.sleep(0.5)

    threading.Thread(target=loop, daemon=True, name="hawk-state").start()
