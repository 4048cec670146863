"""The TLS channel between our processes: the query's credential and a verified TLS stream over a socket.

Owns: the query's TLS credential (an Ed25519 key and a self-signed certificate, both derived from
the per-query secret, so every process holding the secret makes the same certificate and no key
travels), the SSL contexts (cached per secret), the handshake that admits a peer (``admit``), and
``TlsStream``, the encrypted byte stream the frames of ``wire`` run over.

Security comes from Python's ``ssl`` (TLS 1.3 only), not from code of ours: both ends present the
query's certificate and accept only a peer presenting that same certificate (it is the only trust
anchor and is compared byte for byte after the handshake; no host names: addresses are IPs and
Unix paths). A peer without the secret cannot make the key, so it is refused at connect, whichever
end it plays. Every TLS record is encrypted and authenticated under a key of its connection and
a sequence number (AEAD): a record altered, replayed, reordered or injected on the path fails and ends
the connection.

TLS on every socket, the Unix sockets of read tasks included: it costs no more than the HMAC
channel it replaced (which tagged every frame and encrypted nothing by default), so the local path
needs no second, plain mode. Measured when TLS came in (a 2-core VM, OpenSSL 3.0, Python 3.11,
TLS_AES_256_GCM_SHA384, against the HMAC channel of da96ff6), on a Unix socket: a 200-byte frame sent
and received 13.1 vs 13.4 us (plain framing, no protection: 8.6 us); a small RPC's round trip 105 vs
122 us median (it varies by 20% from run to run on this VM, alike for all three); 8 MB blobs
1530 vs 810 MB/s at 1.03 vs 1.34 CPU-s/GB across both ends (plain: 0.52), 1 MB blobs 1.10 vs 1.39.
TCP loopback alike (16.5 vs 16.4 us a frame, 1.09 vs 1.48 CPU-s/GB). AES-GCM with AES-NI costs
less than HMAC-SHA256 over the same bytes. What TLS adds is setting up a connection: 1.6 vs 0.6 ms
(two Ed25519 signatures and checks), once per read task and agent.

OpenSSL does not allow one TLS connection to be read in one thread and written in another at the
same moment, so a connection's TLS state sits on memory BIOs (``TlsEngine``): the SSL object is used
under a lock and never while blocked on a socket, and the wire's one loop thread can serve every
connection of a process without blocking on any.

Must never: accept a peer that does not present the query's certificate, or put the secret or the
key in a log line, an exception message or a file that outlives loading it.
"""
from __future__ import annotations

import datetime
import functools
import hashlib
import logging
import os
import secrets
import socket
import ssl
import tempfile
import threading
from typing import Any, cast

from .. import runtime
from ..errors import AuthError, PeerConnectionError

log = logging.getLogger("spark_share.transport.wire")

READY = b"\x01"  # the server's first byte: it has verified our certificate too
_CHUNK = 256 << 10  # plaintext encrypted per lock hold, and bytes read from the socket at once
HANDSHAKE_TIMEOUT = 10.0
# A frame's blob: bytes, the buffer it was received into, or a pyarrow Buffer (Arrow IPC), never copied.
Blob = Any


def new_secret() -> str:
    """The per-query secret every process of the query gets: 256 random bits, from which each end
    derives the query's key and certificate."""
    return secrets.token_hex(32)


# --- the query's credential -------------------------------------------------------------------------
def certificate(secret: str):
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
def contexts(secret: str) -> tuple[ssl.SSLContext, ssl.SSLContext, bytes]:
    """(server context, client context, the certificate's DER) of a query, built once per process:
    deriving the key and loading it costs milliseconds, a connection should not."""
    key_pem, cert_pem, cert_der = certificate(secret)
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
class TlsEngine:
    """The TLS state of one connection on memory BIOs, with no socket: ciphertext in (``feed``),
    plaintext out (``read_into``), plaintext in (``encrypt``), ciphertext out. Used under ``lock``
    by whichever thread holds it, never while blocked on a socket: the wire's loop decrypts what
    arrives while any thread encrypts what it sends."""

    def __init__(self, ctx: ssl.SSLContext, server_side: bool):
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = ctx.wrap_bio(self._in, self._out, server_side=server_side)
        self.lock = threading.Lock()

    def feed(self, data: bytes) -> None:
        """Ciphertext from the peer (b"": it closed the socket)."""
        with self.lock:
            if data:
                self._in.write(data)
            else:
                self._in.write_eof()

    def outgoing(self) -> bytes:
        """Ciphertext made and not yet taken (handshake messages, a key update's answer)."""
        with self.lock:
            return self._out.read()

    def handshake(self) -> bool:
        """One step of the handshake: True once it is done. Raises ``ssl.SSLError`` on a peer that
        does not prove the query's certificate."""
        with self.lock:
            try:
                self.tls.do_handshake()
                return True
            except ssl.SSLWantReadError:
                return False

    def peer_is(self, pinned: bytes) -> bool:
        with self.lock:
            return self.tls.getpeercert(binary_form=True) == pinned

    def encrypt(self, data) -> bytes:
        """The ciphertext of ``data`` (at most a few hundred KB: callers chunk)."""
        with self.lock:  # the out BIO is empty whenever this lock is free
            self.tls.write(data)
            return self._out.read()

    def read_into(self, view: memoryview) -> int | None:
        """Plaintext into ``view``: the count (0: the peer said TLS's close), or None when no whole record
        is in yet. Raises ``ssl.SSLError`` for a record that fails authentication."""
        with self.lock:
            try:
                return cast(int, self.tls.read(len(view), view))
            except ssl.SSLWantReadError:
                return None
            except ssl.SSLZeroReturnError:
                return 0

    def close_notify(self) -> bytes:
        """TLS's close, as ciphertext to send (b"" if the session cannot say it)."""
        with self.lock:
            try:
                self.tls.unwrap()
            except ssl.SSLError:
                pass  # the peer's close is not awaited (SSLWantReadError) or the session failed
            return self._out.read()


