import json
import os
import socket
import threading

import pytest

from harness.support import wait_until
from spark_share.transport import wire


@pytest.fixture
def server(request):
    """A server echoing requests; ``indirect`` parametrization turns its encryption on."""
    seen = []

    def handler(conn, req, blob):
        seen.append(req)
        if req.get("op") == "boom":
            raise ValueError("boom happened")
        return {"echo": req.get("x"), "n": len(blob)}, blob[::-1]

    srv = wire.RpcServer(("127.0.0.1", 0), "s3cret-value", handler, name="test",
                         encrypt=getattr(request, "param", False))
    yield srv, seen
    srv.close()


def test_round_trip_with_blob(server):
    srv, _ = server
    c = wire.connect(srv.address, "s3cret-value")
    rep, blob = c.call({"op": "x", "x": 5}, b"abc", timeout=5)
    assert rep == {"echo": 5, "n": 3} and blob == b"cba"
    with pytest.raises(wire.RemoteError, match="boom happened"):
        c.call({"op": "boom"}, timeout=5)
    c.close()


@pytest.mark.parametrize("encrypt", [False, True], ids=["tagged", "encrypted"])
def test_arrow_record_blobs_cross_without_a_copy_to_bytes(encrypt):
    """The agent hands read tasks its cached Arrow IPC buffer as it is (no copy to bytes); it must
    cross plain and encrypted connections alike, and arrive as the same rows."""
    import pyarrow as pa

    from spark_share.executor import records

    rows = pa.RecordBatch.from_pylist([{"key": b"k%d" % i, "n": i} for i in range(5000)])
    ipc = records.to_ipc(rows)
    assert isinstance(ipc, pa.Buffer)
    srv = wire.RpcServer(("127.0.0.1", 0), "s3cret-value", lambda conn, req, blob: ({}, ipc), name="arrow",
                         encrypt=encrypt)
    try:
        c = wire.connect(srv.address, "s3cret-value")
        _, blob = c.call({"op": "read"}, timeout=5)
        assert records.from_ipc(blob)[0].equals(rows)
        c.close()
    finally:
        srv.close()


def test_wrong_or_missing_secret_is_refused_and_counted(server, caplog):
    caplog.set_level("WARNING", logger="spark_share.transport.wire")
    srv, seen = server
    with pytest.raises(wire.AuthError):
        wire.connect(srv.address, "wrong")
    raw = socket.create_connection(srv.address)  # no handshake at all: garbage, then close
    raw.sendall(b"GET / HTTP/1.0\r\n\r\n" + b"x" * 100)
    raw.settimeout(5)
    try:
        while raw.recv(100):
            pass
    except OSError:
        pass
    raw.close()
    from harness.support import wait_until
    wait_until(lambda: srv.refused >= 2, timeout=10, message="refusals not counted")
    assert seen == []
    refusals = [r for r in caplog.records if "refused a connection" in r.getMessage()]
    assert len(refusals) == 2 and all(r.levelname == "WARNING" for r in refusals), caplog.text
    assert "s3cret-value" not in caplog.text


def test_handler_errors_reach_the_peer_scrubbed():
    def handler(conn, req, blob):
        raise ValueError("client config rejected: sasl.password=hunter2-secret")

    srv = wire.RpcServer(("127.0.0.1", 0), "k", handler, name="scrub", scrub=lambda s: s.replace("hunter2-secret", "***"))
    try:
        c = wire.connect(srv.address, "k")
        with pytest.raises(wire.RemoteError) as e:
            c.call({"op": "x"}, timeout=5)
        assert "sasl.password=***" in str(e.value) and "hunter2" not in str(e.value)
        c.close()
    finally:
        srv.close()


def test_server_proves_itself_to_the_client():
    # A server with another secret cannot impersonate ours: the client refuses it.
    srv = wire.RpcServer(("127.0.0.1", 0), "other", lambda c, r, b: ({}, b""), name="fake")
    try:
        with pytest.raises(wire.AuthError):
            wire.connect(srv.address, "s3cret-value")
    finally:
        srv.close()


