"""HawkConnector settings: ``kv_transfer_config.kv_connector_extra_config``.

Every field, its default and its meaning (units in the name):

=====================  ==================  ==================================================
field                  default             meaning
=====================  ==================  ==================================================
``transport``          ``"mooncake-tcp"``  how KV bytes move: ``mooncake-tcp``,
                                           ``mooncake-rdma`` (GG-Direct / HAWK) or
                                           ``host-staged`` (GG-Host baseline: a host copy
                                           on each side plus a plain TCP stream)
``rdma_device``        ``""``              RDMA device filter for ``mooncake-rdma``, e.g.
                                           ``"mlx5_0"``; ``""`` = every device found
``side_channel_host``  ``"127.0.0.1"``     prefill: address the side channel (ZMQ) binds and
                                           advertises in ``kv_transfer_params``; also the
                                           address the transfer engine advertises
``side_channel_port``  ``17600``           prefill: side-channel TCP port (decode: unused);
                                           data-parallel rank *r* uses port + *r*
``mode``               ``"direct"``        ``direct``: the decode READs the prefill's KV
                                           block runs straight into its own KV blocks;
                                           ``staged``: the prefill gathers the request's
                                           blocks into its registered ring (Algorithm 1
                                           P5-P6), the decode READs the ring into a
                                           receive buffer and copies into its blocks (D6-D7)
``device_profile``     ``"vllm"``          the decode side's KV destination, set the SAME on
                                           both sides: ``vllm`` (a plain vLLM engine, same
                                           layout as the prefill) or a Tenstorrent profile
                                           name (``p150a``, ``n150``...: GN-HAWK; the decode
                                           runs the ``vllm_hawk.tt_plugin`` platform with that
                                           device; the prefill transforms each request's
                                           blocks into the decode's tile layout in its ring,
                                           whatever its ``mode``; the decode's ``mode``
                                           picks per-bank receive buffers + intra-bank copies
                                           (``staged``) or READs into the KV pages
                                           (``direct``); see ``vllm_hawk.connector.tt``)
``shared_secret``      ``None``            side-channel HMAC key (>= 16 bytes); when unset
                                           the environment variable ``HAWK_SHARED_SECRET``
                                           is used if present, else no authentication
``lease_s``            ``60.0``            prefill (the **lease**): a finished request's
                                           KV is held this long for its decode, from the
                                           hand-over and again from its KVReady; without
                                           a Release it is freed (expired lease)
``pull_timeout_s``     ``20.0``            decode (the **pull deadline**): one pull, side
                                           channel round trips + READ batch + copies
``claim_wait_s``       ``5.0``             both (the **claim wait**): longest wait for
                                           buffer space (prefill ring, decode receive
                                           buffers) before a request is refused
``handshake_timeout_s`` ``5.0``            decode: deadline for the first Hello to a prefill
``ring_nbytes``        ``64 MiB``          prefill ring (staged, GN-HAWK) and decode receive
                                           buffers (staged), bytes
``max_pulls``          ``2``               decode: pulls running at once (worker threads)
=====================  ==================  ==================================================

Validated once at start-up; an error names the field, the bad value and what is allowed.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

from vllm_hawk import envs

TRANSPORTS = ("mooncake-tcp", "mooncake-rdma", "host-staged")
MODES = ("direct", "staged")
VLLM_PROFILE = "vllm"


class HawkConfigError(ValueError):
    """A ``kv_connector_extra_config`` field is missing, unknown or out of range."""


@dataclass(frozen=True)
class HawkConfig:
    transport: str = "mooncake-tcp"
    rdma_device: str = ""
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 17600
    mode: str = "direct"
    device_profile: str = VLLM_PROFILE
    shared_secret: str | None = None
    lease_s: float = 60.0
    pull_timeout_s: float = 20.0
    claim_wait_s: float = 5.0
    handshake_timeout_s: float = 5.0
    ring_nbytes: int = 64 << 20
    max_pulls: int = 2

    @property
    def secret_bytes(self) -> bytes | None:
        return self.shared_secret.encode() if self.shared_secret else None

    def transport_kind_and_options(self) -> tuple[str, dict[str, Any]]:
        """Arguments for :func:`vllm_hawk.transport.make_transport`."""
        if self.transport == "host-staged":
            return "host_staged", {"bind_host": self.side_channel_host}
        protocol = "rdma" if self.transport == "mooncake-rdma" else "tcp"
        return "mooncake", {"local_host": self.side_channel_host, "protocol": protocol,
                            "device_name": self.rdma_device}


_KNOWN = {f.name: f for f in fields(HawkConfig)}
_RENAMED = {"transfer_timeout_s": "pull_timeout_s"}


def _err(name: str, value: Any, want: str) -> HawkConfigError:
    return HawkConfigError(f"kv_connector_extra_config.{name}={value!r} is invalid: {want}")


def _number(name: str, value: Any, *, integer: bool, low: float, high: float | None = None):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            integer and not isinstance(value, int)):
        raise _err(name, value, "expected an integer" if integer else "expected a number")
    if value < low or (high is not None and value > high):
        rng = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise _err(name, value, f"must be {rng}")
    return value


def parse_config(extra: Mapping[str, Any] | None, *, dp_rank: int = 0) -> HawkConfig:
    """Validate ``kv_connector_extra_config`` and return the settings (see module doc)."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(_KNOWN))
    for old, new in _RENAMED.items():
        if old in extra:
            raise HawkConfigError(f"kv_connector_extra_config.{old} was renamed to {new!r}")
    if unknown:
        raise HawkConfigError(f"kv_connector_extra_config has unknown field(s) {unknown}; "
                              f"known fields: {sorted(_KNOWN)}")
    cfg = HawkConfig()
    out: dict[str, Any] = {f: getattr(cfg, f) for f in _KNOWN}
    out.update(extra)

    if out["transport"] not in TRANSPORTS:
        raise _err("transport", out["transport"], f"choose one of {list(TRANSPORTS)}")
    if out["mode"] not in MODES:
        raise _err("mode", out["mode"], f"choose one of {list(MODES)}")
    for name in ("rdma_device", "side_channel_host", "device_profile"):
        if not isinstance(out[name], str):
            raise _err(name, out[name], "expected a string")
    if not out["side_channel_host"]:
        raise _err("side_channel_host", "", "must not be empty")
    if out["rdma_device"] and out["transport"] != "mooncake-rdma":
        raise _err("rdma_device", out["rdma_device"], "only meaningful with "
                   "transport='mooncake-rdma'")
    out["side_channel_port"] = _number("side_channel_port", out["side_channel_port"],
                                       integer=True, low=1, high=65535 - dp_rank) + dp_rank
    for name in ("lease_s", "pull_timeout_s", "claim_wait_s", "handshake_timeout_s"):
        out[name] = float(_number(name, out[name], integer=False, low=0.1))
    out["ring_nbytes"] = _number("ring_nbytes", out["ring_nbytes"], integer=True, low=1 << 16)
    out["max_pulls"] = _number("max_pulls", out["max_pulls"], integer=True, low=1, high=64)

    profile = out["device_profile"]
    if profile != VLLM_PROFILE:
        from vllm_hawk.layout.device_profiles import available_profiles
        known = available_profiles()
        if profile not in known:
            raise _err("device_profile", profile, f"choose {VLLM_PROFILE!r} or one of {known}")

    secret = out["shared_secret"]
    if secret is None:
        secret = envs.shared_secret()
    if secret is not None:
        if not isinstance(secret, str) or len(secret.encode()) < 16:
            raise _err("shared_secret", "<hidden>", "must be a string of at least 16 bytes")
    out["shared_secret"] = secret
    return HawkConfig(**out)
