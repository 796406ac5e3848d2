"""The Mooncake engine's own firewall (vllm_hawk/transport/engine_firewall.py) against a
stranger on the KV network, during a transfer: P (prefill), D (decode, this process) and
S (a stranger with its own Mooncake engine, no secret) on one L2 segment (lan_netns.py).

* while D holds a request (KVReady out, no Release) and while D's READ batches are in
  flight, S can neither READ nor WRITE P's ring range nor D's registered landing buffer:
  its engine never gets through the handshake port (RST), and no byte changes;
* after D's Release, P closes its ports to new connections from D's address; D's next
  request is admitted again and READs over the connection its engine pooled (connections
  an admitted address opened keep working: a reset one would fail that transfer);
* D's READ latency with the firewall against without it (a leading accept rule in the same
  table, toggled within the run): the ratio is printed, and must stay under 1.5;
* without CAP_NET_ADMIN on a namespace with an interface up, the engine refuses to start,
  naming the privilege and the opt-in; the opt-in starts it with a warning.

Needs root, iproute2 and nftables: skips locally without them, fails under CI=true.
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from attack_target import REPO, SECRET, Target
from lan_netns import Lan

from vllm_hawk.bench.endpoints import TTDecode
from vllm_hawk.layout.tt_kv_cache import TTKVCacheSpec
from vllm_hawk.npu.emulated import EmulatedDevice
from vllm_hawk.protocol import KVRequest, ProtocolClient, make_compat
from vllm_hawk.transport.mooncake import MooncakeTransport

pytestmark = pytest.mark.netns

L, BLOCKS, H, BS, D = 2, 16, 2, 32, 64
COMPAT_ARGS = ("tiny", "bfloat16", BS, "vllm-flash-nhd", "tt-paged", "p150a")
COMPAT = make_compat(*COMPAT_ARGS)
KEY = SECRET.encode()
IN_CI = os.environ.get("CI", "").lower() == "true"


@pytest.fixture(scope="module")
def lan():
    why = None
    if os.geteuid() != 0:
        why = "needs root (network namespaces, nftables)"
    elif shutil.which("ip") is None or shutil.which("nft") is None:
        why = "needs iproute2 and nftables (apt-get install nftables)"
    if why:
        if IN_CI:
            pytest.fail(f"engine firewall test cannot run under CI: {why}")
        pytest.skip(why)
    with Lan() as net:
        yield net


def _nft(ns: str, *args: str) -> str:
    out = subprocess.run(["ip", "netns", "exec", ns, "nft", *args], capture_output=True, text=True, check=True)
    return out.stdout


def _on_off_times(ns: str, table: str, pull) -> dict[str, list[float]]:
    """``pull()`` seconds with P's firewall on, and off (a leading accept rule), alternated."""
    times = {"on": [], "off": []}
    for r in range(16):
        for mode in ("on", "off") if r % 2 else ("off", "on"):
            handle = None
            if mode == "off":
                out = _nft(ns, "--echo", "--handle", "insert", "rule", "inet", table, "input", "accept")
                handle = out.rsplit("# handle", 1)[1].split()[0]
            times[mode] += [pull() for _ in range(3)]
            if handle:
                _nft(ns, "delete", "rule", "inet", table, "input", "handle", handle)
    return times


