import hashlib
import json
import logging
import os
import pickle
import socket
import ssl
import struct
import threading
from concurrent.futures import Future

import pytest

from harness.support import wait_until
from spark_share.errors import BatchRefused, PeerConnectionError
from spark_share.transport import endpoints, frames, tls, wire

SECRET = wire.new_secret()
OTHER_QUERY = wire.new_secret()


@pytest.fixture
def server():
    """A TCP server echoing requests (the blob reversed)."""
    seen = []

    def handler(conn, req, blob):
        seen.append(req)
        if req.get("op") == "boom":
            raise ValueError("boom happened")
        return {"echo": req.get("x"), "n": len(blob)}, blob[::-1]

    srv = endpoints.RpcServer(("127.0.0.1", 0), SECRET, handler, name="test")
    yield srv, seen
    srv.close()


def test_round_trip_with_blob(server):
    srv, _ = server
    c = endpoints.connect(srv.address, SECRET)
    rep, blob = c.call({"op": "x", "x": 5}, b"abc", timeout=5)
    assert rep == {"echo": 5, "n": 3} and blob == b"cba"
    with pytest.raises(wire.RemoteError, match="boom happened"):
        c.call({"op": "boom"}, timeout=5)
    c.close()


@pytest.mark.parametrize("where", ["tcp", "unix"])
def test_arrow_record_blobs_cross_without_a_copy_to_bytes(where, tmp_path):
    """The agent hands read tasks its cached Arrow IPC buffer as it is (no copy to bytes); it must
    cross TCP and Unix sockets alike, and arrive as the same rows."""
    import pyarrow as pa

    from spark_share.consumers import records

    rows = pa.RecordBatch.from_pylist([{"key": b"k%d" % i, "n": i} for i in range(5000)])
    ipc = records.to_ipc(rows)
    assert isinstance(ipc, pa.Buffer)
    address = ("127.0.0.1", 0) if where == "tcp" else str(tmp_path / "a.sock")
    srv = endpoints.RpcServer(address, SECRET, lambda conn, req, blob: ({}, ipc), name="arrow")
    try:
        c = endpoints.connect(srv.address, SECRET)
        _, blob = c.call({"op": "read"}, timeout=5)
        assert records.from_ipc(blob)[0].equals(rows)
        c.close()
    finally:
        srv.close()


def test_a_big_blob_arrives_intact_both_ways(server):
    srv, _ = server
    blob = os.urandom(24 << 20)  # many TLS records, many socket reads and writes
    c = endpoints.connect(srv.address, SECRET)
    rep, back = c.call({"op": "x"}, blob, timeout=60)
    assert rep["n"] == len(blob) and hashlib.sha256(back).digest() == hashlib.sha256(blob[::-1]).digest()
    c.close()


