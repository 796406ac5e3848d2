"""HawkConnector settings: ``kv_transfer_config.kv_connector_extra_config``.

Every field is declared once, in :class:`HawkConfig`: its type, its default (or the
expression the parser computes it from when unset), the side that reads it, its limits
and its meaning. ``docs/configuration.md``'s field table is generated from those
declarations (``python -m vllm_hawk.connector.config_doc --write``, ``make config-doc``)
and a test fails when the two differ. What happens at each limit under overload:
``docs/configuration.md``; who may reach each port: ``docs/security.md``.

``pair`` names the pair a user deploys and expands to the four fields that make it
(:data:`PAIRS`); a field given next to it that contradicts it is refused.
Validated once at start-up; an error names the field, the bad value and what is allowed
(a secret's value is never shown).
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from vllm_hawk import envs
from vllm_hawk.kvflow.decode import AUTO_LAYER_GROUPS
from vllm_hawk.kvflow.exposure import REGISTRATION_CHOICES
from vllm_hawk.protocol import VLLM_PROFILE
from vllm_hawk.transport.engine_firewall import FIREWALL_MODES

TRANSPORTS = ("mooncake-tcp", "mooncake-rdma", "host-staged")
MOONCAKE = ("mooncake-tcp", "mooncake-rdma")
AUTH_MODES = ("curve", "hmac", "none")
MIN_SECRET_NBYTES = 16
MAX_SECRET_FILE_NBYTES = 4096
MODES = ("direct", "staged")
LAYOUT_FIXES = ("prefill", "decode")
SIDES = ("prefill", "decode")
RING_AUTO = "auto"  # ``ring_nbytes``: sized from max_model_len (the prefill), DECODE_RECV_NBYTES (the decode)
DECODE_RECV_NBYTES = 64 << 20  # the decode's receive buffers under ring_nbytes "auto"
#: ``device_profile`` in :data:`PAIRS`: a Tenstorrent profile, given explicitly
TENSTORRENT = None

#: What each ``pair`` implies: field -> the values it allows, the first filled in when the
#: field is unset (:data:`TENSTORRENT`: any Tenstorrent profile, which must be given).
#: GN-HAWK leaves ``mode`` to the decode (its landing); the prefill always transforms into
#: its ring, so a GN-HAWK prefill refuses a ``mode``.
PAIRS: dict[str, dict[str, tuple[str, ...] | None]] = {
    "gg-direct": {
        "transport": MOONCAKE,
        "mode": ("direct",),
        "device_profile": (VLLM_PROFILE,),
        "layout_fix": ("prefill",),
    },
    "gg-host": {
        "transport": ("host-staged",),
        "mode": ("staged",),
        "device_profile": (VLLM_PROFILE,),
        "layout_fix": ("prefill",),
    },
    "gn-host": {
        "transport": ("host-staged",),
        "mode": ("staged",),
        "device_profile": TENSTORRENT,
        "layout_fix": ("decode",),
    },
    "gn-hawk": {"transport": MOONCAKE, "device_profile": TENSTORRENT, "layout_fix": ("prefill",)},
}
#: The names the paper and ``LocalCluster.configured`` use for each pair
PAIR_NAMES = {"gg-direct": "GG-Direct", "gg-host": "GG-Host", "gn-host": "GN-Host", "gn-hawk": "GN-HAWK"}

logger = logging.getLogger("vllm.hawk.config")


class HawkConfigError(ValueError):
    """A ``kv_connector_extra_config`` field is missing, unknown or out of range."""


def setting(default: Any, doc: str, *, side: str, limits: str = "", unset: str | None = None, **kw) -> Any:
    """A field of :class:`HawkConfig` with its documentation. ``side``: who reads it
    (``prefill``, ``decode``, ``both``); ``unset``: the expression over the other fields
    that the parser computes the value from when the field is not given (``default`` is
    then that expression over the defaults)."""
    meta = {"doc": " ".join(doc.split()), "side": side, "limits": limits, "unset": unset}
    return field(default=default, metadata=meta, **kw)


@dataclass(frozen=True)
class HawkConfig:
    """The parsed settings; each field's metadata is its documentation (see module doc)."""

    pair: str | None = setting(
        None,
        """the pair this engine is part of, the same on both sides: ``gg-direct`` (GPU -> GPU, the
        decode READs the prefill's KV blocks in place over Mooncake), ``gg-host`` (GPU -> GPU over
        ``host-staged``: a host copy on each side plus a plain TCP stream), ``gn-host`` (GPU ->
        Tenstorrent over ``host-staged``, the decode tilizes the plain blocks: the paper's baseline),
        ``gn-hawk`` (GPU -> Tenstorrent over Mooncake, the prefill transforms into the decode's tile
        layout). It sets ``transport``, ``mode``, ``device_profile`` and ``layout_fix``; one of them
        given as well must agree with it (``transport`` may pick ``mooncake-rdma`` for
        ``gg-direct``/``gn-hawk``; the ``gn-*`` pairs need ``device_profile`` naming the Tenstorrent
        device; under ``gn-hawk`` only the decode takes a ``mode``). Unset: those four fields as given,
        with a warning naming the pair they make""",
        side="both",
        limits="`gg-direct`, `gg-host`, `gn-host`, `gn-hawk`",
    )
    transport: str = setting(
        "mooncake-tcp",
        """how KV bytes move: Mooncake (GG-Direct, GN-HAWK), or ``host-staged`` (the GG-Host / GN-Host
        baselines: a host copy on each side plus a plain TCP stream)""",
        side="both",
        limits="`mooncake-tcp`, `mooncake-rdma`, `host-staged`",
    )
    rdma_device: str = setting(
        "",
        """RDMA device filter, e.g. ``"mlx5_0"``; ``""`` = every device found""",
        side="both",
        limits="only with `mooncake-rdma`",
    )
    side_channel_host: str = setting(
        "127.0.0.1",
        """address the side channel (ZMQ) binds and advertises in ``kv_transfer_params``, and
        ``transfer_engine_host``'s default (on the decode, only that). In the example configs it is the
        node's own address that peers reach, on both sides""",
        side="both",
        limits="not empty",
    )
    side_channel_port: int = setting(
        17600,
        """side-channel TCP port (decode: unused); data-parallel rank *d*, tensor-parallel rank
        *t* uses port + *d* + *t* × data_parallel_size""",
        side="prefill",
        limits="1-65535",
    )
    transfer_engine_host: str = setting(
        "127.0.0.1",
        """the address this engine's KV transport advertises to its peer: Mooncake's transfer engine
        (which listens on every interface whatever this says, [security.md](security.md)) or the
        ``host-staged`` stream, which binds it; a node whose KV link is not its side-channel address
        sets it""",
        side="both",
        limits="not empty",
        unset="side_channel_host",
    )
    engine_firewall: str = setting(
        "require",
        """who may reach Mooncake's ports (the engine listens on every interface and authenticates
        no one): ``require`` puts them behind an nftables table the node manages itself in its network
        namespace, open only to loopback and, on a prefill, to the address a decode's accepted,
        authenticated KVRequest came from, until its last request is released or expires; it needs
        ``CAP_NET_ADMIN`` there (compose ``cap_add: [NET_ADMIN]``) and, without it, start-up fails
        wherever an interface other than loopback is up. ``open-to-network`` accepts the risk: no
        firewall, anyone on the network can read and write the registered KV, a warning at every
        start ([security.md](security.md#transfer-engine-ports))""",
        side="both",
        limits="`require`, `open-to-network`; Mooncake only",
    )
    mode: str = setting(
        "direct",
        """``direct``: the decode READs the prefill's KV block runs straight into its own KV blocks;
        ``staged``: the prefill gathers the request's blocks into its registered ring (Algorithm 1
        P5-P6), the decode READs the ring into a receive buffer and copies into its blocks (D6-D7).
        GN-HAWK: the decode's only (per-bank receive buffers + intra-bank copies, ``staged``, or READs
        into the KV pages, ``direct``, ``vllm_hawk/kvflow/sinks.py``); the prefill always transforms
        into its ring and refuses a ``mode`` with ``pair: gn-hawk``. GN-Host: the prefill's ring
        gather (``staged``) or blocks in place; its decode always lands in its receive ring""",
        side="both",
        limits="`direct`, `staged`",
    )
    device_profile: str = setting(
        VLLM_PROFILE,
        """the decode side's KV destination, the same on both sides: ``vllm`` (a plain vLLM engine, same
        layout as the prefill and a ``--block-size`` equal to the prefill's or a multiple of it: the
        decode regroups the prefill's blocks, [gpu-prefill.md](gpu-prefill.md#block-sizes)) or a
        Tenstorrent profile (``p150a``, ``n150``...: GN-HAWK, GN-Host). GN-HAWK's prefill transforms each
        request's blocks into the decode's tile layout in its ring, whatever the two block sizes (e.g. a
        GPU's 16 into 64)""",
        side="both",
        limits="`vllm` or a profile name",
    )
    layout_fix: str = setting(
        "prefill",
        """who fixes the KV layout for a Tenstorrent decode, the same on both sides: ``prefill``
        (GN-HAWK) or ``decode`` (GN-Host: the prefill serves plain vLLM blocks, the decode READs them
        into a host receive ring (``ring_nbytes``) and tilizes/packs them into its KV pool,
        ``vllm_hawk/kvflow/gn_host.py``). ``decode`` needs a Tenstorrent ``device_profile`` and
        ``layer_groups`` 1 or auto. The decode reads the blocks as vLLM's CPU attention lays them out
        on a host like its own; a prefill with another layout (e.g. a GPU's FlashAttention) is refused
        at the handshake, naming both""",
        side="both",
        limits="`prefill`, `decode`",
    )
    auth: str = setting(
        "curve",
        """side-channel authentication, the same on both sides ([security.md](security.md)): ``curve``
        (CurveZMQ + ZAP at connection time, then the HMAC envelope per message), ``hmac`` (the envelope
        only), ``none`` (nothing authenticated: a private, trusted network only); ``curve``/``hmac``
        need a shared secret and start-up fails without one""",
        side="both",
        limits="`curve`, `hmac`, `none`",
    )
    shared_secret: str | None = setting(
        None,
        """the shared secret, inline; keys the side channel (CurveZMQ keys, HMAC) and the host-staged
        transport's connection check""",
        side="both",
        limits=">= 16 bytes",
        repr=False,
    )
    shared_secret_file: str | None = setting(
        None,
        """a file holding the secret instead (trailing newline stripped); exactly one of the two, else
        ``HAWK_SHARED_SECRET`` or ``HAWK_SHARED_SECRET_FILE`` from the environment""",
        side="both",
        limits="regular file, <= 4,096 bytes",
    )
    lease_s: float = setting(
        60.0,
        """the **lease**: a finished request's KV is held this long for its decode after each decode
        heartbeat for it and after its KVReady; without a Release it is freed (expired lease)""",
        side="prefill",
        limits=">= 0.1",
    )
    handover_s: float = setting(
        60.0,
        """the **hand-over hold**: a finished request's KV is held this long after the hand-over before
        any decode heartbeat: the time the front (``hawk proxy``, vLLM's router) and the decode's API
        server may take to bring it to a decode engine, whose first heartbeat ends the hold. Also how
        long a request the decode refused holds the KV behind a front that does not release it (vLLM's
        router; ``hawk proxy`` releases it at once)""",
        side="prefill",
        limits="0.1 to `max_hold_s`",
        unset="lease_s",
    )
    renew_interval_s: float = setting(
        1.0,
        """the **heartbeat**: every this many seconds, one ``Renew`` per prefill names every request
        this decode accepted but has not pulled yet, so a queue longer than ``lease_s`` fails nothing""",
        side="decode",
        limits="0.01 to `lease_s / 2`",
        unset="min(1.0, lease_s / 4)",
    )
    max_hold_s: float = setting(
        600.0,
        """the **hold bound**: renewals never hold a request's KV longer than this after the hand-over
        (prefill) or after the decode got it (decode); a request queued longer loses its KV (failed
        pull)""",
        side="both",
        limits=">= `lease_s`, `handover_s`",
        unset="max(600.0, lease_s, handover_s)",
    )
    pull_timeout_s: float = setting(
        20.0,
        """the **pull deadline**: one pull, side-channel round trips + READ batch + copies""",
        side="decode",
        limits=">= 0.1",
    )
    claim_wait_s: float = setting(
        5.0,
        """the **claim wait**: longest wait for buffer space (prefill ring, decode receive buffers)
        before a request is refused; a decode refused for a full prefill ring asks again until its
        ``pull_timeout_s`` (backpressure)""",
        side="both",
        limits=">= 0.1",
    )
    handshake_timeout_s: float = setting(
        5.0, """deadline for the first Hello to a prefill""", side="decode", limits=">= 0.1"
    )
    ring_nbytes: int | str = setting(
        RING_AUTO,
        """prefill ring (staged, GN-HAWK) and decode receive buffers (staged), bytes. The prefill's ring
        is on its KV cache's device (GPU memory on a GPU node with Mooncake's CUDA wheel, outside
        vLLM's ``--gpu-memory-utilization`` budget: lower that by the ring's share; host memory with
        ``host-staged``, pinned next to a GPU): [gpu-prefill.md](gpu-prefill.md#ring-size). ``"auto"``:
        the prefill sizes its ring for the largest request its engine admits, ``max_model_len`` tokens
        of this TP rank's heads in the bytes it produces (GN-HAWK: bfloat16 tiles in 64-token blocks;
        GG/GN-Host staged: its vLLM blocks), once, so shorter requests share it; the decode's receive
        buffers take 64 MiB. A request larger than the ring is refused, naming both sizes""",
        side="both",
        limits='>= 64 KiB or `"auto"`',
    )
    registration: str = setting(
        "auto",
        """when KV memory is registered with the transport (what a transport peer can reach,
        ``vllm_hawk/kvflow/exposure.py``): ``per_request`` (a request's ring range, blocks or receive
        buffers, for as long as its transfer needs them), ``whole`` (the ring, cache or receive buffers
        once, at start), ``auto``: ``whole`` for memory on a GPU (each registration of GPU memory costs
        one per NIC and, on Mooncake's dma-buf route, may keep an fd), ``per_request`` for host memory
        (the decode's sinks, a host ring)""",
        side="both",
        limits="`auto`, `whole`, `per_request`",
    )
    max_pulls: int = setting(2, """pulls running at once (worker threads)""", side="decode", limits="1-64")
    layer_groups: int = setting(
        AUTO_LAYER_GROUPS,
        """GN-HAWK: split each pull into this many layer groups; the prefill transforms group i+1 while
        the decode READs group i (one KVRequest and KVReady per group, one Release); 1 = off;
        ``"auto"``: 2 for a direct-mode pull of >= 84 MiB of tiles, else 1 (measured,
        ``vllm_hawk.kvflow.decode.AUTO_GROUPS_MIN_NBYTES``)""",
        side="decode",
        limits='1-64 or `"auto"`',
        unset="'auto'",
    )
    integrity: bool = setting(
        True,
        """**end-to-end integrity**: the decode asks the prefill for a checksum of every segment it
        sends (``wsum64``, taken on the prefill's device over the bytes as produced) and checks each one
        where it landed (receive buffer, KV pages, vLLM cache) before the request runs; a mismatch is a
        load failure (``kv_load_failure_policy``: recompute or fail), counted in
        ``vllm:hawk_integrity_failures_total``, never served. **Warning:** ``false`` serves whatever
        landed: a bit flipped in flight, a block the prefill freed and reused before the READ, or bytes
        of another dtype reach the answers silently (a warning at every start). Costs one more read of
        the KV on each side, [benchmarks.md](benchmarks.md#integrity)""",
        side="decode",
        limits="`true`, `false`",
    )
    prefill_tp: int = setting(
        0,
        """the prefills' tensor_parallel_size, checked at start-up against this decode's TP (or chips)
        and the model's KV heads, and against each request's ``remote_tp_size``; 0 = any (each pull
        checks its own pairing)""",
        side="decode",
        limits="0-64",
    )
    idle_step_wait_ms: int = setting(
        20,
        """in an engine step that computes nothing (vLLM keeps stepping an engine only to poll the
        connector while it holds KV for a decode or waits for a pull), the worker waits this long for a
        Release or a pull's end, and returns as soon as one comes; 0 = at once. Spinning, a TP=2 prefill
        holding one request used 1.9 of 2 cores and starved its own side channel; a request that
        arrives meanwhile starts at most this much later""",
        side="both",
        limits="0-1000",
    )
    secret_bytes: bytes | None = field(default=None, repr=False, compare=False)  # resolved, not a field

    @property
    def recv_nbytes(self) -> int:
        """The decode's receive buffers, bytes over all banks: ``ring_nbytes``, or
        :data:`DECODE_RECV_NBYTES` under ``"auto"``."""
        return DECODE_RECV_NBYTES if self.ring_nbytes == RING_AUTO else int(self.ring_nbytes)

    def transport_kind_and_options(self) -> tuple[str, dict[str, Any]]:
        """Arguments for :func:`vllm_hawk.transport.make_transport`."""
        if self.transport == "host-staged":
            return "host_staged", {"bind_host": self.transfer_engine_host, "secret": self.secret_bytes}
        protocol = "rdma" if self.transport == "mooncake-rdma" else "tcp"
        return "mooncake", {
            "local_host": self.transfer_engine_host,
            "protocol": protocol,
            "device_name": self.rdma_device,
            "firewall": self.engine_firewall,
            # the kernel's safety net on an admitted decode: its longest hold plus a lease
            "firewall_ttl_s": 0.0 if not self.max_hold_s else self.max_hold_s + self.lease_s + 60.0,
        }


