"""Before/after measurements of the side-channel and transport hardening, one script for both checkouts.

Run the same command against the code before the security work and after it::

    PYTHONPATH=/path/to/old/checkout python scripts/security_before_after.py --label before all
    PYTHONPATH=/path/to/new/checkout python scripts/security_before_after.py --label after all

Each measurement mounts the attack of the review against real components in their own
processes (a child of this script: ``target``), the way tests/security does: Mooncake
directly, raw sockets on the host-staged port, ZMQ on the side channel, HTTP at the proxy.
Where the old code's API differs (no ``auth``, no recipient in the envelope, no host-staged
secret, ``Proxy(timeout_s=)`` instead of ``Limits``) the script adapts; ``api`` in the
output says which API it found. Results: one JSON object per measurement, printed and
written to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import hmac
import inspect
import json
import logging
import os
import resource
import socket
import struct
import subprocess
import sys
import threading
import time

os.environ.setdefault("MC_FORCE_TCP", "1")
SECRET = "before-after-shared-secret-0123456789"
KEY = SECRET.encode()
L, BLOCKS, H, BS, D = 2, 16, 2, 32, 64
SHAPE = (L, BLOCKS, H, BS, D)
COMPAT_ARGS = ("tiny", "bfloat16", BS, "vllm-flash-nhd", "tt-paged", "p150a")


def _new_api() -> bool:
    from vllm_hawk.kvflow.prefill import PrefillEndpoint

    return "auth" in inspect.signature(PrefillEndpoint.__init__).parameters


# ----------------------------------------------------------------------------- child process
_STATUS = open("/proc/self/status", "rb")  # noqa: SIM115 - opened now: under an fd flood open() fails


def _status(key: str) -> float:
    _STATUS.seek(0)
    for line in _STATUS.read().decode().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


class _Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.n = 0

    def emit(self, record) -> None:
        self.n += 1


def _child(cfg: dict) -> None:
    """The ``target`` process: sets up ``cfg["what"]`` (a prefill endpoint, a host-staged
    transport or the proxy), prints its addresses as one JSON line, then answers one JSON
    command per stdin line until ``exit`` or end of input."""
    if cfg.get("nofile"):
        n = int(cfg["nofile"])
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))
    counter = _Count()
    logging.getLogger().addHandler(counter)
    logging.getLogger().setLevel(logging.WARNING)
    secret = cfg["secret"].encode() if cfg.get("secret") else None
    new = _new_api()
    ep = t = None
    out: dict = {}
    # memory: the cache or buffer the transport serves by address, held until this process ends
    if cfg["what"] == "prefill":
        ep, t, out, memory = _prefill_target(cfg, secret, new)
    elif cfg["what"] == "host_staged":
        t, out, memory = _host_staged_target(secret, new)
    elif cfg["what"] == "proxy":
        _proxy_child(cfg, counter)
        return
    print(json.dumps(out), flush=True)
    for line in sys.stdin:
        reply = _child_reply(ep, json.loads(line), counter)
        if reply is None:
            break
        print(json.dumps(reply), flush=True)
    if ep is not None:
        ep.close()
    t.close()
    del memory


def _prefill_target(cfg: dict, secret: bytes | None, new: bool) -> tuple:
    """A prefill endpoint over a random paged cache (:data:`SHAPE`): (endpoint, transport,
    its addresses and the cache's address and size in bytes, the cache)."""
    from vllm_hawk.protocol import make_compat
    from vllm_hawk.testing.endpoints import prefill_endpoint
    from vllm_hawk.testing.paged_cache import PagedKVCache
    from vllm_hawk.transport import make_transport

    cache = PagedKVCache(*SHAPE).fill_random(cfg.get("seed", 3))
    opts = {"secret": secret} if cfg["transport"] == "host_staged" and new else {}
    t = make_transport(cfg["transport"], **opts)
    kw = {"auth": cfg["auth"]} if new and cfg.get("auth") else {}
    ep = prefill_endpoint(
        cache,
        t,
        make_compat(*COMPAT_ARGS),
        cfg.get("kind", "staged"),
        ring_nbytes=4 << 20,
        secret=secret,
        lease_s=cfg.get("lease_s", 60.0),
        **kw,
    )
    out = {"endpoint": ep.endpoint, "transfer": t.endpoint, "cache_addr": cache.base_addr, "cache_nbytes": cache.nbytes}
    return ep, t, out, cache


def _host_staged_target(secret: bytes | None, new: bool) -> tuple:
    """A host-staged transport (64 connections at most) with 1 MiB of random bytes
    registered: (transport, its address and the buffer's address and size in bytes, the buffer)."""
    import numpy as np

    from vllm_hawk.transport import make_transport

    opts = {"secret": secret} if new else {}
    t = make_transport("host_staged", max_connections=64, **opts)
    buf = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)
    t.register(buf.ctypes.data, buf.nbytes)
    return t, {"transfer": t.endpoint, "addr": buf.ctypes.data, "nbytes": buf.nbytes}, buf


def _child_reply(ep, cmd: dict, counter: _Count) -> dict | None:
    """The reply to one command of the ``target`` process; None for ``exit`` (or any other op)."""
    op = cmd["op"]
    if op == "add":
        ep.add_request(cmd["rid"], cmd["blocks"], cmd["tokens"])
        return {}
    if op == "addtime":
        return _add_latency(ep, cmd["prefix"], cmd["n"])
    if op == "stats":
        return _child_stats(ep, counter)
    return None


