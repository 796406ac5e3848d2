"""What one request's tensor-parallel pull needs, planned in one call.

A decode *target* (a TP rank of a vLLM decode, or a chip of a Tenstorrent mesh, whose
engine runs TP=1) needs its KV heads from every prefill rank holding some of them
(:func:`vllm_hawk.layout.tp.plan_pulls`). :func:`plan_shares` turns those pulls into
what Algorithm 1 runs: for each, the prefill rank to ask and the
:class:`~vllm_hawk.kvflow.decode.Share` (the rank's local heads, how many shares that
rank serves, a tag that keeps the shares' receive memory apart).

:class:`PullPlanner` is the decode worker's view of it: given a request's remote side
(the connector's ``RecvSpec``: the prefill's TP size and side channels), it returns a
:class:`PullPlan` — per share the :class:`~vllm_hawk.kvflow.decode.DecodeEndpoint` of
that prefill rank (whose HelloAck must say it is that rank), the sink of the share's
destination heads, and the idle prefill ranks (replicated heads nobody pulls) that this
worker releases at once. :func:`vllm_hawk.kvflow.shares.fetch_shares` runs the plan.
Every way the two sides' TP sizes cannot pair raises
:class:`~vllm_hawk.layout.tp.TPMismatch`, naming both sides' values.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from vllm_hawk.kvflow.decode import Share
from vllm_hawk.kvflow.sources import vllm_layout_desc
from vllm_hawk.kvflow.streams import PerHeadRange
from vllm_hawk.layout.tp import TPMismatch, consumers, plan_pulls, replicas, share_index

__all__ = [
    "PlannedShare",
    "PullPlan",
    "PullPlanner",
    "RemoteKV",
    "check_targets",
    "check_whole_chip",
    "idle_ranks",
    "plan_shares",
]


@dataclass(frozen=True)
class PlannedShare:
    """A decode target's pull from one prefill rank: ``share`` of that rank's heads,
    landing at the target's local heads ``[dst_start, dst_start + count)``."""

    target: int
    prefill_rank: int
    share: Share
    dst_start: int
    count: int


def plan_shares(
    num_kv_heads: int, prefill_tp: int, decode_targets: int, target: int, local_heads: int
) -> list[PlannedShare]:
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
        share = (
            Share(chip=target)
            if whole
            else Share(p.src_start, p.count, n, idx, tag=f"t{target}d{p.dst_start}", chip=target)
        )
        out.append(PlannedShare(target, p.prefill_rank, share, p.dst_start, p.count))
    return out


def idle_ranks(num_kv_heads: int, prefill_tp: int, decode_targets: int) -> list[int]:
    """Prefill ranks no decode target pulls from (their heads are replicas served by a
    lower rank): the decode's target 0 releases them at once."""
    return [r for r in range(prefill_tp) if not consumers(num_kv_heads, prefill_tp, decode_targets, r)]


def check_whole_chip(ps: PlannedShare, local: int) -> None:
    """A Tenstorrent chip lands whole head shards: raise TPMismatch unless share ``ps``
    brings all ``local`` heads of its chip."""
    if (ps.dst_start, ps.count) != (0, local):
        last = ps.dst_start + ps.count - 1
        raise TPMismatch(
            f"chip {ps.target} holds {local} KV heads; heads {ps.dst_start}..{last} "
            f"of them would come from prefill rank {ps.prefill_rank} alone, and a Tenstorrent chip lands "
            "whole head shards: use a prefill tensor_parallel_size <= the decode's chips"
        )


def check_targets(num_kv_heads: int, prefill_tp: int, total: int, targets, local: int, *, chips: bool) -> None:
    """Raise TPMismatch unless decode targets ``targets`` of ``total`` (TP ranks, or
    ``chips`` of a Tenstorrent mesh: those take their heads whole from one prefill rank),
    each holding ``local`` heads, can pull from a prefill with ``prefill_tp`` ranks."""
    for t in targets:
        for ps in plan_shares(num_kv_heads, prefill_tp, total, t, local):
            if chips:
                check_whole_chip(ps, local)