class TlsStream:
    """A TLS connection over a blocking socket: the client's side of ``admit`` (connect() hands the
    engine on to the wire's loop once the handshake is done), and tests and benchmarks that speak
    frames by hand. One reading thread and any number of writers; ``_send_lock`` keeps ciphertext
    leaving in the order it was made."""

    def __init__(self, sock: socket.socket, ctx: ssl.SSLContext, server_side: bool):
        self.sock = sock
        self.engine = TlsEngine(ctx, server_side)
        self._send_lock = threading.Lock()

    def handshake(self, pinned: bytes) -> None:
        """Raises ``ssl.SSLError`` or ``AuthError`` if the peer does not present and prove the query's
        certificate (``OSError`` if the socket fails or ``HANDSHAKE_TIMEOUT`` passes)."""
        while not self.engine.handshake():
            self._flush()
            self.engine.feed(self.sock.recv(_CHUNK))
        self._flush()
        if not self.engine.peer_is(pinned):  # verified already; pinned twice
            raise AuthError("the peer's certificate is not the query's")

    def _flush(self) -> None:
        with self._send_lock:
            out = self.engine.outgoing()
            if out:
                self.sock.sendall(out)

    def sendall(self, *parts: Blob) -> None:
        """Send ``parts`` as one run of bytes, however many threads send."""
        with self._send_lock:
            for part in parts:
                with memoryview(part) as view, view.cast("B") as data:
                    for at in range(0, len(data), _CHUNK):
                        self.sock.sendall(self.engine.encrypt(data[at: at + _CHUNK]))

    def recv_into(self, view: memoryview, n: int) -> int:
        """Up to ``n`` bytes into ``view``; 0 once the peer closed the connection cleanly. Raises
        ``ssl.SSLError`` for a record that fails authentication and ``PeerConnectionError`` for a
        connection cut without TLS's close."""
        while True:
            try:
                got = self.engine.read_into(view[:n])
            except ssl.SSLEOFError:
                raise PeerConnectionError("connection cut (no TLS close from the peer)") from None
            if got is not None:
                return got
            self.engine.feed(self.sock.recv(_CHUNK))

    def close(self) -> None:
        """Say TLS's close if the socket takes it now, then shut the socket."""
        if self._send_lock.acquire(blocking=False):
            try:
                self.sock.send(self.engine.close_notify(), socket.MSG_DONTWAIT)
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


def admit(sock: socket.socket, secret: str, server_side: bool) -> TlsStream:
    """The TLS handshake on a connected blocking socket, both ends verified; raises AuthError on a
    peer without the query's certificate (OSError if the socket fails or times out). The wire's
    servers admit peers on their loop instead (``endpoints.RpcServer``), with the same checks."""
    server_ctx, client_ctx, pinned = contexts(secret)
    stream = TlsStream(sock, server_ctx if server_side else client_ctx, server_side)
    sock.settimeout(HANDSHAKE_TIMEOUT)
    try:
        stream.handshake(pinned)
        if server_side:
            stream.sendall(READY)
        else:  # TLS 1.3 ends the client's handshake before the server has checked its certificate
            ready = bytearray(1)
            if stream.recv_into(memoryview(ready), 1) != 1 or ready != READY:
                raise AuthError("the server closed the connection (it refused our credentials)")
    except ssl.SSLError as e:
        raise AuthError(f"TLS handshake failed: {failure_text(e)}") from None
    except ConnectionError as e:  # a peer that hangs up mid-handshake, e.g. on our certificate
        raise AuthError(f"TLS handshake failed: {e}") from None
    sock.settimeout(None)
    return stream


def failure_text(e: ssl.SSLError) -> str:
    return str(getattr(e, "verify_message", None) or e.reason or e)