def _add_latency(ep, prefix: str, n: int) -> dict:
    """Engine-side latency of ``n`` hand-overs of a finished one-block prefill (each takes
    the endpoint's lock): median, 99th percentile and largest, in ms."""
    lat = []
    for i in range(n):
        t0 = time.perf_counter()
        ep.add_request(f"{prefix}-{i}", [1], BS)
        lat.append(time.perf_counter() - t0)
    lat.sort()
    return {"median_ms": lat[len(lat) // 2] * 1e3, "p99_ms": lat[int(len(lat) * 0.99)] * 1e3, "max_ms": lat[-1] * 1e3}


def _child_stats(ep, counter: _Count) -> dict:
    """This process's CPU seconds, RSS and peak RSS (MiB), open fds (-1: unreadable),
    warnings logged, and the endpoint's snapshot if there is one."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    try:
        fds = len(os.listdir("/proc/self/fd"))
    except OSError:
        fds = -1
    reply = {
        "cpu_s": ru.ru_utime + ru.ru_stime,
        "rss_mib": _status("VmRSS"),
        "hwm_mib": _status("VmHWM"),
        "fds": fds,
        "warnings_logged": counter.n,
    }
    if ep is not None:
        reply["snapshot"] = ep.snapshot()
    return reply


class Target:
    def __init__(self, cfg: dict) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "target", json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=dict(os.environ),
        )
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"target {cfg} did not start (exit {self.proc.wait()})")
        self.info = json.loads(line)

    def call(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def stats(self) -> dict:
        return self.call(op="stats")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"op": "exit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(5)

    def __enter__(self) -> Target:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _prefill(kind="staged", transport="inprocess", secret=SECRET, **kw) -> Target:
    return Target({"what": "prefill", "kind": kind, "transport": transport, "secret": secret, **kw})


def _compat():
    from vllm_hawk.protocol import make_compat

    return make_compat(*COMPAT_ARGS)


def _client(ep: str, secret=KEY, auth=None, **kw):
    from vllm_hawk.protocol import ProtocolClient

    if _new_api() and auth is not None:
        kw["auth"] = auth
    return ProtocolClient(ep, _compat(), secret=secret, **kw)


def _tt_decode(ep: str, transport, secret=KEY, recv=256 << 10, auth=None):
    from vllm_hawk.layout.tt_kv_cache import TTKVCacheSpec
    from vllm_hawk.npu.emulated import EmulatedDevice
    from vllm_hawk.testing.endpoints import TTDecode

    dev = EmulatedDevice("p150a", 8 << 20)
    kw = {"auth": auth} if auth and _new_api() else {}
    return dev, TTDecode(
        dev,
        TTKVCacheSpec(L, BLOCKS, H, BS, D, "bfloat16"),
        transport,
        ep,
        _compat(),
        secret=secret,
        recv_nbytes_per_bank=recv,
        timeout_s=20,
        **kw,
    )


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:400]


# ----------------------------------------------------------------------------- 1. data plane
class MooncakeAttacker:
    def __init__(self) -> None:
        import torch
        from mooncake.engine import TransferEngine

        self.engine = TransferEngine()
        assert self.engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        self.buf = torch.zeros(1 << 16, dtype=torch.uint8)
        self.addr = self.buf.data_ptr()
        assert self.engine.register_memory(self.addr, self.buf.numel()) == 0

    def read(self, peer: str, remote: int, n: int) -> bytes | None:
        self.buf.zero_()
        if self.engine.transfer_sync_read(peer, self.addr, remote, n) != 0:
            return None
        return self.buf[:n].numpy().tobytes()

    def write(self, peer: str, remote: int, n: int = 4096) -> bool:
        self.buf.fill_(0xAB)
        return self.engine.transfer_sync_write(peer, self.addr, remote, n) == 0

    def first_buffer(self, peer: str) -> int:
        try:
            v = int(self.engine.get_first_buffer_address(peer))
        except Exception:  # noqa: BLE001
            return 0
        return 0 if v in (2**64 - 1, -1) else v


def m_mooncake(kind: str) -> dict:
    """An idle prefill (after one legitimate transfer) and its decode, both with the secret
    set: what a Mooncake engine without the secret can read and write."""

    from vllm_hawk.testing.paged_cache import PagedKVCache
    from vllm_hawk.transport import make_transport

    att = MooncakeAttacker()
    t = make_transport("mooncake")
    want = PagedKVCache(*SHAPE).fill_random(3).flat.numpy().tobytes()  # the target's cache bytes (same seed)
    res: dict = {"measure": f"mooncake attacker vs {kind} prefill + TT decode (secret set)", "kind": kind}
    with _prefill(kind, transport="mooncake") as p:
        peer = p.info["transfer"]
        dev, dec = _tt_decode(p.info["endpoint"], t)
        try:
            if kind == "hawk":  # one staged and one direct transfer: the decode's pools were used by both
                p.call(op="add", rid="r1", blocks=[1, 2], tokens=2 * BS)
                dec.fetch("r1", 2 * BS, [3, 4], "staged")
                p.call(op="add", rid="r0", blocks=[7], tokens=BS)
                dec.fetch("r0", BS, [8], "direct")
                p.call(op="add", rid="r1b", blocks=[1, 2], tokens=2 * BS)
                dec.fetch("r1b", 2 * BS, [3, 4], "staged")  # the ring's last content: r1's blocks
            base = att.first_buffer(peer)
            res["first_buffer_address_learned"] = bool(base)
            # READ: the whole prefill cache (GG-Direct's export) in 64 KiB pieces, and 4 MiB from the ring base
            got, exact = 0, 0
            ca, cn = p.info["cache_addr"], p.info["cache_nbytes"]
            for off in range(0, cn, 1 << 16):
                n = min(1 << 16, cn - off)
                b = att.read(peer, ca + off, n)
                if b is not None:
                    got += n
                    exact += sum(x == y for x, y in zip(want[off : off + n], b, strict=False))
            res["cache_bytes_read"] = got
            res["cache_bytes_read_equal_to_kv"] = exact
            ring_got, ring_nonzero = 0, 0
            if base and base != ca:
                for off in range(0, 4 << 20, 1 << 16):
                    b = att.read(peer, base + off, 1 << 16)
                    if b is not None:
                        ring_got += len(b)
                        ring_nonzero += len(b) - b.count(0)
            res["ring_bytes_read"] = ring_got
            res["ring_bytes_read_nonzero"] = ring_nonzero
            targets = {"prefill ring base": base, "prefill cache": ca}
            writes = {k: att.write(peer, v) for k, v in targets.items() if v}
            dtargets = {}
            if dec.pool is not None:
                dtargets["decode receive pool bank 0"] = dec.pool.bank_addrs[0]
            dtargets["decode KV pool (bank 0)"] = dev.bank_address(0) + dec.bufs[0].address
            for k, v in dtargets.items():
                writes[k] = att.write(t.endpoint, v)
            res["writes_accepted"] = sum(writes.values())
            res["writes_tried"] = len(writes)
            res["writes"] = writes
            # the legitimate pair still serves
            if kind == "hawk":
                p.call(op="add", rid="r2", blocks=[5], tokens=BS)
                t0 = time.monotonic()
                dec.fetch("r2", BS, [6], "direct")
                res["legit_fetch_after_s"] = round(time.monotonic() - t0, 3)
        finally:
            dec.close()
            t.close()
            dev.close()
    return res


def _hs_talk(host: str, port: int, payload: bytes, wait_s: float = 3.0) -> tuple[bytes, float]:
    t0 = time.monotonic()
    s = socket.create_connection((host, port), timeout=wait_s)
    out = b""
    try:
        s.sendall(payload)
        while True:
            chunk = s.recv(1 << 20)
            if not chunk:
                break
            out += chunk
            if len(out) >= 16 + 4096 and wait_s < 3.1:
                pass
    except (TimeoutError, ConnectionError, OSError):
        pass
    finally:
        s.close()
    return out, time.monotonic() - t0


_REQ = struct.Struct("<4sB3xQQ")


def _hs_hello(key: bytes | None) -> bytes:
    ts, nonce = int(time.time() * 1000), os.urandom(32)
    if key is None:
        return struct.pack("<4sB3xQ32s32s", b"HKHA", 0, ts, nonce, bytes(32))
    from vllm_hawk.security import derive_key

    k = derive_key(key, "host-staged")
    mac = hmac.new(k, b"c" + ts.to_bytes(8, "little") + nonce, hashlib.sha256).digest()
    return struct.pack("<4sB3xQ32s32s", b"HKHA", 1, ts, nonce, mac)


def m_host_staged_raw() -> dict:
    """Raw socket, no secret: READ 4 KiB of registered memory, WRITE 4 KiB, and probe 16
    addresses (8 inside, 8 outside) to see whether replies tell valid from invalid."""
    new = _new_api()
    res: dict = {"measure": "host-staged raw socket without the secret"}
    with Target({"what": "host_staged", "secret": SECRET}) as t:
        host, port = t.info["transfer"].rsplit(":", 1)
        port = int(port)
        addr = t.info["addr"]
        pre = _hs_hello(None) if new else b""  # the new protocol: a hello without the secret first
        out, took = _hs_talk(host, port, _REQ.pack(b"HKHS", 1, addr, 4096))
        res["read_no_hello"] = {
            "reply_bytes": len(out),
            "status": out[0] if out else None,
            "closed_after_s": round(took, 2),
        }
        if new:
            out, took = _hs_talk(host, port, pre + _REQ.pack(b"HKHS", 1, addr, 4096))
            res["read_with_hello_no_secret"] = {"reply_bytes": len(out), "status": out[0] if out else None}
        res["kv_bytes_read"] = (
            max(0, len(out) - 16)
            if (out and out[0] == 0 and len(out) > 40)
            else (4096 if len(out) == 16 + 4096 and out[0] == 0 else 0)
        )
        wout, _ = _hs_talk(host, port, pre + _REQ.pack(b"HKHS", 2, addr, 4096) + b"\xab" * 4096)
        res["write_accepted"] = bool(len(wout) == 16 and wout[0] == 0) or bool(len(wout) == 56 and wout[40] == 0)
        probes = [addr + i * 4096 for i in range(8)] + [addr - (i + 1) * 4096 for i in range(8)]
        replies = set()
        for a in probes:
            o, _ = _hs_talk(host, port, pre + _REQ.pack(b"HKHS", 1, a, 16), wait_s=2.5)
            replies.add(o[: 16 if not new else 41].hex()[:20] if o else "closed")
        res["probe_distinct_replies"] = len(replies)
        res["probe_replies"] = sorted(replies)
    return res


# ----------------------------------------------------------------------------- 2. default config
def m_default_release() -> dict:
    from vllm_hawk.connector.config import parse_config

    res: dict = {"measure": "default config: stranger releases another decode's request"}
    try:
        cfg = parse_config({})
        secret = cfg.secret_bytes
        res["default_config"] = f"starts; secret={'set' if secret else 'none'}"
    except Exception as e:  # noqa: BLE001
        res["default_config"] = "refused at start: " + _err(e)
        secret = None
    runs = [("default", secret)] if res["default_config"].startswith("starts") else []
    runs.append(("secret set, stranger holds the secret", KEY))
    for name, sec in runs:
        with _prefill("hawk", secret=sec.decode() if sec else None) as p:
            ep = p.info["endpoint"]
            p.call(op="add", rid="owned", blocks=[1], tokens=BS)
            dev, layout_src = _tt_decode(ep, None, secret=sec, recv=0)
            try:
                from vllm_hawk.protocol import KVRequest

                a, b = _client(ep, secret=sec, timeout_s=30), _client(ep, secret=sec, timeout_s=30)
                a.handshake(), b.handshake()
                a.request_kv(KVRequest(req_id="owned", dst_layout=layout_src.desc, num_tokens=BS, dst_block_ids=[2]))
                before = p.stats()["snapshot"].get("ring_live")
                try:
                    b.release("owned")
                    ack = "acknowledged"
                except Exception as e:  # noqa: BLE001
                    ack = "refused: " + _err(e)
                after = p.stats()["snapshot"].get("ring_live")
                res[name] = {"stranger_release": ack, "ring_live_before": before, "ring_live_after": after}
                with contextlib.suppress(Exception):
                    a.release("owned")
                a.close(), b.close()
            finally:
                layout_src.close()
                dev.close()
        if sec is None:  # no-secret stranger vs a secret-holding prefill is the next run's other half
            continue
    with _prefill("hawk") as p:  # a stranger WITHOUT the secret against a prefill with one
        try:
            c = _client(p.info["endpoint"], secret=None, timeout_s=3)
            c.handshake()
            try:
                c.release("anything")
                res["no_secret_stranger"] = "release acknowledged"
            except Exception as e:  # noqa: BLE001
                res["no_secret_stranger"] = "release refused: " + _err(e)
        except Exception as e:  # noqa: BLE001
            res["no_secret_stranger"] = "handshake refused: " + _err(e)
    return res


# ----------------------------------------------------------------------------- 3. idle floods
def _raise_own_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def m_zmq_flood(nofile=256, flood=400, settle_s=3.0) -> dict:
    """``flood`` ZMQ DEALERs without the secret (what any ZMQ peer does; libzmq reconnects
    when dropped) at a prefill whose fd limit is ``nofile``; a new decode's handshake."""
    import zmq

    _raise_own_nofile()
    res: dict = {"measure": f"{flood} idle ZMQ peers, prefill RLIMIT_NOFILE={nofile}"}
    ctx = zmq.Context()
    with _prefill(nofile=nofile) as p:
        base = p.stats()
        socks = []
        try:
            for _ in range(flood):
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.connect(p.info["endpoint"])
                socks.append(s)
            t_flood = time.monotonic()
            time.sleep(settle_s)
            times = []
            for _ in range(3):
                c = _client(p.info["endpoint"], timeout_s=10)
                t0 = time.monotonic()
                try:
                    c.handshake()
                    times.append(round(time.monotonic() - t0, 3))
                except Exception as e:  # noqa: BLE001
                    times.append("not served in 10 s: " + _err(e)[:80])
                c.close()
            under = p.stats()
            res["flood_s"] = round(time.monotonic() - t_flood, 1)
        finally:
            for s in socks:
                s.close()
            ctx.term()
        res["new_decode_handshake_s"] = times
        res["prefill_cpu_s"] = round(under["cpu_s"] - base["cpu_s"], 2)
        res["prefill_cores"] = round(res["prefill_cpu_s"] / res["flood_s"], 2)
        res["prefill_fds"] = under["fds"]
        res["rss_mib"] = [round(base["rss_mib"]), round(under["rss_mib"])]
    return res


def m_hs_flood(n=80, nofile=256) -> dict:
    """``n`` idle raw TCP connections (sending nothing) at the host-staged port, then a
    legitimate keyed peer reads 64 KiB."""
    import numpy as np

    from vllm_hawk.transport import make_transport

    new = _new_api()
    res: dict = {"measure": f"host-staged port, {n} idle raw connections (max_connections 64), fd limit {nofile}"}
    with Target({"what": "host_staged", "secret": SECRET, "nofile": nofile}) as t:
        host, port = t.info["transfer"].rsplit(":", 1)
        socks = []
        for _ in range(n):
            s = socket.socket()
            s.settimeout(2)
            with contextlib.suppress(OSError):
                s.connect((host, int(port)))
            socks.append(s)
        time.sleep(1.0)
        tr = make_transport("host_staged", **({"secret": KEY} if new else {}))
        dst = np.zeros(1 << 16, dtype=np.uint8)
        tr.register(dst.ctypes.data, dst.nbytes)
        try:
            times = []
            for _ in range(3):
                h = tr.submit("read", t.info["transfer"], [(dst.ctypes.data, t.info["addr"], dst.nbytes)])
                t0 = time.monotonic()
                try:
                    tr.wait(h, 10)
                    times.append(round(time.monotonic() - t0, 3))
                except Exception as e:  # noqa: BLE001
                    times.append("failed: " + _err(e)[:120])
        finally:
            tr.close()
            for s in socks:
                s.close()
        res["legit_read_s"] = times
        res["served"] = all(isinstance(x, float) for x in times)
    return res


# ----------------------------------------------------------------------------- 4. tables
def m_unknown_releases(n=200_000, cap_s=75.0) -> dict:
    """Releases for unknown ids from a peer with the secret, as fast as one client can;
    RSS and the engine-side hand-over latency (add_request, under the endpoint lock)."""
    res: dict = {"measure": f"Releases for unknown ids (target {n}, cap {cap_s:.0f} s)"}
    with _prefill() as p:
        base = p.stats()
        lat0 = p.call(op="addtime", n=500, prefix="a")
        c = _client(p.info["endpoint"], timeout_s=5)
        c.handshake()
        acked = refused = 0
        t0 = time.monotonic()
        sent = 0
        for i in range(n):
            try:
                c.release(f"unknown-{i}")
                acked += 1
            except Exception:  # noqa: BLE001
                refused += 1
            sent += 1
            if time.monotonic() - t0 > cap_s:
                break
        took = time.monotonic() - t0
        after = p.stats()
        lat1 = p.call(op="addtime", n=500, prefix="b")
        c.close()
        res.update(
            sent=sent,
            acked=acked,
            refused=refused,
            send_s=round(took, 1),
            rss_growth_mib=round(after["rss_mib"] - base["rss_mib"], 1),
            early_release_table=after["snapshot"].get("early_release"),
            handover_median_ms=[round(lat0["median_ms"], 4), round(lat1["median_ms"], 4)],
            handover_p99_ms=[round(lat0["p99_ms"], 4), round(lat1["p99_ms"], 4)],
            warnings_logged=after["warnings_logged"] - base["warnings_logged"],
        )
    return res


def _raw_dealer(endpoint: str):
    import zmq

    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 0)
    s.connect(endpoint)
    return s


def _pack(env, msg, recipient: str):
    if _new_api():
        return env.pack(msg, recipient=recipient)[1]
    return env.pack(msg)[1]


def m_big_kvrequests(count=480, ids=65536) -> dict:
    """KVRequests for unknown ids with ``ids`` block ids each from a peer with the secret
    (HMAC envelope, raw DEALER so they are not waited on); the prefill's RSS."""
    import random

    from vllm_hawk.protocol import Envelope, KVRequest

    res: dict = {"measure": f"{count} KVRequests for unknown ids x {ids} block ids"}
    with _prefill(auth="hmac") as p:
        ep = p.info["endpoint"]
        dev, dec = _tt_decode(ep, None, recv=0, auth="hmac")
        server_id = getattr(dec.ep.hello, "server_id", "")
        base = p.stats()
        env = Envelope("big-requester", KEY)
        raw = _raw_dealer(ep)
        rng = random.Random(1)
        wire = 0
        replies = {}
        from vllm_hawk.protocol import Hello, compat_hash

        raw.send_multipart(
            _pack(
                env, Hello(compat=_compat(), compat_hash=compat_hash(_compat()), client_id="big-requester"), server_id
            )
        )
        res["hello_answered"] = bool(raw.poll(5000)) and bool(raw.recv_multipart())
        block_ids = list(range(ids))
        rng.shuffle(block_ids)
        try:
            for i in range(count):
                msg = KVRequest(req_id=f"ghost-{i}", dst_layout=dec.desc, num_tokens=BS, dst_block_ids=block_ids)
                frames = _pack(env, msg, server_id)
                wire += sum(len(f) for f in frames)
                raw.send_multipart(frames)
            deadline = time.monotonic() + 8
            peak = p.stats()
            while time.monotonic() < deadline:
                while raw.poll(10):
                    r = raw.recv_multipart()
                    try:
                        import msgspec

                        body = msgspec.msgpack.decode(r[-2] if len(r) >= 2 else r[-1])
                        k = body.get("code") or body.get("type") if isinstance(body, dict) else "?"
                    except Exception:  # noqa: BLE001
                        k = "?"
                    replies[str(k)] = replies.get(str(k), 0) + 1
                s = p.stats()
                if s["rss_mib"] > peak["rss_mib"]:
                    peak = s
                time.sleep(0.2)
            after = p.stats()
        finally:
            raw.close()
            dec.close()
            dev.close()
        res.update(
            wire_mib=round(wire / 2**20, 1),
            rss_base_mib=round(base["rss_mib"]),
            rss_peak_growth_mib=round(peak["rss_mib"] - base["rss_mib"]),
            hwm_growth_mib=round(after["hwm_mib"] - base["hwm_mib"]),
            rss_after_8s_growth_mib=round(after["rss_mib"] - base["rss_mib"]),
            replies=replies,
        )
    return res


def m_hs_big_write() -> dict:
    """A refused 64 MiB WRITE (address outside every registered region) at the host-staged
    port; the server's peak RSS. After: sent by a peer that holds the secret (an
    unauthenticated one never gets this far)."""
    new = _new_api()
    res: dict = {"measure": "refused 64 MiB host-staged WRITE: server peak RSS"}
    with Target({"what": "host_staged", "secret": SECRET}) as t:
        host, port = t.info["transfer"].rsplit(":", 1)
        base = t.stats()
        s = socket.create_connection((host, int(port)), timeout=10)
        pre = _hs_hello(KEY) if new else b""
        n = 64 << 20
        s.sendall(pre + _REQ.pack(b"HKHS", 2, 0x1000, n))
        sent_payload = 0
        chunk = b"\xab" * (1 << 20)
        try:
            s.settimeout(5)
            for _ in range(64):
                s.sendall(chunk)
                sent_payload += len(chunk)
        except OSError as e:
            res["payload_send_stopped"] = _err(e)[:100]
        try:
            s.settimeout(3)
            reply = s.recv(128)
        except OSError:
            reply = b""
        s.close()
        time.sleep(0.5)
        after = t.stats()
        res.update(
            payload_sent_mib=sent_payload >> 20,
            reply_hex=reply.hex()[:100],
            hwm_growth_mib=round(after["hwm_mib"] - base["hwm_mib"], 1),
            rss_growth_mib=round(after["rss_mib"] - base["rss_mib"], 1),
        )
    return res


# ----------------------------------------------------------------------------- 5. proxy
class _Upstream:
    """The proxy's fake prefill and decode servers. ``state``: ``prefill_delay_s`` (seconds
    before the prefill answers), ``mode`` of a streamed decode (``ok``: an empty stream,
    ``slow_ok``: a chunk every 0.25 s for 6 s, ``endless``: 64 KiB chunks until the client
    goes) and ``events``: (name, ``time.monotonic`` seconds) of each stream's start, end or
    release."""

    def __init__(self) -> None:
        self.state = {"prefill_delay_s": 0.0, "mode": "ok", "events": []}

    async def prefill(self, request):
        from aiohttp import web

        await request.read()
        await asyncio.sleep(self.state["prefill_delay_s"])
        return web.json_response({"choices": [{"text": "p"}], "kv_transfer_params": {"remote_engine_id": "p"}})

    async def decode(self, request):
        from aiohttp import web

        body = await request.json()
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "d"}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        # each event goes to the list current at that moment: a ``set`` of ``events`` starts a new one
        self.state["events"].append(("start", time.monotonic()))
        try:
            await self._stream(resp)
            self.state["events"].append(("done", time.monotonic()))
            return resp
        except (asyncio.CancelledError, ConnectionError):
            self.state["events"].append(("released", time.monotonic()))
            raise

    async def _stream(self, resp) -> None:
        """The stream's body in the current ``mode``."""
        if self.state["mode"] == "slow_ok":  # a long, healthy stream: a chunk every 0.25 s for 6 s
            for _ in range(24):
                await resp.write(b'data: {"choices": [{"text": "a"}]}\n\n')
                await asyncio.sleep(0.25)
            await resp.write(b"data: [DONE]\n\n")
        elif self.state["mode"] == "endless":
            chunk = b"data: " + b"x" * 65536 + b"\n\n"
            while True:
                await resp.write(chunk)


