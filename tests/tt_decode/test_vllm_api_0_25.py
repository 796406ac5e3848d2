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


def _config(role: str) -> SimpleNamespace:
    ktc = KVTransferConfig(
        kv_connector="HawkConnector",
        kv_connector_module_path="vllm_hawk.connector",
        kv_role=role,
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"auth": "none"},
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


def test_scheduler_side_on_vllm_0_25_requests():
    """The decode's scheduler hooks on 0.25.1's Request, KVCacheBlocks and RequestStatus: the
    remote tokens are offered as an asynchronous load, the allocated blocks go to the worker
    in the step's metadata, and a request aborted before its pull releases the remote blocks."""
    c = HawkConnector(_config("kv_consumer"), KVConnectorRole.SCHEDULER, None)
    params = dict(
        do_remote_prefill=True,
        do_remote_decode=False,
        remote_engine_id="p",
        remote_request_id="cmpl-1",
        remote_block_ids=[1, 2, 3],
        remote_num_tokens=70,
        remote_host="127.0.0.1",
        remote_port=17600,
    )

    def request(rid: str) -> Request:
        sp = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": dict(params)})
        r = Request(rid, list(range(70)), sp, None)
        assert r.kv_transfer_params["do_remote_prefill"]
        return r

    r = request("a")
    c.on_new_request(r)
    assert c.get_num_new_matched_tokens(r, 0) == (70, True)
    blocks = KVCacheBlocks(([KVCacheBlock(b) for b in (11, 12, 13)],))
    c.update_state_after_alloc(r, blocks, 70)
    from vllm.v1.core.sched.output import SchedulerOutput

    meta = c.build_connector_meta(SchedulerOutput.make_empty())  # a step that computes nothing
    assert isinstance(meta, HawkConnectorMetadata) and meta.idle
    assert meta.reqs_to_recv["a"].local_block_ids == [11, 12, 13] and "a" in meta.reqs_to_want
    aborted = request("b")
    aborted.status = RequestStatus.FINISHED_ABORTED
    assert c.request_finished(aborted, []) == (False, None)
    assert "b" in c.build_connector_meta(SchedulerOutput.make_empty()).reqs_to_release


@pytest.mark.parametrize("status", ["FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED", "WAITING_FOR_REMOTE_KVS"])
def test_request_states_the_connector_names_exist_on_0_25(status):
    assert hasattr(RequestStatus, status)


def test_vllm_0_25_recomputes_the_last_prompt_token_after_a_full_remote_hit():
    """The decode's pull fills every prompt block; 0.25.1's scheduler then recomputes the
    last prompt token (as 0.32's does), so the decode writes that token's K/V itself."""
    from vllm.v1.core.sched.scheduler import Scheduler

    src = inspect.getsource(Scheduler._update_waiting_for_remote_kv)
    assert "request.num_computed_tokens = request.num_tokens - 1" in src