def test_calls_both_ways_from_many_threads_arrive_intact(tmp_path):
    """One reader thread and many writers on each end of one TLS connection, both ends calling."""
    def client_handler(conn, req, blob):
        return {"back": req["i"]}, bytes(blob)[::-1]

    def server_handler(conn, req, blob):
        rep, back = conn.call({"op": "back", "i": req["i"]}, blob, timeout=30)  # the server calls the client
        return {"i": rep["back"]}, back

    srv = endpoints.RpcServer(str(tmp_path / "c.sock"), SECRET, server_handler, name="both")
    c = endpoints.connect(srv.address, SECRET, handler=client_handler)
    failures = []

    def caller(t):
        for i in range(t * 100, t * 100 + 20):
            blob = os.urandom((i * 7919) % (300 << 10))
            rep, back = c.call({"op": "x", "i": i}, blob, timeout=30)
            if rep != {"i": i} or bytes(back) != blob[::-1]:
                failures.append(i)

    threads = [threading.Thread(target=caller, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert not any(t.is_alive() for t in threads) and failures == [] and not c.closed
    finally:
        c.close()
        srv.close()


def test_a_handler_waiting_on_a_peer_holds_no_thread_and_its_answer_arrives():
    """A handler returns a future when its answer waits for another request (a read relayed by the
    tracker to an agent that asks the tracker again): more of those than the pool has threads do not
    wait on each other, and an error set on the future reaches the caller as itself."""
    waiting: dict[int, Future] = {}

    def handler(conn, req, blob):
        if req["op"] == "outer":
            return waiting.setdefault(req["i"], Future())
        f = waiting.setdefault(req["i"], Future())  # "inner": answers the outer request of the same i
        if req["i"] == 0:
            f.set_exception(BatchRefused("slot 0 is held by no live agent"))
        else:
            f.set_result(({"outer": req["i"]}, b"rows"))
        return {"ok": True}, b""

    srv = endpoints.RpcServer(("127.0.0.1", 0), SECRET, handler, name="later", workers=2)
    c = endpoints.connect(srv.address, SECRET)
    try:
        outer = [c.call_async({"op": "outer", "i": i}) for i in range(6)]  # three times the pool's threads
        assert [c.call({"op": "inner", "i": i}, timeout=10)[0] for i in range(6)] == [{"ok": True}] * 6
        with pytest.raises(BatchRefused, match="held by no live agent"):
            outer[0].result(timeout=10)
        assert [tuple(f.result(timeout=10)) for f in outer[1:]] == [({"outer": i}, b"rows") for i in range(1, 6)]
    finally:
        c.close()
        srv.close()


def _refused_by_peer(sock) -> bool:
    """Whether the peer ends the connection (after anything it sends first)."""
    sock.settimeout(10)
    try:
        while sock.recv(4096):
            pass
        return True
    except (ConnectionResetError, ssl.SSLError):  # reset, or a TLS alert
        return True
    except TimeoutError:
        return False


def test_a_client_without_the_query_credential_is_refused_and_counted(server, caplog):
    """Another query's credential, a TLS client with no certificate, a plain client speaking our
    frames without TLS, and garbage: each refused at connect, none reaches the handler."""
    caplog.set_level("WARNING", logger="spark_share.transport.wire")
    srv, seen = server
    with pytest.raises(wire.AuthError):
        endpoints.connect(srv.address, OTHER_QUERY)
    header = json.dumps({"op": "x", "_id": 1, "_kind": "req"}).encode()
    frame = struct.pack("!IQ", len(header), 0) + header
    anonymous = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    anonymous.check_hostname, anonymous.verify_mode = False, ssl.CERT_NONE
    tls = anonymous.wrap_socket(socket.create_connection(srv.address))
    tls.sendall(frame)
    assert _refused_by_peer(tls)
    tls.close()
    for first_bytes in (frame, b"GET / HTTP/1.0\r\n\r\n" + b"x" * 100):
        raw = socket.create_connection(srv.address)
        raw.sendall(first_bytes)
        assert _refused_by_peer(raw)
        raw.close()
    wait_until(lambda: srv.refused >= 4, timeout=10, message="refusals not counted")
    assert seen == [] and srv.connections == []
    refusals = [r for r in caplog.records if "refused a connection" in r.getMessage()]
    assert len(refusals) == 4 and all(r.levelname == "WARNING" for r in refusals), caplog.text


def test_a_server_without_the_query_credential_is_refused_by_the_client():
    """A server of another query cannot impersonate ours, nor learn what our client would send."""
    got = []
    srv = endpoints.RpcServer(("127.0.0.1", 0), OTHER_QUERY, lambda c, r, b: got.append(r) or ({}, b""), name="fake")
    try:
        with pytest.raises(wire.AuthError):
            endpoints.connect(srv.address, SECRET)
        wait_until(lambda: srv.refused == 1, timeout=10, message="the server did not see the refusal")
        assert got == []
    finally:
        srv.close()


def test_a_plain_server_is_refused_by_the_client():
    """A listener that answers in clear (our frames, no TLS) is refused before we send anything."""
    listener = socket.create_server(("127.0.0.1", 0))
    received = bytearray()

    def plain_server():
        conn, _ = listener.accept()
        header = json.dumps({"_id": 1, "_kind": "rep"}).encode()
        conn.sendall(struct.pack("!IQ", len(header), 0) + header)
        conn.settimeout(10)
        try:
            while data := conn.recv(4096):
                received.extend(data)
        except OSError:
            pass
        conn.close()

    t = threading.Thread(target=plain_server, daemon=True)
    t.start()
    try:
        with pytest.raises(wire.AuthError):
            endpoints.connect(listener.getsockname()[:2], SECRET, timeout=10)
        t.join(10)
        assert received[:1] == b"\x16"  # all it got is our TLS hello (a handshake record), no frame
    finally:
        listener.close()


def test_the_credential_never_reaches_logs_errors_or_disk(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SPARK_SHARE_RUNTIME_DIR", str(tmp_path / "run"))
    caplog.set_level(logging.DEBUG)
    secret, other = wire.new_secret(), wire.new_secret()  # fresh: their keys are written and loaded here
    key_pem = tls.certificate(secret)[0].decode()
    key_body = "".join(key_pem.splitlines()[1:-1])
    errors = []
    srv = endpoints.RpcServer(("127.0.0.1", 0), secret, lambda c, r, b: ({}, b""), name="quiet")
    rogue = endpoints.RpcServer(("127.0.0.1", 0), other, lambda c, r, b: ({}, b""), name="rogue")
    try:
        for address, credential in ((srv.address, other), (rogue.address, secret)):
            with pytest.raises(wire.AuthError) as e:
                endpoints.connect(address, credential)
            errors.append(f"{e.value!r} {e.value}")
        wait_until(lambda: srv.refused == 1 and rogue.refused == 1, timeout=10, message="refusals not counted")
    finally:
        srv.close()
        rogue.close()
    text = caplog.text + " ".join(errors)
    assert "refused a connection" in caplog.text
    for s in (secret, other, key_body):
        assert s not in text
    assert os.listdir(tmp_path / "run") == [], "a key file outlived loading it"


def test_nothing_received_is_unpickled(server, monkeypatch):
    """A pickle in a blob or a header is data: it arrives as the bytes or the text that was sent."""
    ran = []

    class Payload:
        def __reduce__(self):
            return (ran.append, ("unpickled",))

    def forbidden(*a, **k):
        raise AssertionError("unpickled")

    srv, seen = server
    payload = pickle.dumps(Payload())
    for name in ("loads", "load", "Unpickler"):
        monkeypatch.setattr(pickle, name, forbidden)
    c = endpoints.connect(srv.address, SECRET)
    rep, back = c.call({"op": "x", "x": payload.hex()}, payload, timeout=5)
    assert bytes(back) == payload[::-1] and rep["echo"] == payload.hex() and ran == []
    c.close()


def test_handler_errors_reach_the_peer_scrubbed():
    def handler(conn, req, blob):
        raise ValueError("client config rejected: sasl.password=hunter2-secret")

    srv = endpoints.RpcServer(("127.0.0.1", 0), SECRET, handler, name="scrub",
                         scrub=lambda s: s.replace("hunter2-secret", "***"))
    try:
        c = endpoints.connect(srv.address, SECRET)
        with pytest.raises(wire.RemoteError) as e:
            c.call({"op": "x"}, timeout=5)
        assert "sasl.password=***" in str(e.value) and "hunter2" not in str(e.value)
        c.close()
    finally:
        srv.close()


def test_unix_socket_is_owner_only(tmp_path):
    path = str(tmp_path / "a.sock")
    srv = endpoints.RpcServer(path, SECRET, lambda c, r, b: ({"ok": 1}, b""), name="uds")
    try:
        assert oct(os.stat(path).st_mode & 0o777) == oct(0o600)
        c = endpoints.connect(path, SECRET)
        assert c.call({"op": "x"}, timeout=5)[0] == {"ok": 1}
        c.close()
    finally:
        srv.close()
    assert not os.path.exists(path)


def test_an_abstract_unix_socket_has_no_file_admits_only_the_secret_and_goes_with_its_server():
    name = "\0spark-share-test-" + wire.new_secret()[:12]
    srv = endpoints.RpcServer(name, SECRET, lambda c, r, b: ({"ok": 1}, b""), name="abstract")
    try:
        c = endpoints.connect(name, SECRET)
        assert c.call({"op": "x"}, timeout=5)[0] == {"ok": 1}
        c.close()
        with pytest.raises(wire.AuthError):
            endpoints.connect(name, OTHER_QUERY, timeout=5)
    finally:
        srv.close()
    with pytest.raises(ConnectionRefusedError):
        endpoints.connect(name, SECRET, timeout=5)


def test_what_a_handler_runs_after_its_reply_runs_once_the_reply_is_sent():
    """A reply (rep, blob, then): ``then`` runs after the reply left (an agent that leaves once it answered
    closes the connection there), on a connection whose peer gets the reply first."""
    order = []
    after = threading.Event()

    def then():
        order.append("then")
        srv.close()  # what a leaving agent does: the reply must already be on its way
        after.set()

    def handler(conn, req, blob):
        order.append("handled")
        return {"ok": 1}, b"", then

    srv = endpoints.RpcServer(("127.0.0.1", 0), SECRET, handler, name="then")
    c = endpoints.connect(srv.address, SECRET)
    try:
        assert c.call({"op": "x"}, timeout=5)[0] == {"ok": 1}
        assert after.wait(5) and order == ["handled", "then"]
    finally:
        c.close()
        srv.close()


def test_an_oversized_frame_ends_the_connection(server):
    """The bounds hold inside an authenticated connection too: a frame announcing more than
    MAX_HEADER is not allocated, and the connection ends."""
    srv, seen = server
    sock = socket.create_connection(srv.address)
    stream = tls.admit(sock, SECRET, server_side=False)
    stream.sendall(frames.FRAME.pack(frames.MAX_HEADER + 1, 0))
    assert _refused_by_peer(sock)
    stream.close()
    assert seen == []


def test_pending_calls_fail_when_peer_goes_away(server):
    srv, _ = server
    c = endpoints.connect(srv.address, SECRET)
    fut = c.call_async({"op": "x"})
    fut.result(5)
    srv.close()
    assert c.wait_closed(5)
    with pytest.raises(PeerConnectionError):
        c.call({"op": "x"}, timeout=5)


def test_a_peer_admitted_while_the_server_closes_is_closed_and_close_returns():
    srv = endpoints.RpcServer(("127.0.0.1", 0), SECRET, lambda c, r, b: ({}, b""), name="closing")
    srv._stopped.set()  # close() has begun; the accept loop is still waiting for one more peer
    c = endpoints.connect(srv.address, SECRET)
    assert c.wait_closed(5), "a peer admitted during close stayed connected"
    closer = threading.Thread(target=srv.close)
    closer.start()
    closer.join(10)
    assert not closer.is_alive(), "RpcServer.close() hung"


class _Tap:
    """A TCP relay between one client and a server, TLS record by TLS record: a peer on the path
    between two hosts. Once the test arms it (after the handshake), it may alter the next record
    the client sends, send the client's last record again, or cut the connection after some bytes
    of the server's."""

    def __init__(self, target):
        self._target = target
        self.alter = None  # record -> bytes forwarded in its place (client to server, once)
        self.cut_after = None  # bytes of the server's forwarded before cutting the connection
        self.last_record = b""
        self.seen = bytearray()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = self._listener.getsockname()[:2]
        self._server = None
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        client, _ = self._listener.accept()
        self._server = socket.create_connection(self._target)
        threading.Thread(target=self._client_to_server, args=(client, self._server), daemon=True).start()
        threading.Thread(target=self._server_to_client, args=(self._server, client), daemon=True).start()

    def _client_to_server(self, src, dst):
        pending = b""
        try:
            while data := src.recv(65536):
                pending += data
                while len(pending) >= 5 and len(pending) >= 5 + struct.unpack("!H", pending[3:5])[0]:
                    size = 5 + struct.unpack("!H", pending[3:5])[0]
                    record, pending = pending[:size], pending[size:]
                    self.last_record = record
                    if self.alter is not None:
                        record, self.alter = self.alter(record), None
                    self.seen.extend(record)
                    dst.sendall(record)
        except OSError:
            pass
        finally:
            self._cut(src, dst)

    def _server_to_client(self, src, dst):
        try:
            while data := src.recv(65536):
                if self.cut_after is not None:
                    data = data[: self.cut_after]
                    self.cut_after -= len(data)
                self.seen.extend(data)
                dst.sendall(data)
                if self.cut_after == 0:
                    break
        except OSError:
            pass
        finally:
            self._cut(src, dst)

    def replay(self):
        self._server.sendall(self.last_record)

    @staticmethod
    def _cut(*socks):
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self):
        self._listener.close()


@pytest.fixture
def tapped(server):
    """The echo server, a tap on the path, and a client connected through it (handshake done)."""
    srv, seen = server
    tap = _Tap(srv.address)
    c = endpoints.connect(tap.address, SECRET)
    assert c.call({"op": "x", "x": 1}, timeout=5)[0]["echo"] == 1  # a genuine call first
    yield srv, seen, tap, c
    c.close()
    tap.close()


def test_a_record_altered_on_the_path_ends_the_connection(tapped, caplog):
    caplog.set_level("WARNING", logger="spark_share.transport.wire")
    srv, seen, tap, c = tapped
    tap.alter = lambda record: record[:-20] + bytes([record[-20] ^ 1]) + record[-19:]  # one bit
    with pytest.raises(PeerConnectionError):
        c.call({"op": "x", "x": 2}, b"records", timeout=10)
    wait_until(lambda: srv.forged == 1, timeout=10, message="the altered record was not refused")
    assert [r.get("x") for r in seen] == [1], "the altered request reached the handler"
    assert "a TLS record failed" in caplog.text and SECRET not in caplog.text


def test_a_record_replayed_on_the_path_ends_the_connection(tapped):
    srv, seen, tap, c = tapped
    tap.replay()  # the genuine request's record again: its sequence number is spent
    wait_until(lambda: srv.forged == 1, timeout=10, message="the replayed record was not refused")
    assert c.wait_closed(10)
    assert [r.get("x") for r in seen] == [1], "the replayed request reached the handler"


def test_a_connection_cut_in_a_frame_fails_the_reader(tapped):
    srv, seen, tap, c = tapped
    tap.cut_after = 1 << 20  # of an 8 MB reply
    with pytest.raises(PeerConnectionError):
        c.call({"op": "x", "x": 2}, os.urandom(8 << 20), timeout=30)
    assert c.wait_closed(10) and not c.forged


def test_headers_and_records_do_not_cross_the_network_in_clear(tapped):
    srv, seen, tap, c = tapped
    record = b"card=4111-1111-1111-1111;" * 40
    rep, back = c.call({"op": "x", "x": "header-in-clear?"}, record, timeout=5)
    assert rep["echo"] == "header-in-clear?" and bytes(back) == record[::-1]
    for plain in (b"card=4111", b"1111-1114=drac", b"header-in-clear?"):
        assert plain not in bytes(tap.seen), plain


_TIGHT_SERVER = """
import logging, os, resource, sys
from spark_share.transport import endpoints, frames, wire
logging.basicConfig(stream=sys.stderr, level=logging.INFO)
secret = sys.stdin.readline().strip()
srv = endpoints.RpcServer(("127.0.0.1", 0), secret, lambda c, r, b: ({"pauses": srv.accept_pauses}, b""), name="tight")
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
top = max(int(fd) for fd in os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (top + 4, hard))  # a few peers, then EMFILE
print(srv.address[1], flush=True)
sys.stdin.readline()  # until the test says stop
srv.close()
print("closed", flush=True)
"""


def test_the_accept_loop_survives_running_out_of_descriptors(tmp_path):
    """A server out of descriptors (EMFILE) pauses accepting with a log line, and takes the peers that
    waited once descriptors are free again: it never stops accepting for good."""
    import subprocess
    import sys

    err = open(tmp_path / "server.err", "w+")
    server = subprocess.Popen([sys.executable, "-c", _TIGHT_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=err, text=True)
    clients = []
    try:
        server.stdin.write(SECRET + "\n")
        server.stdin.flush()
        port = int(server.stdout.readline())
        address = ("127.0.0.1", port)
        while True:  # connect until the server has no descriptor for the next peer
            try:
                clients.append(endpoints.connect(address, SECRET, timeout=3))
            except (TimeoutError, OSError, PeerConnectionError):
                break
            assert len(clients) < 50, "the descriptor limit did not hold"
        assert clients, "no peer was admitted at all"
        rep, _ = clients[0].call({"op": "pauses"}, timeout=10)
        assert rep["pauses"] >= 1
        waiting = []
        late = threading.Thread(target=lambda: waiting.append(endpoints.connect(address, SECRET, timeout=30)))
        late.start()
        for c in clients[:2]:  # descriptors free again: the waiting peer gets in
            c.close()
        late.join(40)
        assert waiting, "a peer waiting in the backlog was never accepted"
        rep, _ = waiting[0].call({"op": "pauses"}, timeout=10)
        assert rep["pauses"] >= 1
        clients += waiting
    finally:
        for c in clients:
            c.close()
        server.stdin.write("stop\n")
        server.stdin.flush()
        assert server.stdout.readline().strip() == "closed"
        server.wait(30)
    err.seek(0)
    assert "tight: cannot accept a connection (Too many open files)" in err.read()
