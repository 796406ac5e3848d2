"""Scheduler side of HawkConnector (runs in the engine core, next to vLLM's scheduler).
Where these hooks sit in a request's whole life: ``docs/architecture.md``.

Prefill (``kv_producer``; requests carry ``kv_transfer_params.do_remote_decode``):
  ``request_finished`` keeps a normally finished request's blocks (returns True) and
  answers the ``kv_transfer_params`` the decode needs; the blocks are held for the
  hand-over (``handover_s``, then the decode's heartbeats renew ``lease_s`` at a time)
  from the worker's next step on. The worker
  reports the request in ``finished_sending`` once its decode sent Release, or when the
  lease expired; vLLM then frees the blocks. Aborted requests are freed at once.

Decode (``kv_consumer``; requests carry ``do_remote_prefill`` + the remote fields):
  ``on_new_request`` (every request, as it enters the queue) hands it to the worker's
  lease heartbeat (``reqs_to_want``): its remote blocks are renewed while it waits,
  however deep in the queue (vLLM asks the connector about the queue's head only);
  ``get_num_new_matched_tokens`` offers the remote prompt tokens beyond the local
  prefix-cache hit, loaded asynchronously (on a Tenstorrent decode up to a block boundary:
  :meth:`HawkConnectorScheduler.matched_end`); ``update_state_after_alloc`` records the
  local blocks to fill (once per request); the worker pulls and reports finished and
  failed receives. Requests that will not pull (full local hit, or aborted before they
  were scheduled) are sent to the worker to release their remote blocks.

Who frees the prefill's blocks of a request the decode will not finish:

* aborted while queued, or a full local prefix hit: Release at once (``reqs_to_release``);
* aborted while its KV is pulled (``WAITING_FOR_REMOTE_KVS``): vLLM keeps the local blocks
  until the pull ends (its READs may still write them); the pull's own Release frees
  the prefill then (at most ``pull_timeout_s``);
* preempted: only running requests are, their KV was pulled and released already; they
  resume by recomputing locally;
* refused by the decode's API server before the engine saw it: ``hawk proxy``'s Release
  (:mod:`vllm_hawk.proxy.release`), else the prefill's hand-over hold (``handover_s``);
* the decode dies: its heartbeats stop, the prefill frees them ``lease_s`` after the last.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from vllm_hawk.connector.config import VLLM_PROFILE, HawkConfig, port_stride
from vllm_hawk.connector.metadata import HawkConnectorMetadata, HawkWorkerMeta, RecvSpec, SendSpec

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

# Under "vllm." so that vLLM's log handlers and level apply.
logger = logging.getLogger("vllm.hawk." + __name__.rsplit(".", 1)[-1])


class HawkConnectorScheduler:
    """Per-step bookkeeping; no I/O. ``engine_id`` names this engine in params."""

    def __init__(self, vllm_config, engine_id: str, cfg: HawkConfig) -> None:
        self.cfg = cfg
        self.engine_id = engine_id
        self.block_size = vllm_config.cache_config.block_size
        # A Tenstorrent decode resumes a transferred prompt at a block boundary (see matched_end).
        self.block_aligned = cfg.device_profile != VLLM_PROFILE
        pc = vllm_config.parallel_config
        self.tp_size = int(pc.tensor_parallel_size)
        self.port_stride = port_stride(vllm_config)
        self._reqs_to_send: dict[str, SendSpec] = {}
        self._reqs_to_recv: dict[str, RecvSpec] = {}
        self._reqs_to_release: dict[str, RecvSpec] = {}
        self._reqs_to_want: dict[str, RecvSpec] = {}
        self._transfers: dict[str, dict[str, Any]] = {}  # decode: per-request figures

    # ------------------------------------------------------------------ decode side
    def on_new_request(self, request: Request) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        with contextlib.suppress(ValueError):  # update_state_after_alloc says why, and pulls nothing
            self._reqs_to_want[request.request_id] = RecvSpec.from_params(params)

    def matched_end(self, request: Request) -> int:
        """Prompt tokens ``[0, end)`` whose KV the decode takes from the prefill.

        A vLLM decode takes every token the prefill computed (vLLM then recomputes the last
        prompt token itself). A Tenstorrent decode stops at the last block boundary before
        the prompt's last token: vllm-tt-plugin passes the first uncomputed token to the
        model as ``start_pos``, and tt_transformers' prefix prefill starts only at a block
        boundary that is a multiple of 32 (block sizes on Tenstorrent are). The decode then
        recomputes the prompt's last 1 to ``block_size`` tokens; the transferred blocks are
        not written again."""
        params = request.kv_transfer_params or {}
        remote = min(int(params.get("remote_num_tokens") or 0), request.num_prompt_tokens)
        if not self.block_aligned:
            return remote
        return min(remote, request.num_prompt_tokens - 1) // self.block_size * self.block_size

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        count = self.matched_end(request) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        try:
            spec = RecvSpec.from_params(params)
        except ValueError as e:
            params["do_remote_prefill"] = False
            logger.warning("HawkConnector: request %s: %s; it will not use a KV transfer", request.request_id, e)
            return
        end = self.matched_end(request)
        params["do_remote_prefill"] = False  # one transfer per request
        if num_external_tokens <= 0:  # everything local: only free the remote blocks
            self._reqs_to_release[request.request_id] = spec
            return
        local_tokens = end - num_external_tokens  # block-aligned prefix hit
        first = local_tokens // self.block_size
        last = -(-end // self.block_size)
        ids = blocks.get_block_ids()[0]
        spec.first_block = first
        spec.local_block_ids = list(ids[first:last])
        self._reqs_to_recv[request.request_id] = spec

    # ------------------------------------------------------------------ both
    def build_connector_meta(self, scheduler_output) -> HawkConnectorMetadata:
        meta = HawkConnectorMetadata(
            reqs_to_send=self._reqs_to_send,
            reqs_to_recv=self._reqs_to_recv,
            reqs_to_release=self._reqs_to_release,
            reqs_to_want=self._reqs_to_want,
            idle=scheduler_output.total_num_scheduled_tokens == 0,
        )
        self._reqs_to_send, self._reqs_to_recv, self._reqs_to_release, self._reqs_to_want = {}, {}, {}, {}
        return meta

    def update_connector_output(self, connector_output) -> None:
        wm = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(wm, HawkWorkerMeta):
            self._transfers.update(wm.transfers)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params:
            return False, None
        rid = request.request_id
        if params.get("do_remote_prefill"):
            # Decode side, finished before update_state_after_alloc (aborted while
            # queued): the remote blocks would wait for their lease; release them now.
            params["do_remote_prefill"] = False
            with contextlib.suppress(ValueError):
                self._reqs_to_release[rid] = RecvSpec.from_params(params)
            return False, None
        if not params.get("do_remote_decode"):
            stats = self._transfers.pop(rid, None)  # decode side: report the pull
            return False, ({"hawk_transfer": stats} if stats else None)
        # Prefill side.
        if (
            request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
            or not block_ids
        ):
            return False, None
        lease_expiry = time.time() + self.cfg.handover_s  # the hand-over hold (kvflow.prefill)
        self._reqs_to_send[rid] = SendSpec(list(block_ids), request.num_computed_tokens, lease_expiry)
        return True, dict(
            do_remote_prefill=True,
            do_remote_decode=False,
            remote_engine_id=self.engine_id,
            remote_request_id=rid,
            remote_block_ids=list(block_ids),
            remote_num_tokens=request.num_computed_tokens,
            remote_host=self.cfg.side_channel_host,
            remote_port=self.cfg.side_channel_port,
            remote_tp_size=self.tp_size,  # rank r's side channel: remote_port + r * remote_port_stride
            remote_port_stride=self.port_stride,
            remote_lease_expiry=lease_expiry,
            transfer_mode="pull",
            hawk_mode=self.cfg.mode,
        )