async def _start_proxy(up_srv: _Upstream, ps, new: bool, budget: float | None) -> tuple[int, str]:
    """Serve ``up_srv`` and a proxy in front of it on loopback; (the proxy's port, the
    upstream's base URL). ``budget`` (seconds) bounds the first byte and each idle gap of a
    stream (``timeout_s`` on the API without ``Limits``); None: the proxy's defaults."""
    from aiohttp import web

    app = web.Application()
    app.router.add_post("/p/v1/completions", up_srv.prefill)
    app.router.add_post("/d/v1/completions", up_srv.decode)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    up = f"http://127.0.0.1:{runner.addresses[0][1]}"
    if new:
        lim = ps.Limits(first_byte_s=budget, idle_s=budget) if budget else ps.Limits()
        proxy = ps.Proxy([up + "/p"], [up + "/d"], limits=lim)
    else:
        proxy = ps.Proxy([up + "/p"], [up + "/d"], **({"timeout_s": budget} if budget else {}))
    r = await ps.serve(proxy, "127.0.0.1", 0)
    return r.addresses[0][1], up


def _proxy_child(cfg: dict, counter) -> None:
    """The ``target`` process for the proxy: the proxy and its fake upstream on an event
    loop thread; then one JSON command per stdin line (``set`` the upstream's state,
    ``stats``) until ``exit``."""
    import vllm_hawk.proxy.server as ps

    new = hasattr(ps, "Limits")
    up_srv = _Upstream()
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    port, up = asyncio.run_coroutine_threadsafe(_start_proxy(up_srv, ps, new, cfg.get("budget_s")), loop).result(20)
    print(json.dumps({"port": port, "upstream": up, "api": "Limits" if new else "timeout_s"}), flush=True)
    for line in sys.stdin:
        reply = _proxy_reply(up_srv.state, json.loads(line), counter)
        if reply is None:
            break
        print(json.dumps(reply), flush=True)