def test_unix_socket_is_owner_only(tmp_path):
    path = str(tmp_path / "a.sock")
    srv = wire.RpcServer(path, "k", lambda c, r, b: ({"ok": 1}, b""), name="uds")
    try:
        assert oct(os.stat(path).st_mode & 0o777) == oct(0o600)
        c = wire.connect(path, "k")
        assert c.call({"op": "x"}, timeout=5)[0] == {"ok": 1}
        c.close()
    finally:
        srv.close()
    assert not os.path.exists(path)


def test_pending_calls_fail_when_peer_goes_away(server):
    srv, _ = server
    c = wire.connect(srv.address, "s3cret-value")
    fut = c.call_async({"op": "x"})
    fut.result(5)
    srv.close()
    assert c.wait_closed(5)
    with pytest.raises(ConnectionError):
        c.call({"op": "x"}, timeout=5)


def test_a_peer_admitted_while_the_server_closes_is_closed_and_close_returns():
    srv = wire.RpcServer(("127.0.0.1", 0), "k", lambda c, r, b: ({}, b""), name="closing")
    srv._stopped.set()  # close() has begun; the accept loop is still waiting for one more peer
    c = wire.connect(srv.address, "k")
    assert c.wait_closed(5), "a peer admitted during close stayed connected"
    closer = threading.Thread(target=srv.close)
    closer.start()
    closer.join(10)
    assert not closer.is_alive(), "RpcServer.close() hung"


class _Recorder:
    """A socket stand-in that keeps the bytes sent through it (to replay them)."""

    def __init__(self, sock):
        self.sock, self.sent = sock, []

    def sendall(self, data):
        self.sent.append(bytes(data))
        self.sock.sendall(data)


def _authenticated_socket(srv, secret="s3cret-value"):
    sock = socket.create_connection(srv.address)
    return sock, wire.client_handshake(sock, secret)


def _closed_by_peer(sock) -> bool:
    """Whether the peer ends the connection (after any replies to earlier, genuine frames)."""
    sock.settimeout(10)
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@pytest.mark.parametrize("server", [False, True], indirect=True, ids=["tagged", "encrypted"])
def test_a_forged_frame_after_a_valid_handshake_is_refused(server, caplog):
    """An attacker on the path writes into an authenticated stream: a well-formed frame, without
    the connection's key. The server closes the connection before the frame reaches a handler."""
    caplog.set_level("WARNING", logger="spark_share.transport.wire")
    srv, seen = server
    sock, (send_key, _) = _authenticated_socket(srv)
    assert send_key.encrypts is srv._encrypt
    wire.send_frame(sock, {"op": "x", "x": 1, "_id": 1, "_kind": "req"}, b"", send_key, threading.Lock())
    header = json.dumps({"op": "x", "x": 2, "_id": 2, "_kind": "req"}).encode()
    sock.sendall(wire._FRAME.pack(len(header), 0) + header + os.urandom(32))
    assert _closed_by_peer(sock)
    sock.close()
    wait_until(lambda: srv.forged == 1, timeout=10, message="the forged frame was not counted")
    assert [r.get("x") for r in seen] == [1], "the forged frame reached the handler"
    assert "failed authentication" in caplog.text and "s3cret-value" not in caplog.text


def test_a_replayed_or_altered_frame_is_refused(server):
    srv, seen = server
    sock, (send_key, _) = _authenticated_socket(srv)
    rec = _Recorder(sock)
    wire.send_frame(rec, {"op": "x", "x": 1, "_id": 1, "_kind": "req"}, b"blob", send_key, threading.Lock())
    sock.sendall(b"".join(rec.sent))  # the same bytes again: the sequence number no longer matches
    assert _closed_by_peer(sock)
    sock.close()
    sock, (send_key, _) = _authenticated_socket(srv)
    rec = _Recorder(type("Nowhere", (), {"sendall": lambda self, data: None})())
    wire.send_frame(rec, {"op": "x", "x": 3, "_id": 1, "_kind": "req"}, b"blob", send_key, threading.Lock())
    sock.sendall(b"".join(rec.sent).replace(b'"x":3', b'"x":4'))  # one byte changed on the way
    assert _closed_by_peer(sock)
    sock.close()
    wait_until(lambda: srv.forged == 2, timeout=10, message="refusals not counted")
    assert [r.get("x") for r in seen] == [1]


