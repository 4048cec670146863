"""Frames and RPC between our processes (tracker, agents, read tasks, the user's process), over TLS.

Owns: the frame format (a JSON header plus an optional binary blob, Arrow IPC for record data, on a
``tls.TlsStream``), a small symmetric RPC connection where either side may call the other, the
server that admits only peers with the query's credential, and ``connect``. The channel itself
(credential, handshake, encryption) is ``tls``'s.

A connection cut in a frame ends it (the lengths say a frame is short); a frame over the bounds
ends it too.

Must never: unpickle anything (headers are JSON, blobs are handed to Arrow), or put the secret in a
log line or an exception message.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import ssl
import struct
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from ..errors import WIRE_ERRORS, AuthError, PeerConnectionError, ProtocolError, RemoteError, wire_name
from .tls import Blob, TlsStream, admit, contexts, new_secret

log = logging.getLogger("spark_share.transport.wire")

_FRAME = struct.Struct("!IQ")  # header length, blob length
MAX_HEADER = 64 << 20
MAX_BLOB = 4 << 30

__all__ = ["AuthError", "RemoteError", "RpcConnection", "RpcServer", "connect", "new_secret"]


# --- frames -----------------------------------------------------------------------------------------
def _recv_exact(stream: TlsStream, n: int) -> bytes:
    return bytes(_recv_into_buffer(stream, n))


def _recv_into_buffer(stream: TlsStream, n: int) -> bytearray:
    """``n`` bytes, received into one buffer that is handed on as it is (a blob is megabytes)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = stream.recv_into(view[got:], n - got)
        if k == 0:
            raise PeerConnectionError("connection closed by peer")
        got += k
    return buf


def send_frame(stream: TlsStream, header: dict, blob: Blob) -> None:
    h = json.dumps(header, separators=(",", ":")).encode()
    prefix = _FRAME.pack(len(h), len(blob))
    if blob:
        stream.sendall(prefix + h, blob)
    else:
        stream.sendall(prefix + h)


def recv_frame(stream: TlsStream) -> tuple[dict, Blob]:
    hl, bl = _FRAME.unpack(_recv_exact(stream, _FRAME.size))
    if hl > MAX_HEADER or bl > MAX_BLOB:
        raise ProtocolError(f"oversized frame ({hl} + {bl} bytes)")
    header = json.loads(_recv_exact(stream, hl))
    if not isinstance(header, dict):
        raise ProtocolError("malformed frame header")
    return header, (_recv_into_buffer(stream, bl) if bl else b"")


Handler = Callable[["RpcConnection", dict, Blob], tuple[dict, Blob]]


class RpcConnection:
    """One authenticated connection on which both sides may send requests and get replies.

    Requests are handled on a small thread pool so a slow handler does not block replies.
    ``on_close`` runs once when the connection ends, whoever ended it.
    """

    def __init__(self, stream: TlsStream, handler: Handler | None = None,
                 on_close: Callable[[RpcConnection], None] | None = None, name: str = "rpc",
                 workers: int = 4, scrub: Callable[[str], str] = lambda s: s):
        self.stream = stream
        self.name = name
        self._handler = handler
        self._scrub = scrub
        self._on_close = on_close
        self._pending: dict[int, Future] = {}
        self._ids = 0
        self._ids_lock = threading.Lock()
        self._closed = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"{name}-h") if handler else None
        self.info: dict = {}
        self.forged = False  # the peer's stream carried a TLS record that failed authentication
        self._thread = threading.Thread(target=self._read_loop, name=f"{name}-reader", daemon=True)
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def call_async(self, header: dict, blob: Blob = b"") -> Future:
        fut: Future = Future()
        with self._ids_lock:
            self._ids += 1
            rid = self._ids
        self._pending[rid] = fut
        if self._closed.is_set():
            self._pending.pop(rid, None)
            fut.set_exception(PeerConnectionError(f"{self.name}: connection closed"))
            return fut
        try:
            send_frame(self.stream, dict(header, _id=rid, _kind="req"), blob)
        except (OSError, ValueError) as e:  # ssl.SSLError is an OSError
            self._pending.pop(rid, None)
            fut.set_exception(PeerConnectionError(f"{self.name}: send failed: {e}"))
            self.close()
        return fut

    def call(self, header: dict, blob: Blob = b"", timeout: float | None = None) -> tuple[dict, Blob]:
        return self.call_async(header, blob).result(timeout)

    def _read_loop(self) -> None:
        try:
            while True:
                header, blob = recv_frame(self.stream)
                kind = header.pop("_kind", None)
                rid = header.pop("_id", None)
                if kind == "rep":
                    fut = self._pending.pop(rid, None)
                    if fut is None:
                        continue
                    if "_error" in header:
                        # Our own error kinds come back as themselves (``except BatchRefused`` works across
                        # processes); anything else as RemoteError("Type: message").
                        cls = WIRE_ERRORS.get(header.get("_type", ""), RemoteError)
                        fut.set_exception(cls(header["_error"]))
                    else:
                        fut.set_result((header, blob))
                elif kind == "req" and self._pool is not None:
                    self._pool.submit(self._handle, rid, header, blob)
        except ssl.SSLError as e:
            if not self._closed.is_set():
                self.forged = True
                log.warning("%s: closed the connection: a TLS record failed (%s)", self.name,
                            e.reason or type(e).__name__)
        except (OSError, ConnectionError, ValueError, RuntimeError):  # RuntimeError: pool shut down on close
            pass
        finally:
            self.close()

    def _handle(self, rid, header, blob) -> None:
        try:
            assert self._handler is not None  # requests are only handled on connections that have one
            rep, rblob = self._handler(self, header, blob)
            rep = dict(rep or {})
        except Exception as e:  # the peer gets the message, scrubbed: client errors may quote configs
            log.debug("%s: handler failed for %s", self.name, header.get("op"), exc_info=True)
            name = wire_name(e)
            if name is not None:
                rep, rblob = {"_error": self._scrub(str(e)), "_type": name}, b""
            else:
                rep, rblob = {"_error": self._scrub(f"{type(e).__name__}: {e}")}, b""
        try:
            send_frame(self.stream, dict(rep, _id=rid, _kind="rep"), rblob)
        except (OSError, ValueError):
            self.close()

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self.stream.close()
        for rid, fut in list(self._pending.items()):
            self._pending.pop(rid, None)
            if not fut.done():
                fut.set_exception(PeerConnectionError(f"{self.name}: connection closed"))
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._on_close is not None:
            try:
                self._on_close(self)
            except Exception:
                log.debug("on_close failed", exc_info=True)

    def wait_closed(self, timeout: float | None = None) -> bool:
        return self._closed.wait(timeout)