def _proxy_reply(state: dict, cmd: dict, counter) -> dict | None:
    """The reply to one proxy command; None for ``exit`` (or any other op). ``stats``: RSS
    and peak RSS (MiB), the upstream's events (seconds since ``t0`` when given), warnings
    logged and ``time.monotonic`` now."""
    if cmd["op"] == "set":
        state.update(cmd["state"])
        if "events" in cmd["state"]:
            state["events"] = []
        return {}
    if cmd["op"] == "stats":
        return {
            "rss_mib": _status("VmRSS"),
            "hwm_mib": _status("VmHWM"),
            "events": [(k, round(t - cmd.get("t0", 0), 2)) for k, t in state["events"]]
            if "t0" in cmd
            else state["events"],
            "warnings_logged": counter.n,
            "now": time.monotonic(),
        }
    return None


def _post(port: int, body: bytes, timeout_s: float, read: bool = True) -> tuple[bytes, float]:
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    t0 = time.monotonic()
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body
    )
    out = b""
    try:
        while read:
            c = s.recv(1 << 16)
            if not c:
                break
            out += c
    except (TimeoutError, OSError):
        out += b"<client timeout>"
    s.close()
    return out, time.monotonic() - t0


def m_proxy(stream_only: bool = False) -> dict:
    res: dict = {"measure": "proxy (fake upstreams)"}
    if stream_only:
        return m_proxy_budget(res, 3.0, stream_only=True)
    with Target({"what": "proxy"}) as p:  # default settings
        port = p.info["port"]
        res["api"] = p.info["api"]
        base = p.stats()
        body = b'{"model": "m", "prompt": [' + b"[]," * (50_000_000 // 3) + b'[]], "max_tokens": 1}'
        out, took = _post(port, body, 60)
        after = p.stats()
        res["json_50mb"] = {
            "status": out[:12].decode(errors="replace"),
            "s": round(took, 2),
            "hwm_growth_mib": round(after["hwm_mib"] - base["hwm_mib"]),
        }
        # a never-reading client of an endless stream: when is the decode stream released?
        p.call(op="set", state={"mode": "endless", "events": []})
        s = socket.create_connection(("127.0.0.1", port))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        b = json.dumps({"model": "m", "prompt": "x", "max_tokens": 5, "stream": True}).encode()
        t0 = time.monotonic()
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(b) + b
        )
        released = None
        st = p.stats()
        while time.monotonic() - t0 < 45:
            time.sleep(0.5)
            st = p.stats()
            ev = [e for e in st["events"] if e[0] == "released"]
            if ev:
                released = round(ev[0][1] - (st["now"] - (time.monotonic() - t0)), 1)
                break
        s.close()
        res["never_reading_client"] = (
            f"upstream released after {released} s" if released is not None else "upstream still held after 45 s"
        )
    return m_proxy_budget(res, 3.0)


