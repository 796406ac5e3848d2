"""What the scheduler side tells the worker side each step, and back.

Scheduler -> worker (:class:`HawkConnectorMetadata`, built once per step):
  ``reqs_to_send``    prefill: requests whose blocks are now held for a decode (lease)
  ``reqs_to_recv``    decode: requests to pull, with the local blocks to fill
  ``reqs_to_release`` decode: requests that will not pull (local prefix-cache hit, or
                      aborted before scheduling): tell their prefill to free the blocks
  ``reqs_to_want``    decode: requests that just entered the queue: renew their
                      prefill leases (heartbeat) until their pull or Release
  ``idle``            this step computes nothing (no token scheduled): the engine steps
                      only to poll the connector, which may wait a little for news
Worker -> scheduler (:class:`HawkWorkerMeta`): per-request transfer figures, returned in
the decode's ``kv_transfer_params`` under ``hawk_transfer``.

``kv_transfer_params`` keys (prefill response -> proxy -> decode request), NIXL-style:
``do_remote_prefill``, ``do_remote_decode``, ``remote_engine_id``, ``remote_request_id``,
``remote_block_ids`` (flat list), ``remote_num_tokens``, ``remote_host``,
``remote_port`` (side channel), ``remote_lease_expiry`` (unix seconds),
``transfer_mode`` (``"pull"``), ``hawk_mode`` (``direct`` | ``staged``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from vllm_hawk.protocol import MAX_TP_RANKS, side_channel_endpoint

REQUIRED_REMOTE_KEYS = (
    "remote_engine_id",
    "remote_request_id",
    "remote_block_ids",
    "remote_num_tokens",
    "remote_host",
    "remote_port",
)


@dataclass
class SendSpec:
    """Prefill: blocks held for ``req_id`` until Release or ``lease_expiry`` (unix s)."""

    block_ids: list[int]
    num_tokens: int
    lease_expiry: float


MAX_REMOTE_TP = MAX_TP_RANKS  # prefill tensor-parallel ranks a request may name


@dataclass
class RecvSpec:
    """Decode: pull stream blocks ``first_block ..`` of the remote request into
    ``local_block_ids`` (empty: only release the remote blocks)."""

    remote_engine_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    remote_num_tokens: int
    num_remote_blocks: int
    first_block: int = 0
    local_block_ids: list[int] = field(default_factory=list)
    remote_tp_size: int = 1  # the prefill's tensor-parallel ranks; rank r listens on port + r * port_stride
    remote_port_stride: int = 1

    @property
    def side_channel(self) -> str:
        return self.side_channel_of(0)

    def side_channel_of(self, rank: int) -> str:
        """The side channel of prefill tensor-parallel rank ``rank``."""
        return side_channel_endpoint(self.remote_host, self.remote_port, rank, self.remote_port_stride)

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> RecvSpec:
        """Raise ValueError naming the first missing or malformed key."""
        missing = [k for k in REQUIRED_REMOTE_KEYS if params.get(k) is None]
        if missing:
            raise ValueError(f"kv_transfer_params lacks {missing}")
        blocks = params["remote_block_ids"]
        if blocks and isinstance(blocks[0], (list, tuple)):  # NIXL-style per-group lists
            if len(blocks) != 1:
                raise ValueError("remote_block_ids has several KV cache groups")
            blocks = blocks[0]
        try:
            out = cls(
                remote_engine_id=str(params["remote_engine_id"]),
                remote_request_id=str(params["remote_request_id"]),
                remote_host=str(params["remote_host"]),
                remote_port=int(params["remote_port"]),
                remote_num_tokens=int(params["remote_num_tokens"]),
                num_remote_blocks=len(blocks),
                remote_tp_size=int(params.get("remote_tp_size") or 1),
                remote_port_stride=int(params.get("remote_port_stride") or 1),
            )
        except (TypeError, ValueError) as e:
            raise ValueError(f"malformed kv_transfer_params: {e}") from None
        if not 1 <= out.remote_tp_size <= MAX_REMOTE_TP or not 1 <= out.remote_port_stride <= MAX_REMOTE_TP:
            raise ValueError(
                f"kv_transfer_params remote_tp_size={out.remote_tp_size} / remote_port_stride="
                f"{out.remote_port_stride}: each must be in [1, {MAX_REMOTE_TP}]"
            )
        if not 0 < out.remote_port + (out.remote_tp_size - 1) * out.remote_port_stride <= 65535:
            raise ValueError(
                f"kv_transfer_params remote_port={out.remote_port} with {out.remote_tp_size} ranks "
                "leaves the port range"
            )
        return out


@dataclass
class HawkConnectorMetadata(KVConnectorMetadata):
    reqs_to_send: dict[str, SendSpec] = field(default_factory=dict)
    reqs_to_recv: dict[str, RecvSpec] = field(default_factory=dict)
    reqs_to_release: dict[str, RecvSpec] = field(default_factory=dict)
    reqs_to_want: dict[str, RecvSpec] = field(default_factory=dict)
    idle: bool = False


@dataclass
class HawkWorkerMeta(KVConnectorWorkerMetadata):
    """req_id -> {"nbytes", "entries", "segments", "transfer_ms", "total_ms", "ok"}."""

    transfers: dict[str, dict[str, Any]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, HawkWorkerMeta):
            self.transfers.update(other.transfers)
        return self
