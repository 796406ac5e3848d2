"""One request's KV from several prefill ranks: the shares of a tensor-parallel pull.

:func:`plan_shares` turns :func:`vllm_hawk.layout.tp.plan_pulls` into what Algorithm 1
runs: for each pull, the prefill rank to ask and the :class:`~vllm_hawk.kvflow.decode.Share`
(the rank's local heads, how many shares that rank serves, a tag that keeps the shares'
receive memory apart). :func:`fetch_shares` runs one fetch per share at once, each on
its own :class:`~vllm_hawk.kvflow.decode.DecodeEndpoint` (one per prefill rank), and
sums what moved. Every share lands as its own segments per destination bank (or layer),
into a sink that holds just the destination heads of that share.

A share that fails does not stop the others; once all have ended, the first failure
is raised (a :class:`~vllm_hawk.kvflow.errors.TransferUnsettled` first: its blocks must
not be reused). Each share released itself, so nothing stays held on any prefill rank.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

from vllm_hawk.kvflow.decode import FetchResult, Share
from vllm_hawk.kvflow.errors import TransferUnsettled
from vllm_hawk.layout.tp import consumers, plan_pulls, share_index

__all__ = ["PlannedShare", "plan_shares", "idle_ranks", "fetch_shares"]


@dataclass(frozen=True)
class PlannedShare:
    """A decode target's pull from one prefill rank: ``share`` of that rank's heads,
    landing at the target's local heads ``[dst_start, dst_start + count)``."""

    target: int
    prefill_rank: int
    share: Share
    dst_start: int
    count: int


def plan_shares(num_kv_heads: int, prefill_tp: int, decode_targets: int, target: int,
                local_heads: int) -> list[PlannedShare]:
    """The shares decode target ``target`` (of ``decode_targets`` ranks or chips, holding
    ``local_heads`` heads) pulls. A pull of a prefill rank's whole shard into the whole
    target, with no other consumer, is a plain whole request (as without TP); every share
    names its target as ``chip`` (KVRequest ``dst_chip``, echoed in KVReady).
    Raises :class:`~vllm_hawk.layout.tp.TPMismatch` naming both sides' values."""
    src_heads = max(1, num_kv_heads // prefill_tp)
    out = []
    for p in plan_pulls(num_kv_heads, prefill_tp, decode_targets, target):
        n = consumers(num_kv_heads, prefill_tp, decode_targets, p.prefill_rank)
        whole = p.count == src_heads == local_heads and n == 1
        idx = share_index(num_kv_heads, prefill_tp, decode_targets, target, p.prefill_rank)
        share = Share(chip=target) if whole else Share(p.src_start, p.count, n, idx, tag=f"t{target}d{p.dst_start}",
                                                       chip=target)
        out.append(PlannedShare(target, p.prefill_rank, share, p.dst_start, p.count))
    return out


def idle_ranks(num_kv_heads: int, prefill_tp: int, decode_targets: int) -> list[int]:
    """Prefill ranks no decode target pulls from (their heads are replicas served by a
    lower rank): the decode's target 0 releases them at once."""
    return [r for r in range(prefill_tp) if not consumers(num_kv_heads, prefill_tp, decode_targets, r)]


def fetch_shares(req_id: str, num_tokens: int, shares: list[tuple[object, object, PlannedShare]],
                 dst_blocks, *, first_block: int = 0, layer_groups: int = 1, time_cap_s: float | None = None,
                 on_result: Callable[[PlannedShare, FetchResult], None] | None = None) -> FetchResult:
    """Fetch every ``(endpoint, sink, planned)`` share of ``req_id`` at once (see module
    doc); returns the sum (``extra["shares"]``: per share, prefill rank, target, heads,
    bytes, segments, entries and, for Tenstorrent sinks, bytes per bank; one share: its own
    result). ``time_cap_s``: as :meth:`~vllm_hawk.kvflow.decode.DecodeEndpoint.fetch`
    (per-tile benchmark rows)."""
    if len(shares) == 1:
        ep, sink, ps = shares[0]
        return ep.fetch(req_id, num_tokens, sink, dst_blocks, first_block=first_block, layer_groups=layer_groups,
                        time_cap_s=time_cap_s, share=ps.share)
    results: list = [None] * len(shares)

    def one(i: int) -> None:
        ep, sink, ps = shares[i]
        try:
            results[i] = ep.fetch(req_id, num_tokens, sink, dst_blocks, first_block=first_block,
                                  layer_groups=layer_groups, time_cap_s=time_cap_s, share=ps.share)
        except BaseException as e:  # noqa: BLE001 - raised below, after every share ended
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,), daemon=True, name=f"hawk-share-{i}")
               for i in range(len(shares))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise next((e for e in errors if isinstance(e, TransferUnsettled)), errors[0])
    total = FetchResult(req_id, results[0].mode)
    per = []
    for (_ep, _sink, ps), r in zip(shares, results):
        total.nbytes += r.nbytes
        total.entries += r.entries
        total.segments += r.segments
        total.request_s = max(total.request_s, r.request_s)
        total.transfer_s = max(total.transfer_s, r.transfer_s)
        total.copy_s = max(total.copy_s, r.copy_s)
        total.total_s = max(total.total_s, r.total_s)
        total.release_s = max(total.release_s, r.release_s)
        total.fraction = min(total.fraction, r.fraction)
        per.append({"prefill_rank": ps.prefill_rank, "target": ps.target, "heads": [ps.dst_start, ps.count],
                    "nbytes": r.nbytes, "segments": r.segments, "entries": r.entries,
                    **{k: v for k, v in r.extra.items() if k in ("bytes_per_bank", "banks", "intra_bank_ops")}})
        for k in ("intra_bank_ops",):
            if k in r.extra:
                total.extra[k] = total.extra.get(k, 0) + r.extra[k]
        if on_result is not None:
            on_result(ps, r)
    total.extra["shares"] = per
    return total
