"""Stopping a helper process that is driven over a multiprocessing Pipe."""

from __future__ import annotations

import contextlib


def stop_pipe_process(proc, conn, timeout_s: float = 10.0) -> None:
    """Ask ``proc`` to exit with an ``("exit",)`` command on ``conn``; kill it if it is
    still alive ``timeout_s`` seconds later. Never leaves the process running."""
    if proc.is_alive():
        with contextlib.suppress(OSError):  # the pipe is already gone
            conn.send(("exit",))
        proc.join(timeout=timeout_s)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout=5)
