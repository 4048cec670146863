"""Frames and RPC between our processes (tracker, agents, read tasks, the user's process), over TLS.

Owns: the frame format (a JSON header plus an optional binary blob, Arrow IPC for record data), a
symmetric RPC connection where either side may call the other, the server that admits only peers with
the query's credential, ``connect``, and the keepalive of every connection. The channel itself
(credential, handshake, encryption) is ``tls``'s; the thread that moves the bytes is ``loop``'s.

Every connection of a process is served by that process's one loop thread (``loop.get_loop``): it
accepts, runs servers' handshakes, reads and decrypts frames, answers keepalives and flushes what
senders queued. Requests run on a bounded handler pool (a server's, shared by all its peers), so a
tracker's threads do not grow with its agents. A handler that must wait for another peer returns a
future instead of its reply, which leaves once that peer answered: no pool thread waits on a peer, so
requests that depend on one another (a read relayed by the tracker to an agent that then asks the
tracker) never fill the pool and wait on each other. Any thread may send: it encrypts and writes what
the socket takes at once, and queues the rest for the loop (waiting while too much is queued).

Keepalive: a connection that sent nothing for a while sends a ping, which the peer's loop answers
at once; a connection that received nothing (no frame, no byte) for ``dead_after_s`` is closed as
dead: a peer frozen, its host gone or the network cut, which closes nothing by itself. The accept
loop survives running out of descriptors (it logs, pauses and accepts again).

A connection cut in a frame ends it (the lengths say a frame is short); a frame over the bounds
ends it too.

Must never: unpickle anything (headers are JSON, blobs are handed to Arrow), block the loop thread,
or put the secret in a log line or an exception message.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import socket
import ssl
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from ..errors import WIRE_ERRORS, AuthError, PeerConnectionError, ProtocolError, RemoteError, wire_name
from .loop import READ, WRITE, get_loop
from .tls import HANDSHAKE_TIMEOUT, READY, Blob, TlsEngine, admit, contexts, failure_text, new_secret

log = logging.getLogger("spark_share.transport.wire")

_FRAME = struct.Struct("!IQ")  # header length, blob length
MAX_HEADER = 64 << 20
MAX_BLOB = 4 << 30
_CHUNK = 256 << 10  # plaintext encrypted at once, and bytes read from a socket at once
HIGH_WATER = 32 << 20  # ciphertext queued on one connection before its senders wait
# A connection that received nothing for this long is dead; one that sent nothing for a quarter of it
# sends a ping. The tracker tells its agents a bound from the group's record lock (``set_keepalive``).
DEAD_AFTER_S = 15.0
SWEEP_S = 0.5
SERVER_WORKERS = 32  # a server's handler threads, whatever its number of peers
ACCEPT_PAUSE_S = 0.5  # out of descriptors: accept again after this long
_PAUSE_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)

__all__ = ["AuthError", "RemoteError", "RpcConnection", "RpcServer", "connect", "new_secret"]


class _FrameReader:
    """Turns plaintext into frames. TLS decrypts into one scratch buffer, from which the prefixes and
    headers of however many frames a record holds are parsed; once a blob starts, what follows is
    decrypted straight into the blob's own buffer, handed on as it is (a blob is megabytes)."""

    def __init__(self) -> None:
        self._scratch = bytearray(_CHUNK)
        self._scratch_view = memoryview(self._scratch)
        self._pending = bytearray()  # plaintext received and not yet parsed: the start of a frame
        self._header: dict = {}
        self._blob: bytearray | None = None
        self._blob_got = 0

    def want(self) -> memoryview:
        """Where the next plaintext goes."""
        if self._blob is not None:
            return memoryview(self._blob)[self._blob_got:]
        return self._scratch_view

    def filled(self, n: int) -> list[tuple[dict, Blob]]:
        """``n`` more bytes are in ``want()``'s view: the frames now complete."""
        if self._blob is not None:
            self._blob_got += n
            return [self._blob_done()] if self._blob_got == len(self._blob) else []
        self._pending += self._scratch_view[:n]
        frames = []
        at = 0
        pending = self._pending
        while len(pending) - at >= _FRAME.size:
            hl, bl = _FRAME.unpack_from(pending, at)
            if hl > MAX_HEADER or bl > MAX_BLOB or hl == 0:
                raise ProtocolError(f"oversized or empty frame ({hl} + {bl} bytes)")
            if len(pending) - at < _FRAME.size + hl:
                break
            header = json.loads(pending[at + _FRAME.size: at + _FRAME.size + hl])
            if not isinstance(header, dict):
                raise ProtocolError("malformed frame header")
            at += _FRAME.size + hl
            if not bl:
                frames.append((header, b""))
                continue
            self._header, self._blob = header, bytearray(bl)
            self._blob_got = min(bl, len(pending) - at)
            self._blob[:self._blob_got] = pending[at: at + self._blob_got]
            at += self._blob_got
            if self._blob_got < bl:
                break  # the rest is decrypted straight into it
            frames.append(self._blob_done())
        del pending[:at]
        return frames

    def _blob_done(self) -> tuple[dict, Blob]:
        assert self._blob is not None
        frame = (self._header, self._blob)
        self._blob, self._blob_got = None, 0
        return frame


