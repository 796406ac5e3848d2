"""Runs INSIDE the QEMU guest with rxe0 (soft-RoCE on eth0) up, under the project's venv
Python. Sub-commands print ``CASE <name> PASS|FAIL <detail>`` lines (and ``RESULT`` lines
with figures) for the host test (test_rdma_guest.py):

    bench N_MIB REPS      MooncakeTransport rdma: WRITE then READ N MiB, REPS times, between
                          two processes; bytes verified; rxe packet counters must move
    protocols             which protocol each configuration really uses, by the counters
    dmabuf_mr             pyverbs DmaBufMR over a udmabuf on rxe0: the documented refusal
    all N_MIB REPS        the three above in one process (one interpreter start under TCG)
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import random
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "transport"))  # peer.py
from peer import mp_context, start_peer  # noqa: E402

IP = os.environ.get("HAWK_GUEST_IP", "10.0.2.15")
# The guest is a VM of its own whose engines reach only each other: no firewall table (its
# bare rootfs has no nftables); this stage checks verbs and the wire, not admission
# (tests/security/test_engine_firewall.py does, in network namespaces).
RDMA = {"protocol": "rdma", "device_name": "rxe0", "local_host": IP, "firewall": "open-to-network"}
CNT = Path("/sys/class/infiniband/rxe0/ports/1/hw_counters")
MiB = 1 << 20
FAILED: list[str] = []


def counters() -> dict[str, int]:
    return {k: int((CNT / k).read_text()) for k in ("sent_pkts", "rcvd_pkts")}


def delta(before: dict[str, int]) -> dict[str, int]:
    now = counters()
    return {k: now[k] - before[k] for k in now}


def report(name: str, ok: bool, detail: str) -> None:
    if not ok:
        FAILED.append(name)
    print(f"CASE {name} {'PASS' if ok else 'FAIL'} {detail}", flush=True)


def run_case(name: str, fn, *args) -> None:
    try:
        report(name, True, fn(*args) or "")
    except Exception as e:  # noqa: BLE001 - reported
        tb = " / ".join(traceback.format_exc().strip().splitlines()[-4:])
        report(name, False, f"{type(e).__name__}: {e} | {tb}")


# ------------------------------------------------------------------------------- bench
def bench(nmib: int, reps: int) -> str:
    from vllm_hawk.transport import make_transport

    n = nmib * MiB
    peer = start_peer("mooncake", n, 99, RDMA)
    t = make_transport("mooncake", **RDMA)
    buf = ctypes.create_string_buffer(n)
    base = ctypes.addressof(buf)
    t.register(base, n)
    entry = 4 * MiB
    try:
        c0 = counters()
        reads, writes = [], []
        for rep in range(reps):
            src = random.Random(rep).randbytes(n)
            ctypes.memmove(base, src, n)
            entries = [(base + o, peer.addr + o, min(entry, n - o)) for o in range(0, n, entry)]
            t0 = time.monotonic()
            t.wait(t.submit("write", peer.endpoint, entries), timeout_s=120)
            writes.append(n / (time.monotonic() - t0) / 1e6)
            assert peer.get(0, n) == src, "WRITE: the peer holds other bytes"
            ctypes.memset(base, 0, n)
            t0 = time.monotonic()
            t.wait(t.submit("read", peer.endpoint, entries), timeout_s=120)
            reads.append(n / (time.monotonic() - t0) / 1e6)
            assert ctypes.string_at(base, n) == src, "READ: other bytes came back"
        d = delta(c0)
        # every byte travelled as RoCE packets (MTU <= 4 KiB): at least n/4096 per direction
        need = 2 * reps * n // 4096
        assert d["sent_pkts"] >= need and d["rcvd_pkts"] >= need, (d, need)
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        res = {
            "mib": nmib,
            "reps": reps,
            "write_MBps": [round(x, 1) for x in writes],
            "read_MBps": [round(x, 1) for x in reads],
            "write_median_MBps": round(med(writes), 1),
            "read_median_MBps": round(med(reads), 1),
            "rxe_pkts": d,
        }
        print(f"RESULT bench {json.dumps(res)}", flush=True)
        return (
            f"{reps} x {nmib} MiB WRITE median {res['write_median_MBps']} MB/s, READ median "
            f"{res['read_median_MBps']} MB/s, bytes verified, rxe {d}"
        )
    finally:
        t.close()
        peer.stop()


# --------------------------------------------------------------------------- protocols
def _raw_engine(protocol: str, conn) -> None:
    """A bare TransferEngine (not our transport): register 8 MiB, report, serve until told."""
    from mooncake.engine import TransferEngine

    e = TransferEngine()
    rc = e.initialize(IP, "P2PHANDSHAKE", protocol, "")
    buf = ctypes.create_string_buffer(8 * MiB)
    e.register_memory(ctypes.addressof(buf), 8 * MiB)
    conn.send((rc, f"{IP}:{e.get_rpc_port()}", ctypes.addressof(buf)))
    cmd = conn.recv()
    if cmd[0] == "write":
        _, peer, remote = cmd
        rc = e.transfer_sync_write(peer, ctypes.addressof(buf), remote, 8 * MiB)
        conn.send(rc)
        conn.recv()


def _raw_pair(protocol: str, force_tcp: str | None) -> tuple[int, dict[str, int]]:
    """Two bare engines in two processes, one 8 MiB write; returns (rc, rxe counter delta)."""
    ctx = mp_context()
    old = os.environ.pop("MC_FORCE_TCP", None)
    if force_tcp is not None:
        os.environ["MC_FORCE_TCP"] = force_tcp
    procs = []
    try:
        ends = []
        for _ in range(2):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_raw_engine, args=(protocol, b), daemon=True)
            p.start()
            procs.append(p)
            ends.append(a)
        info = [e.recv() for e in ends]
        assert info[0][0] == 0 and info[1][0] == 0, f"initialize: {info}"
        c0 = counters()
        ends[0].send(("write", info[1][1], info[1][2]))
        rc = ends[0].recv()
        d = delta(c0)
        for e in ends:
            with contextlib.suppress(OSError):
                e.send(("exit",))
        return rc, d
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        os.environ.pop("MC_FORCE_TCP", None)
        if old is not None:
            os.environ["MC_FORCE_TCP"] = old


def _ours(protocol: str, conn, tcp_first: bool = False) -> None:
    from vllm_hawk.transport import make_transport
    from vllm_hawk.transport.mooncake import MooncakeTransport

    if tcp_first:  # a TCP engine earlier in the same process must not turn this one into TCP
        make_transport("mooncake", **dict(RDMA, protocol="tcp")).close()
    opts = dict(RDMA, protocol=protocol)
    t = make_transport("mooncake", **opts)
    assert isinstance(t, MooncakeTransport)
    buf = ctypes.create_string_buffer(8 * MiB)
    t.register(ctypes.addressof(buf), 8 * MiB)
    conn.send((t.endpoint, ctypes.addressof(buf), t.effective_protocol))
    cmd = conn.recv()
    if cmd[0] == "write":
        t.wait(t.submit("write", cmd[1], [(ctypes.addressof(buf), cmd[2], 8 * MiB)]), 60)
        conn.send(0)
        conn.recv()
    t.close()


def _ours_pair(protocol: str, tcp_first: bool = False) -> tuple[str, dict[str, int]]:
    ctx = mp_context()
    ends, procs = [], []
    try:
        for _ in range(2):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_ours, args=(protocol, b, tcp_first), daemon=True)
            p.start()
            procs.append(p)
            ends.append(a)
        info = [e.recv() for e in ends]
        c0 = counters()
        ends[0].send(("write", info[1][0], info[1][1]))
        assert ends[0].recv() == 0
        d = delta(c0)
        for e in ends:
            e.send(("exit",))
        return info[0][2], d
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def protocols() -> None:
    pk = 8 * MiB // 4096  # packets 8 MiB needs at least, over RoCE

    # 1. the engine alone, protocol "tcp", nothing forced: does it use the HCA it finds?
    def raw_tcp():
        rc, d = _raw_pair("tcp", None)
        used = "rdma" if d["sent_pkts"] >= pk else "tcp"
        print(f"RESULT raw_tcp_unforced {json.dumps({'rc': rc, 'rxe_pkts': d, 'used': used})}", flush=True)
        assert rc == 0, rc
        return f"engine protocol='tcp' without MC_FORCE_TCP: used {used} (rxe {d})"

    run_case("engine_tcp_unforced", raw_tcp)

    # 2. our transport: what it says it uses must be what the counters show
    # (rdma alone is subsumed by rdma after a tcp engine in the same process; MC_FORCE_TCP
    # by our tcp case, which sets it)
    for proto, tcp_first in (("tcp", False), ("rdma", True)):

        def ours(proto=proto, tcp_first=tcp_first):
            said, d = _ours_pair(proto, tcp_first)
            used = "rdma" if d["sent_pkts"] >= pk else "tcp"
            assert said == proto == used, f"asked {proto}, transport says {said}, counters show {used} ({d})"
            return f"MooncakeTransport(protocol={proto!r}) says {said}, counters agree (rxe {d})"

        run_case(f"transport_{proto}_really_{proto}" + ("_after_a_tcp_engine" if tcp_first else ""), ours)


# ---------------------------------------------------------------------------- dma-buf MR
def dmabuf_mr() -> str:
    sys.path.insert(0, str(HERE))
    from kmod_guest import Buf  # udmabuf over a memfd
    from pyverbs.device import Context
    from pyverbs.pd import PD

    from vllm_hawk.npu.tt_kmd import registration as reg

    buf = Buf("shmem", 4 * MiB)

    class Mapping:  # the fields register_bank_dmabuf_mr reads from a BankMapping
        bank, dmabuf_fd, nbytes, dmabuf_offset = 0, buf.fd, 4 * MiB, 0

    with Context(name="rxe0") as ctx, PD(ctx) as pd:
        try:
            mr = reg.register_bank_dmabuf_mr(pd, Mapping(), device_name="rxe0")
            mr.close()
            raise AssertionError("rxe0 registered a dma-buf MR: update docs/qemu-guest.md and the doctor")
        except reg.DmaBufMRUnsupported as e:
            assert e.errno == errno.EOPNOTSUPP == 95, e
            assert "rxe0" in str(e) and "soft-RoCE" in str(e), e
            msg = str(e)
    print(f"RESULT dmabuf_mr {json.dumps({'errno': 95, 'message': msg})}", flush=True)
    return f"DmaBufMR on rxe0 -> errno 95 (EOPNOTSUPP): {msg[:120]}"


def main(argv: list[str]) -> int:
    cmd = argv[0]
    if cmd == "bench":
        run_case("rdma_bench", bench, int(argv[1]), int(argv[2]))
    elif cmd == "protocols":
        protocols()
    elif cmd == "dmabuf_mr":
        run_case("dmabuf_mr_refused", dmabuf_mr)
    elif cmd == "all":
        for name, fn in (
            ("rdma_bench", lambda: bench(int(argv[1]), int(argv[2]))),
            ("protocols", protocols),
            ("dmabuf_mr_refused", dmabuf_mr),
        ):
            t0 = time.monotonic()
            if name == "protocols":
                fn()
            else:
                run_case(name, fn)
            print(f"TIME {name} {time.monotonic() - t0:.1f}", flush=True)
    else:
        raise SystemExit(f"unknown sub-command {cmd}")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
