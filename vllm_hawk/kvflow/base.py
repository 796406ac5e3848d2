"""What every KV source and sink is, and what each one can do, declared by its class.

A source (:mod:`~vllm_hawk.kvflow.sources`) produces a request's bytes on the prefill;
a sink (:mod:`~vllm_hawk.kvflow.sinks`, :mod:`~vllm_hawk.kvflow.gn_host`) lands them on
the decode. Each class states its :class:`Capabilities` in ``caps``; the endpoints and
the connector read ``caps`` and never probe for attributes or test concrete classes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from vllm_hawk.integrity import wire_format
from vllm_hawk.protocol import KVReady, KVRequest, LayoutDesc, Segment

Entry = tuple[int, int, int]  # one READ: (local_addr, remote_addr, nbytes)


@dataclass(frozen=True)
class Capabilities:
    """What a source or sink does beyond the base methods.

    layer_groups: a source serves a KVRequest for one layer group
    (:attr:`Prepared.fill_layers` / :attr:`Prepared.segments_layers`).
    group_landing: a sink lands a fetch group by group (``group_ranges``,
    ``check_group``, ``land_groups``) and has a Tenstorrent ``tt_layout``.
    head_shares: a sink gives a sink of a slice of its KV heads (``for_heads``).
    snapshot: a sink's :meth:`KVSink.holds` counts its receive memory and device buffers.
    regroup: a sink takes the blocks of a prefill whose blocks are smaller than its own
    and regroups them (``plan_regroup``, :mod:`~vllm_hawk.kvflow.regroup`); sinks without
    it get source bytes already in their own blocks (equal sizes, or the GN-HAWK transform).
    """

    layer_groups: bool = False
    group_landing: bool = False
    head_shares: bool = False
    snapshot: bool = False
    regroup: bool = False


@dataclass
class Prepared:
    """One request's bytes, planned. ``nbytes``: ring bytes needed (0: served in place);
    ``fill(addr, view)``: write them at ring address ``addr`` (``view``: uint8 tensor over
    the range); ``segments(offset)``: where they are, offsets from the export base.
    Sources with ``caps.layer_groups`` also give ``fill_layers(addr, view, lo, hi)`` and
    ``segments_layers(offset, lo, hi)``: the same for layers lo..hi-1 only, inside the
    whole request's range. ``wire_format``: the format of the bytes produced
    (:func:`vllm_hawk.integrity.wire_format`), which seeds their checksums."""

    nbytes: int
    fill: Callable[[int, object], None]
    segments: Callable[[int], list[Segment]]
    fill_layers: Callable[[int, object, int, int], None] | None = None
    segments_layers: Callable[[int, int, int], list[Segment]] | None = None
    wire_format: str = ""


class KVSource:
    """What a :class:`~vllm_hawk.kvflow.prefill.PrefillEndpoint` serves from: a KV cache
    of ``layout`` (its block size is the request's source blocks') on ``device``."""

    name: ClassVar[str]
    uses_ring: ClassVar[bool]  # True: bytes are produced into a ring range per request
    caps: ClassVar[Capabilities] = Capabilities()
    layout: LayoutDesc
    device: torch.device = torch.device("cpu")  # where the cache is; the ring goes there too

    def exports(self) -> list[tuple[int, int]]:
        """``(addr, nbytes)`` regions to register when ``uses_ring`` is False."""
        raise NotImplementedError

    def check(self, msg: KVRequest) -> str:
        """'' when ``msg``'s destination layout can be served, else why not."""
        raise NotImplementedError

    def prepare(self, msg: KVRequest, src_blocks: np.ndarray, export_base: int) -> Prepared:
        """Plan the bytes of source blocks ``src_blocks`` (already the requested ones)."""
        raise NotImplementedError

    def request_nbytes(self, num_tokens: int) -> int:
        """With ``uses_ring``: the ring bytes of the largest request of ``num_tokens`` tokens
        (all this rank's heads), from the same plan ``prepare`` makes."""
        raise NotImplementedError

    def export_view(self, addr: int, nbytes: int) -> torch.Tensor:
        """Without ``uses_ring``: ``nbytes`` bytes of the exported region at ``addr`` as a
        uint8 tensor on ``device`` (a view, no copy), for checksums taken on the device."""
        raise NotImplementedError


@dataclass
class Landing:
    """One request's READ batch and what to do after it (see :mod:`~vllm_hawk.kvflow.sinks`).

    Integrity (:mod:`~vllm_hawk.kvflow.landing_check`): the entries' bytes are checked at
    their local (host) addresses, where they landed, before ``complete`` runs, or after it
    with ``check_after_complete`` (KV pages: after the device's ``dma_written`` and DRAM
    barrier). Every device that lands READs in its KV pages maps them into host memory
    (the emulated banks, tt-kmd's TLB windows); ttnn on a simulator lands staged only."""

    entries: list[Entry]
    complete: Callable[[], dict]
    free: Callable[[], None] | None
    dst_blocks: tuple[int, ...] = ()
    figures: dict = field(default_factory=dict)
    unexpose: Callable[[], None] | None = None  # unregister what land() registered (direct sinks)
    check_after_complete: bool = False


class KVSink:
    """Where a :class:`~vllm_hawk.kvflow.decode.DecodeEndpoint` lands a request's KV."""

    layout: LayoutDesc  # sent in the KVRequest
    mode: str
    caps: ClassVar[Capabilities] = Capabilities()
    wire_kind: ClassVar[str] = "vllm-blocks"  # what its bytes are: vLLM block bytes, or "tt-tiles"

    @property
    def wire_format(self) -> str:
        """The format this sink asks for, which the landed bytes' checksums must carry."""
        return wire_format(self.wire_kind, self.layout.dtype)

    def plan(self, dst_blocks: np.ndarray):
        """This sink's transfer plan for destination blocks (raises ValueError on bad ids)."""
        raise NotImplementedError

    def plan_regroup(self, dst_blocks: np.ndarray, src_block_size: int, num_tokens: int, first_block: int):
        """With ``caps.regroup``: the plan of a pull from a prefill with ``src_block_size``-token
        blocks (``num_tokens`` tokens, destination blocks from ``first_block``); raises
        ValueError naming both sizes when they do not pair."""
        raise NotImplementedError

    def check_ready(self, ready: KVReady, plan, export_nbytes: int) -> str:
        """'' when KVReady's segments are exactly what the plan expects, else why not."""
        raise NotImplementedError

    def land(self, req_id: str, ready: KVReady, plan, remote_base: int, claim_wait_s: float) -> Landing:
        """D2-D5: claim receive memory (may raise BufferFull) and pair the segments."""
        raise NotImplementedError

    def holds(self) -> dict:
        """With ``caps.snapshot``: ``recv_live`` (receive ranges held) and ``device_buffers``
        (buffers live on the device); empty otherwise."""
        return {}

    def close(self) -> None:
        """Unregister and free what the sink took."""
