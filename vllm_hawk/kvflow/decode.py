"""The decode endpoint of Algorithm 1 (D1-D8), the one implementation vLLM and the tests run.

A :class:`DecodeEndpoint` talks to ONE prefill (side channel + transfer endpoint from
its HelloAck) and moves requests' KV into a :mod:`sink <vllm_hawk.kvflow.sinks>`: D1
``KVRequest`` -> P7 ``KVReady`` (checked against the sink's own plan before anything is
read), D2-D5 one batch of READs, D6-D7 the sink's copies, D8 ``Release``. Each step by
function, and the threads: ``docs/architecture.md``.

Backpressure. A prefill whose ring stays full for its ``claim_wait_s`` refuses a
KVRequest with ``no_space``; the decode asks again (backing off from
:data:`~vllm_hawk.kvflow.prefill_channel.NO_SPACE_BACKOFF_S` to ``NO_SPACE_BACKOFF_MAX_S``)
until the fetch's deadline, so a full ring slows pulls down instead of failing them
(``backpressured`` counts the retries). Layer-group fetches are not retried.

Deadlines. ``pull_timeout_s`` bounds a fetch; the READs must also end before the
prefill's lease on the range (``KVReady.lease_ms`` from its arrival, less a margin).
Receive memory is waited for at most ``claim_wait_s``. On any failure ``fetch`` raises
:class:`PeerFailed` (``BufferFull`` when memory ran out) and frees everything it took:
receive buffers once the transport has settled the batch (in the background when that
is late; a batch that never settles within :data:`SETTLE_LIMIT_S` leaves them held,
``quarantined``). When the READs target KV pages (direct sinks) a failed batch is
waited for up to :data:`SETTLE_WAIT_S`; if it has not drained, :class:`TransferUnsettled`
names the unsafe destination blocks and carries the batch's ``settled`` event.
A failed fetch returns at the latest ``pull_timeout_s + RELEASE_TIMEOUT_S`` (+
``SETTLE_WAIT_S`` for direct sinks) after it started.

Block sizes. The HelloAck names the prefill's block size; a vLLM sink whose blocks are
a multiple of it plans the pull as sub-blocks (``plan_regroup``) and regroups them in
D6-D7 (:mod:`~vllm_hawk.kvflow.regroup`); the prefill serves its own blocks either way.

Tensor parallelism. A fetch may move one :class:`Share` of a request: a range of the
prefill rank's KV heads (``KVRequest.head_start`` / ``num_heads``), into a sink that
holds just those heads of this decode rank or chip (see :mod:`vllm_hawk.layout.tp`).
Its KVRequest and Release name the share; the sink's receive memory and registrations
are keyed by ``Share.key`` so that shares of one request never collide.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from vllm_hawk.integrity import ALGORITHM
from vllm_hawk.kvflow.base import KVSink, Landing
from vllm_hawk.kvflow.errors import BufferFull, IntegrityError, KVFlowError, PeerFailed, TransferUnsettled
from vllm_hawk.kvflow.landing_check import Landed, verify_landed
from vllm_hawk.kvflow.prefill_channel import RELEASE_TIMEOUT_S, PrefillChannel
from vllm_hawk.kvflow.settle import ReceiveFrees
from vllm_hawk.protocol import CompatFields, HelloAck, KVReady, KVRequest, ProtocolTimeout, RemoteError
from vllm_hawk.transport import TransferFailed, TransferTimeout

SETTLE_WAIT_S = 1.0  # after a failed batch into KV pages: wait this long for its READs to drain
SETTLE_LIMIT_S = 60.0  # background free of receive buffers gives up (quarantines) after this
LEASE_MARGIN_S = 1.0  # reads end this long before the prefill's lease does (at most a quarter of it)


@dataclass(frozen=True)
class Share:
    """The part of a request one fetch moves: the prefill's local KV heads
    ``[head_start, head_start + num_heads)`` (``num_heads`` 0: all of them), share
    ``index`` of the ``consumers`` shares the prefill serves; ``tag`` makes the sink's
    key unique among the shares of one request this decode pulls at once (e.g. the
    destination heads)."""

    head_start: int = 0
    num_heads: int = 0
    consumers: int = 1
    index: int = 0
    tag: str = ""
    chip: int = 0  # the destination chip (or decode TP rank); KVReady must name it back

    def key(self, req_id: str) -> str:
        return req_id if not self.tag else f"{req_id}\x00{self.tag}"


WHOLE = Share()


@dataclass
class FetchResult:
    """Timings (seconds, monotonic) of one fetch and what moved.

    request_s: D1 -> P7 (includes the prefill's transform and checksums); transfer_s: batch
    submit -> done; copy_s: the sink's copies (staged); ``extra["check_s"]``: the integrity
    check; total_s: D1 -> KV in place; release_s: D8
    round trip (not in total_s). nbytes: bytes moved; entries: transfer entries;
    segments: segments in KVReady; fraction: share of the entries moved (< 1 only when a
    per-tile run hit its time cap); extra: the sink's figures (bytes per bank, ...).
    """

    req_id: str
    mode: str
    nbytes: int = 0
    entries: int = 0
    segments: int = 0
    request_s: float = 0.0
    transfer_s: float = 0.0
    copy_s: float = 0.0
    total_s: float = 0.0
    release_s: float = 0.0
    fraction: float = 1.0
    extra: dict = field(default_factory=dict)


def _read_deadline(ready: KVReady, t_ready: float, deadline: float) -> tuple[float, str]:
    """The deadline for reading ``ready``'s range: the caller's, capped by the prefill's
    lease (counted from KVReady's arrival, less a margin); and a note for errors."""
    if not ready.lease_ms:
        return deadline, ""
    lease = ready.lease_ms / 1000.0
    margin = min(LEASE_MARGIN_S, lease / 4)
    end = t_ready + lease - margin
    if end >= deadline:
        return deadline, ""
    return end, (
        f" (read deadline capped by the prefill's lease of {ready.lease_ms} ms less {margin:.2f} s: "
        "after the lease the prefill frees the range and may reuse it)"
    )


def _chip_error(ready: KVReady, share: Share) -> str:
    if ready.chip != share.chip:
        return f"KVReady names chip {ready.chip}, this share lands on chip {share.chip}"
    return ""


AUTO_LAYER_GROUPS = 0  # ``fetch(layer_groups=AUTO_LAYER_GROUPS)``: :func:`auto_layer_groups` picks
#: G' bytes of a direct-mode pull from which "auto" splits it into 2 layer groups. Chosen with
#: ``hawk bench transfer`` (Llama-3.1-70B TP=1 -> 1 p150a, Mooncake TCP, 2 cores; latency of the
#: pipelined row over the whole pull's in the same run; 6 runs of 5-9 repeats, bf16 and bfloat8_b
#: targets): direct with 2 groups at 85-620 MiB of G' mean 0.93 (18 cells, 13 below 1, range
#: 0.78-1.15), at 11-80 MiB mean 1.01 (18 cells); staged with 2 groups mean 1.07 up to 85 MiB and
#: 0.98 at 329-620 MiB (its transfer, intra-bank copies and the transform share the 2 cores); 4
#: and 8 groups were never better than 2. Smaller pulls and staged pulls go whole.
AUTO_GROUPS_MIN_NBYTES = 84 << 20


def auto_layer_groups(sink, n_blocks: int) -> int:
    """The layer groups "auto" gives a pull of ``n_blocks`` blocks into ``sink``: 2 for a
    Tenstorrent sink in direct mode moving at least :data:`AUTO_GROUPS_MIN_NBYTES` of G',
    else 1 (see the measurements above)."""
    if not sink.caps.group_landing or sink.mode != "direct":
        return 1
    s = sink.tt_layout.spec
    return 2 if n_blocks * s.tiles_per_block * s.tile_nbytes * 2 * s.num_layers >= AUTO_GROUPS_MIN_NBYTES else 1


def split_layers(num_layers: int, groups: int) -> list[tuple[int, int]]:
    """``groups`` (at most ``num_layers``) consecutive layer ranges ``(lo, hi)`` of
    near-equal size covering every layer."""
    g = max(1, min(int(groups), num_layers))
    cuts = [round(i * num_layers / g) for i in range(g + 1)]
    return [(cuts[i], cuts[i + 1]) for i in range(g)]


class _AllSettled:
    """Several batches as one for the abandon path: ``settled.wait`` waits for all."""

    def __init__(self, handles) -> None:
        self.handles = list(handles)
        self.settled = self

    def wait(self, timeout: float) -> bool:
        end = time.monotonic() + max(0.0, timeout)
        return all(h.settled.wait(max(0.0, end - time.monotonic())) for h in self.handles)


@dataclass
class _Fetch:
    """One fetch from :meth:`DecodeEndpoint.fetch` to its return: what was asked for,
    its deadlines, and what the prefill and the sink answered so far. ``ready`` is the
    (first group's) KVReady, ``t_ready`` its arrival; ``read_deadline`` and ``note``
    come from :func:`_read_deadline`; ``hello`` is the HelloAck the READs address. A
    layer-group fetch also keeps the futures of its groups' KVReady (``futs``) and its
    submitted READ batches (``handles``)."""

    req_id: str
    num_tokens: int
    sink: KVSink
    dst: np.ndarray
    first_block: int
    share: Share
    timeout: float
    t0: float
    deadline: float
    release: bool
    time_cap_s: float | None
    plan: object = None
    res: FetchResult | None = None
    ready: KVReady | None = None
    t_ready: float = 0.0
    read_deadline: float = 0.0
    note: str = ""
    landing: Landing | None = None
    hello: HelloAck | None = None
    futs: list = field(default_factory=list)
    handles: list = field(default_factory=list)
    checksum: str = ""  # the checksum asked for and verified ("": none)
    landed: list = field(default_factory=list)  # the batches to verify (landing_check.Landed)

    def __post_init__(self) -> None:
        self.t_ready, self.read_deadline = self.t0, self.deadline

    def first_ready(self, ready: KVReady) -> None:
        """Record the first KVReady: its arrival, request_s, and the read deadline."""
        self.t_ready = time.monotonic()
        self.ready = ready
        self.res.request_s = self.t_ready - self.t0
        self.read_deadline, self.note = _read_deadline(ready, self.t_ready, self.deadline)

    def claim_wait(self, claim_wait_s: float) -> float:
        """How long the sink may wait for receive memory: ``claim_wait_s``, at most until
        the read deadline."""
        return max(0.0, min(claim_wait_s, self.read_deadline - time.monotonic()))

    def group_ready(self, fut, group: tuple[int, int], client) -> KVReady:
        """The KVReady of layers ``lo..hi-1`` (``group``), checked against the sink's
        plan; the READs address ``client``'s HelloAck at its arrival; the first one sets
        request_s and the read deadline."""
        req_id, (lo, hi) = self.req_id, group
        try:
            ready = fut.result(max(1e-3, self.deadline - time.monotonic()))
        except Exception as e:  # noqa: BLE001 - timeout or cancelled
            raise PeerFailed(
                f"request {req_id}: no KVReady for layers {lo}..{hi - 1} in time ({type(e).__name__})", req_id
            ) from e
        if not isinstance(ready, KVReady) or ready.req_id != req_id:
            raise PeerFailed(f"request {req_id}: prefill answered {ready!r:.300}", req_id)
        self.hello = client.hello
        if self.ready is None:
            self.first_ready(ready)  # request_s: the first group's KVReady
        err = _chip_error(ready, self.share) or self.sink.check_group(
            ready, self.plan, self.hello.export_nbytes, lo, hi, self.ready.ring_offset
        )
        if err:
            raise PeerFailed(f"request {req_id}: {err}", req_id)
        return ready


def _check_dst(req_id: str, num_tokens: int, sink: KVSink, dst_blocks, first_block: int) -> np.ndarray:
    """``dst_blocks`` as int64 block ids; ValueError unless they end the request."""
    dst = np.asarray(dst_blocks, dtype=np.int64).reshape(-1)
    bs = sink.layout.block_size
    n_req = -(-num_tokens // bs)
    if num_tokens <= 0 or first_block < 0 or dst.size == 0 or first_block + dst.size != n_req:
        raise ValueError(
            f"fetch {req_id}: {dst.size} destination blocks from block {first_block} do not "
            f"end a {num_tokens}-token request ({n_req} blocks of {bs})"
        )
    return dst


def _kv_request(fs: _Fetch) -> KVRequest:
    """The D1 KVRequest of fetch ``fs`` (all layers; its share's heads)."""
    share = fs.share
    return KVRequest(
        req_id=fs.req_id,
        dst_layout=fs.sink.layout,
        num_tokens=fs.num_tokens,
        dst_block_ids=[int(b) for b in fs.dst],
        first_block=fs.first_block,
        deadline_ms=int((time.time() + fs.timeout) * 1000),
        head_start=share.head_start,
        num_heads=share.num_heads,
        consumers=share.consumers,
        share=share.index,
        dst_chip=share.chip,
        checksum=fs.checksum,
    )


class DecodeEndpoint:
    """The decode side towards one prefill (see module doc). Thread-safe: fetches may run
    concurrently. ``peer`` / ``export_*`` follow the latest HelloAck: after the prefill
    restarts, the client handshakes again and the new ring applies to later fetches.

    transport: a started transport (shared by every endpoint of a decode); endpoint:
    the prefill's side channel; pull_timeout_s: default deadline of one fetch;
    claim_wait_s: longest wait for receive memory; handshake_timeout_s: the first Hello.
    It talks to the prefill through a :class:`~vllm_hawk.kvflow.prefill_channel.PrefillChannel`
    and frees a failed batch's receive memory through a
    :class:`~vllm_hawk.kvflow.settle.ReceiveFrees`.
    """

    def __init__(
        self,
        transport,
        endpoint: str,
        compat: CompatFields,
        *,
        secret: bytes | None = None,
        auth: str | None = None,
        pull_timeout_s: float = 10.0,
        claim_wait_s: float = 5.0,
        handshake_timeout_s: float | None = None,
        integrity: bool = True,
    ) -> None:
        self.transport, self.pull_timeout_s, self.claim_wait_s = transport, pull_timeout_s, claim_wait_s
        self.integrity = integrity
        self._frees = ReceiveFrees()
        self.quarantined = self._frees.quarantined  # requests whose receive memory stays held (batch never settled)
        self._channel = PrefillChannel(
            endpoint,
            compat,
            secret=secret,
            auth=auth,
            timeout_s=pull_timeout_s,
            handshake_timeout_s=handshake_timeout_s or pull_timeout_s,
        )
        self.client = self._channel.client

    @property
    def backpressured(self) -> int:
        """KVRequests asked again after the prefill's ring was full (``no_space``)."""
        return self._channel.backpressured

    @property
    def hello(self) -> HelloAck:
        return self.client.hello

    @property
    def peer(self) -> str:
        return self.client.hello.transfer_endpoint

    # ------------------------------------------------------------------ D1-D8
    def fetch(
        self,
        req_id: str,
        num_tokens: int,
        sink: KVSink,
        dst_blocks,
        *,
        first_block: int = 0,
        timeout_s: float | None = None,
        release: bool = True,
        time_cap_s: float | None = None,
        layer_groups: int = 1,
        share: Share = WHOLE,
    ) -> FetchResult:
        """Move source blocks ``first_block ..`` of request ``req_id`` (``num_tokens``
        prefilled tokens) into ``sink``'s blocks ``dst_blocks``.

        Returns when the KV is in place (and, with ``release``, the prefill freed it).
        ``time_cap_s`` (per-tile benchmark rows) stops submitting after that long and
        reports the fraction done. ``layer_groups`` > 1 (sinks with ``layer_groups``,
        i.e. Tenstorrent sinks): the request is asked for as that many layer groups at
        once and each group's READs go out as soon as its KVReady arrives, so the
        transfer of group i overlaps the prefill's transform of group i+1 (same
        guarantees); :data:`AUTO_LAYER_GROUPS`: as many as :func:`auto_layer_groups`
        says. ``share``: only those heads (module doc). Raises as the module doc says,
        with nothing held."""
        timeout = self.pull_timeout_s if timeout_s is None else timeout_s
        t0 = time.monotonic()
        dst = _check_dst(req_id, num_tokens, sink, dst_blocks, first_block)
        fs = _Fetch(req_id, num_tokens, sink, dst, first_block, share, timeout, t0, t0 + timeout, release, time_cap_s)
        if self.integrity and time_cap_s is None:  # a time-capped (per-tile benchmark) run lands in part
            fs.checksum = ALGORITHM
        if layer_groups == AUTO_LAYER_GROUPS:
            layer_groups = auto_layer_groups(sink, len(dst))
        groups = split_layers(sink.layout.num_layers, layer_groups)
        fs.plan = self._plan(fs)
        if len(groups) > 1 and sink.caps.group_landing and time_cap_s is None:
            return self._fetch_groups(fs, groups)
        return self._fetch_whole(fs)

    def _fetch_whole(self, fs: _Fetch) -> FetchResult:
        """:meth:`fetch` as one KVRequest and (unless time-capped) one READ batch."""
        fs.res = FetchResult(fs.req_id, fs.sink.mode)
        msg = _kv_request(fs)
        try:
            ready = self._channel.request_kv(msg, fs.deadline)  # D1 -> P7
        except (ProtocolTimeout, RemoteError) as e:
            self._release_quietly(fs.req_id, ok=False, share=fs.share)  # also cancels a request still being served
            raise PeerFailed(f"request {fs.req_id}: {e}", fs.req_id) from e
        fs.first_ready(ready)
        fs.hello = self.client.hello
        fs.res.segments = len(ready.segments)
        fs.landing = self._land(fs)
        try:
            return self._finish(fs, self._read_whole(fs))
        finally:
            if fs.landing.unexpose is not None:  # the batch is over (done, failed or abandoned)
                fs.landing.unexpose()

    def _read_whole(self, fs: _Fetch) -> float:
        """Submit the whole request's READs (one batch unless time-capped) and wait for
        them; returns when the last batch ended (monotonic)."""
        res, landing = fs.res, fs.landing
        res.entries, res.nbytes = len(landing.entries), sum(e[2] for e in landing.entries)
        res.extra.update(landing.figures)
        peer = fs.hello.transfer_endpoint
        t2 = time.monotonic()
        step = 4096 if fs.time_cap_s is not None else max(1, len(landing.entries))
        done = 0
        while done < len(landing.entries):  # ONE batch unless a per-tile run is time-capped
            h = self._submit(peer, landing.entries[done : done + step], fs)
            self._wait(fs, h)
            done += min(step, len(landing.entries) - done)
            if fs.time_cap_s is not None and time.monotonic() - t2 > fs.time_cap_s:
                break
        res.fraction = done / max(1, len(landing.entries))
        fs.landed.append(Landed(fs.ready, landing.entries))
        t3 = time.monotonic()
        res.transfer_s = t3 - t2
        return t3

    def _finish(self, fs: _Fetch, t3: float) -> FetchResult:
        """D6-D8 once every READ ended at ``t3``: the integrity check where the bytes
        landed, the sink's copies (a failure Releases and raises PeerFailed), copy_s and
        total_s, then (with ``release``) the Release."""
        res, after = fs.res, fs.landing.check_after_complete
        if not after:
            self._check(fs)
        try:
            res.extra.update(fs.landing.complete())  # D6-D7 (frees the receive memory)
        except Exception as e:
            self._release_quietly(fs.req_id, ok=False, share=fs.share)
            raise PeerFailed(f"request {fs.req_id}: copying into the destination failed: {e}", fs.req_id) from e
        if after:
            self._check(fs)
        t4 = time.monotonic()
        res.copy_s, res.total_s = t4 - t3 - res.extra.get("check_s", 0.0), t4 - fs.t0  # the check: check_s
        if fs.release:  # D8
            self._release_done(fs)
            res.release_s = time.monotonic() - t4
        return res

    def _check(self, fs: _Fetch) -> None:
        """D7: the landed bytes against the prefill's checksums (when asked for); a
        mismatch frees the receive memory, Releases and raises IntegrityError."""
        if not fs.checksum:
            return
        t0 = time.monotonic()
        try:
            verify_landed(fs.req_id, fs.share.chip, fs.sink.wire_format, fs.hello.export_base_addr, fs.landed)
        except Exception as e:  # a mismatch, or a check that could not run: the KV is not used either way
            if fs.landing.free is not None and not fs.landing.check_after_complete:
                fs.landing.free()
            self._release_quietly(fs.req_id, ok=False, share=fs.share)
            if isinstance(e, IntegrityError):
                raise
            msg = f"request {fs.req_id} (chip {fs.share.chip}): the integrity check failed to run: {e!r}"
            raise IntegrityError(msg, fs.req_id, fs.share.chip) from e
        fs.res.extra["check_s"] = time.monotonic() - t0

    def _fetch_groups(self, fs: _Fetch, groups: list[tuple[int, int]]) -> FetchResult:
        """:meth:`fetch` by layer groups: every group's D1 at once; D2 (receive memory)
        once at the first KVReady; each group's READ batch as its KVReady arrives; D6-D8
        once. On failure: every submitted batch is abandoned together (receive memory
        freed once all settled; KV pages waited for and named if they did not drain)."""
        fs.res = FetchResult(fs.req_id, f"{fs.sink.mode}-layer-groups")
        fs.res.extra["layer_groups"] = len(groups)
        fs.futs = self._channel.ask_layers(fs, _kv_request(fs), groups)
        try:
            self._read_groups(fs, groups)
        except Exception as e:
            err = self._abandon_groups(fs, e)
            if err is None:
                raise
            raise err from e
        finally:
            if fs.landing is not None and fs.landing.unexpose is not None:  # every batch done or abandoned
                fs.landing.unexpose()
        t3 = time.monotonic()
        fs.res.transfer_s = t3 - fs.t0 - fs.res.request_s  # first KVReady -> last batch done
        fs.res.extra.update(fs.landing.figures)
        return self._finish(fs, t3)

    def _read_groups(self, fs: _Fetch, groups: list[tuple[int, int]]) -> None:
        """Each group's KVReady in turn, checked, then its READ batch (appended to
        ``fs.handles``); then wait for every batch until the read deadline."""
        for (lo, hi), fut in zip(groups, fs.futs, strict=False):
            ready = fs.group_ready(fut, (lo, hi), self.client)
            if fs.landing is None:
                fs.landing = fs.sink.land_groups(
                    fs.share.key(fs.req_id), fs.plan, fs.claim_wait(self.claim_wait_s)
                )  # D2
            entries = fs.landing.entries(ready, fs.hello.export_base_addr, lo, hi)
            fs.landed.append(Landed(ready, entries, f"layers {lo}..{hi - 1}"))
            fs.handles.append(self.transport.submit("read", fs.hello.transfer_endpoint, entries))
            fs.res.entries += len(entries)
            fs.res.nbytes += sum(e[2] for e in entries)
            fs.res.segments += len(ready.segments)
        for h in fs.handles:
            self.transport.wait(h, max(0.0, fs.read_deadline - time.monotonic()))

    def _abandon_groups(self, fs: _Fetch, e: Exception) -> KVFlowError | None:
        """A layer-group fetch failed with ``e``: cancel what is still asked for, abandon
        every submitted batch together, Release. Returns the error to raise from ``e``
        (None: raise ``e`` itself)."""
        req_id = fs.req_id
        for fut in fs.futs:
            fut.cancel()
        unsafe: list[int] = []
        if fs.landing is not None:
            unsafe = self._abandon(fs, _AllSettled(fs.handles), time.monotonic() + SETTLE_WAIT_S)
        self._release_quietly(req_id, ok=False, share=fs.share)  # also cancels groups still being served
        if unsafe:
            return TransferUnsettled(
                f"request {req_id}: {e}; READs did not drain within {SETTLE_WAIT_S} s and "
                f"may still write destination blocks {unsafe}: do not use them",
                req_id,
                tuple(unsafe),
                _AllSettled(fs.handles),
            )
        if isinstance(e, KVFlowError):
            return None
        if isinstance(e, (TransferFailed, TransferTimeout)):
            return PeerFailed(f"request {req_id}: transfer from {self.peer} failed: {e}{fs.note}", req_id)
        return PeerFailed(f"request {req_id}: {type(e).__name__}: {e}", req_id)

    def renew(self, req_ids, timeout_s: float | None = None):
        """Heartbeat (see :mod:`~vllm_hawk.protocol.leases`): extend the prefill's leases of
        ``req_ids`` (at most ``MAX_RENEW_IDS``); returns its ``Renewed``."""
        return self.client.renew(list(req_ids), timeout_s=self.pull_timeout_s if timeout_s is None else timeout_s)

    def release(self, req_id: str, ok: bool = True, timeout_s: float | None = None, share: Share = WHOLE) -> None:
        """D8 without a fetch: the decode will not read ``req_id`` (or ``share`` of it;
        e.g. it had the prefix locally, or the request was aborted). Raises
        RemoteError/ProtocolTimeout."""
        self.client.release(
            req_id, ok=ok, timeout_s=self.pull_timeout_s if timeout_s is None else timeout_s, share=share.index
        )

    # ------------------------------------------------------------------ pieces
    def _plan(self, fs: _Fetch):
        """The sink's plan; for a sink that regroups (``caps.regroup``), from the prefill's
        block size in its HelloAck when it differs from the sink's. A pair that does not
        fit (the handshake refuses it) is Released and raises PeerFailed naming both sizes."""
        sink, src_bs = fs.sink, self.client.hello.block_size
        if not sink.caps.regroup or not src_bs or src_bs == sink.layout.block_size:
            return sink.plan(fs.dst)
        try:
            return sink.plan_regroup(fs.dst, src_bs, fs.num_tokens, fs.first_block)
        except ValueError as e:
            self._release_quietly(fs.req_id, ok=False, share=fs.share)
            raise PeerFailed(f"request {fs.req_id}: {e}", fs.req_id) from e

    def _land(self, fs: _Fetch) -> Landing:
        """Check KVReady against the sink's plan, then D2-D5 (claim and pair); a failure
        Releases."""
        req_id, ready = fs.req_id, fs.ready
        try:
            err = _chip_error(ready, fs.share) or fs.sink.check_ready(ready, fs.plan, fs.hello.export_nbytes)
            if err:
                raise PeerFailed(f"request {req_id}: {err}", req_id)
            try:
                return fs.sink.land(
                    fs.share.key(req_id), ready, fs.plan, fs.hello.export_base_addr, fs.claim_wait(self.claim_wait_s)
                )
            except ValueError as e:
                raise PeerFailed(f"request {req_id}: KVReady does not fit this sink: {e}", req_id) from e
        except KVFlowError as e:
            self._release_quietly(req_id, ok=False, share=fs.share)
            if isinstance(e, BufferFull) and fs.note and time.monotonic() >= fs.read_deadline:
                raise BufferFull(f"{e}{fs.note}", req_id) from e
            raise

    def _submit(self, peer: str, entries, fs: _Fetch):
        """Submit one READ batch; a refused submit frees what was taken and Releases."""
        try:
            return self.transport.submit("read", peer, entries)
        except Exception:
            if fs.landing.free is not None:
                fs.landing.free()
            self._release_quietly(fs.req_id, ok=False, share=fs.share)
            raise

    def _wait(self, fs: _Fetch, handle) -> None:
        """Wait for one READ batch until the read deadline; on failure abandon it (settle
        or quarantine), Release."""
        try:
            self.transport.wait(handle, max(0.0, fs.read_deadline - time.monotonic()))
        except (TransferFailed, TransferTimeout) as e:
            unsafe = self._abandon(fs, handle, time.monotonic() + SETTLE_WAIT_S)
            self._release_quietly(fs.req_id, ok=False, share=fs.share)
            msg = f"request {fs.req_id}: transfer from {self.peer} failed: {e}{fs.note}"
            if unsafe:
                raise TransferUnsettled(
                    f"{msg}; its READs did not drain within {SETTLE_WAIT_S} s and may still "
                    f"write destination blocks {list(unsafe)}: do not use them",
                    fs.req_id,
                    tuple(unsafe),
                    handle.settled,
                ) from e
            raise PeerFailed(msg, fs.req_id) from e

    def _abandon(self, fs: _Fetch, handle, settle_end: float) -> list[int]:
        """A failed batch ``handle``: nothing may write our memory once we return. Receive
        memory is freed once settled (in the background if late, up to the fetch's
        deadline here); KV pages are waited for until ``settle_end`` and returned as
        unsafe if the batch has not drained."""
        if fs.landing.free is not None:
            self._frees.free_when_settled(
                handle, fs.req_id, fs.landing.free, fs.deadline, SETTLE_WAIT_S, SETTLE_LIMIT_S
            )
            return []
        if handle.settled.wait(max(0.0, settle_end - time.monotonic())):
            return []
        return [int(b) for b in fs.landing.dst_blocks]

    def pending_frees(self) -> int:
        """Receive memory waiting (in the background) for its batch to settle."""
        return self._frees.pending()

    def _release_quietly(self, req_id: str, ok: bool, share: Share = WHOLE) -> None:
        self._channel.release_quietly(req_id, ok, share.index)

    def _release_done(self, fs: _Fetch) -> None:
        """D8 after the KV is in place (PeerFailed if refused)."""
        self._channel.release_read(fs, max(RELEASE_TIMEOUT_S, fs.deadline - time.monotonic()))

    def close(self) -> None:
        self.client.close()