#: Every field the user may set, by name, in declaration order
FIELDS = {f.name: f for f in fields(HawkConfig) if f.name != "secret_bytes"}
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


def _unset(name: str, out: dict) -> Any:
    """The value of field ``name`` when it is not given: its declared ``unset`` expression
    over the fields parsed so far (the same text ``docs/configuration.md`` shows)."""
    expr = FIELDS[name].metadata["unset"]
    # expr is a constant of HawkConfig's declarations, never user input; no builtins but min/max
    return eval(expr, {"__builtins__": {}, "min": min, "max": max}, dict(out))


def port_stride(vllm_config) -> int:
    """Side-channel ports between tensor-parallel ranks: the prefill's TP rank ``r`` of
    data-parallel rank ``d`` listens on ``side_channel_port + d + r * data_parallel_size``."""
    return max(1, int(getattr(vllm_config.parallel_config, "data_parallel_size", 1) or 1))


def parse_config(extra: Mapping[str, Any] | None, *, dp_rank: int = 0, side: str | None = None) -> HawkConfig:
    """Validate ``kv_connector_extra_config`` and return the settings (see module doc).
    ``side``: ``prefill`` or ``decode`` where the caller knows (``None``: checks that need
    it are skipped). Fields are checked in a fixed order, so the first error is always the
    same one."""
    if side not in (None, *SIDES):
        raise ValueError(f"side must be one of {list(SIDES)} or None, got {side!r}")
    extra = dict(extra or {})
    _check_names(extra)
    out: dict[str, Any] = {name: f.default for name, f in FIELDS.items()}
    out.update(_expand_pair(extra, side))
    out.update(extra)
    _check_strategy(out, extra)
    _check_numbers(out, extra, dp_rank)
    _check_layout_fix(out)
    if "pair" not in extra:
        _warn_old_keys(out, extra, side)
    if out["auth"] not in AUTH_MODES:
        raise _err("auth", out["auth"], f"choose one of {list(AUTH_MODES)}")
    _check_integrity(out, side)
    out["secret_bytes"] = _resolve_secret(out)
    return HawkConfig(**out)


