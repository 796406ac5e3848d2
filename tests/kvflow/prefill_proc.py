"""A prefill endpoint in its own process (spawn; ``HAWK_TEST_MP_START=fork`` forks instead),
driven over a multiprocessing pipe.

The child builds a seeded :class:`PagedKVCache`, a transport and a
:class:`PrefillEndpoint` with the source ``cfg["kind"]`` (hawk | staged | vllm),
reports ``(protocol endpoint, cache base addr)`` and then
serves commands: ``("add", req_id, src_blocks, num_tokens)``, ``("snapshot",)``,
``("exit",)``. A request id starting with ``die-in-transform`` makes the child exit
abruptly while serving it (a prefill dying mid-flight).
"""

from __future__ import annotations

import multiprocessing as mp
import os
from dataclasses import dataclass

from vllm_hawk.child_process import stop_pipe_process


def _child(cfg: dict, conn) -> None:
    from vllm_hawk.bench.endpoints import source_for
    from vllm_hawk.bench.paged_cache import PagedKVCache
    from vllm_hawk.kvflow import PrefillEndpoint
    from vllm_hawk.protocol import make_compat
    from vllm_hawk.transport import make_transport

    class DyingPrefill(PrefillEndpoint):
        def _serve(self, msg, reply):
            if msg.req_id.startswith("die-in-transform"):
                os._exit(17)
            super()._serve(msg, reply)

    cache = PagedKVCache(*cfg["shape"]).fill_random(cfg["seed"])
    t = make_transport(cfg.get("transport", "mooncake"), **cfg.get("transport_options", {}))
    compat = make_compat(*cfg["compat"])
    kind = cfg.get("kind", "hawk")
    ep = DyingPrefill(
        source_for(cache, kind, compat.device_profile),
        t,
        compat,
        ring_nbytes=cfg.get("ring_nbytes", 2 << 20),
        secret=cfg.get("secret"),
        claim_wait_s=cfg.get("claim_wait_s", 10.0),
    )
    conn.send((ep.endpoint, cache.base_addr))
    try:
        while True:
            cmd = conn.recv()
            if cmd[0] == "add":
                ep.add_request(cmd[1], cmd[2], cmd[3])
                conn.send(None)
            elif cmd[0] == "snapshot":
                conn.send(ep.snapshot())
            else:
                break
    finally:
        ep.close()
        t.close()


@dataclass
class PrefillProcess:
    proc: mp.Process
    conn: object
    endpoint: str
    cache_addr: int

    def add(self, req_id: str, src_blocks, num_tokens: int) -> None:
        self.conn.send(("add", req_id, [int(b) for b in src_blocks], int(num_tokens)))
        self.conn.recv()

    def snapshot(self) -> dict:
        self.conn.send(("snapshot",))
        return self.conn.recv()

    def stop(self) -> None:
        stop_pipe_process(self.proc, self.conn, 10)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(timeout=5)


def start_prefill(cfg: dict, start_timeout_s: float | None = None) -> PrefillProcess:
    """Start the child and wait for its endpoint.

    Under QEMU TCG (the RDMA guest stage) ``import torch`` alone takes about two minutes,
    so that stage sets ``HAWK_TEST_MP_START=fork``: the child inherits the test process's
    imported modules (fork before the parent starts any thread: no transport yet) and
    ``HAWK_TEST_START_TIMEOUT_S`` raises the start timeout."""
    start_timeout_s = start_timeout_s or float(os.environ.get("HAWK_TEST_START_TIMEOUT_S", "60"))
    ctx = mp.get_context(os.environ.get("HAWK_TEST_MP_START", "spawn"))
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_child, args=(cfg, child), daemon=True)
    p.start()
    child.close()
    if not parent.poll(start_timeout_s):
        p.kill()
        p.join(timeout=5)
        raise RuntimeError(f"prefill process did not start within {start_timeout_s} s")
    endpoint, addr = parent.recv()
    return PrefillProcess(p, parent, endpoint, addr)
