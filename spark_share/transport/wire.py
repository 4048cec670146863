"""Mutual TLS between our processes (tracker, agents, read tasks, the user's process), frames and RPC.

Owns: the query's TLS credential (an Ed25519 key and a self-signed certificate, both derived from
the per-query secret), the TLS channel over a blocking socket, the frame format (a JSON header
plus an optional binary blob, Arrow IPC for record data) and a small symmetric RPC connection
where either side may call the other.

Security comes from Python's ``ssl`` (TLS 1.3 only), not from code of ours: both ends present the
query's certificate and accept only a peer presenting that same certificate (it is the only trust
anchor and is compared byte for byte after the handshake; no host names: addresses are IPs and
Unix paths). A peer without the secret cannot make the key, so it is refused at connect, whichever
end it plays. Every TLS record is encrypted and authenticated under a key of its connection and
a sequence number (AEAD): a record altered, replayed, reordered or injected on the path fails and ends
the connection, a connection cut in a frame ends it too (the lengths say a frame is short).

TLS on every socket, the Unix sockets of read tasks included: it costs no more than the HMAC
channel it replaced (which tagged every frame and encrypted nothing by default), so the local path
needs no second, plain mode. ``benchmarks/wire_cost.py`` (2-core VM, OpenSSL 3.0, Python 3.11,
TLS_AES_256_GCM_SHA384), TLS against the old channel, on a Unix socket: a 200-byte frame sent and
received 13.1 vs 13.4 us (plain framing, no protection: 8.6 us); a small RPC's round trip 105 vs
122 us median (it varies by 20% from run to run on this VM, alike for all three); 8 MB blobs
1530 vs 810 MB/s at 1.03 vs 1.34 CPU-s/GB across both ends (plain: 0.52), 1 MB blobs 1.10 vs 1.39.
TCP loopback alike (16.5 vs 16.4 us a frame, 1.09 vs 1.48 CPU-s/GB). AES-GCM with AES-NI costs
less than HMAC-SHA256 over the same bytes. What TLS adds is setting up a connection: 1.6 vs 0.6 ms
(two Ed25519 signatures and checks), once per read task and agent.

OpenSSL does not allow one TLS connection to be read in one thread and written in another at the
same moment (the reader blocks in a read while handlers reply), so the connection runs over
memory BIOs: the SSL object is used under a lock and never while blocked on the socket.

Must never: unpickle anything (headers are JSON, blobs are handed to Arrow), accept a peer that
does not present the query's certificate, or put the secret or the key in a log line, an exception
message or a file that outlives loading it.
"""
from __future__ import annotations

import datetime
import functools
import hashlib
import json
import logging
import os
import secrets
import socket
import ssl
import struct
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, cast

from .. import runtime
from ..errors import WIRE_ERRORS, AuthError, PeerConnectionError, ProtocolError, RemoteError, wire_name

log = logging.getLogger("spark_share.transport.wire")

_FRAME = struct.Struct("!IQ")  # header length, blob length
_READY = b"\x01"  # the server's first byte: it has verified our certificate too
_CHUNK = 256 << 10  # plaintext encrypted per lock hold, and bytes read from the socket at once
MAX_HEADER = 64 << 20
MAX_BLOB = 4 << 30
HANDSHAKE_TIMEOUT = 10.0
# A frame's blob: bytes, the buffer it was received into, or a pyarrow Buffer (Arrow IPC), never copied.
Blob = Any


__all__ = ["AuthError", "RemoteError", "RpcConnection", "RpcServer", "connect", "new_secret"]


def new_secret() -> str:
    """The per-query secret every process of the query gets: 256 random bits, from which each end
    derives the query's key and certificate."""
    return secrets.token_hex(32)