def m_proxy_budget(res: dict, budget: float, stream_only: bool = False) -> dict:
    """The same budget on both: the old total timeout, the new first-byte and idle timeouts."""
    with Target({"what": "proxy", "budget_s": budget}) as p:
        port = p.info["port"]
        p.call(op="set", state={"prefill_delay_s": 1e6})
        out, took = _post(port, json.dumps({"model": "m", "prompt": "x", "max_tokens": 5}).encode(), 30)
        res[f"hung_prefill_budget_{budget:.0f}s"] = {"s": round(took, 2), "reply": out[:12].decode(errors="replace")}
        p.call(op="set", state={"prefill_delay_s": 0.0, "mode": "slow_ok"})
        out, took = _post(port, json.dumps({"model": "m", "prompt": "x", "max_tokens": 5, "stream": True}).encode(), 30)
        txt = out.decode(errors="replace")
        res[f"healthy_6s_stream_budget_{budget:.0f}s"] = {
            "s": round(took, 2),
            "chunks": txt.count('"text": "a"'),
            "done": "[DONE]" in txt,
            "error_event": '"error"' in txt,
            "tail": txt[-240:],
        }
    if stream_only:
        return res
    with Target({"what": "proxy"}) as p:
        p.call(op="set", state={"prefill_delay_s": 1e6})
        out, took = _post(p.info["port"], json.dumps({"model": "m", "prompt": "x", "max_tokens": 5}).encode(), 20)
        res["hung_prefill_defaults"] = f"{'no reply within 20 s' if took >= 19.5 else round(took, 2)}"
    return res


