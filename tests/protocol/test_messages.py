"""Message round trips, field validation, compat hash, and decoder fuzzing."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_hawk.protocol import (
    ERROR_CODES,
    PROTOCOL_VERSION,
    Ack,
    AuthError,
    CompatFields,
    Envelope,
    ErrorMsg,
    FrameError,
    Hello,
    HelloAck,
    KVReady,
    KVRequest,
    LayoutDesc,
    ProtocolError,
    Release,
    Segment,
    compat_diff,
    compat_hash,
    decode,
    describe_diff,
    encode,
    make_compat,
)

LAYOUT = LayoutDesc(
    name="tt-paged",
    dtype="bfloat8_b",
    block_size=64,
    num_layers=4,
    num_kv_heads=4,
    head_dim=128,
    num_banks=8,
    tile_nbytes=1088,
    page_nbytes=1088,
)
COMPAT = make_compat("tiny-llama", "bfloat16", 64, "vllm-cpu-vec", "tt-bfp8-8bank", "p150a")


def all_messages():
    h = compat_hash(COMPAT)
    return [
        Hello(compat=COMPAT, compat_hash=h, client_id="decode-0"),
        HelloAck(
            compat_hash=h,
            server_id="prefill-0",
            transfer_endpoint="127.0.0.1:15001",
            export_base_addr=0x7F0000000000,
            export_nbytes=1 << 30,
        ),
        KVRequest(
            req_id="req-1",
            dst_layout=LAYOUT,
            num_tokens=4096,
            dst_block_ids=list(range(64)),
            deadline_ms=1_800_000_000_000,
        ),
        KVReady(
            req_id="req-1",
            ring_offset=4096,
            total_nbytes=8 * 1088,
            segments=[Segment(b, 4096 + b * 1088, 1088) for b in range(8)],
            lease_ms=30_000,
        ),
        Release(req_id="req-1"),
        Release(req_id="req-1", ok=False),
        Ack(req_id="req-1"),
        *[ErrorMsg(code=c, detail=f"detail {c}", req_id="req-1") for c in ERROR_CODES],
    ]


@pytest.mark.parametrize("msg", all_messages(), ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    data = encode(msg)
    assert decode(data) == msg
    assert b"pickle" not in data


def test_encode_refuses_non_messages():
    with pytest.raises(TypeError):
        encode({"type": "ack", "req_id": "x"})


def _raw(d: dict) -> bytes:
    return msgspec.msgpack.encode(d)


@pytest.mark.parametrize(
    "bad",
    [
        {"type": "ack", "req_id": ""},  # empty req_id
        {"type": "ack", "req_id": "x" * 300},  # too long
        {"type": "ack"},  # missing field
        {"type": "ack", "req_id": "x", "extra": 1},  # unknown field
        {"type": "nope", "req_id": "x"},  # unknown tag
        {"type": "error", "code": "whatever", "detail": ""},  # unknown code
        {"type": "error", "code": "expired", "detail": "d" * 5000},  # detail too long
        {"type": "release", "req_id": "x", "ok": "yes"},  # wrong type
        {"type": "kv_ready", "req_id": "r", "ring_offset": -1, "total_nbytes": 0, "segments": []},
        {
            "type": "kv_ready",
            "req_id": "r",
            "ring_offset": 0,
            "total_nbytes": 10,
            "segments": [[0, 0, 5]],
        },  # sum mismatch
        {
            "type": "kv_ready",
            "req_id": "r",
            "ring_offset": 0,
            "total_nbytes": 10,
            "segments": [[0, 0, 5], [1, 3, 5]],
        },  # overlap
        {
            "type": "kv_ready",
            "req_id": "r",
            "ring_offset": 0,
            "total_nbytes": 0,
            "segments": [[0, 0, 0]],
        },  # empty segment
        {
            "type": "kv_ready",
            "req_id": "r",
            "ring_offset": 0,
            "total_nbytes": 5000,
            "segments": [[0, i, 1] for i in range(5000)],
        },  # too many segments
        {
            "type": "kv_ready",
            "req_id": "r",
            "ring_offset": 0,
            "total_nbytes": 1,
            "segments": [[5000, 0, 1]],
        },  # bank out of range
    ],
)
def test_invalid_fields_rejected(bad):
    with pytest.raises(ProtocolError):
        decode(_raw(bad))


def test_oversized_rejected():
    msg = KVRequest(req_id="r", dst_layout=LAYOUT, num_tokens=1, dst_block_ids=[1] * 60000)
    data = encode(msg)
    assert decode(data, max_nbytes=len(data)) == msg
    with pytest.raises(ProtocolError, match="exceeds"):
        decode(data, max_nbytes=len(data) - 1)


def test_compat_hash_and_diff():
    other = make_compat("tiny-llama", "bfloat16", 128, "vllm-cpu-vec", "tt-bfp8-8bank", "n150")
    assert compat_hash(COMPAT) == compat_hash(
        make_compat(*[getattr(COMPAT, f) for f in CompatFields.__struct_fields__])
    )
    assert compat_hash(COMPAT) != compat_hash(other)
    assert compat_diff(COMPAT, other) == ["block_size", "device_profile"]
    text = describe_diff(COMPAT, other)
    assert "block_size differs (ours 64, peer 128)" in text and "device_profile" in text
    assert COMPAT.protocol_version == PROTOCOL_VERSION


def test_only_a_gg_decode_with_a_multiple_of_the_prefill_block_size_regroups():
    """:func:`regroups`: the one pair whose fields may differ (block_size only, a vLLM decode
    whose blocks are a multiple of the prefill's); the refusal names both sizes and --block-size."""
    from vllm_hawk.protocol import regroups

    def gg(bs, **kw):
        return make_compat("tiny", "float32", bs, "CPU_ATTN/vec/BHNC", "vllm-paged/CPU_ATTN/vec/BHNC", "vllm", **kw)

    assert regroups(gg(32), gg(64)) and regroups(gg(16), gg(64)) and regroups(gg(16), gg(48))
    assert not regroups(gg(32), gg(32))  # equal: the hashes match, nothing to regroup
    assert not regroups(gg(64), gg(32)) and not regroups(gg(32), gg(48))
    assert not regroups(gg(32), msgspec.structs.replace(gg(64), dtype="bfloat16"))  # another field differs too
    assert not regroups(gg(0), gg(64))
    tt = msgspec.structs.replace(gg(32), device_profile="p150a")  # GN-Host: the decode reads the blocks as sent
    assert not regroups(tt, msgspec.structs.replace(tt, block_size=64))
    text = describe_diff(gg(64), gg(32))
    assert "block_size differs (ours 64, peer 32)" in text and "--block-size 32" in text and "--block-size 64" in text
    names_only = describe_diff(gg(64), gg(32), values=False)  # for an unauthenticated peer
    assert "--block-size" in names_only and "ours" not in names_only


def test_protocol_version_is_9_with_renew_control_hello_head_shares_vllm_versions_block_size_and_checksums():
    # 4 = sec's recipient-bound envelope (HAWK/4, auth_failed) + main's layer-group fields;
    # 5 adds Renew/Renewed (lease heartbeats) and ControlHello (the proxy's Release);
    # 6 tensor-parallel shares; 7 each side's vLLM version in Hello / HelloAck;
    # 8 HelloAck.block_size (a GG decode regroups smaller blocks);
    # 9 KVRequest.checksum and KVReady.checksums (end-to-end integrity).
    from vllm_hawk.protocol import ControlHello, Hello, HelloAck, Renew, Renewed
    from vllm_hawk.protocol.envelope import MAGIC, Header

    assert PROTOCOL_VERSION == 9 and MAGIC == b"HAWK/9"
    assert "checksum" in KVRequest.__struct_fields__ and "checksums" in KVReady.__struct_fields__
    assert "vllm_version" in Hello.__struct_fields__ and "vllm_version" in HelloAck.__struct_fields__
    assert "block_size" in HelloAck.__struct_fields__
    assert Renew.__struct_config__.tag == "renew" and "gone" in Renewed.__struct_fields__
    assert ControlHello.__struct_fields__ == ("client_id",)
    assert "recipient" in Header.__struct_fields__
    assert {"first_layer", "num_layers"} <= set(KVRequest.__struct_fields__)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=512))
