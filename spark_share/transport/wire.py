"""Authenticated framing between our processes (tracker, agents, read tasks, the user's process).

Owns: the handshake (mutual HMAC-SHA256 challenge over a per-query secret), the frame format
(a JSON header plus an optional binary blob, Arrow IPC for record data, then an HMAC-SHA256 tag),
and a small symmetric RPC connection where either side may call the other.

Every frame is authenticated, not only the handshake: the tag covers the frame and its sequence
number under a key per connection and direction, derived from the secret and both handshake
nonces. A frame injected into an established connection (a hijacked TCP stream between hosts),
replayed, reordered or cut is refused and ends the connection before its header is parsed.

A server may also encrypt its connections (records relayed between hosts, when Kafka itself is
reached over TLS): header and blob are encrypted with AES-256-CTR under a key per connection and
direction, and the tag covers the ciphertext (encrypt-then-MAC). The server's hello says so, and
the client's proof covers that flag: a peer on the path cannot turn encryption off.

Must never: unpickle anything (headers are JSON, blobs are handed to Arrow), accept a peer or a
frame that has not proven it knows the secret, or put the secret in a log line or an exception
message.
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
from typing import Any

from ..errors import WIRE_ERRORS, AuthError, RemoteError, SparkShareError

log = logging.getLogger("spark_share.transport.wire")

_MAGIC = b"SSHR3"  # 2: every frame carries a tag; 3: the server's hello says whether frames are encrypted
_ENCRYPTED = b"\x01"
_PLAIN = b"\x00"
_NONCE = 32
_FRAME = struct.Struct("!IQ")  # header length, blob length
_SEQ = struct.Struct("!Q")
_TAG = 32
MAX_HEADER = 64 << 20
MAX_BLOB = 4 << 30
HANDSHAKE_TIMEOUT = 10.0
# A frame's blob: bytes, the buffer it was received into, or a pyarrow Buffer (Arrow IPC), never copied.
Blob = Any


__all__ = ["AuthError", "RemoteError", "RpcConnection", "RpcServer", "connect", "new_secret"]


def new_secret() -> str:
    return secrets.token_hex(32)


def _mac(secret: str, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret.encode(), role + nonce, hashlib.sha256).digest()


class FrameKey:
    """Tags (and, if asked, encrypts) the frames of one direction of one connection: HMAC-SHA256
    over the sequence number and the frame, under a key only the two ends of this handshake can
    derive; AES-256-CTR under another such key, its counter block starting at (sequence, part)."""

    def __init__(self, secret: str, direction: bytes, server_nonce: bytes, client_nonce: bytes,
                 encrypt: bool = False):
        def derive(use: bytes) -> bytes:
            return hmac.new(secret.encode(), use + direction + server_nonce + client_nonce, hashlib.sha256).digest()

        self._key = derive(b"frames ")
        self._aes = None
        if encrypt:
            from cryptography.hazmat.primitives.ciphers import algorithms

            self._aes = algorithms.AES(derive(b"encrypt "))
        self._seq = 0

    @property
    def encrypts(self) -> bool:
        return self._aes is not None

    def next_seq(self) -> int:
        """The next frame's sequence number (call in send or receive order, once per frame)."""
        self._seq += 1
        return self._seq - 1

    def tag(self, seq: int, *parts: Blob) -> bytes:
        mac = hmac.new(self._key, _SEQ.pack(seq), hashlib.sha256)
        for part in parts:
            mac.update(part)
        return mac.digest()

    def crypt(self, seq: int, part: int, data: Blob) -> Blob:
        """Encrypt or decrypt (CTR is its own inverse) part ``part`` of frame ``seq``: each frame and
        part has its own counter range, so no key stream is used twice."""
        if self._aes is None or not data:
            return data
        from cryptography.hazmat.primitives.ciphers import Cipher, modes

        ctx = Cipher(self._aes, modes.CTR(_SEQ.pack(seq) + bytes([part]) + bytes(7))).encryptor()
        if not isinstance(data, (bytes, bytearray)):  # the cipher takes no read-only buffer (a pyarrow Buffer)
            data = bytes(data)
        return ctx.update(data) + ctx.finalize()