def connect(address, secret: str, handler: Handler | None = None, timeout: float = 10.0,
            name: str = "rpc", on_close=None, scrub: Callable[[str], str] = lambda s: s) -> RpcConnection:
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
    return RpcConnection(stream, handler, on_close=on_close, name=name, scrub=scrub)


class RpcServer:
    """Accepts authenticated connections on a TCP (host, port) or a Unix socket path.

    Peers that fail the handshake are refused and logged (without the secret).
    """

    def __init__(self, address, secret: str, handler: Handler, name: str = "server", on_close=None,
                 scrub: Callable[[str], str] = lambda s: s):
        self._secret = secret
        contexts(secret)  # a bad credential fails here, not in every peer's handshake
        self._handler = handler
        self._scrub = scrub
        self._on_close = on_close
        self.name = name
        self.refused = 0  # peers that failed the handshake
        self.forged = 0  # connections closed on a TLS record that failed authentication
        self.connections: list = []
        self._lock = threading.Lock()
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
        sock.listen(128)
        self._sock = sock
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name=f"{name}-accept", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, peer = self._sock.accept()
            except OSError:
                break
            threading.Thread(target=self._admit, args=(conn, peer), daemon=True,
                             name=f"{self.name}-admit").start()

    def _admit(self, conn: socket.socket, peer) -> None:
        try:
            if conn.family != socket.AF_UNIX:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            stream = admit(conn, self._secret, server_side=True)
        except (AuthError, OSError, ConnectionError) as e:
            self.refused += 1
            log.warning("%s: refused a connection from %s: %s", self.name, peer or "a local peer", e)
            try:
                conn.close()
            except OSError:
                pass
            return
        rpc = RpcConnection(stream, self._handler, on_close=self._closed, name=self.name, workers=8,
                            scrub=self._scrub)
        with self._lock:
            closing = self._stopped.is_set()
            if not closing:
                self.connections.append(rpc)
        if closing:
            # Admitted while the server closes: it must not outlive it. Closed outside the lock, which
            # its on_close (``_closed``) takes.
            rpc.close()

    def _closed(self, rpc: RpcConnection) -> None:
        with self._lock:
            if rpc in self.connections:
                self.connections.remove(rpc)
            self.forged += rpc.forged
        if self._on_close:
            self._on_close(rpc)

    def close(self) -> None:
        self._stopped.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
        except OSError:
            pass
        try:
            self._sock.close()
        except OSError:
            pass
        if isinstance(self.address, str):
            try:
                os.unlink(self.address)
            except OSError:
                pass
        with self._lock:
            conns = list(self.connections)
        for c in conns:
            c.close()
