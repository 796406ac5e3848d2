"""Side channel of HAWK's Algorithm 1: messages, handshake, server and client, and the
lease heartbeat (:class:`~vllm_hawk.protocol.leases.LeaseKeeper`: ``Renew`` every interval
for the requests a decode, or the proxy during the hand-over, still waits for).

ZMQ (ROUTER server on the prefill, DEALER client on the decode) carrying msgpack
messages decoded with msgspec into typed, bounded structs; no pickle anywhere.
Shared-secret authentication: CurveZMQ + ZAP at connection time (default) and an
HMAC-SHA256 envelope per message (replay window, recipient binding): see
:mod:`vllm_hawk.protocol.server` and :mod:`vllm_hawk.protocol.envelope`.
"""

from vllm_hawk.protocol.address import MAX_TP_RANKS, side_channel_endpoint
from vllm_hawk.protocol.client import AuthRefused, IncompatiblePeer, ProtocolClient, ProtocolTimeout, RemoteError
from vllm_hawk.protocol.compat import (
    VLLM_PROFILE,
    check_vllm_pair,
    compat_diff,
    compat_hash,
    describe_diff,
    engine_version,
    make_compat,
    regroups,
)
from vllm_hawk.protocol.envelope import AuthError, AuthMismatch, Envelope, FrameError, Header
from vllm_hawk.protocol.leases import LeaseKeeper
from vllm_hawk.protocol.messages import (
    ERROR_CODES,
    MAX_RENEW_IDS,
    PROTOCOL_VERSION,
    Ack,
    CompatFields,
    ControlHello,
    ErrorMsg,
    Hello,
    HelloAck,
    KVReady,
    KVRequest,
    LayoutDesc,
    Message,
    ProtocolError,
    Release,
    Renew,
    Renewed,
    Segment,
    SegmentSum,
    decode,
    encode,
    validate,
)
from vllm_hawk.protocol.server import AUTH_MODES, ProtocolHandler, ProtocolServer, ServerStats, resolve_auth

__all__ = [
    "AUTH_MODES",
    "MAX_TP_RANKS",
    "Ack",
    "AuthError",
    "AuthMismatch",
    "AuthRefused",
    "resolve_auth",
    "CompatFields",
    "ControlHello",
    "ERROR_CODES",
    "MAX_RENEW_IDS",
    "Renew",
    "Renewed",
    "Envelope",
    "ErrorMsg",
    "FrameError",
    "Header",
    "Hello",
    "HelloAck",
    "IncompatiblePeer",
    "KVReady",
    "KVRequest",
    "LayoutDesc",
    "LeaseKeeper",
    "Message",
    "PROTOCOL_VERSION",
    "ProtocolClient",
    "ProtocolError",
    "ProtocolHandler",
    "ProtocolServer",
    "ProtocolTimeout",
    "Release",
    "RemoteError",
    "Segment",
    "SegmentSum",
    "ServerStats",
    "VLLM_PROFILE",
    "compat_diff",
    "compat_hash",
    "check_vllm_pair",
    "engine_version",
    "decode",
    "describe_diff",
    "encode",
    "make_compat",
    "regroups",
    "side_channel_endpoint",
    "validate",
]
