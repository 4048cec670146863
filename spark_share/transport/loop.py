"""The one I/O thread of a process for all of its connections of ours.

Owns: a selector over every socket of ours in this process (listeners, handshakes under way, open
connections), the calls other threads hand it (``call_soon``: it alone registers, unregisters and closes
sockets, so a file descriptor is never reused under the selector), timers (``call_later``), the sweep
that keeps every open connection alive (pings, dead peers) and ends handshakes that take too long, and a
small thread for callbacks that may block (``run_off_loop``: on_close handlers take locks that handler
threads hold). A tracker serving 500 agents runs on this thread, a handler pool and nothing per peer.

Must never: block (no lock held by code that waits on the network, no blocking socket call, no user
callback run inline), or outlive a fork (a child process gets a loop of its own, see ``get_loop``).
"""
from __future__ import annotations

import heapq
import itertools
import logging
import os
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger("spark_share.transport.wire")

READ, WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE
SWEEP_S = 0.5


class Loop:
    def __init__(self) -> None:
        # Touched on this loop's thread only: the wire's connections (``keepalive(now)``) and the servers
        # (``expire_admissions(now)``), which the sweep visits.
        self.open_conns: set = set()
        self.servers: set = set()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, READ, None)
        self._calls: deque[Callable[[], None]] = deque()
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._callbacks = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spark-share-wire-events")
        self.thread = threading.Thread(target=self._run, name="spark-share-wire", daemon=True)
        self.thread.start()
        self.call_soon(self._sweep)

    # --- from any thread --------------------------------------------------------------------------
    def call_soon(self, fn: Callable[[], None]) -> None:
        self._calls.append(fn)
        if threading.current_thread() is not self.thread:
            try:
                self._wake_w.send(b"\0")
            except (BlockingIOError, OSError):  # a wake-up is pending already (buffer full) or we are gone
                pass

    def call_later(self, delay: float, fn: Callable[[], None]) -> None:
        self.call_soon(lambda: heapq.heappush(self._timers, (time.monotonic() + delay, next(self._seq), fn)))

    def run_off_loop(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the callback thread, in order: for what may wait on a lock."""
        try:
            self._callbacks.submit(_logged, fn)
        except RuntimeError:  # interpreter shutting down
            pass

    @property
    def in_loop(self) -> bool:
        return threading.current_thread() is self.thread

    # --- on the loop thread ----------------------------------------------------------------------
    def register(self, sock: socket.socket, events: int, handler) -> None:
        """``handler.on_event(mask)`` runs on the loop for each event of ``sock``."""
        self._selector.register(sock, events, handler)

    def modify(self, sock: socket.socket, events: int, handler) -> None:
        try:
            self._selector.modify(sock, events, handler)
        except (KeyError, ValueError, OSError):  # unregistered (closed) meanwhile
            pass

    def unregister(self, sock: socket.socket) -> None:
        try:
            self._selector.unregister(sock)
        except (KeyError, ValueError, OSError):
            pass

    def _sweep(self) -> None:
        self.call_later(SWEEP_S, self._sweep)  # first: one connection's failure must not end the sweep
        now = time.monotonic()
        for conn in list(self.open_conns):
            _logged(lambda: conn.keepalive(now))
        for server in list(self.servers):
            _logged(lambda: server.expire_admissions(now))

    def _run(self) -> None:
        while True:
            timeout = 1.0
            if self._calls:
                timeout = 0.0
            elif self._timers:
                timeout = max(0.0, min(timeout, self._timers[0][0] - time.monotonic()))
            try:
                events = self._selector.select(timeout)
            except OSError:  # EINTR and the like: select again
                events = []
            for key, mask in events:
                if key.data is None:
                    try:
                        while self._wake_r.recv(4096):
                            pass
                    except (BlockingIOError, OSError):
                        pass
                    continue
                _logged(lambda: key.data.on_event(mask))
            while self._calls:
                _logged(self._calls.popleft())
            now = time.monotonic()
            while self._timers and self._timers[0][0] <= now:
                _logged(heapq.heappop(self._timers)[2])


def _logged(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:  # one connection's failure must not stop the others'
        log.exception("spark-share wire loop: a callback failed")


_loop: Loop | None = None
_loop_pid = 0
_loop_lock = threading.Lock()


def _after_fork_in_child() -> None:
    global _loop, _loop_lock
    _loop, _loop_lock = None, threading.Lock()  # the parent's thread is not here; its lock may be held


os.register_at_fork(after_in_child=_after_fork_in_child)


def get_loop() -> Loop:
    """This process's loop, started on first use (a forked child starts its own)."""
    global _loop, _loop_pid
    with _loop_lock:
        if _loop is None or _loop_pid != os.getpid():
            _loop, _loop_pid = Loop(), os.getpid()
        return _loop
