"""Tensor parallelism: which KV heads each rank or chip holds, and who pulls what (pure).

vLLM shards a model's KV heads over its tensor-parallel ranks (``QKVParallelLinear``):
with ``H`` KV heads and ``tp`` ranks, rank ``r`` holds heads ``[r*H/tp, (r+1)*H/tp)``
when ``H >= tp`` (``H % tp == 0``), and the single head ``r // (tp/H)`` when ``H < tp``
(``tp % H == 0``; each head replicated on ``tp/H`` ranks). tt_transformers shards a
Tenstorrent decode's KV cache over the chips of a mesh the same way (each chip's cache is
``[num_blocks, H/chips, block_size, head_dim]``), so a decode "target" below is a vLLM
rank or a chip.

A decode target needs its heads from every prefill rank that holds some of them
(:func:`plan_pulls`): one :class:`Pull` per (target, prefill rank) pair, naming the head
range in the prefill rank's local heads and where it lands in the target's local heads.
When a head is replicated on several prefill ranks, the pull goes to the one with the
lowest rank (``serving_rank``): one copy on the wire, never two. The prefill rank holds a
request's blocks until every pull aimed at it has been released (:func:`consumers`).

All head counts and offsets are in heads (not bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "HeadShard",
    "Pull",
    "TPMismatch",
    "shard_heads",
    "plan_pulls",
    "consumers",
    "share_index",
    "serving_rank",
    "replicas",
]


class TPMismatch(ValueError):
    """The two sides' tensor-parallel sizes cannot split the model's KV heads; the
    message names both sides' values. ``hello``: the prefill's HelloAck when a side
    channel said it (its real TP size), else None."""

    hello = None


@dataclass(frozen=True)
class HeadShard:
    """Global KV heads ``[start, start + count)`` held by one rank (or chip)."""

    rank: int
    start: int
    count: int

    @property
    def stop(self) -> int:
        return self.start + self.count


@dataclass(frozen=True)
class Pull:
    """One decode target's heads from one prefill rank: global heads ``[head, head+count)``
    = the prefill rank's local heads ``[src_start, src_start+count)`` landing at the
    target's local heads ``[dst_start, dst_start+count)``."""

    prefill_rank: int
    head: int
    src_start: int
    dst_start: int
    count: int


def check_split(num_kv_heads: int, tp: int, who: str = "tensor_parallel_size") -> None:
    """Raise :class:`TPMismatch` unless ``tp`` ranks can hold ``num_kv_heads`` heads."""
    if num_kv_heads <= 0 or tp <= 0:
        raise TPMismatch(f"{who}={tp} with {num_kv_heads} KV heads: both must be positive")
    if num_kv_heads >= tp and num_kv_heads % tp:
        raise TPMismatch(f"{who}={tp} does not divide the model's {num_kv_heads} KV heads")
    if num_kv_heads < tp and tp % num_kv_heads:
        raise TPMismatch(
            f"{who}={tp} is not a multiple of the model's {num_kv_heads} KV heads "
            "(fewer heads than ranks: each head is replicated on tp/heads ranks)"
        )


def shard_heads(num_kv_heads: int, tp: int, rank: int, who: str = "tensor_parallel_size") -> HeadShard:
    """The global heads rank ``rank`` of ``tp`` holds (vLLM's split, see module doc)."""
    check_split(num_kv_heads, tp, who)
    if not 0 <= rank < tp:
        raise TPMismatch(f"rank {rank} outside [0, {who}={tp})")
    if num_kv_heads >= tp:
        per = num_kv_heads // tp
        return HeadShard(rank, rank * per, per)
    return HeadShard(rank, rank // (tp // num_kv_heads), 1)


def serving_rank(num_kv_heads: int, prefill_tp: int, head: int) -> int:
    """The prefill rank that serves global head ``head``: the lowest rank holding it."""
    check_split(num_kv_heads, prefill_tp, "prefill tensor_parallel_size")
    if num_kv_heads >= prefill_tp:
        return head // (num_kv_heads // prefill_tp)
    return head * (prefill_tp // num_kv_heads)


def replicas(num_kv_heads: int, prefill_tp: int) -> str:
    """Which prefill rank serves each replicated head ('' when no head is replicated):
    e.g. ``"head 0 on ranks 0-1 (served by 0)"`` per head, for logs and ``hawk layout``."""
    check_split(num_kv_heads, prefill_tp, "prefill tensor_parallel_size")
    if num_kv_heads >= prefill_tp:
        return ""
    per = prefill_tp // num_kv_heads
    return "; ".join(
        f"head {h} on ranks {h * per}-{h * per + per - 1} (served by {serving_rank(num_kv_heads, prefill_tp, h)})"
        for h in range(num_kv_heads)
    )


def plan_pulls(num_kv_heads: int, prefill_tp: int, decode_tp: int, decode_rank: int) -> list[Pull]:
    """The pulls of decode target ``decode_rank`` of ``decode_tp`` (ranks or chips), in
    ascending head order. Raises :class:`TPMismatch` naming both sides' values."""
    try:
        check_split(num_kv_heads, prefill_tp, "prefill tensor_parallel_size")
        check_split(num_kv_heads, decode_tp, "decode tensor_parallel_size (or chips)")
    except TPMismatch as e:
        raise TPMismatch(
            f"prefill TP {prefill_tp} -> decode TP {decode_tp} with {num_kv_heads} KV heads: {e}"
        ) from None
    dst = shard_heads(num_kv_heads, decode_tp, decode_rank, "decode tensor_parallel_size (or chips)")
    out: list[Pull] = []
    h = dst.start
    while h < dst.stop:
        p = serving_rank(num_kv_heads, prefill_tp, h)
        src = shard_heads(num_kv_heads, prefill_tp, p, "prefill tensor_parallel_size")
        n = min(dst.stop, src.stop) - h
        out.append(Pull(p, h, h - src.start, h - dst.start, n))
        h += n
    return out


def consumers(num_kv_heads: int, prefill_tp: int, decode_tp: int, prefill_rank: int) -> int:
    """How many pulls (over all decode targets) prefill rank ``prefill_rank`` serves per
    request: it frees the request's blocks after that many Releases."""
    return sum(
        p.prefill_rank == prefill_rank
        for d in range(decode_tp)
        for p in plan_pulls(num_kv_heads, prefill_tp, decode_tp, d)
    )


def share_index(num_kv_heads: int, prefill_tp: int, decode_tp: int, decode_rank: int, prefill_rank: int) -> int:
    """The number of decode target ``decode_rank``'s pull among all pulls aimed at
    ``prefill_rank`` (ordered by target): the ``share`` its KVRequest and Release name."""
    n = 0
    for d in range(decode_rank):
        n += sum(p.prefill_rank == prefill_rank for p in plan_pulls(num_kv_heads, prefill_tp, decode_tp, d))
    return n