# --- the query's credential -------------------------------------------------------------------------
def _certificate(secret: str):
    """The query's key and certificate, the same in every process that knows ``secret``: the key is
    the secret's HKDF, the certificate is self-signed by it with fixed fields, and Ed25519
    signatures are deterministic, so both ends can pin the very certificate the other presents."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF
    from cryptography.x509.oid import NameOID

    seed = HKDF(hashes.SHA256(), 32, salt=b"spark-share", info=b"query tls key").derive(secret.encode())
    key = ed25519.Ed25519PrivateKey.from_private_bytes(seed)
    public = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "spark-share query")])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(int.from_bytes(hashlib.sha256(public).digest()[:8], "big"))
            .not_valid_before(datetime.datetime(2000, 1, 1, tzinfo=datetime.timezone.utc))
            .not_valid_after(datetime.datetime(9999, 12, 31, 23, 59, 59, tzinfo=datetime.timezone.utc))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, None))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return key_pem, cert.public_bytes(serialization.Encoding.PEM), cert.public_bytes(serialization.Encoding.DER)


@functools.lru_cache(maxsize=8)
def _contexts(secret: str) -> tuple[ssl.SSLContext, ssl.SSLContext, bytes]:
    """(server context, client context, the certificate's DER) of a query, built once per process:
    deriving the key and loading it costs milliseconds, a connection should not."""
    key_pem, cert_pem, cert_der = _certificate(secret)
    # ssl loads a key from a file only: an owner-only file in our owner-only directory, gone at once.
    fd, path = tempfile.mkstemp(prefix="tls-", suffix=".pem", dir=runtime.runtime_dir())
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(key_pem + cert_pem)
        made = []
        for purpose in (ssl.PROTOCOL_TLS_SERVER, ssl.PROTOCOL_TLS_CLIENT):
            ctx = ssl.SSLContext(purpose)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_3
            ctx.check_hostname = False  # peers are pinned by certificate, not named
            ctx.verify_mode = ssl.CERT_REQUIRED  # on the server side too: the client must present it
            ctx.load_verify_locations(cadata=cert_pem.decode())  # the only trust anchor
            ctx.load_cert_chain(path)
            if purpose == ssl.PROTOCOL_TLS_SERVER:
                ctx.num_tickets = 0  # no resumption to offer
            made.append(ctx)
    finally:
        os.unlink(path)
    return made[0], made[1], cert_der


# --- one TLS connection ----------------------------------------------------------------------------
class TlsStream:
    """A TLS connection over a blocking socket, for one reading thread and any number of writers.

    The SSL object sits on memory BIOs and is only used under ``_tls_lock``, never while blocked
    on the socket; ``_send_lock`` keeps ciphertext leaving in the order it was made.
    """

    def __init__(self, sock: socket.socket, ctx: ssl.SSLContext, server_side: bool):
        self.sock = sock
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = ctx.wrap_bio(self._in, self._out, server_side=server_side)
        self._tls_lock = threading.Lock()
        self._send_lock = threading.Lock()

    def handshake(self, pinned: bytes) -> None:
        """Raises ``ssl.SSLError`` or ``AuthError`` if the peer does not present and prove the query's
        certificate (``OSError`` if the socket fails or ``HANDSHAKE_TIMEOUT`` passes)."""
        while True:
            try:
                self._tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._flush()
                self._fill()
        self._flush()
        if self._tls.getpeercert(binary_form=True) != pinned:  # verified already; pinned twice
            raise AuthError("the peer's certificate is not the query's")

    def _fill(self) -> None:
        data = self.sock.recv(_CHUNK)
        with self._tls_lock:
            if data:
                self._in.write(data)
            else:
                self._in.write_eof()

    def _flush(self) -> None:
        with self._send_lock:
            with self._tls_lock:
                out = self._out.read()
            if out:
                self.sock.sendall(out)

    def sendall(self, *parts: Blob) -> None:
        """Send ``parts`` as one run of bytes, however many threads send."""
        with self._send_lock:
            ready: list[bytes] = []  # ciphertext made, in order, sent by the quarter megabyte
            size = 0
            for part in parts:
                with memoryview(part) as view, view.cast("B") as data:
                    for at in range(0, len(data), _CHUNK):
                        with self._tls_lock:  # the out BIO is empty whenever this lock is free
                            self._tls.write(data[at: at + _CHUNK])
                            ready.append(self._out.read())
                        size += len(ready[-1])
                        if size >= _CHUNK:
                            self.sock.sendall(b"".join(ready) if len(ready) > 1 else ready[0])
                            ready, size = [], 0
            if ready:
                self.sock.sendall(b"".join(ready) if len(ready) > 1 else ready[0])

    def recv_into(self, view: memoryview, n: int) -> int:
        """Up to ``n`` bytes into ``view``; 0 once the peer closed the connection cleanly. Raises
        ``ssl.SSLError`` for a record that fails authentication and ``PeerConnectionError`` for a
        connection cut without TLS's close."""
        got = 0
        while True:
            with self._tls_lock:
                try:
                    while got < n:  # a read returns one TLS record (16 KB) at most: take all there is
                        k = cast(int, self._tls.read(n - got, view[got:]))  # into a buffer: a count
                        if not k:
                            return got  # the peer's TLS close (0 if nothing came before it)
                        got += k
                except ssl.SSLWantReadError:
                    pass
                except ssl.SSLZeroReturnError:
                    return got
                except ssl.SSLEOFError:
                    if not got:
                        raise PeerConnectionError("connection cut (no TLS close from the peer)") from None
                answer = self._out.pending  # only a key update request makes a read write; we never send one
            if answer and self._send_lock.acquire(blocking=False):
                try:  # else it leaves with the next frame sent (behind the sender's frame, in order)
                    with self._tls_lock:
                        out = self._out.read()
                    self.sock.sendall(out)
                finally:
                    self._send_lock.release()
            if got:
                return got
            self._fill()

    def close(self) -> None:
        """Say TLS's close if the socket takes it now, then shut the socket (waking the reader)."""
        if self._send_lock.acquire(blocking=False):
            try:
                with self._tls_lock:
                    try:
                        self._tls.unwrap()
                    except ssl.SSLError:
                        pass  # the peer's close is not awaited (SSLWantReadError) or the session failed
                    out = self._out.read()
                self.sock.send(out, socket.MSG_DONTWAIT)
            except (OSError, ValueError):
                pass
            finally:
                self._send_lock.release()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass


def _admit(sock: socket.socket, secret: str, server_side: bool) -> TlsStream:
    """The TLS handshake on a connected socket, both ends verified; raises AuthError on a peer
    without the query's certificate (OSError if the socket fails or times out)."""
    server_ctx, client_ctx, pinned = _contexts(secret)
    stream = TlsStream(sock, server_ctx if server_side else client_ctx, server_side)
    sock.settimeout(HANDSHAKE_TIMEOUT)
    try:
        stream.handshake(pinned)
        if server_side:
            stream.sendall(_READY)
        else:  # TLS 1.3 ends the client's handshake before the server has checked its certificate
            ready = bytearray(1)
            if stream.recv_into(memoryview(ready), 1) != 1 or ready != _READY:
                raise AuthError("the server closed the connection (it refused our credentials)")
    except ssl.SSLError as e:
        raise AuthError(f"TLS handshake failed: {getattr(e, 'verify_message', None) or e.reason or e}") from None
    except ConnectionError as e:  # a peer that hangs up mid-handshake, e.g. on our certificate
        raise AuthError(f"TLS handshake failed: {e}") from None
    sock.settimeout(None)
    return stream


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
        stream = _admit(sock, secret, server_side=False)
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
        _contexts(secret)  # a bad credential fails here, not in every peer's handshake
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
            stream = _admit(conn, self._secret, server_side=True)
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