class PartialHeaderFlood:
    """``n`` clients that send half a request's headers and hold the connection; each one
    the server drops is reopened (a sustained flood)."""

    def __init__(self, port: int, n: int) -> None:
        import selectors

        self.port, self.sel, self.reopened = port, selectors.DefaultSelector(), 0
        self.stop = threading.Event()
        for _ in range(n):
            self._open()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _open(self) -> None:
        s = socket.socket()
        s.settimeout(1)
        try:
            s.connect(("127.0.0.1", self.port))
            s.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        except OSError:
            pass
        s.setblocking(False)
        import selectors

        self.sel.register(s, selectors.EVENT_READ)

    def _run(self) -> None:
        while not self.stop.is_set():
            for key, _ in self.sel.select(0.05):
                try:
                    data = key.fileobj.recv(4096)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if not data:
                    self.sel.unregister(key.fileobj)
                    key.fileobj.close()
                    self.reopened += 1
                    self._open()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        for key in list(self.sel.get_map().values()):
            key.fileobj.close()


def m_proxy_flood(n: int = 400, nofile: int = 256) -> dict:
    """``n`` partial-header clients at ``python -m vllm_hawk.proxy`` (default settings) whose
    fd limit is ``nofile``; the fake upstreams run in another process. A legitimate
    request's time."""
    _raise_own_nofile()
    res: dict = {"measure": f"proxy, {n} partial-header clients, proxy RLIMIT_NOFILE={nofile}"}
    with Target({"what": "proxy"}) as up:  # the fake upstreams (their own process)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        u = up.info["upstream"]
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_hawk.proxy", "--prefill", u + "/p", "--decode", u + "/d", "--port", str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile)),
        )
        assert "hawk proxy on" in proc.stdout.readline()
        base = _pid_rss(proc.pid)
        flood = PartialHeaderFlood(port, n)
        try:
            time.sleep(2.0)
            times = []
            for _ in range(3):
                try:
                    out, took = _post(port, json.dumps({"model": "m", "prompt": "x", "max_tokens": 5}).encode(), 15)
                    times.append(f"{out[:12].decode(errors='replace')} in {took:.2f} s")
                except OSError as e:
                    times.append("connect failed: " + _err(e)[:80])
            after = _pid_rss(proc.pid)
        finally:
            flood.close()
            proc.terminate()
            proc.wait(10)
        res.update(
            legit_requests=times, flood_dropped_and_reopened=flood.reopened, proxy_rss_mib=[round(base), round(after)]
        )
    return res