FrameKeys = tuple[FrameKey, FrameKey]  # (frames we send, frames we receive)


def _frame_keys(secret: str, server_nonce: bytes, client_nonce: bytes, we_are_server: bool,
                encrypt: bool) -> FrameKeys:
    to_client = FrameKey(secret, b"server->client", server_nonce, client_nonce, encrypt)
    to_server = FrameKey(secret, b"client->server", server_nonce, client_nonce, encrypt)
    return (to_client, to_server) if we_are_server else (to_server, to_client)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    return bytes(_recv_into_buffer(sock, n))


def _recv_into_buffer(sock: socket.socket, n: int) -> bytearray:
    """``n`` bytes, received into one buffer that is handed on as it is (a blob is megabytes)."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("connection closed by peer")
        got += k
    return buf


def server_handshake(sock: socket.socket, secret: str, encrypt: bool = False) -> FrameKeys:
    """Challenge the connecting peer, then prove ourselves. Raises AuthError on a bad peer.
    Returns the keys of this connection's frames. The hello carries ``encrypt``; the peer's proof
    covers it with the nonce."""
    sock.settimeout(HANDSHAKE_TIMEOUT)
    flag = _ENCRYPTED if encrypt else _PLAIN
    nonce = os.urandom(_NONCE)
    sock.sendall(_MAGIC + flag + nonce)
    reply = _recv_exact(sock, len(_MAGIC) + 32 + _NONCE)
    if reply[: len(_MAGIC)] != _MAGIC:
        raise AuthError("peer does not speak the spark-share protocol")
    their_mac, their_nonce = reply[len(_MAGIC): len(_MAGIC) + 32], reply[len(_MAGIC) + 32:]
    if not hmac.compare_digest(their_mac, _mac(secret, b"client", flag + nonce)):
        sock.sendall(b"\x00")
        raise AuthError("peer failed authentication (wrong or missing per-query secret)")
    sock.sendall(b"\x01" + _mac(secret, b"server", their_nonce))
    sock.settimeout(None)
    return _frame_keys(secret, nonce, their_nonce, we_are_server=True, encrypt=encrypt)


def client_handshake(sock: socket.socket, secret: str) -> FrameKeys:
    sock.settimeout(HANDSHAKE_TIMEOUT)
    hello = _recv_exact(sock, len(_MAGIC) + 1 + _NONCE)
    if hello[: len(_MAGIC)] != _MAGIC:
        raise AuthError("server does not speak the spark-share protocol")
    flag, server_nonce = hello[len(_MAGIC): len(_MAGIC) + 1], hello[len(_MAGIC) + 1:]
    if flag not in (_ENCRYPTED, _PLAIN):
        raise AuthError("server sent a malformed hello")
    nonce = os.urandom(_NONCE)
    sock.sendall(_MAGIC + _mac(secret, b"client", flag + server_nonce) + nonce)
    ok = _recv_exact(sock, 1)
    if ok != b"\x01":
        raise AuthError("server refused our credentials (per-query secret mismatch)")
    if not hmac.compare_digest(_recv_exact(sock, 32), _mac(secret, b"server", nonce)):
        raise AuthError("server failed authentication")
    sock.settimeout(None)
    return _frame_keys(secret, server_nonce, nonce, we_are_server=False, encrypt=flag == _ENCRYPTED)


class ForgedFrame(ConnectionError):
    """A frame whose tag does not match: not sent by the authenticated peer, or altered, replayed
    or reordered on the way."""


def send_frame(sock: socket.socket, header: dict, blob: Blob, key: FrameKey, lock: threading.Lock) -> None:
    h = json.dumps(header, separators=(",", ":")).encode()
    prefix = _FRAME.pack(len(h), len(blob))
    with lock:  # frames are numbered: number, encrypt, tag and send in one order
        seq = key.next_seq()
        h, blob = key.crypt(seq, 0, h), key.crypt(seq, 1, blob)
        tag = key.tag(seq, prefix, h, blob)
        if blob:
            sock.sendall(prefix + h)
            sock.sendall(blob)
            sock.sendall(tag)
        else:
            sock.sendall(prefix + h + tag)


def recv_frame(sock: socket.socket, key: FrameKey) -> tuple[dict, Blob]:
    prefix = _recv_exact(sock, _FRAME.size)
    hl, bl = _FRAME.unpack(prefix)
    if hl > MAX_HEADER or bl > MAX_BLOB:
        raise ForgedFrame(f"oversized frame ({hl} + {bl} bytes)")
    h = _recv_exact(sock, hl)
    blob: Blob = _recv_into_buffer(sock, bl) if bl else b""
    seq = key.next_seq()
    if not hmac.compare_digest(_recv_exact(sock, _TAG), key.tag(seq, prefix, h, blob)):
        raise ForgedFrame("a frame failed authentication (forged, altered, replayed or reordered)")
    h, blob = key.crypt(seq, 0, h), key.crypt(seq, 1, blob)
    header = json.loads(h)
    if not isinstance(header, dict):
        raise ConnectionError("malformed frame header")
    return header, blob


Handler = Callable[["RpcConnection", dict, Blob], tuple[dict, Blob]]


class RpcConnection:
    """One authenticated socket on which both sides may send requests and get replies.

    Requests are handled on a small thread pool so a slow handler does not block replies.
    ``on_close`` runs once when the connection ends, whoever ended it.
    """

    def __init__(self, sock: socket.socket, keys: FrameKeys, handler: Handler | None = None,
                 on_close: Callable[[RpcConnection], None] | None = None, name: str = "rpc",
                 workers: int = 4, scrub: Callable[[str], str] = lambda s: s):
        self.sock = sock
        self._send_key, self._recv_key = keys
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
        self.forged = False  # the peer's stream carried a frame that failed authentication
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
            fut.set_exception(ConnectionError(f"{self.name}: connection closed"))
            return fut
        try:
            send_frame(self.sock, dict(header, _id=rid, _kind="req"), blob, self._send_key, self._send_lock)
        except OSError as e:
            self._pending.pop(rid, None)
            fut.set_exception(ConnectionError(f"{self.name}: send failed: {e}"))
            self.close()
        return fut

    def call(self, header: dict, blob: Blob = b"", timeout: float | None = None) -> tuple[dict, Blob]:
        return self.call_async(header, blob).result(timeout)

    def _read_loop(self) -> None:
        try:
            while True:
                header, blob = recv_frame(self.sock, self._recv_key)
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
        except ForgedFrame as e:
            self.forged = True
            log.warning("%s: closed the connection: %s", self.name, e)
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
            send_frame(self.sock, dict(rep, _id=rid, _kind="rep"), rblob, self._send_key, self._send_lock)
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
        keys = client_handshake(sock, secret)
    except BaseException:
        sock.close()
        raise
    return RpcConnection(sock, keys, handler, on_close=on_close, name=name, scrub=scrub)


class RpcServer:
    """Accepts authenticated connections on a TCP (host, port) or a Unix socket path.

    Peers that fail the handshake are refused and logged (without the secret).
    """

    def __init__(self, address, secret: str, handler: Handler, name: str = "server", on_close=None,
                 scrub: Callable[[str], str] = lambda s: s, encrypt: bool = False):
        self._secret = secret
        self._encrypt = encrypt
        self._handler = handler
        self._scrub = scrub
        self._on_close = on_close
        self.name = name
        self.refused = 0  # peers that failed the handshake
        self.forged = 0  # connections closed on a frame that failed authentication
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
            keys = server_handshake(conn, self._secret, self._encrypt)
        except (AuthError, OSError, ConnectionError) as e:
            self.refused += 1
            log.warning("%s: refused a connection from %s: %s", self.name, peer or "a local peer", e)
            try:
                conn.close()
            except OSError:
                pass
            return
        rpc = RpcConnection(conn, keys, self._handler, on_close=self._closed, name=self.name, workers=8, scrub=self._scrub)
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
