"""The decode's pull plan (:class:`vllm_hawk.kvflow.pull_plan.PullPlanner`), pure: a
request's ``RecvSpec`` and both sides' heads and TP sizes in, per prefill rank its side
channel's endpoint, share and sink out, with the idle ranks to release."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from vllm_hawk.connector.metadata import RecvSpec
from vllm_hawk.kvflow.base import Capabilities, KVSink
from vllm_hawk.kvflow.decode import Share
from vllm_hawk.kvflow.pull_plan import PullPlanner
from vllm_hawk.layout.tp import TPMismatch
from vllm_hawk.protocol import LayoutDesc

PORT, STRIDE = 7000, 10


class _Sink(KVSink):
    """A vLLM-like sink that gives views of its heads (``for_heads``)."""

    caps = Capabilities(head_shares=True)

    def __init__(self, name: str = "sink") -> None:
        self.name, self.views = name, []

    def for_heads(self, region_map, layout, head_start):
        view = (self.name, region_map.heads, layout.num_kv_heads)
        self.views.append(view)
        return view


class _WholeSink(KVSink):
    """A sink that lands whole shards only (no ``head_shares``)."""


class _Endpoint:
    def __init__(self, side_channel: str, tp_size: int, tp_rank: int, num_kv_heads: int) -> None:
        self.side_channel = side_channel
        self.hello = SimpleNamespace(tp_size=tp_size, tp_rank=tp_rank, num_kv_heads=num_kv_heads)


def _layout(heads: int) -> LayoutDesc:
    return LayoutDesc(
        name="test",
        dtype="bfloat16",
        block_size=16,
        num_layers=2,
        num_kv_heads=heads,
        head_dim=64,
        num_banks=1,
        tile_nbytes=1024,
        page_nbytes=4096,
    )


def _head_maps(start: int, count: int):
    return SimpleNamespace(
        heads=(start, count), layers=[SimpleNamespace(block_nbytes=1024 * count, block_stride_nbytes=4096)]
    )


def _spec(prefill_tp: int) -> RecvSpec:
    return RecvSpec(
        "prefill-0",
        "req-1",
        "10.0.0.1",
        PORT,
        remote_num_tokens=40,
        num_remote_blocks=3,
        local_block_ids=[4, 5, 6],
        remote_tp_size=prefill_tp,
        remote_port_stride=STRIDE,
    )


def _planner(heads: int, local: int, sinks=None, *, lie: dict | None = None, **kw):
    """A planner whose peers answer as prefill TP rank ``(port - PORT) // STRIDE`` of the
    spec's size (``lie``: side channel -> (tp_size, tp_rank) it says instead)."""
    calls = []

    def peer(side_channel: str, engine_id: str):
        calls.append((side_channel, engine_id))
        rank = (int(side_channel.rsplit(":", 1)[1]) - PORT) // STRIDE
        tp_size, tp_rank = (lie or {}).get(side_channel, (kw.get("prefill_tp") or peer.tp, rank))
        return _Endpoint(side_channel, tp_size, tp_rank, heads)

    peer.tp = kw.pop("spec_tp", 1)
    p = PullPlanner(
        heads, _layout(local), sinks or [_Sink()], head_maps=_head_maps, peer=peer, chips=kw.pop("chips", False), **kw
    )
    return p, calls


def _side(rank: int) -> str:
    return f"tcp://10.0.0.1:{PORT + rank * STRIDE}"


def test_without_tp_one_whole_share_into_the_worker_sink():
    p, calls = _planner(4, 4)
    plan = p.plan(_spec(1))
    ((ep, sink, ps),) = plan.shares
    assert ep.side_channel == _side(0) and calls == [(_side(0), "prefill-0")]
    assert sink is p.sinks[0] and ps.share == Share(chip=0)
    assert (ps.prefill_rank, ps.dst_start, ps.count) == (0, 0, 4)
    assert plan.idle == [] and p.side_channels(_spec(1)) == [_side(0)]


def test_two_prefill_ranks_into_one_decode_each_into_a_view_of_its_heads():
    p, _ = _planner(4, 4, spec_tp=2)
    plan = p.plan(_spec(2))
    assert [ep.side_channel for ep, _, _ in plan.shares] == [_side(0), _side(1)]
    assert [sink for _, sink, _ in plan.shares] == [("sink", (0, 2), 2), ("sink", (2, 2), 2)]
    assert [ps.share for _, _, ps in plan.shares] == [
        Share(0, 2, 1, 0, tag="t0d0", chip=0),
        Share(0, 2, 1, 0, tag="t0d2", chip=0),
    ]
    assert plan.idle == []
    p.plan(_spec(2))  # a second pull reuses the head views
    assert len(p.sinks[0].views) == 2


