"""What a :class:`~vllm_hawk.protocol.client.ProtocolClient` socket's monitor says about
its connection: lost connections (``epoch``) and failed ZMTP handshakes, turned into the
reason a pending Hello fails (wrong CURVE secret, a different auth mode) instead of a
timeout. Its events are read on the client's thread only."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message  # imported now: opening files may fail under fd floods

from vllm_hawk.security import RateLimitedLog

ZMTP_ATTEMPTS = 4  # connections closed during the ZMTP handshake, in a row, before a Hello fails
MONITOR_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_DISCONNECTED
)


class ZmtpWatch:
    """The monitor of ``sock`` (a DEALER to ``endpoint`` with ``auth``).

    epoch: connections lost after a handshake (``in_session()`` true), counted under
    ``lock``; refused: why a refusal ended the connection for good ("" none; set under
    ``lock``); auth_failure: why the last ZMTP handshake failed, for a timed-out Hello.
    ``fail_hellos(why)`` fails the pending Hellos.
    """

    def __init__(
        self,
        sock: zmq.Socket,
        *,
        endpoint: str,
        auth: str,
        lock: threading.Lock,
        rlog: RateLimitedLog,
        in_session: Callable[[], bool],
        fail_hellos: Callable[[str], None],
    ) -> None:
        self.monitor = sock.get_monitor_socket(MONITOR_EVENTS)
        self._endpoint, self._auth, self._lock, self._rlog = endpoint, auth, lock, rlog
        self._in_session, self._fail_hellos = in_session, fail_hellos
        self.auth_failure = ""  # why the ZMTP handshake failed
        self.epoch = 0  # connections lost after a handshake
        self.refused = ""  # why, once a refusal ended the connection for good
        self._up = False  # the current connection finished its ZMTP handshake
        self._failures = 0  # connections in a row closed during the handshake
        self._closed = ""  # the last handshake-failure event, for the error message
        self._refused_now = False  # the handshake was refused outright (auth, mechanism)

    def close(self, sock: zmq.Socket) -> None:
        with contextlib.suppress(zmq.ZMQError):
            sock.disable_monitor()
        self.monitor.close(0)

    def drain(self) -> None:
        """Read the monitor's queued events (at most 256)."""
        for _ in range(256):
            try:
                ev = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            kind, value = ev["event"], ev["value"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.auth_failure = self._closed = self.refused = ""
                self._up, self._failures = True, 0
                continue
            if kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:  # the DISCONNECTED that follows decides
                self._closed = f"{zmq.Event(kind).name}, errno {value}"
                continue
            if kind == zmq.EVENT_DISCONNECTED:
                if self._in_session():
                    with self._lock:  # messages queued from now on are numbered for the new epoch
                        self.epoch += 1
                if self._up or self._refused_now:  # an established connection was lost (libzmq
                    self._up = self._refused_now = False  # reconnects), or the refusal below ended it
                    continue
                self._on_handshake_closed()
                continue
            self._on_refusal(kind, value)

    def _on_refusal(self, kind: int, value: int) -> None:
        if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            why = (
                f"the prefill's ZAP handler refused this decode's CURVE key (status {value}): the shared secrets differ"
            )
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            why = (
                f"ZMTP security mechanism mismatch: this decode has auth {self._auth!r} and the prefill does "
                "not (with a shared secret both sides need the same 'auth'; without one both need "
                "auth 'none')"
            )
        else:
            why = (
                f"the ZMTP handshake failed ({zmq.Event(kind).name}, value {value}): the shared secrets "
                f"or the auth modes differ (this side: auth {self._auth!r})"
            )
        self.auth_failure, self._refused_now = why, True
        with self._lock:  # libzmq does not reconnect after a refusal: later Hellos fail at once
            self.refused = why
        self._rlog("zmtp", "protocol client %s: %s", self._endpoint, why)
        self._fail_hellos(why)

    def _on_handshake_closed(self) -> None:
        """A connection closed before its ZMTP handshake finished. A prefill that cannot
        open our CURVE HELLO (a different secret) closes it at once; so does one whose
        1 s ``HANDSHAKE_IVL`` ran out because it was starved of CPU (4-6 vLLM processes
        on 2 cores). libzmq reconnects, and the queued Hello goes out on the next
        connection; the pending Hellos fail after :data:`ZMTP_ATTEMPTS` such closes in a
        row (0.5 s for a wrong secret here, with libzmq's 100 ms reconnect interval)."""
        self._failures += 1
        if self._auth == "curve":
            why = (
                "the prefill closed the connection during the CURVE handshake: the shared secrets differ, "
                "or the prefill has auth 'hmac'/'none'"
            )
        else:
            why = (
                f"the prefill closed the connection during the ZMTP handshake: the auth modes differ "
                f"(this side: auth {self._auth!r})"
            )
        why += f" ({self._failures} connection(s) in a row; {self._closed or 'no handshake event'})"
        self._closed = ""
        self.auth_failure = why
        if self._failures < ZMTP_ATTEMPTS:
            self._rlog("zmtp-retry", "protocol client %s: %s; reconnecting", self._endpoint, why)
            return
        self._rlog("zmtp", "protocol client %s: %s", self._endpoint, why)
        self._fail_hellos(why)
