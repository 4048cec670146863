"""Authenticated framing between our processes (tracker, agents, read tasks, the user's process).

Owns: the handshake (mutual HMAC-SHA256 challenge over a per-query secret), the frame format
(a JSON header plus an optional binary blob, Arrow IPC for record data) and a small symmetric
RPC connection where either side may call the other.

Must never: unpickle anything (headers are JSON, blobs are handed to Arrow), accept a peer that
has not proven it knows the secret, or put the secret in a log line or an exception message.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import struct
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from .errors import WIRE_ERRORS, AuthError, RemoteError, SparkShareError

log = logging.getLogger("spark_share.wire")

_MAGIC = b"SSHR1"
_NONCE = 32
_FRAME = struct.Struct("!IQ")  # header length, blob length
MAX_HEADER = 64 << 20
MAX_BLOB = 4 << 30
HANDSHAKE_TIMEOUT = 10.0


__all__ = ["AuthError", "RemoteError", "RpcConnection", "RpcServer", "connect", "new_secret"]


def new_secret() -> str:
    return secrets.token_hex(32)


def _mac(secret: str, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret.encode(), role + nonce, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("connection closed by peer")
        got += k
    return bytes(buf)


def server_handshake(sock: socket.socket, secret: str) -> None:
    """Challenge the connecting peer, then prove ourselves. Raises AuthError on a bad peer."""
    sock.settimeout(HANDSHAKE_TIMEOUT)
    nonce = os.urandom(_NONCE)
    sock.sendall(_MAGIC + nonce)
    reply = _recv_exact(sock, len(_MAGIC) + 32 + _NONCE)
    if reply[: len(_MAGIC)] != _MAGIC:
        raise AuthError("peer does not speak the spark-share protocol")
    their_mac, their_nonce = reply[len(_MAGIC): len(_MAGIC) + 32], reply[len(_MAGIC) + 32:]
    if not hmac.compare_digest(their_mac, _mac(secret, b"client", nonce)):
        sock.sendall(b"\x00")
        raise AuthError("peer failed authentication (wrong or missing per-query secret)")
    sock.sendall(b"\x01" + _mac(secret, b"server", their_nonce))
    sock.settimeout(None)


def client_handshake(sock: socket.socket, secret: str) -> None:
    sock.settimeout(HANDSHAKE_TIMEOUT)
    hello = _recv_exact(sock, len(_MAGIC) + _NONCE)
    if hello[: len(_MAGIC)] != _MAGIC:
        raise AuthError("server does not speak the spark-share protocol")
    nonce = os.urandom(_NONCE)
    sock.sendall(_MAGIC + _mac(secret, b"client", hello[len(_MAGIC):]) + nonce)
    ok = _recv_exact(sock, 1)
    if ok != b"\x01":
        raise AuthError("server refused our credentials (per-query secret mismatch)")
    if not hmac.compare_digest(_recv_exact(sock, 32), _mac(secret, b"server", nonce)):
        raise AuthError("server failed authentication")
    sock.settimeout(None)


def send_frame(sock: socket.socket, header: dict, blob: bytes = b"", lock: threading.Lock | None = None) -> None:
    h = json.dumps(header, separators=(",", ":")).encode()
    prefix = _FRAME.pack(len(h), len(blob))
    if lock is not None:
        with lock:
            sock.sendall(prefix + h)
            if blob:
                sock.sendall(blob)
    else:
        sock.sendall(prefix + h)
        if blob:
            sock.sendall(blob)


def recv_frame(sock: socket.socket) -> tuple[dict, bytes]:
    hl, bl = _FRAME.unpack(_recv_exact(sock, _FRAME.size))
    if hl > MAX_HEADER or bl > MAX_BLOB:
        raise ConnectionError(f"oversized frame ({hl} + {bl} bytes)")
    header = json.loads(_recv_exact(sock, hl))
    if not isinstance(header, dict):
        raise ConnectionError("malformed frame header")
    blob = _recv_exact(sock, bl) if bl else b""
    return header, blob


Handler = Callable[["RpcConnection", dict, bytes], tuple[dict, bytes]]


class RpcConnection:
    """One authenticated socket on which both sides may send requests and get replies.

    Requests are handled on a small thread pool so a slow handler does not block replies.
    ``on_close`` runs once when the connection ends, whoever ended it.
    """

    def __init__(self, sock: socket.socket, handler: Handler | None = None,
                 on_close: Callable[[RpcConnection], None] | None = None, name: str = "rpc",
                 workers: int = 4, scrub: Callable[[str], str] = lambda s: s):
        self.sock = sock
        self.name = name
        self._handler = handler
        self._scrub = scrub
        self._on_close = on_close
        self._send_lock = threading.Lock()
        self._pending: dict[int, Future] = {}
        self._ids = 0
        self._ids_lock = threading.Lock()
        self._closed = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"{name}-h") if handler else None
        self.info: dict = {}
        self._thread = threading.Thread(target=self._read_loop, name=f"{name}-reader", daemon=True)
        self._thread.start()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def call_async(self, header: dict, blob: bytes = b"") -> Future:
        fut: Future = Future()
        with self._ids_lock:
            self._ids += 1
            rid = self._ids
        self._pending[rid] = fut
        if self._closed.is_set():
            self._pending.pop(rid, None)
            fut.set_exception(ConnectionError(f"{self.name}: connection closed"))
            return fut
        try:
            send_frame(self.sock, dict(header, _id=rid, _kind="req"), blob, self._send_lock)
        except OSError as e:
            self._pending.pop(rid, None)
            fut.set_exception(ConnectionError(f"{self.name}: send failed: {e}"))
            self.close()
        return fut

    def call(self, header: dict, blob: bytes = b"", timeout: float | None = None) -> tuple[dict, bytes]:
        return self.call_async(header, blob).result(timeout)

    def _read_loop(self) -> None:
        try:
            while True:
                header, blob = recv_frame(self.sock)
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
            if isinstance(e, SparkShareError) and type(e).__name__ in WIRE_ERRORS:
                rep, rblob = {"_error": self._scrub(str(e)), "_type": type(e).__name__}, b""
            else:
                rep, rblob = {"_error": self._scrub(f"{type(e).__name__}: {e}")}, b""
        try:
            send_frame(self.sock, dict(rep, _id=rid, _kind="rep"), rblob, self._send_lock)
        except OSError:
            self.close()

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass
        for rid, fut in list(self._pending.items()):
            self._pending.pop(rid, None)
            if not fut.done():
                fut.set_exception(ConnectionError(f"{self.name}: connection closed"))
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
        client_handshake(sock, secret)
    except BaseException:
        sock.close()
        raise
    return RpcConnection(sock, handler, on_close=on_close, name=name, scrub=scrub)


class RpcServer:
    """Accepts authenticated connections on a TCP (host, port) or a Unix socket path.

    Peers that fail the handshake are refused and logged (without the secret).
    """

    def __init__(self, address, secret: str, handler: Handler, name: str = "server", on_close=None,
                 scrub: Callable[[str], str] = lambda s: s):
        self._secret = secret
        self._handler = handler
        self._scrub = scrub
        self._on_close = on_close
        self.name = name
        self.refused = 0
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
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(tuple(address))
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
            server_handshake(conn, self._secret)
        except (AuthError, OSError, ConnectionError) as e:
            self.refused += 1
            log.warning("%s: refused a connection from %s: %s", self.name, peer or "a local peer", e)
            try:
                conn.close()
            except OSError:
                pass
            return
        rpc = RpcConnection(conn, self._handler, on_close=self._closed, name=self.name, workers=8, scrub=self._scrub)
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