def test_decode_ranks_each_pull_their_heads_from_one_prefill_rank():
    for rank in (0, 1):
        p, _ = _planner(8, 4, rank=rank, ranks=2, spec_tp=4)
        plan = p.plan(_spec(4))
        assert [(ps.prefill_rank, ps.dst_start, ps.count) for _, _, ps in plan.shares] == [
            (2 * rank, 0, 2),
            (2 * rank + 1, 2, 2),
        ]
        assert all(ps.target == rank for _, _, ps in plan.shares)


def test_one_prefill_rank_serves_two_decode_ranks_by_share_index():
    shares = []
    for rank in (0, 1):
        p, _ = _planner(4, 2, rank=rank, ranks=2)
        ((_, sink, ps),) = p.plan(_spec(1)).shares
        assert sink is p.sinks[0]  # all of this rank's heads (a part of the prefill's)
        shares.append(ps.share)
    assert shares == [Share(0, 2, 2, 0, tag="t0d0", chip=0), Share(2, 2, 2, 1, tag="t1d0", chip=1)]


def test_replicated_heads_leave_idle_ranks_that_rank_0_releases(caplog):
    log = logging.getLogger("test.pull_plan")
    p, _ = _planner(2, 2, spec_tp=4, log=log)
    with caplog.at_level(logging.INFO, logger="test.pull_plan"):
        plan = p.plan(_spec(4))
        p.plan(_spec(4))
    assert [ps.prefill_rank for _, _, ps in plan.shares] == [0, 2] and plan.idle == [1, 3]
    (rec,) = [r for r in caplog.records if r.name == "test.pull_plan"]  # once per prefill TP size
    assert "prefill TP 4 replicates KV heads: head 0 on ranks 0-1 (served by 0)" in rec.getMessage()
    assert "idle ranks [1, 3] are released at once" in rec.getMessage()
    assert p.side_channels(_spec(4)) == [_side(r) for r in range(4)]
    other, _ = _planner(2, 1, rank=1, ranks=2, spec_tp=4)
    assert other.plan(_spec(4)).idle == [] and other.side_channels(_spec(4)) == [_side(2)]


def test_a_release_plan_opens_no_side_channel():
    p, calls = _planner(4, 4, spec_tp=2)
    plan = p.plan(_spec(2), connect=False)
    assert calls == [] and [(ep, sink, ps.prefill_rank) for ep, sink, ps in plan.shares] == [
        (None, None, 0),
        (None, None, 1),
    ]


def test_mesh_chips_each_take_a_whole_shard_into_their_own_sink():
    sinks = [_Sink("chip0"), _Sink("chip1")]
    p, _ = _planner(8, 4, sinks, chips=True, spec_tp=2)
    assert (p.total, p.targets) == (2, [0, 1])
    plan = p.plan(_spec(2))
    assert [(sink, ps.prefill_rank, ps.target) for _, sink, ps in plan.shares] == [(sinks[0], 0, 0), (sinks[1], 1, 1)]
    p.check_pairing(2)
    with pytest.raises(TPMismatch, match="whole head shards"):
        p.check_pairing(4)
    p, _ = _planner(8, 4, sinks, chips=True, spec_tp=4)
    with pytest.raises(TPMismatch, match="chip 0 holds 4 KV heads; heads 0..1 .*whole head shards"):
        p.plan(_spec(4))


def test_a_side_channel_that_is_another_rank_is_refused_with_its_hello():
    p, _ = _planner(4, 4, spec_tp=2, lie={_side(1): (4, 3)})
    with pytest.raises(
        TPMismatch,
        match=r"says it is TP rank 3 of 4 with 4 KV heads; kv_transfer_params name "
        r"rank 1 of 2",
    ) as e:
        p.plan(_spec(2))
    assert e.value.hello.tp_size == 4
    assert p.after_mismatch(e.value) == [0, 1, 2, 3]  # every rank the prefill says it has
    assert _planner(4, 2, rank=1, ranks=2)[0].after_mismatch(e.value) == []  # rank 0 releases them
    assert p.after_mismatch(TPMismatch("no hello")) == []


def test_the_configured_prefill_tp_must_match_the_request():
    p, calls = _planner(4, 4, prefill_tp=2)
    with pytest.raises(TPMismatch, match="tensor_parallel_size 4; this decode is configured for prefill_tp=2"):
        p.plan(_spec(4))
    assert calls == [] and p.side_channels(_spec(4)) == [_side(0)]


def test_a_whole_shard_sink_refuses_a_share_of_its_heads():
    p, _ = _planner(4, 4, [_WholeSink()], spec_tp=2)
    with pytest.raises(
        TPMismatch,
        match=r"sink \(_WholeSink\) takes whole shards only; heads 0..1 of its 4 would "
        r"come from prefill rank 0 alone",
    ):
        p.plan(_spec(2))
    p, _ = _planner(4, 4, [_WholeSink()])
    assert len(p.plan(_spec(1)).shares) == 1  # a whole shard lands as before
