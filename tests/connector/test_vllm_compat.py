"""The vLLM 0.32 side of vllm_hawk/connector/vllm_compat.py (tests/tt_decode/test_vllm_api_0_25.py
checks the 0.25.1 side): 0.32 has the request-level failure report, and HawkConnector answers
it there, reporting no invalid blocks for a failed pull (vLLM would handle it twice)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm


def test_failed_pull_reaches_vllm_0_32_as_failed_recving_only():
    from vllm_fixtures import require_vllm

    require_vllm()
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, KVConnectorTransferResults
    from vllm.v1.outputs import KVConnectorOutput

    from vllm_hawk.connector import vllm_compat
    from vllm_hawk.connector.connector import HawkConnector

    assert vllm_compat.HAS_TRANSFER_RESULTS and vllm_compat.CacheHitSource is not None
    assert "failed_recving" in KVConnectorOutput.__dataclass_fields__
    ktc = KVTransferConfig(
        kv_connector="HawkConnector",
        kv_connector_module_path="vllm_hawk.connector",
        kv_role="kv_consumer",
        kv_connector_extra_config={"auth": "none"},
    )
    cfg = SimpleNamespace(
        kv_transfer_config=ktc, parallel_config=SimpleNamespace(pipeline_parallel_size=1, data_parallel_index=0)
    )
    c = HawkConnector(cfg, KVConnectorRole.WORKER, None)
    w = c.connector_worker
    w.results.begin("bad", [5, 6])
    w.results.end("bad", {"ok": False, "error": "prefill gone", "total_ms": 1.0})
    out = vllm_compat.transfer_output(c, set())
    assert out.finished_recving == {"bad"} and out.failed_recving == {"bad"} and out.invalid_block_ids == set()
    assert isinstance(c.get_transfer_results(set()), KVConnectorTransferResults)
    c.shutdown()