def _check_integrity(out: dict, side: str | None) -> None:
    """``integrity`` is a boolean; off on a decode, a warning names what it lets through."""
    if not isinstance(out["integrity"], bool):
        raise _err("integrity", out["integrity"], "expected true or false")
    if not out["integrity"] and side != "prefill":
        logger.warning(
            "kv_connector_extra_config.integrity=false: the KV this decode receives is not checked; a bit flipped "
            "in flight, a block the prefill reused before the READ, or bytes of another dtype reach the answers "
            "silently (docs/configuration.md)"
        )


def _check_names(extra: dict) -> None:
    """Renamed and unknown fields are refused, naming the field to use instead."""
    unknown = sorted(set(extra) - set(FIELDS))
    for old, new in _RENAMED.items():
        if old in extra:
            raise HawkConfigError(f"kv_connector_extra_config.{old} was renamed to {new!r}")
    if unknown:
        raise HawkConfigError(
            f"kv_connector_extra_config has unknown field(s) {unknown}; known fields: {sorted(FIELDS)}"
        )


def _expand_pair(extra: dict, side: str | None) -> dict[str, Any]:
    """The fields ``pair`` implies and ``extra`` does not give; a given one that contradicts
    the pair is refused, naming both."""
    if "pair" not in extra:
        return {}
    pair = extra["pair"]
    if not isinstance(pair, str) or pair not in PAIRS:
        raise _err("pair", pair, f"choose one of {list(PAIRS)}")
    implied: dict[str, Any] = {}
    for name, allowed in PAIRS[pair].items():
        if name not in extra:
            if allowed is TENSTORRENT:
                raise _err("pair", pair, "needs device_profile naming the Tenstorrent device (e.g. 'p150a')")
            implied[name] = allowed[0]
            continue
        given = extra[name]
        if allowed is TENSTORRENT and given == VLLM_PROFILE:
            raise HawkConfigError(
                f"kv_connector_extra_config.pair={pair!r} (a Tenstorrent decode) contradicts "
                f"{name}={given!r}: set device_profile to the decode's Tenstorrent device (e.g. 'p150a')"
            )
        if allowed is not TENSTORRENT and given not in allowed:
            want = repr(allowed[0]) if len(allowed) == 1 else f"one of {list(allowed)}"
            raise HawkConfigError(
                f"kv_connector_extra_config.pair={pair!r} contradicts {name}={given!r}: the pair sets "
                f"{name} to {want}; drop {name} or choose the pair it belongs to"
            )
    if pair == "gn-hawk" and side == "prefill" and "mode" in extra:
        raise HawkConfigError(
            f"kv_connector_extra_config.pair='gn-hawk' contradicts mode={extra['mode']!r} on the prefill: a "
            "GN-HAWK prefill always transforms into its ring; mode picks the decode's landing, set it there only"
        )
    return implied


