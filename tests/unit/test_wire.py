import os
import socket
import threading

import pytest

from spark_share import wire


@pytest.fixture
def server():
    seen = []

    def handler(conn, req, blob):
        seen.append(req)
        if req.get("op") == "boom":
            raise ValueError("boom happened")
        return {"echo": req.get("x"), "n": len(blob)}, blob[::-1]

    srv = wire.RpcServer(("127.0.0.1", 0), "s3cret-value", handler, name="test")
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


def test_wrong_or_missing_secret_is_refused_and_counted(server, caplog):
    caplog.set_level("WARNING", logger="spark_share.wire")
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
    from support import wait_until
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