def test_stranger_gets_nothing_while_a_request_is_held_or_in_flight(lan):
    os.environ.setdefault("MC_FORCE_TCP", "1")
    cfg = {
        "what": "prefill",
        "transport": "mooncake",
        "transport_options": {"local_host": lan.p},
        "kind": "hawk",
        "shape": (L, BLOCKS, H, BS, D),
        "seed": 3,
        "compat": COMPAT_ARGS,
        "secret": SECRET,
        "ring_nbytes": 4 << 20,
        "bind": f"tcp://{lan.p}:0",
    }
    dev = EmulatedDevice("p150a", 8 << 20)
    t = MooncakeTransport(lan.d)  # D: the test's namespace, firewalled too (admits no one)
    land = np.zeros(1 << 20, dtype=np.uint8)  # D's landing buffer (a bank receive buffer's role)
    t.register(land.ctypes.data, land.nbytes)
    with (
        Target(cfg, prefix=lan.prefix(lan.ns_p)) as p,
        Target({"what": "stranger", "host": lan.s}, prefix=lan.prefix(lan.ns_s)) as s,
    ):
        desc = TTDecode(
            dev,
            TTKVCacheSpec(L, BLOCKS, H, BS, D, "bfloat16"),
            None,
            p.info["endpoint"],
            COMPAT,
            secret=KEY,
            recv_nbytes_per_bank=0,
            timeout_s=5,
        )
        client = ProtocolClient(p.info["endpoint"], COMPAT, secret=KEY)
        try:
            ack = client.handshake()
            assert p.stats()["admitted"] == []  # a Hello alone admits no one
            p.call(op="add", rid="held", blocks=list(range(1, 9)), tokens=8 * BS)
            ready = client.request_kv(
                KVRequest(req_id="held", dst_layout=desc.desc, num_tokens=8 * BS, dst_block_ids=list(range(8)))
            )
            assert p.stats()["admitted"] == [lan.d]
            peer, ring = ack.transfer_endpoint, ack.export_base_addr + ready.ring_offset
            n = min(ready.total_nbytes, land.nbytes)

            def pull() -> float:
                t0 = time.perf_counter()
                h = t.submit("read", peer, [(land.ctypes.data, ring, n)])
                t.wait(h, 10)
                return time.perf_counter() - t0

            pull()
            first = land[:n].copy()
            assert first.any()

            def probes() -> list[dict]:
                out = []
                for addr in (ring, ring + n // 2):
                    out.append(s.call(op="read", peer=peer, addr=addr))
                    out.append(s.call(op="write", peer=peer, addr=addr))
                for addr in (land.ctypes.data, land.ctypes.data + n // 2):
                    out.append(s.call(op="read", peer=t.endpoint, addr=addr))
                    out.append(s.call(op="write", peer=t.endpoint, addr=addr))
                return out

            # held: KVReady out, no Release
            for r in probes():
                assert r == {"ok": False, "got_bytes": 0}, r
            # in flight: D pulls in a loop while S probes
            stop, pulls = threading.Event(), []

            def loop():
                while not stop.is_set():
                    pulls.append(pull())

            th = threading.Thread(target=loop)
            th.start()
            try:
                t0, during = time.monotonic(), []
                while len(pulls) < 5 and time.monotonic() - t0 < 10:  # probes while batches run
                    during += probes()
                t_probe = time.monotonic() - t0
            finally:
                stop.set()
                th.join()
            assert all(r == {"ok": False, "got_bytes": 0} for r in during), during
            assert len(pulls) >= 5, (pulls, t_probe)  # batches overlapped the probes
            pull()
            assert np.array_equal(land[:n], first)  # no stranger's byte landed, on either side

            # the legitimate pair's latency, firewall on against a leading accept rule (off)
            table = _nft(lan.ns_p, "list", "tables", "inet").split()[-1]
            # the control: with the accept rule in, the stranger reads the held ring
            out = _nft(lan.ns_p, "--echo", "--handle", "insert", "rule", "inet", table, "input", "accept")
            got = s.call(op="read", peer=peer, addr=ring)
            _nft(lan.ns_p, "delete", "rule", "inet", table, "input", "handle", out.rsplit("# handle", 1)[1].split()[0])
            assert got["ok"] and got["got_bytes"] > 0, got
            assert s.call(op="read", peer=peer, addr=ring) == {"ok": False, "got_bytes": 0}
            times = _on_off_times(lan.ns_p, table, pull)
            ratio = statistics.median(times["on"]) / statistics.median(times["off"])
            print(
                f"\nengine firewall: READ of {n} B, median on {statistics.median(times['on']) * 1e3:.2f} ms, "
                f"off {statistics.median(times['off']) * 1e3:.2f} ms, ratio {ratio:.3f} (n={len(times['on'])})"
            )
            assert ratio < 1.5

            # Release: the last lease of D ends, P closes its ports to new connections from D
            client.release("held")
            assert p.stats()["admitted"] == []
            host, port = peer.rsplit(":", 1)
            with pytest.raises(OSError):  # reset at the SYN: refused
                socket.create_connection((host, int(port)), timeout=5).close()
            # D's engine still uses the connection it pooled while admitted: a READ of the
            # released range crosses it (refused: the range is unregistered) ...
            h = t.submit("read", peer, [(land.ctypes.data, ring, n)])
            with pytest.raises(Exception):  # noqa: B017 - the remote range is refused
                t.wait(h, 10)
            # ... and is not reset for it: D's next request is admitted again and its READ
            # runs on that connection (a reset pooled connection fails the next transfer)
            p.call(op="add", rid="next", blocks=list(range(1, 9)), tokens=8 * BS)
            again = client.request_kv(
                KVRequest(req_id="next", dst_layout=desc.desc, num_tokens=8 * BS, dst_block_ids=list(range(8)))
            )
            assert p.stats()["admitted"] == [lan.d]
            h = t.submit("read", peer, [(land.ctypes.data, ack.export_base_addr + again.ring_offset, n)])
            t.wait(h, 10)
            assert np.array_equal(land[:n], first)  # the same blocks, the same bytes
            client.release("next")
        finally:
            client.close()
            desc.close()
            t.close()
            dev.close()


_START = (
    "import logging, sys; logging.basicConfig(level=logging.WARNING)\n"
    "from vllm_hawk.transport.mooncake import MooncakeTransport\n"
    "MooncakeTransport('{host}', firewall=sys.argv[1]).close()\n"
)


@pytest.mark.parametrize("mode", ["require", "open-to-network"])
def test_without_cap_net_admin_the_engine_refuses_or_warns(lan, mode):
    """S has an interface up; the process lacks CAP_NET_ADMIN (setpriv drops it)."""
    argv = [
        *lan.prefix(lan.ns_s),
        "setpriv",
        "--inh-caps=-net_admin",
        "--bounding-set=-net_admin",
        sys.executable,
        "-c",
        _START.format(host=lan.s),
        mode,
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO), MC_FORCE_TCP="1")
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    if mode == "require":
        assert out.returncode != 0
        assert "CAP_NET_ADMIN" in out.stderr and '"engine_firewall": "open-to-network"' in out.stderr, out.stderr
        assert "host-staged" in out.stderr
    else:
        assert out.returncode == 0, out.stderr
        assert "WARNING" in out.stderr and "reachable by anyone" in out.stderr, out.stderr
    assert _nft(lan.ns_s, "list", "tables").strip() == ""  # no table left behind
