"""A transport peer in its own process, driven over a multiprocessing pipe.

The child allocates ``nbytes`` of seeded random bytes, registers them and reports
``(endpoint, addr, nbytes)``; then it answers ``("get", offset, n)`` with the bytes at
that offset (to verify writes) until ``("exit",)``.

Children are spawned; ``HAWK_TEST_MP_START=forkserver`` forks them from one server that
has imported the transport already (the QEMU TCG guest stage, where an interpreter start
and ``import mooncake`` take ten seconds or more).
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import random
from dataclasses import dataclass

from vllm_hawk.child_process import stop_pipe_process


def pattern(seed: int, nbytes: int) -> bytes:
    return random.Random(seed).randbytes(nbytes)


def mp_context():
    """The multiprocessing context for test children: $HAWK_TEST_MP_START, else spawn."""
    method = os.environ.get("HAWK_TEST_MP_START", "spawn")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload([__name__, "vllm_hawk.transport.mooncake", "mooncake.engine"])
    return ctx


def _child(kind: str, options: dict, nbytes: int, seed: int, conn) -> None:
    from vllm_hawk.transport import make_transport

    t = make_transport(kind, **options)
    buf = ctypes.create_string_buffer(pattern(seed, nbytes), nbytes)
    addr = ctypes.addressof(buf)
    t.register(addr, nbytes)
    conn.send((t.endpoint, addr, nbytes))
    try:
        while True:
            cmd = conn.recv()
            if cmd[0] == "get":
                _, off, n = cmd
                conn.send(ctypes.string_at(addr + off, n))
            elif cmd[0] == "submit":  # ("submit", kind, peer, [(off, remote, n)], timeout)
                _, k, peer, rel, timeout = cmd
                h = t.submit(k, peer, [(addr + o, r, n) for o, r, n in rel])
                try:
                    t.wait(h, timeout)
                    conn.send(None)
                except Exception as e:  # noqa: BLE001 - reported to the parent
                    conn.send(repr(e))
            else:
                break
    finally:
        t.close()


@dataclass
class PeerProcess:
    proc: mp.Process
    conn: object
    endpoint: str
    addr: int
    nbytes: int

    def get(self, offset: int, n: int) -> bytes:
        self.conn.send(("get", offset, n))
        return self.conn.recv()

    def stop(self) -> None:
        stop_pipe_process(self.proc, self.conn, 10)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(timeout=5)


def start_peer(
    kind: str, nbytes: int, seed: int, options: dict | None = None, start_timeout_s: float = 60.0
) -> PeerProcess:
    ctx = mp_context()
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_child, args=(kind, options or {}, nbytes, seed, child), daemon=True)
    p.start()
    child.close()
    if not parent.poll(start_timeout_s):
        p.kill()
        raise RuntimeError(f"{kind} peer did not start within {start_timeout_s} s")
    endpoint, addr, n = parent.recv()
    return PeerProcess(p, parent, endpoint, addr, n)
