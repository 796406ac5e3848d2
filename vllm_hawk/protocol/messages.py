"""Side-channel messages of HAWK's Algorithm 1 (msgpack via msgspec; no pickle).

Decode (client) -> prefill (server):
  ``Hello``      versioned handshake with the compatibility fields (reply ``HelloAck``)
  ``KVRequest``  D1: send me request ``req_id``'s KV for this destination layout
  ``Release``    D8: I have read it; free the ring region (reply ``Ack``) — P8
  ``Renew``      heartbeat: I still want these requests, extend their leases (reply
                 ``Renewed``); one per prefill per interval, at most
                 :data:`MAX_RENEW_IDS` ids
Control peer (the proxy) -> prefill:
  ``ControlHello`` handshake of a peer that moves no KV (no compatibility fields); such a
                 session may send only ``Release``
Prefill -> decode (always as the reply to one request):
  ``HelloAck``   transfer endpoint + the exported region (base address, size): the
                 registered ring, or the whole KV cache for a source served in place
  ``KVReady``    P7: where the request's bytes are: G' in the ring, one segment per
                 destination bank; or per-layer streams of the source blocks
  ``Ack``        Release done
  ``Renewed``    Renew done: the ids the prefill no longer holds (stop renewing them)
  ``ErrorMsg``   typed refusal (``code``) with a human-readable ``detail``

Every field is bounded at decode time (non-negative ints, string and list lengths);
:func:`validate` adds the cross-field checks. Byte offsets in ``KVReady`` are relative
to the exported region's base address (``HelloAck.export_base_addr``).

Version 2: ``HelloAck.ring_*`` became ``export_*`` (it may describe a whole exported
cache, not a ring) and ``KVRequest.first_block`` selects which of the request's source
blocks are sent (the decode may already hold a prefix). Version 3 had two variants on
two branches: the envelope header naming its recipient (magic ``HAWK/3``) with the
``auth_failed`` refusal, and ``KVRequest.first_layer`` / ``num_layers``.

Version 4 has both: the envelope header names its recipient (magic
``HAWK/4``), the ``auth_failed`` refusal, and ``KVRequest.first_layer`` / ``num_layers``
ask for one layer group of a request (layer-group pipelining: the decode sends one
KVRequest per group at once and reads group i while the prefill transforms group i+1); a
KVReady then covers only that group's bytes, and one Release ends the whole request.

Version 5 added lease renewal (``Renew`` / ``Renewed``: a decode keeps the
leases of the requests it still wants alive while they wait in its queue) and
``ControlHello`` (the proxy releases the prefill's blocks of a request the decode
refused before its engine saw it).

Version 6 added tensor parallelism (:mod:`vllm_hawk.layout.tp`): ``HelloAck``
says which TP rank the prefill side channel serves and which KV heads it holds;
``KVRequest.head_start`` / ``num_heads`` ask for a range of those heads (one *share* of
the request: a decode rank or chip holding only some of them) and ``consumers`` says how
many shares of the request all decode targets together will pull from this rank and
``share`` which one this is; ``Release`` names the share it ends. The prefill frees a request's blocks when all its
shares are released.

Version 7: ``Hello`` and ``HelloAck`` name each side's vLLM version (``vllm_version``); a
pair whose versions HawkConnector does not handle together is refused at the first handshake,
naming both (:func:`vllm_hawk.protocol.compat.check_vllm_pair`).

Version 8: ``HelloAck.block_size`` tells the decode the prefill's tokens per
block, so that a GG decode with larger blocks regroups the prefill's (see
:func:`vllm_hawk.protocol.compat.regroups`).

Version 9 (this one): end-to-end integrity (:mod:`vllm_hawk.integrity`).
``KVRequest.checksum`` names the checksum the decode will verify (``"wsum64"``; ``""``:
none), and ``KVReady.checksums`` carries one :class:`SegmentSum` per segment, over the
bytes as the prefill produced them. Envelope magic ``HAWK/9``.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta, Struct

PROTOCOL_VERSION = 9

MAX_SEGMENTS = 4096  # per KVReady: N_ch banks x layers x K/V stays well below this
MAX_BLOCK_IDS = 1 << 16
MAX_STR = 256
MAX_DETAIL = 1024
MAX_CONSUMERS = 64  # shares of one request one prefill rank serves (decode ranks x chips)
MAX_RENEW_IDS = 2048  # ids per Renew / Renewed: <= 2048 x 256 chars, well under a message's 1 MiB

U64 = Annotated[int, Meta(ge=0, le=2**63 - 1)]  # msgspec bounds must fit int64
U32 = Annotated[int, Meta(ge=0, le=2**32 - 1)]
Pos32 = Annotated[int, Meta(gt=0, le=2**32 - 1)]
Name = Annotated[str, Meta(max_length=MAX_STR)]
ReqId = Annotated[str, Meta(min_length=1, max_length=MAX_STR)]
Detail = Annotated[str, Meta(max_length=MAX_DETAIL)]
Hash = Annotated[str, Meta(pattern="^[0-9a-f]{64}$")]
Word64 = Annotated[int, Meta(ge=0)]  # 0 .. 2**64 - 1 (msgpack's uint64 caps it)

ErrorCode = Literal[
    "unknown_request", "expired", "layout_mismatch", "no_space", "bad_message", "auth_failed", "internal"
]
ERROR_CODES: tuple[str, ...] = ErrorCode.__args__  # type: ignore[attr-defined]


class ProtocolError(ValueError):
    """A message could not be decoded or failed validation (maps to ``bad_message``)."""


class _Base(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class Segment(Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """One contiguous piece of G' destined for one DRAM bank.

    bank: destination bank index; offset_bytes: from the ring's registered base;
    nbytes: length in bytes (> 0).
    """

    bank: Annotated[int, Meta(ge=0, le=1023)]
    offset_bytes: U64
    nbytes: Annotated[int, Meta(gt=0, le=2**48)]


class SegmentSum(Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """The checksum of one KVReady segment (``wsum64``: see :mod:`vllm_hawk.integrity`):
    ``a`` the sum of its 32-bit words, ``b`` their position-weighted sum, each modulo 2**64
    and offset by the seed of the bytes' format."""

    a: Word64
    b: Word64


