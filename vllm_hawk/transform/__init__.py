"""Prefill-side transfer-aware transform (paper section 4.3): regroup a request's KV into
G' = [N_ch, -1, tile_chunk] (one contiguous, tilized and packed segment per destination
DRAM bank), and the transfer plan that says where each byte of G' lands."""

from vllm_hawk.transform.kv_transform import transform_kv, transform_source
from vllm_hawk.transform.plan import OpList, TransferPlan, block_runs, make_plan

__all__ = ["OpList", "TransferPlan", "block_runs", "make_plan", "transform_kv", "transform_source"]