def test_frames_of_another_connection_do_not_verify(server):
    """Keys differ per connection (both handshake nonces): a frame recorded on one connection is
    refused on another, even as its first frame."""
    srv, seen = server
    first, (key, _) = _authenticated_socket(srv)
    rec = _Recorder(first)
    wire.send_frame(rec, {"op": "x", "x": 1, "_id": 1, "_kind": "req"}, b"", key, threading.Lock())
    second, _ = _authenticated_socket(srv)
    second.sendall(b"".join(rec.sent))
    assert _closed_by_peer(second)
    first.close()
    second.close()
    wait_until(lambda: srv.forged == 1, timeout=10, message="the foreign frame was not refused")


class _Tap:
    """A TCP relay between a client and a server that keeps what crosses it, and may rewrite the
    server's first bytes (its hello) on the way: a peer on the path between two hosts."""

    def __init__(self, target, rewrite_hello=None):
        self._target, self._rewrite = target, rewrite_hello
        self.seen = bytearray()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = self._listener.getsockname()[:2]
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self):
        client, _ = self._listener.accept()
        server = socket.create_connection(self._target)
        for src, dst, first in ((client, server, None), (server, client, self._rewrite)):
            t = threading.Thread(target=self._pump, args=(src, dst, first), daemon=True)
            t.start()
            self._threads.append(t)

    def _pump(self, src, dst, rewrite):
        try:
            while data := src.recv(65536):
                if rewrite is not None:
                    data, rewrite = rewrite(data), None
                self.seen.extend(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self._listener.close()


@pytest.mark.parametrize("encrypt", [True, False])
def test_an_encrypting_server_hides_headers_and_records_on_the_wire(encrypt):
    """With encryption on, neither a frame's header nor its blob (relayed records) crosses the
    network in the clear, and they arrive intact; with it off (the control) both are visible."""
    record = b"card=4111-1111-1111-1111;" * 40
    got = []

    def handler(conn, req, blob):
        got.append((req.get("note"), blob))
        return {"note": "reply-in-clear?"}, blob

    srv = wire.RpcServer(("127.0.0.1", 0), "s3cret-value", handler, name="enc", encrypt=encrypt)
    tap = _Tap(srv.address)
    try:
        c = wire.connect(tap.address, "s3cret-value")
        rep, blob = c.call({"op": "x", "note": "header-in-clear?"}, record, timeout=5)
        assert rep["note"] == "reply-in-clear?" and blob == record
        assert got == [("header-in-clear?", record)]
        c.close()
        wire_bytes = bytes(tap.seen)
        for plain in (b"card=4111", b"header-in-clear?", b"reply-in-clear?"):
            assert (plain in wire_bytes) is (not encrypt), plain
    finally:
        tap.close()
        srv.close()


def test_a_peer_on_the_path_cannot_turn_encryption_off():
    """The server's hello says its frames are encrypted; a relay that flips that flag makes the
    client's proof fail, and the connection is refused rather than run in the clear."""
    srv = wire.RpcServer(("127.0.0.1", 0), "s3cret-value", lambda c, r, b: ({}, b""), name="enc", encrypt=True)
    flag_at = len(wire._MAGIC)
    tap = _Tap(srv.address, rewrite_hello=lambda d: d[:flag_at] + wire._PLAIN + d[flag_at + 1:])
    try:
        with pytest.raises((wire.AuthError, ConnectionError)):
            wire.connect(tap.address, "s3cret-value").call({"op": "x"}, b"records", timeout=5)
        wait_until(lambda: srv.refused == 1, timeout=10, message="the downgraded handshake was not refused")
    finally:
        tap.close()
        srv.close()