class LayoutDesc(_Base):
    """Destination KV layout, as the prefill needs it to build G' [N_ch, -1, tile_chunk].

    dtype: "bfloat16" | "bfloat8_b" | ...; block_size: tokens per vLLM block;
    num_banks: N_ch; tile_nbytes: bytes per tile in ``dtype`` (bf16 2048, bfp8 1088);
    page_nbytes: bytes per interleaved page; name: free-form layout id.
    """

    name: Name
    dtype: Name
    block_size: Pos32
    num_layers: Pos32
    num_kv_heads: Pos32
    head_dim: Pos32
    num_banks: Annotated[int, Meta(gt=0, le=1024)]
    tile_nbytes: Pos32
    page_nbytes: Pos32


class CompatFields(_Base):
    """What two peers must agree on; hashed by :func:`vllm_hawk.protocol.compat.compat_hash`.
    block_size: the tokens per block both sides must share, or 0 where the two may differ
    (GN-HAWK: the prefill regroups tokens into the decode's blocks, which every
    KVRequest's ``dst_layout.block_size`` names)."""

    model: Name
    dtype: Name
    block_size: U32
    src_layout: Name
    dst_layout: Name
    device_profile: Name
    protocol_version: Pos32


class Hello(_Base, tag="hello"):
    compat: CompatFields
    compat_hash: Hash
    client_id: Name = ""
    vllm_version: Name = ""  # the decode engine's vLLM ("" outside an engine: tools, tests)


