"""Mooncake Transfer Engine transport (RDMA on hardware, TCP here).

The engine is started with ``initialize(local_host, "P2PHANDSHAKE", protocol,
device_name)`` (no metadata server); peers are named ``host:rpc_port``.

Why the calls are used the way they are (checked on Mooncake 0.3.13.post1, see
docs/mooncake.md in the repository):

* The engine's blocking calls (``batch_transfer_sync_*`` and
  ``get_batch_transfer_status``) spin a core until done; the only non-spinning status
  query, ``transfer_check_status(batch_id)``, looks at the FIRST entry of a batch and
  frees the batch when that entry ends. So every entry is submitted as its own
  one-entry async batch and polled with ``transfer_check_status``, by one thread per
  peer that sleeps between polls.
* Opening a peer that accepts the connection but never answers blocks the submitting
  call for ~60 s (handshake read timeout). Submission therefore happens on that
  per-peer thread, never on the caller's; ``wait`` enforces the caller's deadline.
* A TCP peer queues at most ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`` (default 1024)
  transfers plus ``MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER`` (1024) waiting ones; more
  are rejected at once ("lane queue-full"). We raise both defaults before the engine
  starts and keep at most ``max_inflight`` entries per peer in flight, so batches of
  any size work.
* The target refuses remote ranges outside its registered memory (the entry fails,
  nothing is written). Local ranges are checked here, as RDMA would require.
* ``protocol`` alone does not choose the wire: the engine goes by ``MC_FORCE_TCP`` (set, to
  any value, means TCP). We set it for ``"tcp"`` only while ``initialize`` runs and restore
  the environment after, so a later ``"rdma"`` engine in the same process is not silently
  turned into TCP; a ``MC_FORCE_TCP`` the user exported is honoured and logged.
  :attr:`MooncakeTransport.effective_protocol` says what the engine really uses; in the
  QEMU guest stage the soft-RoCE packet counters check it (tests/guest).
* Every registration names its memory's location (``register_memory``'s third argument,
  a key of the engine's NIC topology): ``cuda:N`` for a GPU's memory, so the NIC reads it
  with GPUDirect RDMA and the engine prefers the NICs next to that GPU; host memory goes
  as ``*``, for which the engine looks up the pages' NUMA node itself (its topology names
  host memory ``cpu:<numa node>``, so a bare ``cpu`` would match no NIC).
* Device memory (:mod:`vllm_hawk.transport.mooncake_cuda`): which wheel is installed says
  nothing reliable (``mooncake-transfer-engine`` is cu12, ``-cuda13`` cu13, ``-non-cuda``
  none, all one ``mooncake`` package), and ``register_memory`` over TCP accepts any
  address in every build. So the engine is asked: ``mooncake.engine.SUPPORT_CUDA``
  (its ``USE_CUDA`` compile flag), then one 4 KiB loopback READ from the device into
  host memory through this engine, compared byte for byte.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm_hawk.transport.base import (
    HOST,
    Entry,
    Kind,
    RegionError,
    RegionTable,
    TransferHandle,
    TransferState,
    TransportError,
    begin_transfer,
    check_location,
    closed_transfer,
    wait_handle,
)
from vllm_hawk.transport.engine_firewall import REQUIRE, listening_ports, open_firewall
from vllm_hawk.transport.mooncake_cuda import CudaReach, install_hint

logger = logging.getLogger(__name__)

#: Environment defaults applied (only where unset) before the engine starts.
ENV_DEFAULTS = {
    "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER": "8192",
    "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "8192",
    # TCP connections per peer (Mooncake's default 1). `hawk bench entries`, 2 cores, each
    # setting twice in one run: 1,280 x 8 KiB READs 36-37 us per entry with 1 lane, 28-33
    # with 2, 20-22 with 4, 20-24 with 8; 8 x 11 MiB (a staged bfloat8_b pull's shape)
    # 25-29 ms with 1, 25-27 with 4, 25-33 with 8. 4 is the most lanes that never slowed
    # the large entries (the staged transfer bench was slower with 8 in 2 runs of 2).
    "MC_TCP_LANES_PER_PEER": "4",
}
#: Longest sleep between polls of in-flight entries: a batch of a few large entries finishes
#: up to one sleep after its last byte. `hawk bench entries`, 4 lanes, two runs: 4 x 40 MiB
#: 45.8-50.3 ms with 0.2 ms against 51.0-61.5 with 2 ms; 1,280 x 8 KiB 22.0-26.5 us per entry
#: against 21.9-30.6 (docs/mooncake.md).
POLL_MAX_S = 200e-6
_BAD_BATCH_IDS = (0, 2**64 - 1, -1)  # the binding returns 0 or (uint64)-1 on failure


def engine_location(location: str) -> str:
    """``register_memory``'s location for ours: ``*`` for host memory (the engine finds its
    NUMA node), the device name as it is (``cuda:0``)."""
    return "*" if location == HOST else location


@dataclass(eq=False)
class _Job:
    handle: TransferHandle
    read: bool
    entries: Sequence[Entry]
    next_entry: int = 0
    inflight: int = 0
    failed_entries: int = 0
    aborted: bool = False  # stop submitting (failure, or transport closing)

    @property
    def submitted_all(self) -> bool:
        return self.aborted or self.next_entry >= len(self.entries)


@dataclass(eq=False)
class _PeerWorker:
    peer: str
    jobs: queue.Queue = field(default_factory=queue.Queue)
    thread: threading.Thread | None = None


class MooncakeTransport:
    """Transport over Mooncake Transfer Engine.

    local_host: address peers use to reach us (``endpoint`` = ``local_host:rpc_port``).
    protocol: "tcp" (forces TCP via MC_FORCE_TCP) or "rdma"; device_name: HCA filter for
    RDMA, e.g. "mlx5_0" ("" = all). max_inflight: engine entries in flight per peer.
    poll_min_s / poll_max_s: the polling thread's sleep range (seconds).
    firewall: ``require`` (the engine's ports admit only loopback and the peers a prefill
    :meth:`~vllm_hawk.transport.engine_firewall.EngineFirewall.admit`, see
    :mod:`~vllm_hawk.transport.engine_firewall`; refused without ``CAP_NET_ADMIN`` where
    another interface is up) or ``open-to-network`` (no firewall, a warning); ``firewall_ttl_s``:
    the kernel timeout of an admitted peer. :attr:`firewall` is the table (None: none).
    """

    def __init__(
        self,
        local_host: str = "127.0.0.1",
        protocol: str = "tcp",
        device_name: str = "",
        *,
        max_inflight: int = 512,
        poll_min_s: float = 50e-6,
        poll_max_s: float = POLL_MAX_S,
        firewall: str = REQUIRE,
        firewall_ttl_s: float = 3600.0,
    ) -> None:
        if protocol not in ("tcp", "rdma"):
            raise ValueError(f"protocol must be 'tcp' or 'rdma', got {protocol!r}")
        for k, v in ENV_DEFAULTS.items():
            os.environ.setdefault(k, v)
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise TransportError(
                f"Mooncake is not importable ({e}): pip install {install_hint()}; it needs "
                "libibverbs1, libnuma1 and libcurl4 even for TCP"
            ) from e
        self._engine = TransferEngine()
        with _START_LOCK:  # one engine starts at a time: the new listeners are its own
            before = listening_ports()
            rc, self.effective_protocol = _initialize(self._engine, local_host, protocol, device_name)
            new_ports = listening_ports() - before
        if rc != 0:
            raise TransportError(
                f"Mooncake initialize({local_host!r}, P2PHANDSHAKE, {protocol!r}, {device_name!r}) returned {rc}"
            )
        rpc_port = self._engine.get_rpc_port()
        self._endpoint = f"{local_host}:{rpc_port}"
        #: the engine's listening TCP ports: the handshake (RPC) port and, over TCP, the data port
        self.ports = engine_ports(rpc_port, new_ports)
        try:
            self.firewall = open_firewall(self.ports, firewall, self._endpoint, ttl_s=firewall_ttl_s)
        except TransportError:
            self._engine = None  # the engine's ports close with it
            raise
        if self.effective_protocol != protocol:
            logger.warning(
                "Mooncake engine %s: protocol %r requested but MC_FORCE_TCP=%r is set in "
                "the environment: the engine uses TCP",
                self._endpoint,
                protocol,
                os.environ.get("MC_FORCE_TCP"),
            )
        else:
            logger.info(
                "Mooncake engine %s uses %s%s",
                self._endpoint,
                self.effective_protocol,
                f" (device {device_name or 'any'})" if protocol == "rdma" else "",
            )
        self._regions = RegionTable()
        self._cuda = CudaReach(self)
        self._max_inflight = max(1, max_inflight)
        self._poll_min = poll_min_s
        self._poll_max = poll_max_s
        self._lock = threading.Lock()
        self._workers: dict[str, _PeerWorker] = {}
        self._closed = threading.Event()

    # ---------------------------------------------------------------- interface
    @property
    def endpoint(self) -> str:
        return self._endpoint

    def accepts_memory(self, location: str) -> bool:
        """Host memory always; ``cuda:N`` where this engine was seen to reach that GPU
        (decided on the first question about it, see :class:`CudaReach`)."""
        return location == HOST or (location.startswith("cuda:") and self._cuda.reason(location) is None)

    def register(self, addr: int, nbytes: int, location: str = HOST) -> None:
        why = (
            self._cuda.reason(location) or ""
            if location.startswith("cuda:")
            else "it registers host memory ('cpu') and CUDA device memory ('cuda:N') only"
        )
        check_location(self, location, "Mooncake", why)
        self._register(addr, nbytes, location)

    def _register(self, addr: int, nbytes: int, location: str) -> None:
        """``register`` without the location check (the CUDA probe registers through it)."""
        self._regions.add(addr, nbytes)
        where = engine_location(location)
        rc = self._engine.register_memory(addr, nbytes, where)
        if rc != 0:
            self._regions.remove(addr)
            raise RegionError(f"Mooncake register_memory({addr:#x}, {nbytes}, {where!r}) returned {rc}")

    def unregister(self, addr: int) -> None:
        self._regions.remove(addr)
        rc = self._engine.unregister_memory(addr)
        if rc != 0:
            logger.warning("Mooncake unregister_memory(%#x) returned %d", addr, rc)

    def submit(self, kind: Kind, peer: str, entries: Sequence[Entry]) -> TransferHandle:
        h = begin_transfer(self._regions, kind, peer, entries)
        if self._closed.is_set():
            return closed_transfer(h)
        self._worker(peer).jobs.put(_Job(h, kind == "read", list(entries)))
        return h

    def poll(self, handle: TransferHandle) -> TransferState:
        return handle.state

    def wait(self, handle: TransferHandle, timeout_s: float) -> None:
        wait_handle(handle, timeout_s)

    def close(self) -> None:
        """Stop the peer threads and unregister memory.

        A thread stuck inside an engine call (a peer that never answers blocks ~60 s)
        keeps the engine object alive so that the call never touches freed state.
        """
        if self._closed.is_set():
            return
        self._closed.set()
        with self._lock:
            workers = list(self._workers.values())
        for w in workers:
            w.jobs.put(None)
        stuck = False
        for w in workers:
            if w.thread is not None:
                w.thread.join(timeout=2.0)
                stuck = stuck or w.thread.is_alive()
        for addr, _n in self._regions.regions():
            with contextlib.suppress(Exception):  # best effort at shutdown
                self.unregister(addr)
        if stuck:
            logger.warning(
                "Mooncake transport closed with a peer thread still blocked in the engine; keeping the engine alive"
            )
            _LEAKED.append(self._engine)
        self._engine = None
        if self.firewall is not None:
            self.firewall.close()
            self.firewall = None

    # ---------------------------------------------------------------- peer threads
    def _worker(self, peer: str) -> _PeerWorker:
        with self._lock:
            w = self._workers.get(peer)
            if w is None:
                w = _PeerWorker(peer)
                w.thread = threading.Thread(
                    target=self._peer_loop, args=(w,), daemon=True, name=f"hawk-mooncake-{peer}"
                )
                self._workers[peer] = w
                w.thread.start()
            return w

    def _peer_loop(self, w: _PeerWorker) -> None:
        """One peer's entries: submit while the window has room, poll in submission order,
        back off from ``poll_min`` to ``poll_max`` while nothing moves. The engine is
        taken once: close() drops ``self._engine`` while a stuck thread may still run."""
        engine = self._engine
        active: collections.deque[_Job] = collections.deque()  # jobs still submitting
        inflight: collections.deque[tuple[int, _Job]] = collections.deque()
        sleep_s = self._poll_min
        stopping = False
        while True:
            stopping = self._take_jobs(w, active, stopping, block=not (active or inflight or stopping))
            if stopping and not inflight:
                for j in active:
                    j.handle.settled.set()
                return
            progressed = self._submit_some(engine, w, active, inflight)
            progressed = self._poll_done(engine, inflight) or progressed
            if progressed:
                sleep_s = self._poll_min
            elif inflight:
                time.sleep(sleep_s)
                sleep_s = min(sleep_s * 2, self._poll_max)

    @staticmethod
    def _take_jobs(w: _PeerWorker, active: collections.deque, stopping: bool, block: bool) -> bool:
        """Move queued jobs to ``active`` (blocking only when there is nothing to do); a
        None job means close(): every job not yet submitted fails. Returns ``stopping``."""
        try:
            while True:
                job = w.jobs.get(block=block)
                block = False
                if job is None:
                    stopping = True
                    for j in active:
                        j.aborted = True
                        j.handle.finish_failed("transport closed")
                else:
                    if stopping:  # submitted while close() was under way
                        job.aborted = True
                        job.handle.finish_failed("transport closed")
                    active.append(job)
        except queue.Empty:
            pass
        return stopping

    def _submit_some(self, engine, w: _PeerWorker, active: collections.deque, inflight: collections.deque) -> bool:
        """Submit entries, one per engine batch, while the window has room."""
        progressed = False
        while active and len(inflight) < self._max_inflight:
            job = active[0]
            if job.submitted_all:
                active.popleft()
                self._maybe_finish(job)
                continue
            local, remote, nbytes = job.entries[job.next_entry]
            job.next_entry += 1
            if job.read:
                bid = engine.batch_transfer_async_read(w.peer, [local], [remote], [nbytes])
            else:
                bid = engine.batch_transfer_async_write(w.peer, [local], [remote], [nbytes])
            progressed = True
            if bid in _BAD_BATCH_IDS:
                job.failed_entries += 1
                job.aborted = True
                job.handle.finish_failed(
                    f"engine refused to start entry {job.next_entry - 1} (peer unreachable or queue full)"
                )
                continue
            job.inflight += 1
            inflight.append((bid, job))
        return progressed

    def _poll_done(self, engine, inflight: collections.deque) -> bool:
        """Retire finished entries in submission order; stop at the first still moving."""
        progressed = False
        while inflight:
            bid, job = inflight[0]
            st = engine.transfer_check_status(bid)
            if st == 0:
                break
            inflight.popleft()
            progressed = True
            job.inflight -= 1
            if st != 1:  # -1 failed, -2 timed out (engine keeps that batch id)
                job.failed_entries += 1
                job.aborted = True
                job.handle.finish_failed(
                    "entry failed in the engine (peer died, or remote range refused)"
                    if st == -1
                    else "entry timed out in the engine"
                )
            self._maybe_finish(job)
        return progressed

    @staticmethod
    def _maybe_finish(job: _Job) -> None:
        if job.inflight == 0 and job.submitted_all:
            if job.failed_entries == 0 and not job.aborted:
                job.handle.finish_ok()
            else:
                job.handle.finish_failed(job.handle.error or "failed")
            job.handle.settled.set()


_LEAKED: list = []  # engines kept alive because a thread was stuck inside them
_START_LOCK = threading.Lock()  # engines of one process start one at a time (their ports)
_ENV_LOCK = threading.Lock()


def engine_ports(rpc_port: int, new_ports: set[int]) -> set[int]:
    """The engine's ports: ``rpc_port`` and those of ``new_ports`` (this process's listeners
    that appeared while the engine started) in Mooncake's port range (``MC_MIN_RPC_PORT`` ..
    ``MC_MAX_RPC_PORT``, default 15000-17000), where its TCP data port is picked too (the
    Python API names only the RPC port)."""
    low = int(os.environ.get("MC_MIN_RPC_PORT", "15000"))
    high = int(os.environ.get("MC_MAX_RPC_PORT", "17000"))
    return {rpc_port} | {p for p in new_ports if low <= p <= high}


def _initialize(engine, local_host: str, protocol: str, device_name: str) -> tuple[int, str]:
    """``engine.initialize`` with ``MC_FORCE_TCP`` set for ``"tcp"`` only while it runs.

    Returns (rc, the protocol the engine really uses): an engine started without
    ``MC_FORCE_TCP`` uses RDMA whenever it finds an HCA, whatever ``protocol`` says;
    with it (any value, as Mooncake only tests that it is set) it uses TCP."""
    with _ENV_LOCK:
        user_value = os.environ.get("MC_FORCE_TCP")
        if protocol == "tcp" and user_value is None:
            os.environ["MC_FORCE_TCP"] = "1"
        try:
            rc = engine.initialize(local_host, "P2PHANDSHAKE", protocol, device_name)
        finally:
            if user_value is None:
                os.environ.pop("MC_FORCE_TCP", None)
    return rc, "tcp" if protocol == "tcp" or user_value is not None else "rdma"