def pair_of(out: Mapping[str, Any]) -> str | None:
    """The pair that ``transport``, ``mode``, ``device_profile`` and ``layout_fix`` make, or
    None when they make none of :data:`PAIRS`."""
    for pair, implied in PAIRS.items():
        if all(
            out[name] != VLLM_PROFILE if allowed is TENSTORRENT else out[name] in allowed
            for name, allowed in implied.items()
        ):
            return pair
    return None


def _warn_old_keys(out: dict, extra: dict, side: str | None) -> None:
    """Without ``pair``: a warning naming the pair the strategy fields make (and that a
    GN-HAWK prefill ignores ``mode``)."""
    given = [n for n in ("transport", "mode", "device_profile", "layout_fix") if n in extra]
    pair = pair_of(out)
    if not given or pair is None:
        return
    implied = PAIRS[pair]
    ignored = pair == "gn-hawk" and side == "prefill" and "mode" in extra
    replaced = [
        n
        for n in given
        if (n == "mode" and ignored) or (implied.get(n) not in (None, TENSTORRENT) and extra[n] == implied[n][0])
    ]
    text = f"set pair={pair!r} ({PAIR_NAMES[pair]})"
    if replaced:
        text += " instead of " + " + ".join(f"{n}={extra[n]!r}" for n in replaced)
    if kept := [f"{n}={extra[n]!r}" for n in given if n not in replaced]:
        text += ", keeping " + ", ".join(kept)
    if ignored:
        text += "; a GN-HAWK prefill ignores mode (it always transforms into its ring)"
    logger.warning("kv_connector_extra_config: %s", text)