class ControlHello(_Base, tag="control_hello"):
    """Handshake of a control peer (the proxy): no compatibility fields, because it moves
    no KV. Its session may send only ``Release``, which the prefill accepts only for
    requests no decode has claimed (see :mod:`vllm_hawk.kvflow.prefill`)."""

    client_id: Name = ""


class HelloAck(_Base, tag="hello_ack"):
    """transfer_endpoint: the prefill transport's ``endpoint``; export_*: the registered
    region KVReady offsets refer to (host virtual address and size in bytes): the ring,
    or the exported KV cache when the prefill serves blocks in place (GG-Direct).
    block_size: the prefill's ``CompatFields.block_size`` (tokens per block of its KV
    cache; 0 for GN-HAWK, whose prefill regroups tokens into the decode's blocks itself)."""

    compat_hash: Hash
    server_id: Name
    transfer_endpoint: Name
    export_base_addr: U64
    export_nbytes: U64
    tp_size: Annotated[int, Meta(gt=0, le=1024)] = 1
    tp_rank: Annotated[int, Meta(ge=0, le=1023)] = 0
    num_kv_heads: U32 = 0  # the model's KV heads (all ranks); 0 = not told
    head_start: U32 = 0  # global index of this rank's first KV head
    num_heads: U32 = 0  # KV heads this rank holds; 0 = not told
    vllm_version: Name = ""  # the prefill engine's vLLM ("" outside an engine)
    block_size: U32 = 0  # the prefill's tokens per block; 0 = not told


class KVRequest(_Base, tag="kv_request"):
    """D1. num_tokens: the request's prefilled tokens the decode needs; first_block: the
    first of the request's source blocks to send (the decode holds the ones before it);
    dst_block_ids: the decode's blocks for source blocks ``first_block, first_block+1,
    ...`` in order; deadline_ms: unix ms after which the decode gives up (0 = none); first_layer,
    num_layers: only layers ``first_layer .. first_layer + num_layers - 1`` (one layer
    group; num_layers 0 = the whole request). Every group of a request carries the same
    blocks and layout; the prefill produces the request's bytes once, group by group.
    head_start, num_heads: only the prefill's local KV heads ``head_start ..
    head_start + num_heads - 1`` (one share; num_heads 0 = all; ``dst_layout.num_kv_heads``
    is the share's head count); consumers: how many shares of this request the decode
    side pulls from this prefill in all (the prefill frees the blocks after that many
    Releases); share: this share's index among them (0 .. consumers - 1); dst_chip: the
    decode chip (or tensor-parallel rank) the share lands on, named back in KVReady;
    checksum: the checksum the decode verifies the bytes with (``"wsum64"``), which the
    prefill computes and sends with KVReady; ``""``: none."""

    req_id: ReqId
    dst_layout: LayoutDesc
    num_tokens: Annotated[int, Meta(ge=0, le=2**31)]
    dst_block_ids: Annotated[list[U32], Meta(max_length=MAX_BLOCK_IDS)] = []
    first_block: Annotated[int, Meta(ge=0, le=2**31)] = 0
    deadline_ms: U64 = 0
    first_layer: Annotated[int, Meta(ge=0, le=1 << 16)] = 0
    num_layers: Annotated[int, Meta(ge=0, le=1 << 16)] = 0
    head_start: Annotated[int, Meta(ge=0, le=1 << 16)] = 0
    num_heads: Annotated[int, Meta(ge=0, le=1 << 16)] = 0
    consumers: Annotated[int, Meta(ge=1, le=MAX_CONSUMERS)] = 1
    share: Annotated[int, Meta(ge=0, lt=MAX_CONSUMERS)] = 0
    dst_chip: Annotated[int, Meta(ge=0, le=1023)] = 0
    checksum: Annotated[str, Meta(max_length=32)] = ""