def encode_frame(header: dict, blob: Blob) -> tuple[bytes, Blob]:
    h = json.dumps(header, separators=(",", ":")).encode()
    return _FRAME.pack(len(h), len(blob)) + h, blob


# A reply (header, blob), or a future of one: a handler that waits for another peer answers once it has.
Handler = Callable[["RpcConnection", dict, Blob], "tuple[dict, Blob] | Future"]


def _ensure_sweep(loop) -> None:
    """Start the loop's keepalive sweep (once per loop): pings, dead peers, handshakes that take too long."""
    if getattr(loop, "swept", False):
        return
    loop.swept = True

    def sweep() -> None:
        now = time.monotonic()
        for conn in list(loop.open_conns):
            conn._keepalive(now)
        for server in list(loop.servers):
            server._expire_admissions(now)
        loop.call_later(SWEEP_S, sweep)

    loop.call_soon(sweep)


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
        self._reader = _FrameReader()
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
        _ensure_sweep(self._loop)
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
                data = self.sock.recv(_CHUNK)
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
                fut.set_exception(error_of(header))
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

    def _keepalive(self, now: float) -> None:
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
        try:
            assert self._handler is not None  # requests are only handled on connections that have one
            out = self._handler(self, header, blob)
            if isinstance(out, Future):  # answered once another peer answers: no thread waits for it
                out.add_done_callback(lambda f: self._answer_later(rid, header.get("op"), f))
                return
            rep, rblob = out
            rep = dict(rep or {})
        except Exception as e:
            rep, rblob = self.error_reply(header.get("op"), e), b""
        reply = dict(rep, _id=rid, _kind="rep")
        if not inline:
            self._send_or_close(reply, rblob)
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
                    for at in range(0, len(data), _CHUNK):
                        self._encrypt(data[at: at + _CHUNK], wait=True)

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


def error_of(reply: dict) -> Exception:
    """The exception a reply with ``_error`` stands for: one of our kinds as itself, else RemoteError."""
    return WIRE_ERRORS.get(reply.get("_type", ""), RemoteError)(reply["_error"])


def connect(address, secret: str, handler: Handler | None = None, timeout: float = 10.0,
            name: str = "rpc", on_close=None, scrub: Callable[[str], str] = lambda s: s,
            workers: int = 4, inline: Callable[[dict], bool] | None = None) -> RpcConnection:
    """Connect to a TCP (host, port) or Unix socket path, authenticate, return the connection."""
    if isinstance(address, str):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    else:
        sock = socket.socket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(timeout)
    try:
        sock.connect(address if isinstance(address, str) else tuple(address))
        stream = admit(sock, secret, server_side=False)
    except BaseException:
        sock.close()
        raise
    return RpcConnection(sock, stream.engine, handler, on_close=on_close, name=name, workers=workers, scrub=scrub,
                         inline=inline)


class _Admission:
    """A peer's TLS handshake, on the loop: it becomes an ``RpcConnection`` once the peer proved the
    query's certificate, or is refused (logged, counted) when it does not, or takes too long."""

    def __init__(self, server: RpcServer, sock: socket.socket, peer):
        self.server, self.sock, self.peer = server, sock, peer
        server_ctx, _, self._pinned = contexts(server._secret)
        self.engine = TlsEngine(server_ctx, server_side=True)
        self.started = time.monotonic()
        self._out = b""
        self._done = False  # the handshake is done and READY made: what is left is sending it

    def on_event(self, mask: int) -> None:
        loop = self.server._loop
        if mask & READ and not self._done:
            try:
                data = self.sock.recv(_CHUNK)
            except (BlockingIOError, InterruptedError):
                data = None
            except OSError as e:
                self.refuse(str(e))
                return
            if data is not None:
                if not data:
                    self.refuse("the peer closed the connection during the TLS handshake")
                    return
                self.engine.feed(data)
        if not self._done:
            try:
                done = self.engine.handshake()
            except ssl.SSLError as e:
                self.refuse(f"TLS handshake failed: {failure_text(e)}")
                return
            if done and not self.engine.peer_is(self._pinned):
                self.refuse("the peer's certificate is not the query's")
                return
            self._out += self.engine.outgoing()
            if done:
                self._done = True
                self._out += self.engine.encrypt(READY)  # we verified the peer: it may send frames
        try:
            n = self.sock.send(self._out) if self._out else 0
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError as e:
            self.refuse(str(e))
            return
        self._out = self._out[n:]
        if self._out:
            loop.modify(self.sock, READ | WRITE, self)
        elif self._done:
            self.server._admitted(self)

    def refuse(self, why: str) -> None:
        self.server._refuse(self, why)


