"""One request's KV from several prefill ranks at once: the fetches of a tensor-parallel pull.

:func:`fetch_shares` runs one fetch per planned share (:mod:`vllm_hawk.kvflow.pull_plan`)
at once, each on its own :class:`~vllm_hawk.kvflow.decode.DecodeEndpoint` (one per
prefill rank), and sums what moved. Every share lands as its own segments per
destination bank (or layer), into a sink that holds just the destination heads of that
share.

A share that fails does not stop the others; once all have ended, the first failure
is raised (a :class:`~vllm_hawk.kvflow.errors.TransferUnsettled` first: its blocks must
not be reused; then an :class:`~vllm_hawk.kvflow.errors.IntegrityError`, so that it is
counted as one). Each share released itself, so nothing stays held on any prefill rank.
The planning names stay importable from here (the benchmarks and tests use them).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from vllm_hawk.kvflow.decode import FetchResult
from vllm_hawk.kvflow.errors import IntegrityError, TransferUnsettled
from vllm_hawk.kvflow.pull_plan import PlannedShare, idle_ranks, plan_shares

__all__ = ["PlannedShare", "plan_shares", "idle_ranks", "fetch_shares"]


def fetch_shares(
    req_id: str,
    num_tokens: int,
    shares: list[tuple[object, object, PlannedShare]],
    dst_blocks,
    *,
    first_block: int = 0,
    layer_groups: int = 1,
    time_cap_s: float | None = None,
    on_result: Callable[[PlannedShare, FetchResult], None] | None = None,
) -> FetchResult:
    """Fetch every ``(endpoint, sink, planned)`` share of ``req_id`` at once (see module
    doc); returns the sum (``extra["shares"]``: per share, prefill rank, target, heads,
    bytes, segments, entries and, for Tenstorrent sinks, bytes per bank; one share: its own
    result). ``time_cap_s``: as :meth:`~vllm_hawk.kvflow.decode.DecodeEndpoint.fetch`
    (per-tile benchmark rows)."""

    def fetch(share) -> FetchResult:
        ep, sink, ps = share
        return ep.fetch(
            req_id,
            num_tokens,
            sink,
            dst_blocks,
            first_block=first_block,
            layer_groups=layer_groups,
            time_cap_s=time_cap_s,
            share=ps.share,
        )

    if len(shares) == 1:
        return fetch(shares[0])
    results: list = [None] * len(shares)

    def one(i: int) -> None:
        try:
            results[i] = fetch(shares[i])
        except BaseException as e:  # noqa: BLE001 - raised below, after every share ended
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,), daemon=True, name=f"hawk-share-{i}") for i in range(len(shares))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        first = next((e for e in errors if isinstance(e, IntegrityError)), errors[0])
        raise next((e for e in errors if isinstance(e, TransferUnsettled)), first)
    return _summed(req_id, [ps for _ep, _sink, ps in shares], results, on_result)


def _summed(req_id: str, planned: list[PlannedShare], results: list[FetchResult], on_result) -> FetchResult:
    """One FetchResult for the shares: bytes, entries and segments added, times the
    slowest share's, ``extra["shares"]`` one entry per share."""
    total = FetchResult(req_id, results[0].mode)
    per = []
    for ps, r in zip(planned, results, strict=True):
        total.nbytes += r.nbytes
        total.entries += r.entries
        total.segments += r.segments
        total.request_s = max(total.request_s, r.request_s)
        total.transfer_s = max(total.transfer_s, r.transfer_s)
        total.copy_s = max(total.copy_s, r.copy_s)
        total.total_s = max(total.total_s, r.total_s)
        total.release_s = max(total.release_s, r.release_s)
        total.fraction = min(total.fraction, r.fraction)
        per.append(
            {
                "prefill_rank": ps.prefill_rank,
                "target": ps.target,
                "heads": [ps.dst_start, ps.count],
                "nbytes": r.nbytes,
                "segments": r.segments,
                "entries": r.entries,
                **{k: v for k, v in r.extra.items() if k in ("bytes_per_bank", "banks", "intra_bank_ops")},
            }
        )
        if "src_block_size" in r.extra:  # the decode regrouped the prefill's smaller blocks
            total.extra["src_block_size"] = r.extra["src_block_size"]
        if "intra_bank_ops" in r.extra:
            total.extra["intra_bank_ops"] = total.extra.get("intra_bank_ops", 0) + r.extra["intra_bank_ops"]
        if on_result is not None:
            on_result(ps, r)
    total.extra["shares"] = per
    return total