class KVReady(_Base, tag="kv_ready"):
    """P7. The request occupies ``total_nbytes`` bytes from ``ring_offset`` (bytes from
    the export base; 0 when served in place); ``segments`` list the bytes per bank (G')
    or per layer (vLLM streams). lease_ms: how long from this message the prefill keeps
    the bytes without a Release (0 = until Release). chip: the destination chip of the
    segments' banks (the KVRequest's ``dst_chip``; a mesh gets one G' per chip).
    checksums: one per segment, in segment order, when the KVRequest asked for a
    ``checksum`` (else empty)."""

    req_id: ReqId
    ring_offset: U64
    total_nbytes: U64
    segments: Annotated[list[Segment], Meta(max_length=MAX_SEGMENTS)]
    lease_ms: U64 = 0
    chip: Annotated[int, Meta(ge=0, le=1023)] = 0
    checksums: Annotated[list[SegmentSum], Meta(max_length=MAX_SEGMENTS)] = []


class Release(_Base, tag="release"):
    """D8/P8. ok=False tells the prefill the transfer failed (it frees the region anyway).
    share: the share it ends (its KVRequest's ``share``; 0 also for a whole request)."""

    req_id: ReqId
    ok: bool = True
    share: Annotated[int, Meta(ge=0, lt=MAX_CONSUMERS)] = 0


class Renew(_Base, tag="renew"):
    """Heartbeat: the sender still wants ``req_ids`` (held by the prefill, not yet
    requested); the prefill extends each one's lease to ``lease_s`` from now (bounded,
    see :mod:`vllm_hawk.kvflow.prefill`)."""

    req_ids: Annotated[list[ReqId], Meta(max_length=MAX_RENEW_IDS)]


class Renewed(_Base, tag="renewed"):
    """Reply to Renew. renewed: leases extended; gone: ids of the Renew the prefill no
    longer holds (released, expired or never known): the sender stops renewing them."""

    renewed: U32 = 0
    gone: Annotated[list[ReqId], Meta(max_length=MAX_RENEW_IDS)] = []


class Ack(_Base, tag="ack"):
    req_id: ReqId


class ErrorMsg(_Base, tag="error"):
    code: ErrorCode
    detail: Detail = ""
    req_id: Name = ""


Message = Hello | ControlHello | HelloAck | KVRequest | KVReady | Release | Renew | Renewed | Ack | ErrorMsg
MESSAGE_TYPES = (Hello, ControlHello, HelloAck, KVRequest, KVReady, Release, Renew, Renewed, Ack, ErrorMsg)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    if not isinstance(msg, MESSAGE_TYPES):
        raise TypeError(f"not a protocol message: {type(msg).__name__}")
    return _encoder.encode(msg)


def decode(data: bytes, max_nbytes: int = 1 << 20) -> Message:
    """Decode and validate one message body; raise :class:`ProtocolError` on anything bad."""
    if len(data) > max_nbytes:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {max_nbytes}")
    try:
        msg = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(str(e)[:MAX_DETAIL]) from None
    validate(msg)
    return msg


def validate(msg: Message) -> None:
    """Cross-field checks that the type annotations cannot express."""
    if isinstance(msg, KVReady):
        total = 0
        for i, s in enumerate(msg.segments):
            if s.offset_bytes + s.nbytes > 2**63 - 1:
                raise ProtocolError(f"segment {i} overflows 63 bits")
            total += s.nbytes
        if total != msg.total_nbytes:
            raise ProtocolError(f"segments sum to {total} bytes, total_nbytes is {msg.total_nbytes}")
        if msg.checksums and len(msg.checksums) != len(msg.segments):
            raise ProtocolError(f"{len(msg.checksums)} checksums for {len(msg.segments)} segments")
        spans = sorted((s.offset_bytes, s.offset_bytes + s.nbytes) for s in msg.segments)
        for (_a0, a1), (b0, _b1) in zip(spans, spans[1:], strict=False):
            if b0 < a1:
                raise ProtocolError(f"segments overlap at offset {b0}")
    elif isinstance(msg, HelloAck) and msg.export_base_addr + msg.export_nbytes > 2**63 - 1:
        raise ProtocolError("exported range overflows 63 bits")
