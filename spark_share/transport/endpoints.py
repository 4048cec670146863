"""Where connections between our processes start: ``RpcServer`` admits peers that prove the query's
credential, ``connect`` dials one.

Owns: listening (TCP, a Unix socket file only its user may open, or an abstract one), each peer's TLS
handshake on the loop thread (refused, logged without the secret, when it fails or takes too long), and
the accept loop, which survives running out of descriptors (it logs, pauses and accepts again). An admitted peer becomes a
``wire.RpcConnection``; the server's handler runs on one bounded pool shared by all its connections, so
a tracker's threads do not grow with its agents.

Must never: block the loop thread, or put the secret in a log line or an exception message.
"""
from __future__ import annotations

import errno
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from .frames import CHUNK
from .loop import READ, WRITE, get_loop
from .tls import HANDSHAKE_TIMEOUT, READY, TlsEngine, admit, contexts, failure_text
from .wire import Handler, RpcConnection

log = logging.getLogger("spark_share.transport.endpoints")

SERVER_WORKERS = 32  # a server's handler threads, whatever its number of peers
ACCEPT_PAUSE_S = 0.5  # out of descriptors: accept again after this long
_PAUSE_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)

__all__ = ["RpcServer", "connect", "connect_patiently"]


def _abstract(address: str) -> bool:
    """A Unix socket in Linux's abstract namespace (a name, not a file)."""
    return address.startswith("\0")


def connect(address, secret: str, handler: Handler | None = None, timeout: float = 10.0,
            name: str = "rpc", on_close=None, scrub: Callable[[str], str] = lambda s: s,
            workers: int = 4, inline: Callable[[dict], bool] | None = None) -> RpcConnection:
    """Connect to a TCP (host, port) or Unix socket (a path, or an abstract name: ``\0`` first),
    authenticate, return the connection."""
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


def connect_patiently(address, secret: str, wait_s: float, attempt_s: float, **kwargs) -> RpcConnection:
    """``connect``, with a cut network (no answer, or no route) waited out for ``wait_s`` in attempts of
    ``attempt_s``: a single attempt would wait on the kernel's backoff between its SYNs, the next one up to
    seconds after the network is back. Any other failure (a refusal: nothing listens there) raises at once."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return connect(address, secret, timeout=attempt_s, **kwargs)
        except OSError as e:
            cut = isinstance(e, TimeoutError) or e.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH)
            if not cut or time.monotonic() >= deadline:
                raise
            if not isinstance(e, TimeoutError):
                time.sleep(attempt_s / 4)  # no route yet: a bounded pause before the next attempt


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
                data = self.sock.recv(CHUNK)
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
            except OSError:
                sock.close()
                raise
            finally:
                os.umask(old)
            if not _abstract(address):  # an abstract socket has no file, so no mode: the handshake admits
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

    def expire_admissions(self, now: float) -> None:
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
        if isinstance(self.address, str) and not _abstract(self.address):
            try:
                os.unlink(self.address)
            except OSError:
                pass
        with self._lock:
            conns = list(self.connections)
        for c in conns:
            c.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
