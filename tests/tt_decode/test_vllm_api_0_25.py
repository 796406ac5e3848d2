"""HawkConnector on vLLM 0.25.1, the version vllm-tt-plugin pins: every KV-connector API
difference from vLLM 0.32 (the table in vllm_hawk/connector/vllm_compat.py), on the real
0.25.1 classes (no engine: the end to end runs are test_gn_hawk_tt.py)."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import vllm
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1 import base as v1_base
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus

from vllm_hawk.connector import vllm_compat
from vllm_hawk.connector.connector import HawkConnector
from vllm_hawk.connector.metadata import HawkConnectorMetadata

BLOCK = 32


def _config(role: str, **extra) -> SimpleNamespace:
    ktc = KVTransferConfig(
        kv_connector="HawkConnector",
        kv_connector_module_path="vllm_hawk.connector",
        kv_role=role,
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"auth": "none", **extra},
    )
    return SimpleNamespace(
        kv_transfer_config=ktc,
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1, data_parallel_index=0),
        cache_config=SimpleNamespace(block_size=BLOCK),
    )


def test_this_is_vllm_0_25_1_and_the_connector_is_complete_on_it():
    assert vllm.__version__.split("+")[0] == "0.25.1"
    assert issubclass(HawkConnector, KVConnectorBase_V1) and not HawkConnector.__abstractmethods__
    # 0.32's request-level failure report, its result dataclass and cache-hit sources are absent
    assert not hasattr(v1_base, "KVConnectorTransferResults") and not vllm_compat.HAS_TRANSFER_RESULTS
    assert vllm_compat.CacheHitSource is None and "_cache_hit_source" not in HawkConnector.__dict__
    assert "failed_recving" not in KVConnectorOutput.__dataclass_fields__
    assert "get_transfer_results" not in KVConnectorBase_V1.__dict__
    # 0.32-only hooks: never called here (HawkConnector defines get_loaded_kv_cache_group_ids)
    for hook in (
        "get_loaded_kv_cache_group_ids",
        "get_external_cache_hit_sources",
        "requires_kv_delivery",
        "bind_kv_cache_manager",
        "finish_forward",
        "has_pending_block_frees",
    ):
        assert hook not in KVConnectorBase_V1.__dict__, hook
    # 0.32 starts asynchronous loads after the forward (has_sync_kv_loads); 0.25.1 before it
    from vllm.v1.core.sched.output import SchedulerOutput

    assert "has_sync_kv_loads" not in SchedulerOutput.__dataclass_fields__
    # 0.25.1-only: cross-layer blocks (off: HawkConnector does not override it)
    assert "prefer_cross_layer_blocks" in KVConnectorBase_V1.__dict__
    assert "prefer_cross_layer_blocks" not in HawkConnector.__dict__
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

    assert not hasattr(KVConnectorStats, "to_dict")  # stats travel as ``data`` on both
    # the constructor and the hooks HawkConnector implements keep their 0.32 signatures here
    assert list(inspect.signature(KVConnectorBase_V1.__init__).parameters) == [
        "self",
        "vllm_config",
        "role",
        "kv_cache_config",
    ]
    for hook in ("get_num_new_matched_tokens", "update_state_after_alloc", "request_finished", "get_finished"):
        assert list(inspect.signature(getattr(KVConnectorBase_V1, hook)).parameters) == list(
            inspect.signature(getattr(HawkConnector, hook)).parameters
        ), hook


def test_failed_pull_reaches_vllm_0_25_as_invalid_blocks_in_the_same_step():
    """0.25.1 learns of a failed load only through ``get_block_ids_with_load_errors``, asked
    right after ``get_finished`` in the same step (the model runner's
    :func:`~vllm_hawk.connector.vllm_compat.transfer_output`): the failed pull's local blocks
    are there, the request in ``finished_recving``; a successful pull reports no block."""
    c = HawkConnector(_config("kv_consumer"), KVConnectorRole.WORKER, None)
    w = c.connector_worker
    for rid, blocks in (("ok", [3, 4]), ("bad", [7, 8, 9])):
        w.results.begin(rid, blocks)
    w.results.end("bad", {"ok": False, "error": "prefill gone", "total_ms": 1.0})
    out = vllm_compat.transfer_output(c, set())
    assert out.finished_recving == {"bad"} and out.invalid_block_ids == {7, 8, 9}
    w.results.end(
        "ok",
        dict(ok=True, nbytes=1, entries=1, segments=1, request_ms=1.0, transfer_ms=1.0, copy_ms=0.0, total_ms=2.0),
    )
    out = vllm_compat.transfer_output(c, set())
    assert out.finished_recving == {"ok"} and out.invalid_block_ids == set()
    assert vllm_compat.transfer_output(c, set()).is_empty()
    c.shutdown()


def _remote_params(num_tokens: int) -> dict:
    return dict(
        do_remote_prefill=True,
        do_remote_decode=False,
        remote_engine_id="p",
        remote_request_id="cmpl-1",
        remote_block_ids=list(range(1, 1 + -(-num_tokens // BLOCK))),
        remote_num_tokens=num_tokens,
        remote_host="127.0.0.1",
        remote_port=17600,
    )


def _request(rid: str, num_tokens: int) -> Request:
    sp = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": _remote_params(num_tokens)})
    r = Request(rid, list(range(num_tokens)), sp, None)
    assert r.kv_transfer_params["do_remote_prefill"]
    return r


def test_scheduler_side_on_vllm_0_25_requests():
    """The decode's scheduler hooks on 0.25.1's Request, KVCacheBlocks and RequestStatus, on a
    Tenstorrent decode (gn-hawk): the remote tokens up to the last block boundary before the
    prompt's last token are offered as an asynchronous load, the blocks they fill go to the
    worker in the step's metadata, and a request aborted before its pull releases the
    remote blocks."""
    c = HawkConnector(_config("kv_consumer", pair="gn-hawk", device_profile="p150a"), KVConnectorRole.SCHEDULER, None)
    r = _request("a", 70)
    c.on_new_request(r)
    assert c.get_num_new_matched_tokens(r, 0) == (64, True)
    blocks = KVCacheBlocks(([KVCacheBlock(b) for b in (11, 12, 13)],))
    c.update_state_after_alloc(r, blocks, 64)
    from vllm.v1.core.sched.output import SchedulerOutput

    meta = c.build_connector_meta(SchedulerOutput.make_empty())  # a step that computes nothing
    assert isinstance(meta, HawkConnectorMetadata) and meta.idle
    assert meta.reqs_to_recv["a"].local_block_ids == [11, 12] and "a" in meta.reqs_to_want
    aborted = _request("b", 70)
    aborted.status = RequestStatus.FINISHED_ABORTED
    assert c.request_finished(aborted, []) == (False, None)
    assert "b" in c.build_connector_meta(SchedulerOutput.make_empty()).reqs_to_release


def test_a_transferred_prompt_resumes_block_aligned_on_a_tenstorrent_decode():
    """For every prompt length and local prefix hit, what the decode holds after the pull
    (local hit + matched tokens, 0.25.1's ``num_computed_tokens``) ends on a block boundary
    before the last prompt token: 0.25.1's full-hit branch (``num_computed_tokens =
    num_tokens - 1``, next test) is never taken, and vllm-tt-plugin's ``start_pos`` is
    block-aligned (a multiple of 32). A prompt of one block or less transfers nothing and
    releases the prefill's blocks."""
    c = HawkConnector(_config("kv_consumer", pair="gn-hawk", device_profile="p150a"), KVConnectorRole.SCHEDULER, None)
    for n in range(1, 5 * BLOCK + 2):
        for local in range(0, n, BLOCK):  # local prefix hits are whole blocks
            matched, is_async = c.get_num_new_matched_tokens(_request(f"r{n}-{local}", n), local)
            start = local + matched
            assert start % BLOCK == 0 and start % 32 == 0 and start < n, (n, local, matched)
            assert start == (n - 1) // BLOCK * BLOCK, (n, local, matched)  # recomputes 1..BLOCK tokens
            assert is_async == (matched > 0)
    r = _request("short", BLOCK)
    assert c.get_num_new_matched_tokens(r, 0) == (0, False)
    c.update_state_after_alloc(r, KVCacheBlocks(([KVCacheBlock(7)],)), 0)
    from vllm.v1.core.sched.output import SchedulerOutput

    meta = c.build_connector_meta(SchedulerOutput.make_empty())
    assert "short" in meta.reqs_to_release and "short" not in meta.reqs_to_recv