def _check_strategy(out: dict, extra: dict) -> None:
    """transport, mode and the string fields; transfer_engine_host unset: side_channel_host."""
    if out["transport"] not in TRANSPORTS:
        raise _err("transport", out["transport"], f"choose one of {list(TRANSPORTS)}")
    if out["mode"] not in MODES:
        raise _err("mode", out["mode"], f"choose one of {list(MODES)}")
    if out["registration"] not in REGISTRATION_CHOICES:
        raise _err("registration", out["registration"], f"choose one of {list(REGISTRATION_CHOICES)}")
    for name in ("rdma_device", "side_channel_host", "device_profile"):
        if not isinstance(out[name], str):
            raise _err(name, out[name], "expected a string")
    if not out["side_channel_host"]:
        raise _err("side_channel_host", "", "must not be empty")
    if "transfer_engine_host" not in extra:
        out["transfer_engine_host"] = _unset("transfer_engine_host", out)
    if not isinstance(out["transfer_engine_host"], str) or not out["transfer_engine_host"]:
        raise _err("transfer_engine_host", out["transfer_engine_host"], "expected a host name or address")
    if out["rdma_device"] and out["transport"] != "mooncake-rdma":
        raise _err("rdma_device", out["rdma_device"], "only meaningful with transport='mooncake-rdma'")
    if out["engine_firewall"] not in FIREWALL_MODES:
        raise _err("engine_firewall", out["engine_firewall"], f"choose one of {list(FIREWALL_MODES)}")