def test_fuzz_decode_raw_bytes(data):
    try:
        msg = decode(data)
    except ProtocolError:
        return
    assert decode(encode(msg)) == msg


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=128), max_size=6))
def test_fuzz_envelope_frames(frames):
    for secret in (None, b"k" * 32):
        with contextlib.suppress(FrameError):
            Envelope("fuzz", secret).unpack(frames)


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=20) | st.binary(max_size=20),
        lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=10), c, max_size=4),
        max_leaves=20,
    ),
    st.sampled_from(["hello", "hello_ack", "kv_request", "kv_ready", "release", "ack", "error"]),
)
def test_fuzz_structured_garbage(value, tag):
    """Well-formed msgpack with a valid tag but arbitrary fields never escapes validation."""
    doc = dict(value) if isinstance(value, dict) else {"x": value}
    doc["type"] = tag
    with contextlib.suppress(ProtocolError):
        decode(_raw(doc))


def test_envelope_auth_and_replay():
    key = b"s" * 32
    a, b = Envelope("client", key), Envelope("server", key)
    _seq, frames = a.pack(Ack(req_id="r"), recipient="server")
    header, msg = b.unpack(frames)
    assert msg == Ack(req_id="r") and header.sender == "client" and header.recipient == "server"
    with pytest.raises(AuthError, match="replay"):
        b.unpack(frames)
    _seq, frames2 = a.pack(Ack(req_id="r"), recipient="server")
    forged = list(frames2)
    forged[2] = encode(Ack(req_id="evil"))
    with pytest.raises(AuthError, match="MAC"):
        b.unpack(forged)
    with pytest.raises(AuthError, match="MAC"):
        Envelope("server", b"t" * 32).unpack(frames2)
    with pytest.raises(AuthError):
        b.unpack(frames2[:3] + [b""])
    assert b.unpack(frames2)[1] == Ack(req_id="r")  # the genuine one still passes