def _pid_rss(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


# ----------------------------------------------------------------------------- 6. low
def m_low() -> dict:
    import msgspec

    from vllm_hawk.protocol import Envelope, Hello, compat_hash, make_compat

    res: dict = {"measure": "low-severity findings"}
    new = _new_api()
    with _prefill(auth="hmac") as a, _prefill(auth="hmac") as b:
        # 6a: a refused handshake (another model), peer holds the secret
        from vllm_hawk.protocol import ProtocolClient

        bad = make_compat("other-model", *COMPAT_ARGS[1:])
        kw = {"auth": "hmac"} if new else {}
        with ProtocolClient(a.info["endpoint"], bad, secret=KEY, timeout_s=3, **kw) as c:
            try:
                c.handshake()
                res["refused_handshake"] = "accepted?"
            except Exception as e:  # noqa: BLE001
                res["refused_handshake"] = _err(e)
        with ProtocolClient(a.info["endpoint"], bad, secret=None, timeout_s=3) as c:
            try:
                c.handshake()
                res["refused_handshake_no_secret"] = "accepted?"
            except Exception as e:  # noqa: BLE001
                res["refused_handshake_no_secret"] = _err(e)
        # 6b: a signed Hello meant for prefill A, replayed at prefill B (same secret)
        ca = _client(a.info["endpoint"], auth="hmac")
        hello_a = ca.handshake()
        server_a = getattr(hello_a, "server_id", "")
        ca.close()
        env = Envelope("decode-x", KEY)
        frames = _pack(env, Hello(compat=_compat(), compat_hash=compat_hash(_compat()), client_id="decode-x"), server_a)
        for name, tgt in (("at A (intended)", a), ("replayed at B", b)):
            raw = _raw_dealer(tgt.info["endpoint"])
            raw.send_multipart(frames)
            if raw.poll(2000):
                r = raw.recv_multipart()
                try:
                    body = msgspec.msgpack.decode(r[2]) if len(r) == 4 else msgspec.msgpack.decode(r[-1])
                    kind = body.get("type") if isinstance(body, dict) else str(body)[:40]
                    if isinstance(body, dict) and body.get("code"):
                        kind += f" ({body['code']})"
                except Exception:  # noqa: BLE001
                    kind = "undecodable reply"
            else:
                kind = "no reply (dropped)"
            res[f"hello {name}"] = kind
            raw.close()
        # 6c: log lines for N rejected messages: garbage frames, and Hellos signed with a wrong key
        n = 2000
        forger = Envelope("forger", b"w" * 32)
        for kind in ("garbage", "forged_signature"):
            base = a.stats()["warnings_logged"]
            raw = _raw_dealer(a.info["endpoint"])
            for i in range(n):
                if kind == "garbage":
                    raw.send_multipart([b"HAWK", b"junk-%d" % i, b"x", b""])
                else:
                    raw.send_multipart(
                        _pack(
                            forger,
                            Hello(compat=_compat(), compat_hash=compat_hash(_compat()), client_id="forger"),
                            server_a,
                        )
                    )
            time.sleep(3)
            raw.close()
            res[f"warning_lines_for_{n}_{kind}"] = a.stats()["warnings_logged"] - base
    return res


def m_low_nosecret() -> dict:
    """The prefill without a secret (old default; new: explicit ``auth: none``): what a
    refused handshake discloses to an unauthenticated peer whose every field differs, and
    the WARNING lines logged for 2,000 rejected messages of each kind."""
    from vllm_hawk.protocol import Envelope, Hello, ProtocolClient, compat_hash, make_compat

    res: dict = {"measure": "no-secret prefill: disclosure and log lines"}
    with _prefill(secret=None, auth="none") as a:
        ep = a.info["endpoint"]
        bad = make_compat("other-model", "float32", 64, "other-src", "other-dst", "n300")
        with ProtocolClient(ep, bad, secret=None, timeout_s=3, **({"auth": "none"} if _new_api() else {})) as c:
            try:
                c.handshake()
                res["refused_handshake"] = "accepted?"
            except Exception as e:  # noqa: BLE001
                res["refused_handshake"] = _err(e)
        n = 2000
        for kind in ("garbage", "incompatible_hello"):
            base = a.stats()["warnings_logged"]
            raw = _raw_dealer(ep)
            env = Envelope("noisy-peer", None)
            for i in range(n):
                if kind == "garbage":
                    raw.send_multipart([b"HAWK", b"junk-%d" % i, b"x", b""])
                else:
                    raw.send_multipart(
                        _pack(env, Hello(compat=bad, compat_hash=compat_hash(bad), client_id="noisy-peer"), "")
                    )
            time.sleep(3)
            raw.close()
            res[f"warning_lines_for_{n}_{kind}"] = a.stats()["warnings_logged"] - base
    return res


MEASURES = {
    "mooncake_hawk": lambda: m_mooncake("hawk"),
    "mooncake_gg_direct": lambda: m_mooncake("vllm"),
    "host_staged_raw": m_host_staged_raw,
    "default_release": m_default_release,
    "zmq_flood": m_zmq_flood,
    "hs_flood": m_hs_flood,
    "unknown_releases": m_unknown_releases,
    "big_kvrequests": m_big_kvrequests,
    "hs_big_write": m_hs_big_write,
    "proxy": m_proxy,
    "low": m_low,
    "proxy_stream": lambda: m_proxy(stream_only=True),
    "low_nosecret": m_low_nosecret,
    "proxy_flood": m_proxy_flood,
    "proxy_flood_1024": lambda: m_proxy_flood(1100, 1024),
}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "target":
        _child(json.loads(sys.argv[2]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label", required=True)
    ap.add_argument("--out", default="")
    ap.add_argument("measures", nargs="+", help=f"'all' or any of {list(MEASURES)}")
    a = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    names = list(MEASURES) if a.measures == ["all"] else a.measures
    out = {}
    import vllm_hawk

    for name in names:
        t0 = time.monotonic()
        try:
            r = MEASURES[name]()
        except Exception as e:  # noqa: BLE001 - report and go on
            r = {"error": _err(e)}
        r["took_s"] = round(time.monotonic() - t0, 1)
        r["code"] = os.path.dirname(os.path.dirname(vllm_hawk.__file__))
        out[name] = r
        print(json.dumps({a.label: {name: r}}), flush=True)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