def _check_numbers(out: dict, extra: dict, dp_rank: int) -> None:
    """Ports, times (s), sizes (bytes) and counts, in place; unset ones from their ``unset``."""
    out["side_channel_port"] = (
        _number("side_channel_port", out["side_channel_port"], integer=True, low=1, high=65535 - dp_rank) + dp_rank
    )
    for name in ("lease_s", "pull_timeout_s", "claim_wait_s", "handshake_timeout_s"):
        out[name] = float(_number(name, out[name], integer=False, low=0.1))

    def value(name: str) -> Any:
        return out[name] if name in extra else _unset(name, out)

    out["renew_interval_s"] = float(
        _number("renew_interval_s", value("renew_interval_s"), integer=False, low=0.01, high=out["lease_s"] / 2)
    )
    out["handover_s"] = float(_number("handover_s", value("handover_s"), integer=False, low=0.1))
    low = max(out["lease_s"], out["handover_s"])
    out["max_hold_s"] = float(_number("max_hold_s", value("max_hold_s"), integer=False, low=low))
    out["layer_groups"] = value("layer_groups")
    if out["ring_nbytes"] != RING_AUTO:
        if isinstance(out["ring_nbytes"], str):
            raise _err("ring_nbytes", out["ring_nbytes"], f"expected a byte count >= {1 << 16} or {RING_AUTO!r}")
        out["ring_nbytes"] = _number("ring_nbytes", out["ring_nbytes"], integer=True, low=1 << 16)
    out["max_pulls"] = _number("max_pulls", out["max_pulls"], integer=True, low=1, high=64)
    if out["layer_groups"] == "auto":
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
        logger.warning("%s %s is readable by every user on this host: chmod o-r it", name, path)
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