@pytest.mark.parametrize("status", ["FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED", "WAITING_FOR_REMOTE_KVS"])
def test_request_states_the_connector_names_exist_on_0_25(status):
    assert hasattr(RequestStatus, status)


def test_vllm_0_25_recomputes_the_last_prompt_token_after_a_full_remote_hit():
    """The decode's pull fills every prompt block; 0.25.1's scheduler then recomputes the
    last prompt token (as 0.32's does), so the decode writes that token's K/V itself."""
    from vllm.v1.core.sched.scheduler import Scheduler

    src = inspect.getsource(Scheduler._update_waiting_for_remote_kv)
    assert "request.num_computed_tokens = request.num_tokens - 1" in src


def test_lane_mode_is_refused_with_a_kv_connector():
    """vllm-tt-plugin's lane mode (a Galaxy's lanes: tt data parallel > 1 in one engine) runs
    its TTLaneCoordinator, whose get_kv_connector() is None: the HAWK worker refuses it at
    start-up, naming it; without a connector, or with one lane, nothing is refused."""
    from vllm_tt_plugin.config import store_tt_lane_count
    from vllm_tt_plugin.lane_scheduler import TTLaneCoordinator

    from vllm_hawk.tenstorrent.vllm_tt.worker import refuse_lane_mode

    assert TTLaneCoordinator.get_kv_connector(object.__new__(TTLaneCoordinator)) is None
    cfg = _config("kv_consumer")
    cfg.additional_config = {}
    cfg.parallel_config.data_parallel_size = 1
    refuse_lane_mode(cfg)  # one lane
    store_tt_lane_count(cfg, 4)
    with pytest.raises(ValueError, match=r"lane mode \(tt data parallel 4 .*get_kv_connector\(\) returns None"):
        refuse_lane_mode(cfg)
    cfg.kv_transfer_config = None
    refuse_lane_mode(cfg)
