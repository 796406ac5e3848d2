"""Idle-connection floods larger than the target's fd limit (lowered inside the target
process): new legitimate peers are still served within 2 s, and the target's memory
stays within a stated bound.

The attacker holds ``FLOOD`` connections open for the whole test and reopens each one
the target drops (a sustained flood), sending nothing (raw TCP) or, against the side
channel, speaking ZMTP with the NULL mechanism (what any ZMQ socket without the secret
does).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq
from attack_target import SECRET, Target
from security_helpers import RawFlood

from vllm_hawk.protocol import ProtocolClient, make_compat
from vllm_hawk.transport import make_transport

NOFILE = 256  # the target's fd limit (soft and hard)
FLOOD = 400  # connections the attacker keeps open: more than the limit
SERVE_WITHIN_S = 2.0
RSS_BOUND_MIB = 64  # growth of the target's RSS under the flood
COMPAT_ARGS = ("tiny", "bfloat16", 16, "vllm-flash-nhd", "vllm-flash-nhd", "vllm")
SHAPE = (2, 16, 2, 16, 64)


def _serve_time(fn) -> float:
    t0 = time.monotonic()
    fn()
    return time.monotonic() - t0


@pytest.mark.parametrize("zmtp_null", [False, True], ids=["silent", "zmtp-null"])
def test_side_channel_serves_new_decodes_under_an_idle_flood(zmtp_null):
    """auth 'curve' (the default): a connection that does not finish the CURVE handshake
    is dropped after 1 s, so the flood never holds the fds for long."""
    cfg = {
        "what": "prefill",
        "transport": "inprocess",
        "kind": "staged",
        "shape": SHAPE,
        "compat": COMPAT_ARGS,
        "secret": SECRET,
        "auth": "curve",
        "nofile": NOFILE,
    }
    with Target(cfg) as t:
        base = t.stats()
        flood = RawFlood(t.info["endpoint"], FLOOD, zmtp_null)
        try:
            time.sleep(1.5)  # the target is at its fd limit and has dropped a first wave
            compat = make_compat(*COMPAT_ARGS)
            times = []
            for i in range(3):
                with ProtocolClient(t.info["endpoint"], compat, secret=SECRET.encode(), timeout_s=5) as c:
                    times.append(_serve_time(lambda c=c, i=i: (c.handshake(), c.release(f"none-{i}"))))
            under = t.stats()
        finally:
            flood.close()
        print(
            f"side channel under a {FLOOD}-connection flood ({'ZMTP NULL' if zmtp_null else 'silent'}), "
            f"fd limit {NOFILE}: new decode served in {max(times):.2f} s (max of 3); attacker connections "
            f"dropped and reopened {flood.reopened}; target CPU {under['cpu_s'] - base['cpu_s']:.2f} s; RSS "
            f"{base['rss_mib']:.0f} -> {under['rss_mib']:.0f} MiB; refusals {under['refusals']}"
        )
        assert max(times) < SERVE_WITHIN_S, times
        assert flood.reopened > 0  # the target drops what does not authenticate
        assert under["rss_mib"] - base["rss_mib"] < RSS_BOUND_MIB
        assert under["server"]["received"] == 3 * 2  # attacker input never reached our code


def test_host_staged_serves_new_peers_under_an_idle_flood():
    """Unauthenticated connections: at most 32 at once (the oldest is dropped for a new
    one) and 2 s each; a legitimate peer authenticates and reads within 2 s."""
    with Target({"what": "host_staged", "secret": SECRET, "nofile": NOFILE}) as t:
        base = t.stats()
        flood = RawFlood(t.info["transfer"], FLOOD)
        tr = make_transport("host_staged", secret=SECRET.encode())
        dst = np.zeros(1 << 16, dtype=np.uint8)
        tr.register(dst.ctypes.data, dst.nbytes)
        try:
            time.sleep(1.5)
            times = []
            for _ in range(3):
                h = tr.submit("read", t.info["transfer"], [(dst.ctypes.data, t.info["addr"], dst.nbytes)])
                times.append(_serve_time(lambda h=h: tr.wait(h, 10)))
            under = t.stats()
        finally:
            flood.close()
            tr.close()
        want = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)[: dst.nbytes]
        assert np.array_equal(dst, want)
        print(
            f"host-staged under a {FLOOD}-connection flood, fd limit {NOFILE}: first read in {times[0]:.2f} s; "
            f"reopened {flood.reopened}; CPU {under['cpu_s'] - base['cpu_s']:.2f} s; RSS {base['rss_mib']:.0f} -> "
            f"{under['rss_mib']:.0f} MiB; refusals {under['refusals']}"
        )
        assert times[0] < SERVE_WITHIN_S, times
        assert under["rss_mib"] - base["rss_mib"] < RSS_BOUND_MIB


def test_hmac_only_side_channel_is_locked_out_by_null_peers():
    """The evaluation behind the 'curve' default, kept honest: with the HMAC envelope alone
    (NULL ZMTP mechanism), peers without the secret complete the ZMTP handshake and keep
    their connections; once they hold every fd, a new decode is not served. This test
    documents the measurement (it asserts the lockout, so a libzmq that fixes it shows up)."""
    cfg = {
        "what": "prefill",
        "transport": "inprocess",
        "kind": "staged",
        "shape": SHAPE,
        "compat": COMPAT_ARGS,
        "secret": SECRET,
        "auth": "hmac",
        "nofile": NOFILE,
    }
    ctx = zmq.Context()
    with Target(cfg) as t:
        base = t.stats()
        socks = []
        try:
            for _ in range(FLOOD):
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.connect(t.info["endpoint"])
                socks.append(s)
            time.sleep(2.0)
            with ProtocolClient(
                t.info["endpoint"],
                make_compat(*COMPAT_ARGS),
                secret=SECRET.encode(),
                auth="hmac",
                timeout_s=SERVE_WITHIN_S,
            ) as c:
                t0 = time.monotonic()
                try:
                    c.handshake()
                    served = time.monotonic() - t0
                except Exception:  # noqa: BLE001 - ProtocolTimeout expected
                    served = None
            under = t.stats()
        finally:
            for s in socks:
                s.close()
            ctx.term()
        print(
            f"hmac-only side channel, {FLOOD} idle ZMQ peers, fd limit {NOFILE}: new decode "
            f"{f'served in {served:.2f} s' if served is not None else 'NOT served within 2 s'}; target CPU "
            f"{under['cpu_s'] - base['cpu_s']:.2f} s over ~3 s; fds {under['fds']}"
        )
        assert served is None
