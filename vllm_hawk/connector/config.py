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
                                           data-parallel rank *d*, tensor-parallel rank *t*
                                           uses port + *d* + *t* x data_parallel_size
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
                                           runs the ``vllm_hawk.tenstorrent.emulated`` platform with that
                                           device; the prefill transforms each request's
                                           blocks into the decode's tile layout in its ring,
                                           whatever its ``mode``; the decode's ``mode``
                                           picks per-bank receive buffers + intra-bank copies
                                           (``staged``) or READs into the KV pages
                                           (``direct``); see :mod:`vllm_hawk.kvflow.sinks`)
``layout_fix``         ``"prefill"``       who fixes the KV layout for a Tenstorrent decode,
                                           set the SAME on both sides: ``prefill`` (GN-HAWK:
                                           the prefill transforms into the tile layout) or
                                           ``decode`` (GN-Host, the paper's baseline: the
                                           prefill serves plain vLLM blocks, the decode
                                           READs them into a host receive ring and
                                           tilizes/packs them into its KV pool, see
                                           :mod:`vllm_hawk.kvflow.gn_host`). ``decode``
                                           needs a Tenstorrent ``device_profile`` and
                                           ``layer_groups`` 1 or auto; the prefill's ``mode`` picks
                                           ring gather (``staged``) or blocks in place; the
                                           decode always lands in its receive ring
                                           (``ring_nbytes``). The paper's baseline: with
                                           ``transport: host-staged``, ``mode: staged``.
                                           The decode reads the blocks as vLLM's CPU
                                           attention lays them out on a host like its own
                                           (CPU_ATTN, the ISA vLLM picks there); a prefill
                                           with another layout (e.g. a GPU's FlashAttention)
                                           is refused at the handshake, naming both
``auth``               ``"curve"``         side-channel authentication, set the SAME on both
                                           sides: ``curve`` (CurveZMQ + ZAP at connection
                                           time, then the HMAC envelope per message),
                                           ``hmac`` (the envelope only), ``none`` (nothing
                                           authenticated: a private, trusted network only).
                                           ``curve``/``hmac`` need a shared secret and
                                           start-up fails without one; see "Security"
``shared_secret``      ``None``            the shared secret (>= 16 bytes), inline; keys the
                                           side channel (CurveZMQ keys, HMAC) and the
                                           host-staged transport's connection check
``shared_secret_file`` ``None``            a file holding the secret instead (its bytes,
                                           trailing newline stripped); exactly one of the
                                           two, else ``HAWK_SHARED_SECRET`` or
                                           ``HAWK_SHARED_SECRET_FILE`` from the environment
``lease_s``            ``60.0``            prefill (the **lease**): a finished request's
                                           KV is held this long for its decode after each
                                           decode heartbeat for it (``renew_interval_s``)
                                           and after its KVReady; without a Release it is
                                           freed (expired lease)
``handover_s``         ``lease_s``         prefill (the **hand-over hold**): a finished
                                           request's KV is held this long after the
                                           hand-over before any decode heartbeat: the
                                           time the front (``hawk proxy``, vLLM's router)
                                           and the decode's API server may take to bring
                                           it to a decode engine, and the time a request
                                           the decode refused holds the KV (``hawk
                                           proxy`` releases those at once); <=
                                           ``max_hold_s``
``renew_interval_s``   ``1.0``             decode (the **heartbeat**): every this many
                                           seconds, one ``Renew`` per prefill names every
                                           request this decode accepted but has not pulled
                                           yet (queued), so a queue longer than
                                           ``lease_s`` fails nothing; at most
                                           ``lease_s / 2``; unset: ``min(1, lease_s / 4)``
``max_hold_s``         ``600.0``           both (the **hold bound**): renewals never hold
                                           a request's KV longer than this after the
                                           hand-over (prefill) or after the decode got it
                                           (decode); a request queued longer loses its KV
                                           (failed pull); >= ``lease_s``; unset:
                                           ``max(600, lease_s)``
``pull_timeout_s``     ``20.0``            decode (the **pull deadline**): one pull, side
                                           channel round trips + READ batch + copies
``claim_wait_s``       ``5.0``             both (the **claim wait**): longest wait for
                                           buffer space (prefill ring, decode receive
                                           buffers) before a request is refused; a decode
                                           refused for a full prefill ring asks again
                                           until its ``pull_timeout_s`` (backpressure)
``handshake_timeout_s`` ``5.0``            decode: deadline for the first Hello to a prefill
``ring_nbytes``        ``64 MiB``          prefill ring (staged, GN-HAWK) and decode receive
                                           buffers (staged), bytes
``max_pulls``          ``2``               decode: pulls running at once (worker threads)
``layer_groups``       ``"auto"``          decode, GN-HAWK: split each pull into this many
                                           layer groups (1-64); the prefill transforms group
                                           i+1 while the decode READs group i (one KVRequest
                                           and KVReady per group, one Release); 1 = off;
                                           ``"auto"``: 2 for a direct-mode pull of >= 84 MiB
                                           of tiles, else 1 (measured, see
                                           ``kvflow.decode.AUTO_GROUPS_MIN_NBYTES``)
``idle_step_wait_ms``  ``20``              both: in an engine step that computes nothing (the
                                           engine steps only to poll the connector while it
                                           holds KV for a decode, or waits for a pull), the
                                           worker waits this long for a Release or a pull to
                                           end before it returns; 0 = return at once. Without
                                           it such steps spin every worker and the engine
                                           core (a TP=2 prefill holding one request: 1.9 of 2
                                           cores), starving the side channel on small hosts.
                                           A request that arrives meanwhile starts at most
                                           this much later
``prefill_tp``         ``0``               decode: the prefills' tensor_parallel_size; checked
                                           at start-up against this decode's TP (or chips)
                                           and the model's KV heads, and against each
                                           request's ``remote_tp_size``; 0 = any (each pull
                                           checks its own pairing)
=====================  ==================  ==================================================

Validated once at start-up; an error names the field, the bad value and what is allowed
(a secret's value is never shown).

Limits under overload
---------------------
What happens when each limit is reached (nothing fails a request on a healthy pair
except where it says "failed pull"; a failed pull is recomputed by the decode under
``kv_load_failure_policy: recompute``, or fails the request under ``fail``):

* **prefill KV cache full** (blocks held for decodes): vLLM's prefill scheduler queues
  new requests until blocks are released (backpressure to the proxy and clients).
* **prefill ring full** (``ring_nbytes``; staged and GN-HAWK): a KVRequest waits up to
  ``claim_wait_s`` for space, then is refused ``no_space``; the decode asks again,
  backing off up to 0.5 s, until its ``pull_timeout_s`` ends: a failed pull only then.
* **decode receive buffers full** (staged sinks, ``ring_nbytes``): a pull waits up to
  ``claim_wait_s`` (within the lease of its KVReady), then fails (failed pull; the
  prefill's range is released at once).
* **max_pulls**: further pulls queue in the decode's worker (no bound beyond the
  engine's own ``max_num_seqs`` and KV blocks); their leases are renewed meanwhile.
* **hand-over hold** (``handover_s``): from the hand-over until the decode engine's
  first heartbeat for it (the front's queue, the decode's API server) the prefill holds a
  request by itself, whatever front forwards it; one that no decode engine takes up
  within it (the front died, the decode refused it) is freed then.
* **lease** (``lease_s``): a request the decode still wants is renewed every
  ``renew_interval_s``; one whose decode stopped wanting it (the decode died) is freed
  ``lease_s`` after its last renewal; a served range without Release ``lease_s`` after
  its KVReady (the decode's READs must end before).
* **hold bound** (``max_hold_s``): see the table; failed pull beyond it.
* **pull deadline** (``pull_timeout_s``): failed pull.
* **side-channel tables** (:mod:`vllm_hawk.kvflow.prefill`): at most 1024
  early KVRequests / Releases, 4096 sessions, 65,536 ids renewed per decode; beyond
  them the oldest is evicted or the new one refused (counted in the refusals).
* **refused at the decode's API server** (bad ``max_tokens``, prompt longer than the
  decode's ``max_model_len``): ``hawk proxy``, which has the shared secret, sends the
  prefill a ``Release`` at once (the request was never claimed, so no decode owns it);
  behind a front that does not (vLLM's router), the hand-over hold frees it
  ``handover_s`` after the hand-over.

Security
--------
Who may reach each port and what it exposes (threat model: docs/security.md):

* side channel (``side_channel_host:side_channel_port``, ZMQ). CurveZMQ + ZAP against the
  HMAC envelope alone, measured (``tests/security/test_idle_floods.py``: a prefill limited
  to 256 fds, 400 connections held and reopened as they are dropped):

  - ``auth: curve`` (default): a peer without the secret cannot finish the ZMTP handshake
    (its CURVE key is derived from the secret; pyzmq's ZAP handler admits only that key);
    libzmq drops it after 1 s (``HANDSHAKE_IVL``) whether it talks or idles, and none of
    our code runs for it. New decodes were served in 1.0-1.1 s (silent flood) and
    0.02-0.1 s (a flood speaking ZMTP/NULL); RSS +1 MiB. While the flood holds every fd,
    libzmq retries ``accept`` in a busy loop (2-4 CPU seconds over the 3 s test): keep the
    fd limit high (vLLM raises it to 65,535) so that this takes more than a second's worth
    of connections.
  - ``auth: hmac``: every message is checked (forgeries, replays and messages for another
    prefill are dropped) but any peer completes the NULL handshake and HOLDS its
    connection; 400 idle ZMQ peers lock new decodes out (not served within 2 s), as the
    review's 4,100 did at 4,096 fds. Use it only where ``curve`` cannot be (no libsodium).

  Both keep the message-level envelope: HMAC-SHA256, 30 s replay window, the recipient's
  id. When one side has a secret and the other none (or another, or a different
  ``auth``), the decode's handshake fails at once with an error that says so.
* transfer engine (Mooncake): listens on two ports on EVERY interface, whatever
  ``side_channel_host`` says, without authentication (Mooncake has no setting for
  either; ``MC_MIN_RPC_PORT``/``MC_MAX_RPC_PORT`` only pick the port range). Anyone who
  reaches them can READ/WRITE memory registered at that moment. HAWK therefore
  registers only what a transfer needs while it needs it (a request's ring range, the
  receive buffers of a pull in flight) and the ports must be firewalled to the peer
  nodes; ``hawk doctor`` says so.
* host-staged transport (``side_channel_host``, ephemeral port): every connection proves
  the shared secret (HMAC challenge-response) before any request is read; ranges are
  checked before anything is allocated; connections are bounded and idle ones dropped.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from vllm_hawk import envs
from vllm_hawk.kvflow.decode import AUTO_LAYER_GROUPS
from vllm_hawk.protocol import VLLM_PROFILE

TRANSPORTS = ("mooncake-tcp", "mooncake-rdma", "host-staged")
AUTH_MODES = ("curve", "hmac", "none")
MIN_SECRET_NBYTES = 16
MAX_SECRET_FILE_NBYTES = 4096
MODES = ("direct", "staged")
LAYOUT_FIXES = ("prefill", "decode")


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
    layout_fix: str = "prefill"
    auth: str = "curve"
    shared_secret: str | None = field(default=None, repr=False)
    shared_secret_file: str | None = None
    lease_s: float = 60.0
    handover_s: float = 60.0
    renew_interval_s: float = 1.0
    max_hold_s: float = 600.0
    pull_timeout_s: float = 20.0
    claim_wait_s: float = 5.0
    handshake_timeout_s: float = 5.0
    ring_nbytes: int = 64 << 20
    max_pulls: int = 2
    layer_groups: int = AUTO_LAYER_GROUPS  # "auto" in kv_connector_extra_config (0 once parsed)
    prefill_tp: int = 0
    idle_step_wait_ms: int = 20
    secret_bytes: bytes | None = field(default=None, repr=False, compare=False)  # resolved, not a field

    def transport_kind_and_options(self) -> tuple[str, dict[str, Any]]:
        """Arguments for :func:`vllm_hawk.transport.make_transport`."""
        if self.transport == "host-staged":
            return "host_staged", {"bind_host": self.side_channel_host, "secret": self.secret_bytes}
        protocol = "rdma" if self.transport == "mooncake-rdma" else "tcp"
        return "mooncake", {"local_host": self.side_channel_host, "protocol": protocol, "device_name": self.rdma_device}


_KNOWN = {f.name: f for f in fields(HawkConfig) if f.name != "secret_bytes"}
_RENAMED = {"transfer_timeout_s": "pull_timeout_s"}


def _err(name: str, value: Any, want: str) -> HawkConfigError:
    return HawkConfigError(f"kv_connector_extra_config.{name}={value!r} is invalid: {want}")


def _number(name: str, value: Any, *, integer: bool, low: float, high: float | None = None):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise _err(name, value, "expected an integer" if integer else "expected a number")
    if value < low or (high is not None and value > high):
        rng = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise _err(name, value, f"must be {rng}")
    return value


def port_stride(vllm_config) -> int:
    """Side-channel ports between tensor-parallel ranks: the prefill's TP rank ``r`` of
    data-parallel rank ``d`` listens on ``side_channel_port + d + r * data_parallel_size``."""
    return max(1, int(getattr(vllm_config.parallel_config, "data_parallel_size", 1) or 1))


def parse_config(extra: Mapping[str, Any] | None, *, dp_rank: int = 0) -> HawkConfig:
    """Validate ``kv_connector_extra_config`` and return the settings (see module doc).
    Fields are checked in a fixed order, so the first error is always the same one."""
    extra = dict(extra or {})
    _check_names(extra)
    cfg = HawkConfig()
    out: dict[str, Any] = {f: getattr(cfg, f) for f in _KNOWN}
    out.update(extra)
    _check_strategy(out)
    _check_numbers(out, extra, dp_rank)
    _check_layout_fix(out)
    if out["auth"] not in AUTH_MODES:
        raise _err("auth", out["auth"], f"choose one of {list(AUTH_MODES)}")
    out["secret_bytes"] = _resolve_secret(out)
    return HawkConfig(**out)


def _check_names(extra: dict) -> None:
    """Renamed and unknown fields are refused, naming the field to use instead."""
    unknown = sorted(set(extra) - set(_KNOWN))
    for old, new in _RENAMED.items():
        if old in extra:
            raise HawkConfigError(f"kv_connector_extra_config.{old} was renamed to {new!r}")
    if unknown:
        raise HawkConfigError(
            f"kv_connector_extra_config has unknown field(s) {unknown}; known fields: {sorted(_KNOWN)}"
        )


def _check_strategy(out: dict) -> None:
    """transport, mode and the string fields."""
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
        raise _err("rdma_device", out["rdma_device"], "only meaningful with transport='mooncake-rdma'")


def _check_numbers(out: dict, extra: dict, dp_rank: int) -> None:
    """Ports, times (s), sizes (bytes) and counts, in place; defaults derived from lease_s."""
    out["side_channel_port"] = (
        _number("side_channel_port", out["side_channel_port"], integer=True, low=1, high=65535 - dp_rank) + dp_rank
    )
    for name in ("lease_s", "pull_timeout_s", "claim_wait_s", "handshake_timeout_s"):
        out[name] = float(_number(name, out[name], integer=False, low=0.1))
    if "renew_interval_s" not in extra:
        out["renew_interval_s"] = min(1.0, out["lease_s"] / 4)
    out["renew_interval_s"] = float(
        _number("renew_interval_s", out["renew_interval_s"], integer=False, low=0.01, high=out["lease_s"] / 2)
    )
    if "handover_s" not in extra:
        out["handover_s"] = out["lease_s"]
    out["handover_s"] = float(_number("handover_s", out["handover_s"], integer=False, low=0.1))
    if "max_hold_s" not in extra:
        out["max_hold_s"] = max(600.0, out["lease_s"], out["handover_s"])
    out["max_hold_s"] = float(
        _number("max_hold_s", out["max_hold_s"], integer=False, low=max(out["lease_s"], out["handover_s"]))
    )
    out["ring_nbytes"] = _number("ring_nbytes", out["ring_nbytes"], integer=True, low=1 << 16)
    out["max_pulls"] = _number("max_pulls", out["max_pulls"], integer=True, low=1, high=64)
    if "layer_groups" not in extra or out["layer_groups"] == "auto":
        out["layer_groups"] = AUTO_LAYER_GROUPS
    elif isinstance(out["layer_groups"], str):
        raise _err("layer_groups", out["layer_groups"], "expected an integer in [1, 64] or 'auto'")
    else:
        out["layer_groups"] = _number("layer_groups", out["layer_groups"], integer=True, low=1, high=64)
    out["prefill_tp"] = _number("prefill_tp", out["prefill_tp"], integer=True, low=0, high=64)
    out["idle_step_wait_ms"] = _number("idle_step_wait_ms", out["idle_step_wait_ms"], integer=True, low=0, high=1000)


def _check_layout_fix(out: dict) -> None:
    """device_profile is known, and layout_fix fits it and layer_groups."""
    profile = out["device_profile"]
    if profile != VLLM_PROFILE:
        from vllm_hawk.layout.device_profiles import available_profiles

        known = available_profiles()
        if profile not in known:
            raise _err("device_profile", profile, f"choose {VLLM_PROFILE!r} or one of {known}")
    fix = out["layout_fix"]
    if fix not in LAYOUT_FIXES:
        raise _err("layout_fix", fix, f"choose one of {list(LAYOUT_FIXES)}")
    if fix != "decode":
        return
    if profile == VLLM_PROFILE:
        raise _err(
            "layout_fix",
            fix,
            "the decode-side layout fix (GN-Host) is for a Tenstorrent decode: set "
            "device_profile to its device (e.g. 'p150a'); a vLLM decode needs no fix",
        )
    if out["layer_groups"] not in (1, AUTO_LAYER_GROUPS):
        raise _err(
            "layer_groups",
            out["layer_groups"],
            "layout_fix='decode' (GN-Host) pulls whole requests: set layer_groups 1 (or leave it auto)",
        )


def _read_secret_file(name: str, path: Any) -> bytes:
    if not isinstance(path, str) or not path:
        raise _err(name, path, "expected the path of a file holding the shared secret")
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_SECRET_FILE_NBYTES:
            raise _err(name, path, f"must be a regular file of at most {MAX_SECRET_FILE_NBYTES} bytes")
        with open(path, "rb") as f:
            data = f.read(MAX_SECRET_FILE_NBYTES + 1).rstrip(b"\r\n")
    except OSError as e:
        raise _err(name, path, f"cannot be read: {e.strerror}") from None
    if st.st_mode & stat.S_IROTH:
        import logging

        logging.getLogger("vllm.hawk.config").warning(
            "%s %s is readable by every user on this host: chmod o-r it", name, path
        )
    return data


def _resolve_secret(out: dict) -> bytes | None:
    """The shared secret from the config (inline or file) or the environment; checked
    against ``auth``. Errors never show the secret."""
    inline, path = out["shared_secret"], out["shared_secret_file"]
    if inline is not None and path is not None:
        raise _err("shared_secret_file", path, "set either shared_secret or shared_secret_file, not both")
    if inline is not None:
        if not isinstance(inline, str):
            raise _err("shared_secret", "<hidden>", "expected a string")
        secret, name = inline.encode(), "shared_secret"
    elif path is not None:
        secret, name = _read_secret_file("shared_secret_file", path), "shared_secret_file"
    else:
        env_inline, env_path = envs.shared_secret(), envs.shared_secret_file()
        if env_inline is not None:
            secret, name = env_inline.encode(), "shared_secret (from HAWK_SHARED_SECRET)"
        elif env_path is not None:
            secret, name = _read_secret_file("HAWK_SHARED_SECRET_FILE", env_path), "HAWK_SHARED_SECRET_FILE"
        else:
            secret, name = None, ""
    if out["auth"] == "none":
        if secret is not None:
            raise _err(
                "auth",
                "none",
                f"a shared secret is configured ({name}): remove it, or choose auth 'curve' (default) or 'hmac'",
            )
        return None
    if secret is None:
        raise HawkConfigError(
            f"kv_connector_extra_config.auth={out['auth']!r} needs a shared secret and none is set: side-channel "
            "authentication is on by default. Set shared_secret or shared_secret_file (or HAWK_SHARED_SECRET / "
            "HAWK_SHARED_SECRET_FILE) to the same >= 16-byte secret on the prefill and the decode, or set "
            '"auth": "none" on both to turn authentication off on a private, trusted network'
        )
    if len(secret) < MIN_SECRET_NBYTES:
        raise _err(
            name.split(" ")[0], "<hidden>", f"the secret must be at least {MIN_SECRET_NBYTES} bytes, got {len(secret)}"
        )
    return secret