class RpcServer:
    """Accepts authenticated connections on a TCP (host, port) or a Unix socket path.

    Peers that fail the handshake are refused and logged (without the secret). Its handler runs on
    ``workers`` threads shared by all its connections.
    """

    def __init__(self, address, secret: str, handler: Handler, name: str = "server", on_close=None,
                 scrub: Callable[[str], str] = lambda s: s, workers: int = SERVER_WORKERS,
                 inline: Callable[[dict], bool] | None = None):
        self._secret = secret
        self._inline = inline
        contexts(secret)  # a bad credential fails here, not in every peer's handshake
        self._handler = handler
        self._scrub = scrub
        self._on_close = on_close
        self.name = name
        self.refused = 0  # peers that failed the handshake
        self.forged = 0  # connections closed on a TLS record that failed authentication
        self.accept_pauses = 0  # times the accept loop ran out of descriptors (or memory) and paused
        self.connections: list[RpcConnection] = []
        self._admitting: set[_Admission] = set()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"{name}-h")
        self._stopped = threading.Event()
        if isinstance(address, str):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            old = os.umask(0o177)
            try:
                sock.bind(address)
            finally:
                os.umask(old)
            os.chmod(address, 0o600)
            self.address = address
        else:
            sock = socket.socket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(tuple(address))
            except OSError:
                sock.close()
                raise
            self.address = sock.getsockname()[:2]
        sock.listen(512)
        sock.setblocking(False)
        self._sock = sock
        self._loop = get_loop()
        _ensure_sweep(self._loop)
        self._loop.call_soon(self._listen)

    # --- on the loop ------------------------------------------------------------------------------
    def _listen(self) -> None:
        if self._stopped.is_set() and self._sock.fileno() < 0:
            return
        self._loop.servers.add(self)
        self._loop.register(self._sock, READ, self)

    def on_event(self, mask: int) -> None:
        """The listener is readable: take every peer waiting."""
        while True:
            try:
                conn, peer = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in _PAUSE_ERRNOS:
                    # Out of descriptors (or memory): the peers wait in the backlog; try again soon.
                    self.accept_pauses += 1
                    if self.accept_pauses == 1 or self.accept_pauses % 100 == 0:
                        log.warning("%s: cannot accept a connection (%s); accepting again in %.1f s (%d times so far)",
                                    self.name, os.strerror(e.errno or 0), ACCEPT_PAUSE_S, self.accept_pauses)
                    self._loop.unregister(self._sock)
                    self._loop.call_later(ACCEPT_PAUSE_S, self._resume)
                    return
                if self._sock.fileno() < 0:  # closed
                    return
                log.info("%s: accept failed (%s); going on", self.name, e)
                continue
            conn.setblocking(False)
            if conn.family != socket.AF_UNIX:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            admission = _Admission(self, conn, peer)
            self._admitting.add(admission)
            self._loop.register(conn, READ, admission)

    def _resume(self) -> None:
        if not self._stopped.is_set() and self._sock.fileno() >= 0:
            try:
                self._loop.register(self._sock, READ, self)
            except (KeyError, ValueError, OSError):
                pass

    def _admitted(self, a: _Admission) -> None:
        self._admitting.discard(a)
        self._loop.unregister(a.sock)
        rpc = RpcConnection(a.sock, a.engine, self._handler, on_close=self._closed, name=self.name,
                            pool=self._pool, scrub=self._scrub, inline=self._inline)
        with self._lock:
            closing = self._stopped.is_set()
            if not closing:
                self.connections.append(rpc)
        if closing:  # admitted while the server closes: it must not outlive it
            rpc.close()

    def _refuse(self, a: _Admission, why: str) -> None:
        self._admitting.discard(a)
        self._loop.unregister(a.sock)
        self.refused += 1
        log.warning("%s: refused a connection from %s: %s", self.name, a.peer or "a local peer", why)
        try:
            a.sock.close()
        except OSError:
            pass

    def _expire_admissions(self, now: float) -> None:
        for a in list(self._admitting):
            if now - a.started > HANDSHAKE_TIMEOUT:
                a.refuse(f"no TLS handshake within {HANDSHAKE_TIMEOUT:.0f} s")

    # --- from any thread --------------------------------------------------------------------------
    def _closed(self, rpc: RpcConnection) -> None:
        with self._lock:
            if rpc in self.connections:
                self.connections.remove(rpc)
            self.forged += rpc.forged
        if self._on_close:
            self._on_close(rpc)

    def close(self) -> None:
        self._stopped.set()

        def stop_listening() -> None:
            self._loop.servers.discard(self)
            self._loop.unregister(self._sock)
            try:
                self._sock.close()
            except OSError:
                pass
            for a in list(self._admitting):
                self._admitting.discard(a)
                self._loop.unregister(a.sock)
                a.sock.close()

        if self._loop.in_loop:
            stop_listening()
        else:
            done = threading.Event()

            def stop_and_say() -> None:
                stop_listening()
                done.set()

            self._loop.call_soon(stop_and_say)
            done.wait(5)
        if isinstance(self.address, str):
            try:
                os.unlink(self.address)
            except OSError:
                pass
        with self._lock:
            conns = list(self.connections)
        for c in conns:
            c.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