class RemoteKV(Protocol):
    """What the planner reads of a request's remote side (the connector's ``RecvSpec``)."""

    remote_engine_id: str
    remote_tp_size: int

    def side_channel_of(self, rank: int) -> str: ...


@dataclass
class PullPlan:
    """Everything one request's pull (or Release) needs.

    shares: per share, ``(endpoint, sink, planned)``: the DecodeEndpoint of the prefill
    rank's side channel and the sink of the share's destination heads (both None in a plan
    for a Release only). idle: the prefill ranks nobody pulls from, for this worker to
    release at once (empty except on target 0)."""

    shares: list[tuple[object, object, PlannedShare]]
    idle: list[int]


class PullPlanner:
    """The pulls of one decode worker (see module doc), fixed at start-up.

    num_kv_heads: the model's KV heads in all (0: unknown, a single-target decode);
    layout: the worker's LayoutDesc (its ``num_kv_heads`` are each target's heads);
    sinks: the worker's sinks, one per chip when ``chips`` (a Tenstorrent mesh), else
    one; rank, ranks: this worker's TP rank and size; prefill_tp: the prefill TP size
    the configuration names (0: any); head_maps: ``(start, count) -> KVRegionMap`` of the
    worker's heads (vLLM caches; None: its sink takes whole shards only); peer:
    ``(side channel, engine id) -> DecodeEndpoint``; log: where the replicated heads are
    logged, once per prefill TP size.
    """

    def __init__(
        self,
        num_kv_heads: int,
        layout,
        sinks: list,
        *,
        chips: bool,
        rank: int = 0,
        ranks: int = 1,
        prefill_tp: int = 0,
        head_maps: Callable | None = None,
        peer: Callable | None = None,
        log: logging.Logger | None = None,
    ) -> None:
        self.num_kv_heads, self.layout, self.sinks, self.chips = num_kv_heads, layout, sinks, chips
        self.local = layout.num_kv_heads  # KV heads each target holds
        self.heads = num_kv_heads or self.local  # the model's, as planned
        self.total, self.targets = (len(sinks), list(range(len(sinks)))) if chips else (ranks, [rank])
        self.rank, self.prefill_tp, self.head_maps, self.peer = rank, prefill_tp, head_maps, peer
        self.log = log or logging.getLogger(__name__)
        self._lock = threading.Lock()
        self._replicas_logged: set[int] = set()  # prefill TP sizes whose replicated heads were logged
        self._share_sinks = PerHeadRange(self._share_sink)  # (dst_start, count) -> the sink of those heads

    def check_pairing(self, prefill_tp: int) -> None:
        """Raise TPMismatch unless this worker's targets can pull from ``prefill_tp`` ranks."""
        check_targets(self.heads, prefill_tp, self.total, self.targets, self.local, chips=self.chips)

    def plan(self, spec: RemoteKV, *, connect: bool = True) -> PullPlan:
        """``spec``'s shares with their endpoints and sinks (``connect`` False: without,
        for a Release only) and the idle ranks to release."""
        planned = self.shares(spec)
        shares = [
            (self._endpoint(spec, ps.prefill_rank), self._sink_for(ps), ps) if connect else (None, None, ps)
            for ps in planned
        ]
        return PullPlan(shares, self._idle_logged(spec))

    def shares(self, spec: RemoteKV) -> list[PlannedShare]:
        """The shares this worker pulls for ``spec`` (one WHOLE share without TP)."""
        if self.prefill_tp and spec.remote_tp_size != self.prefill_tp:
            raise TPMismatch(
                f"kv_transfer_params name a prefill with tensor_parallel_size {spec.remote_tp_size}; "
                f"this decode is configured for prefill_tp={self.prefill_tp}"
            )
        return [
            ps for t in self.targets for ps in plan_shares(self.heads, spec.remote_tp_size, self.total, t, self.local)
        ]

    def idle(self, spec: RemoteKV) -> list[int]:
        """The prefill ranks nobody pulls from, which this worker releases (target 0 only)."""
        if self.rank != 0 or not self.num_kv_heads:
            return []
        return idle_ranks(self.num_kv_heads, spec.remote_tp_size, self.total)

    def side_channels(self, spec: RemoteKV) -> list[str]:
        """Every prefill rank's side channel this worker renews leases on (rank 0's when
        the two sides cannot pair: the pull then fails by name)."""
        try:
            ranks = {ps.prefill_rank for ps in self.shares(spec)} | set(self.idle(spec))
        except TPMismatch:
            ranks = {0}
        return [spec.side_channel_of(r) for r in sorted(ranks)]

    def after_mismatch(self, e: TPMismatch) -> list[int]:
        """The prefill ranks to release after a pull that could not be planned: every rank
        the prefill says it has (so its blocks are not held until the lease), by rank 0."""
        if e.hello is None or self.rank != 0:
            return []
        return list(range(e.hello.tp_size))

    def _idle_logged(self, spec: RemoteKV) -> list[int]:
        idle = self.idle(spec)
        if self.rank == 0 and self.num_kv_heads and self._first_plan_for(spec.remote_tp_size):
            note = replicas(self.num_kv_heads, spec.remote_tp_size)
            if note:
                self.log.info(
                    "HawkConnector decode: prefill TP %d replicates KV heads: %s; idle ranks %s are released at once",
                    spec.remote_tp_size,
                    note,
                    idle,
                )
        return idle

    def _first_plan_for(self, prefill_tp: int) -> bool:
        with self._lock:  # pulls run on several threads: log once per prefill TP size
            first = prefill_tp not in self._replicas_logged
            self._replicas_logged.add(prefill_tp)
        return first

    def _endpoint(self, spec: RemoteKV, rank: int):
        """The endpoint of prefill TP rank ``rank``; its HelloAck must say it is that rank."""
        ep = self.peer(spec.side_channel_of(rank), spec.remote_engine_id)
        h = ep.hello
        if h.num_kv_heads and (
            (h.tp_size, h.tp_rank) != (spec.remote_tp_size, rank) or h.num_kv_heads != self.num_kv_heads
        ):
            err = TPMismatch(
                f"prefill side channel {spec.side_channel_of(rank)} says it is TP rank {h.tp_rank} of "
                f"{h.tp_size} with {h.num_kv_heads} KV heads; kv_transfer_params name rank {rank} of "
                f"{spec.remote_tp_size}, and this decode's model has {self.num_kv_heads}"
            )
            err.hello = h
            raise err
        return ep

    def _sink_for(self, ps: PlannedShare):
        """The sink of share ``ps``: its chip's sink (a mesh), this worker's sink, or a view
        of it restricted to the share's destination heads (vLLM caches)."""
        if self.chips:
            check_whole_chip(ps, self.local)
            return self.sinks[ps.target]
        sink = self.sinks[0]
        if ps.dst_start == 0 and ps.count == self.local:
            return sink
        if self.head_maps is None or not sink.caps.head_shares:
            raise TPMismatch(
                f"this decode's sink ({type(sink).__name__}) takes whole shards only; "
                f"heads {ps.dst_start}..{ps.dst_start + ps.count - 1} of its {self.local} would come "
                f"from prefill rank {ps.prefill_rank} alone"
            )
        return self._share_sinks(ps.dst_start, ps.count)

    def _share_sink(self, start: int, count: int):
        """This worker's vLLM sink restricted to its KV heads ``[start, start+count)``."""
        m, lay = self.head_maps(start, count), self.layout
        desc = vllm_layout_desc(m, lay.name, lay.dtype, lay.block_size, count, lay.head_dim)
        return self.sinks[0].for_heads(m, desc, start)
