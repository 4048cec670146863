"""The RPC connection between our processes (tracker, agents, read tasks, the user's process), over TLS.

Owns: a symmetric connection where either side may call the other, on frames of ``frames``, and the
keepalive of every connection. The channel (credential, handshake, encryption) is ``tls``'s; where
connections start (server, dialing) is ``endpoints``'; the thread that moves the bytes is ``loop``'s.

Every connection of a process is served by that process's one loop thread (``loop.get_loop``): it reads
and decrypts frames, answers keepalives and flushes what senders queued. Requests run on a bounded
handler pool (a server's, shared by all its peers). A handler that must wait for another peer returns a
future instead of its reply, which leaves once that peer answered: no pool thread waits on a peer, so
requests that depend on one another (a read relayed by the tracker to an agent that then asks the
tracker) never fill the pool. Any thread may send: it encrypts and writes what the socket takes at
once, and queues the rest for the loop (waiting while too much is queued).

Keepalive: a connection that sent nothing for a while pings, which the peer's loop answers at once; one
that received nothing (no frame, no byte) for ``dead_after_s`` is closed as dead: a peer frozen, its
host gone or the network cut, which closes nothing by itself.

Must never: unpickle anything, block the loop thread, or put the secret in a log or an exception.
"""
from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from ..errors import AuthError, PeerConnectionError, ProtocolError, RemoteError, from_wire, wire_name
from .frames import CHUNK, FrameReader, encode_frame
from .loop import READ, WRITE, get_loop
from .tls import Blob, TlsEngine, new_secret

log = logging.getLogger("spark_share.transport.wire")

HIGH_WATER = 32 << 20  # ciphertext queued on one connection before its senders wait
# A connection that received nothing for this long is dead; one that sent nothing for a quarter of it
# sends a ping. The tracker tells its agents a bound from the group's record lock (``set_keepalive``).
DEAD_AFTER_S = 15.0

__all__ = ["AuthError", "RemoteError", "RpcConnection", "new_secret"]


# A reply (header, blob), or a future of one: a handler that waits for another peer answers once it has.
Handler = Callable[["RpcConnection", dict, Blob], "tuple | Future"]


