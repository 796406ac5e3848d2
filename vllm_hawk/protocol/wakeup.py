"""Waking a ZMQ poll loop from other threads: an inproc PUSH/PULL pair."""

from __future__ import annotations

import contextlib
import threading
import uuid

import zmq


class Wakeup:
    """``rx`` goes into the loop's poller; any thread calls :meth:`wake`; the loop calls
    :meth:`drain` when ``rx`` is readable. The sender is closed by :meth:`close_sender`
    (from the owner's ``close``), the receiver by :meth:`close_receiver` (from the loop)."""

    def __init__(self, ctx: zmq.Context, name: str):
        addr = f"inproc://{name}-{uuid.uuid4().hex}"
        self.rx = ctx.socket(zmq.PULL)
        self.rx.bind(addr)
        self._tx = ctx.socket(zmq.PUSH)
        self._tx.setsockopt(zmq.LINGER, 0)
        self._tx.connect(addr)
        self._lock = threading.Lock()  # zmq sockets are not thread-safe

    def wake(self) -> None:
        with self._lock:
            if not self._tx.closed:
                with contextlib.suppress(zmq.Again):  # already a wake-up pending
                    self._tx.send(b"", zmq.NOBLOCK)

    def drain(self) -> None:
        while True:
            try:
                self.rx.recv(zmq.NOBLOCK)
            except zmq.Again:
                return

    def close_sender(self) -> None:
        with self._lock:
            self._tx.close()

    def close_receiver(self) -> None:
        self.rx.close()
