"""Bundling a host's reads' requests to the tracker: while one is on its way, the next ones wait and leave
together as one ``Bundle`` (the tracker's ``dispatcher`` unpacks it), so a host whose read tasks start at
once costs the tracker one message, not one per task.

Owns: ``Bundler``, used by an agent for its reads' Claims, Mores and Acquireds (``protocol.BUNDLED``).
Must never: delay a request when none is on its way (no timer), or hand one caller another's reply.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

from ..errors import ProtocolError, from_wire
from .protocol import BUNDLED, Bundle, Message


class Bundler:
    """``BUNDLED`` requests on one connection, from any number of threads: while one is on its way, the
    next ones queue and leave together, as one ``Bundle``, when its answer comes (a host's read tasks
    start together; the tracker then serves one message for them). A request with none on its way
    leaves at once: no timer, no added wait. Each caller gets its own reply or error, as ``call``'s."""

    def __init__(self, conn):
        self._conn = conn
        self._lock = threading.Lock()
        self._queued: list[tuple[dict, Future]] = []
        self._on_its_way = False
        # The next bundle leaves from here, not from the wire's loop that delivers the answer: a send may
        # wait for the loop to flush.
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bundler")

    def call(self, msg: Message, timeout: float | None = None) -> tuple[dict, bytes]:
        """``msg``'s reply, or its error, as ``call``'s."""
        if msg.op not in BUNDLED:
            raise ProtocolError(f"request {msg.op!r} cannot come in a bundle")
        fut: Future = Future()
        with self._lock:
            self._queued.append((msg.header(), fut))
            lead, self._on_its_way = not self._on_its_way, True
        if lead:
            self._send()
        return fut.result(timeout), b""

    def close(self) -> None:
        self._sender.shutdown(wait=False)

    def _send(self) -> None:
        with self._lock:
            items, self._queued = self._queued, []
            if not items:
                self._on_its_way = False
                return
        header = items[0][0] if len(items) == 1 else Bundle([h for h, _ in items]).header()
        self._conn.call_async(header).add_done_callback(lambda f: self._answered(f, items))

    def _answered(self, sent: Future, items: list[tuple[dict, Future]]) -> None:
        try:
            rep, _ = sent.result()
            replies = [rep] if len(items) == 1 else rep["replies"]
            if len(replies) != len(items):
                raise ProtocolError(f"a bundle of {len(items)} requests got {len(replies)} replies")
        except BaseException as e:  # noqa: BLE001 - the connection's error is each request's
            for _, fut in items:
                fut.set_exception(e)
        else:
            for (_, fut), r in zip(items, replies):
                if "_error" in r:
                    fut.set_exception(from_wire(r.get("_type", ""), r["_error"]))
                else:
                    fut.set_result(r)
        try:
            self._sender.submit(self._send)
        except RuntimeError:  # closed: what queued since fails as the connection does
            self._fail_queued()

    def _fail_queued(self) -> None:
        with self._lock:
            items, self._queued, self._on_its_way = self._queued, [], False
        for _, fut in items:
            fut.set_exception(ProtocolError("the connection's bundler is closed"))
