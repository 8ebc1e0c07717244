"""The engine core's ends of its link with the API server: the two ZMQ sockets (`CoreChannel`), the watch on the
server's pid (`watch_server`: no core outlives its server) and the signals it turns into a drain request
(`Signals`). Only the standard library at module level, as engine/core_proc.py requires of what it imports first.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

PARENT_POLL_S = 0.25


class CoreChannel:
    """The core's two sockets: frames in (PULL), frames out (PUSH). Sends come from the stage threads during the
    start-up (spans) and from the loop afterwards, so they share a lock (a ZMQ socket is not thread-safe)."""

    def __init__(self, to_core: str, from_core: str) -> None:
        import zmq

        self._zmq = zmq
        self._ctx = zmq.Context(1)
        self._in = self._ctx.socket(zmq.PULL)
        self._in.setsockopt(zmq.LINGER, 0)
        self._in.connect(to_core)
        self._out = self._ctx.socket(zmq.PUSH)
        # Sent frames are delivered even while the loop is already closing down (Failed, the last outputs).
        self._out.setsockopt(zmq.LINGER, 2000)
        self._out.connect(from_core)
        self._lock = threading.Lock()
        from .core_frames import ToCore, decode_frame, encode_frame

        self._encode = encode_frame
        self._decode = lambda data: decode_frame(data, ToCore)

    def send(self, frame: Any) -> None:
        data = self._encode(frame)
        with self._lock:
            self._out.send(data, copy=False)

    def receive(self, timeout_ms: int) -> list[Any]:
        """Every frame waiting now, after waiting up to `timeout_ms` for the first (0: do not wait)."""
        zmq = self._zmq
        if timeout_ms and not self._in.poll(timeout_ms):
            return []
        frames: list[Any] = []
        while True:
            try:
                data = self._in.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return frames
            frames.append(self._decode(data.buffer))

    def close(self) -> None:
        self._in.close(0)
        self._out.close()
        self._ctx.term()


def watch_server(pid: int) -> None:
    """Exit at once when the server that started this core is gone (no core outlives its server)."""

    def watch() -> None:
        while True:
            if os.getppid() != pid:
                os._exit(1)
            time.sleep(PARENT_POLL_S)

    threading.Thread(target=watch, name="glowplug-core-parent", daemon=True).start()


class Signals:
    """SIGTERM / SIGINT: remembered, and turned into a Notice by whoever sends next (a handler must not send)."""

    def __init__(self) -> None:
        self.pending: str | None = None
        self.told = False

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, sig: int, _frame: Any) -> None:
        self.pending = signal.Signals(sig).name

    def notice(self) -> Any:
        if self.pending is None or self.told:
            return None
        from .core_frames import Notice

        self.told = True
        return Notice("sigterm", f"the engine core got {self.pending}")
