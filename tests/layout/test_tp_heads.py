"""Which KV heads a tensor-parallel rank or chip holds, and who pulls what (pure)."""

from __future__ import annotations

import itertools

import pytest

from vllm_hawk.layout.tp import TPMismatch, consumers, plan_pulls, replicas, serving_rank, shard_heads, share_index


@pytest.mark.parametrize("heads,tp", [(8, 1), (8, 2), (8, 4), (8, 8), (4, 8), (2, 4), (1, 4)])
def test_shards_follow_vllm_split(heads, tp):
    shards = [shard_heads(heads, tp, r) for r in range(tp)]
    if heads >= tp:  # contiguous, disjoint, covering
        assert [s.start for s in shards] == list(range(0, heads, heads // tp))
        assert all(s.count == heads // tp for s in shards)
    else:  # QKVParallelLinear: rank r holds head r // (tp / heads)
        assert [s.start for s in shards] == [r // (tp // heads) for r in range(tp)]
        assert all(s.count == 1 for s in shards)


@pytest.mark.parametrize(
    "heads,p,d",
    [
        (h, p, d)
        for h in (1, 2, 4, 8)
        for p in (1, 2, 4, 8)
        for d in (1, 2, 4, 8)
        if (h % p == 0 or p % h == 0) and (h % d == 0 or d % h == 0)
    ],
)
def test_every_target_gets_each_of_its_heads_exactly_once(heads, p, d):
    for t in range(d):
        dst = shard_heads(heads, d, t)
        got = []
        for pull in plan_pulls(heads, p, d, t):
            src = shard_heads(heads, p, pull.prefill_rank)
            assert src.start <= pull.head and pull.head + pull.count <= src.stop  # the rank holds them
            assert pull.src_start == pull.head - src.start and pull.dst_start == pull.head - dst.start
            assert pull.prefill_rank == serving_rank(heads, p, pull.head)  # the lowest rank holding it
            got += range(pull.head, pull.head + pull.count)
        assert got == list(range(dst.start, dst.stop))
    # consumers: how many pulls each prefill rank serves; share indices number them 0..n-1
    for r in range(p):
        idx = [
            share_index(heads, p, d, t, r) for t in range(d) for q in plan_pulls(heads, p, d, t) if q.prefill_rank == r
        ]
        assert sorted(idx) == list(range(consumers(heads, p, d, r)))


def test_paper_configuration_is_rank_to_chip():
    # Llama-3.1-70B: 8 KV heads, prefill TP 4 -> 4 Blackhole chips: rank r feeds chip r, 2 heads each
    for c in range(4):
        (pull,) = plan_pulls(8, 4, 4, c)
        assert (pull.prefill_rank, pull.src_start, pull.dst_start, pull.count) == (c, 0, 0, 2)
    assert [consumers(8, 4, 4, r) for r in range(4)] == [1, 1, 1, 1]


@pytest.mark.parametrize(
    "heads,p,d,names",
    [
        (8, 3, 1, ["prefill tensor_parallel_size=3", "8 KV heads"]),
        (8, 2, 3, ["decode tensor_parallel_size (or chips)=3"]),
        (2, 3, 1, ["is not a multiple"]),
    ],
)
def test_impossible_splits_name_both_sides(heads, p, d, names):
    with pytest.raises(TPMismatch) as e:
        plan_pulls(heads, p, d, 0)
    msg = str(e.value)
    assert f"prefill TP {p} -> decode TP {d}" in msg
    for n in names:
        assert n in msg


def test_rank_outside_the_group_is_refused():
    with pytest.raises(TPMismatch, match="rank 2 outside"):
        shard_heads(4, 2, 2)
    assert list(itertools.islice((shard_heads(4, 2, r).start for r in range(2)), 2)) == [0, 2]


def test_replicas_name_the_serving_rank_of_each_replicated_head():
    assert replicas(8, 4) == ""  # no replication: nothing to say
    assert replicas(2, 4) == "head 0 on ranks 0-1 (served by 0); head 1 on ranks 2-3 (served by 2)"
    assert replicas(1, 2) == "head 0 on ranks 0-1 (served by 0)"
    with pytest.raises(TPMismatch, match="prefill tensor_parallel_size=3"):
        replicas(2, 3)