def test_envelope_binds_the_recipient():
    """A message signed for one server is refused by another holding the same secret; a
    Hello (sent before the client knows the server's id) leaves the recipient empty (the
    server answers anything else sent to nobody with 'handshake required')."""
    key = b"s" * 32
    a, b, other = Envelope("client", key), Envelope("server-a", key), Envelope("server-b", key)
    _seq, frames = a.pack(Ack(req_id="r"), recipient="server-a")
    with pytest.raises(AuthError, match="addressed to 'server-a'"):
        other.unpack(frames)
    assert b.unpack(frames)[1] == Ack(req_id="r")
    hello = Hello(compat=COMPAT, compat_hash=compat_hash(COMPAT))
    assert isinstance(other.unpack(a.pack(hello)[1])[1], Hello)


def test_envelope_stale_timestamp_rejected():
    key = b"s" * 32
    a = Envelope("client", key, window_s=0.0)
    b = Envelope("server", key, window_s=0.0)
    _seq, frames = a.pack(Ack(req_id="r"), recipient="server")
    import time

    time.sleep(0.01)
    with pytest.raises(AuthError, match="window"):
        b.unpack(frames)


def test_envelope_secret_too_short():
    with pytest.raises(ValueError):
        Envelope("x", b"short")


def test_renew_is_bounded():
    from vllm_hawk.protocol import MAX_RENEW_IDS, ProtocolError, Renew, Renewed, decode, encode

    ids = [f"cmpl-{i:0200d}" for i in range(MAX_RENEW_IDS)]  # the largest Renew fits a message
    assert decode(encode(Renew(req_ids=ids))) == Renew(req_ids=ids)
    assert decode(encode(Renewed(renewed=1, gone=ids[:2]))).gone == ids[:2]
    too_many = msgspec.msgpack.encode({"type": "renew", "req_ids": ids + ["x"]})
    with pytest.raises(ProtocolError):
        decode(too_many)