class RpcConnection:
    """One authenticated connection on which both sides may send requests and get replies.

    Requests are handled on a thread pool (the server's, or the connection's own), so a slow handler
    does not block replies. ``on_close`` runs once when the connection ends, whoever ended it.
    """

    def __init__(self, sock: socket.socket, engine: TlsEngine, handler: Handler | None = None,
                 on_close: Callable[[RpcConnection], None] | None = None, name: str = "rpc",
                 pool: ThreadPoolExecutor | None = None, workers: int = 4,
                 scrub: Callable[[str], str] = lambda s: s, dead_after_s: float = DEAD_AFTER_S,
                 inline: Callable[[dict], bool] | None = None):
        self.sock = sock
        self.engine = engine
        self.name = name
        self._handler = handler
        self._inline = inline  # requests it says may be handled on the loop: brief, and never waiting on a peer
        self._scrub = scrub
        self._on_close = on_close
        self._pending: dict[int, Future] = {}
        self._ids = 0
        self._ids_lock = threading.Lock()
        self._own_pool = pool is None and handler is not None
        self._pool = pool if pool is not None else (
            ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"{name}-h") if handler else None)
        self._reader = FrameReader()
        self._frame_lock = threading.Lock()  # one frame's ciphertext at a time, in order
        self._out_lock = threading.Lock()
        self._drained = threading.Condition(self._out_lock)
        self._out: deque[memoryview] = deque()
        self._out_bytes = 0
        self._watching_write = False
        self._closed = False
        self._closed_event = threading.Event()
        self.info: dict = {}
        self.forged = False  # the peer's stream carried a TLS record that failed authentication
        self.bytes_sent = 0
        self.bytes_received = 0
        now = time.monotonic()
        self.last_recv = self.last_sent = now
        self.dead_after_s = dead_after_s
        self._loop = get_loop()
        sock.setblocking(False)
        self._loop.call_soon(self._start)

    # --- on the loop ------------------------------------------------------------------------------
    def _start(self) -> None:
        if self._closed:
            return
        self._loop.open_conns.add(self)
        self._loop.register(self.sock, READ, self)
        self._decrypt()  # what came with the handshake

    def on_event(self, mask: int) -> None:
        if mask & WRITE:
            self._flush()
        if mask & READ and not self._closed:
            try:
                data = self.sock.recv(CHUNK)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self.close()
                return
            self.last_recv = time.monotonic()
            self.bytes_received += len(data)
            self.engine.feed(data)
            self._decrypt()
            if not data:
                self.close()  # the peer closed its socket (a frame cut short is failed with it)

    def _decrypt(self) -> None:
        while not self._closed:
            try:
                n = self.engine.read_into(self._reader.want())
            except ssl.SSLEOFError:  # cut without TLS's close
                self.close()
                return
            except ssl.SSLError as e:
                if not self._closed:
                    self.forged = True
                    log.warning("%s: closed the connection: a TLS record failed (%s)", self.name,
                                e.reason or type(e).__name__)
                self.close()
                return
            if n is None:
                break
            if n == 0:  # the peer's TLS close
                self.close()
                return
            try:
                frames = self._reader.filled(n)
            except (ProtocolError, ValueError) as e:
                log.warning("%s: closed the connection: %s", self.name, e)
                self.close()
                return
            for frame in frames:
                self._dispatch(*frame)
        answer = self.engine.outgoing()  # only a key update request makes a read write; we never send one
        if answer:
            self._queue(answer)

    def _dispatch(self, header: dict, blob: Blob) -> None:
        kind = header.pop("_kind", None)
        rid = header.pop("_id", None)
        if kind == "ping":
            self._control({"_kind": "pong"})
        elif kind == "rep":
            fut = self._pending.pop(rid, None)
            if fut is None or fut.done():
                return
            if "_error" in header:
                # Our own error kinds come back as themselves (``except BatchRefused`` works across
                # processes); anything else as RemoteError("Type: message").
                fut.set_exception(from_wire(header.get("_type", ""), header["_error"]))
            else:
                fut.set_result((header, blob))
        elif kind == "req" and self._pool is not None:
            if self._inline is not None and self._inline(header):
                self._handle(rid, header, blob, inline=True)
                return
            try:
                self._pool.submit(self._handle, rid, header, blob)
            except RuntimeError:  # the pool shut down: the server or connection is closing
                pass

    def keepalive(self, now: float) -> None:
        if now - self.last_recv > self.dead_after_s:
            log.warning("%s: closed the connection: nothing came from the peer for %.0f s (it is frozen, its host "
                        "is gone or the network between us is cut)", self.name, now - self.last_recv)
            self.close()
        elif now - self.last_sent > self.dead_after_s / 4:
            self._control({"_kind": "ping"})

    def _flush(self) -> None:
        with self._out_lock:
            self._send_queued()
            if not self._out and self._watching_write:
                self._watching_write = False
                self._loop.modify(self.sock, READ, self)

    # --- from any thread --------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed_event.is_set()

    def set_keepalive(self, dead_after_s: float) -> None:
        """Close the connection once nothing came from the peer for ``dead_after_s``; ping it after a
        quarter of that without sending."""
        self.dead_after_s = dead_after_s

    def call_async(self, header: dict, blob: Blob = b"") -> Future:
        fut: Future = Future()
        with self._ids_lock:
            self._ids += 1
            rid = self._ids
        self._pending[rid] = fut
        if self._closed:
            self._pending.pop(rid, None)
            fut.set_exception(PeerConnectionError(f"{self.name}: connection closed"))
            return fut
        try:
            self._send(dict(header, _id=rid, _kind="req"), blob)
        except (OSError, ValueError) as e:  # PeerConnectionError is an OSError
            self._pending.pop(rid, None)
            if not fut.done():
                fut.set_exception(PeerConnectionError(f"{self.name}: send failed: {e}"))
            self.close()
        return fut

    def call(self, header: dict, blob: Blob = b"", timeout: float | None = None) -> tuple[dict, Blob]:
        fut = self.call_async(header, blob)
        try:
            return fut.result(timeout)
        except FutureTimeout:
            for rid, f in list(self._pending.items()):
                if f is fut:
                    self._pending.pop(rid, None)
            raise

    def _handle(self, rid, header, blob, inline: bool = False) -> None:
        then: list[Callable[[], None]] = []  # a reply (rep, blob, then) runs then() once it is sent (not inline)
        try:
            assert self._handler is not None  # requests are only handled on connections that have one
            out = self._handler(self, header, blob)
            if isinstance(out, Future):  # answered once another peer answers: no thread waits for it
                out.add_done_callback(lambda f: self._answer_later(rid, header.get("op"), f))
                return
            rep, rblob, *then = out
            rep = dict(rep or {})
        except Exception as e:
            rep, rblob = self.error_reply(header.get("op"), e), b""
        reply = dict(rep, _id=rid, _kind="rep")
        if not inline:
            self._send_or_close(reply, rblob)
            for after in then:
                after()
            return
        # On the loop, never waiting: a reply with a blob, or one that finds a sender in the middle of a
        # frame (it may be waiting for the loop to flush), leaves from the pool.
        if rblob or not self._frame_lock.acquire(blocking=False):
            self._submit(self._send_or_close, reply, rblob)
            return
        try:
            self._encrypt(encode_frame(reply, b"")[0], wait=False)
        except (OSError, ValueError):
            self.close()
        finally:
            self._frame_lock.release()

    def error_reply(self, op, e: BaseException) -> dict:
        """What the peer gets of a handler's error: its message, scrubbed (client errors may quote
        configs), and its kind when it is one of ours (raised again as itself on the other side)."""
        log.debug("%s: handler failed for %s", self.name, op, exc_info=e)
        name = wire_name(e)
        if name is not None:
            return {"_error": self._scrub(str(e)), "_type": name}
        return {"_error": self._scrub(f"{type(e).__name__}: {e}")}

    def _answer_later(self, rid, op, fut: Future) -> None:
        """The reply to a request whose handler returned a future, once it is done (on whichever thread
        finished it, often the loop: the reply leaves from the pool)."""
        try:
            rep, rblob = fut.result(timeout=0)
            rep = dict(rep or {})
        except BaseException as e:  # noqa: BLE001 - a cancelled future too: the peer must get an answer
            rep, rblob = self.error_reply(op, e), b""
        self._submit(self._send_or_close, dict(rep, _id=rid, _kind="rep"), rblob)

    def _submit(self, fn, *args) -> None:
        try:
            self._pool.submit(fn, *args)  # type: ignore[union-attr]
        except RuntimeError:  # closing
            pass

    def _send_or_close(self, header: dict, blob: Blob) -> None:
        try:
            self._send(header, blob)
        except (OSError, ValueError):
            self.close()

    def _send(self, header: dict, blob: Blob) -> None:
        prefix, blob = encode_frame(header, blob)
        with self._frame_lock:
            self._encrypt(prefix, wait=True)
            if blob:
                with memoryview(blob) as view, view.cast("B") as data:
                    for at in range(0, len(data), CHUNK):
                        self._encrypt(data[at: at + CHUNK], wait=True)

    def _control(self, header: dict) -> None:
        """A ping or a pong, from the loop: skipped while a sender is in the middle of a frame (the peer
        hears that frame instead), never waiting."""
        if self._closed or not self._frame_lock.acquire(blocking=False):
            return
        try:
            self._encrypt(encode_frame(header, b"")[0], wait=False)
        except (OSError, ValueError):
            self.close()
        finally:
            self._frame_lock.release()

    def _encrypt(self, plain, wait: bool) -> None:
        self._queue(self.engine.encrypt(plain), wait)

    def _queue(self, data: bytes, wait: bool = False) -> None:
        """Send ``data`` now as far as the socket takes it, and queue the rest for the loop."""
        with self._out_lock:
            if self._closed:
                raise PeerConnectionError(f"{self.name}: connection closed")
            self.last_sent = time.monotonic()
            self._out.append(memoryview(data))
            self._out_bytes += len(data)
            if len(self._out) == 1:
                self._send_queued()
            if self._out and not self._watching_write:
                self._watching_write = True
                self._loop.call_soon(lambda: self._loop.modify(self.sock, READ | WRITE, self)
                                     if self._watching_write and not self._closed else None)
            while wait and self._out_bytes > HIGH_WATER and not self._closed:
                if not self._drained.wait(self.dead_after_s) and self._out_bytes > HIGH_WATER:
                    raise PeerConnectionError(f"{self.name}: the peer took nothing for {self.dead_after_s:.0f} s")
            if self._closed:
                raise PeerConnectionError(f"{self.name}: connection closed")

    def _send_queued(self) -> None:
        """Write what the socket takes now. Call with ``_out_lock`` held."""
        while self._out:
            head = self._out[0]
            try:
                n = self.sock.send(head)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self._out.clear()
                self._out_bytes = 0
                self._loop.call_soon(self.close)
                break
            self.bytes_sent += n
            self._out_bytes -= n
            if n < len(head):
                self._out[0] = head[n:]
                break
            self._out.popleft()
        self._drained.notify_all()

    def close(self) -> None:
        with self._out_lock:
            if self._closed:
                return
            self._closed = True
            quiet = not self._out
            self._drained.notify_all()
        self._closed_event.set()
        if quiet and self._frame_lock.acquire(blocking=False):
            try:  # TLS's close, when no frame is half sent (it would come between that frame's records)
                self.sock.send(self.engine.close_notify(), socket.MSG_DONTWAIT)
            except (OSError, ValueError):
                pass
            finally:
                self._frame_lock.release()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # the peer learns at once
        except OSError:
            pass
        for rid, fut in list(self._pending.items()):
            self._pending.pop(rid, None)
            if not fut.done():
                try:
                    fut.set_exception(PeerConnectionError(f"{self.name}: connection closed"))
                except Exception:  # set by the loop meanwhile
                    pass
        self._loop.call_soon(self._finish)
        if self._own_pool and self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._on_close is not None:
            on_close = self._on_close
            self._loop.run_off_loop(lambda: on_close(self))

    def _finish(self) -> None:
        self._loop.open_conns.discard(self)
        self._loop.unregister(self.sock)
        try:
            self.sock.close()
        except OSError:
            pass

    def wait_closed(self, timeout: float | None = None) -> bool:
        return self._closed_event.wait(timeout)
