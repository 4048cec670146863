"""The file mailbox between the user's code and a tracker (spark_share/transport/mailbox.py): a call gets its
reply, errors come back as themselves and scrubbed, a malformed request is answered with an error, each
request is answered once, a stopped tracker's mailbox is gone and a call to it fails at once, stale
mailboxes are not offered, and a day-old one is pruned."""
from __future__ import annotations

import os
import threading
import time

import pytest

from spark_share.errors import PeerConnectionError, ProtocolError, VerdictError
from spark_share.transport import mailbox
from spark_share.transport.frames import decode_frame, encode_frame


def serve(tmp_path, handler, tracker_id="t1"):
    return mailbox.MailboxServer(str(tmp_path / "x"), tracker_id, handler, scrub=lambda s: s.replace("pw123", "***"))


def test_a_call_gets_its_reply_and_its_blob_reaches_the_handler(tmp_path):
    seen = []

    def handler(conn, header, blob):
        seen.append((header["op"], bytes(blob)))
        return {"records": len(blob)}, b""

    server = serve(tmp_path, handler)
    try:
        (box,) = mailbox.live_mailboxes(str(tmp_path / "x"))
        assert box.call({"op": "verdicts", "part": 0}, b"abc", timeout=10) == ({"records": 3}, b"")
        assert box.call({"op": "verdicts", "part": 1}, timeout=10)[0] == {"records": 0}
        assert seen == [("verdicts", b"abc"), ("verdicts", b"")]
        # answered and read: nothing left in the mailbox
        assert os.listdir(os.path.join(server.directory, "requests")) == []
        assert os.listdir(os.path.join(server.directory, "replies")) == []
    finally:
        server.close()


def test_errors_come_back_as_themselves_and_scrubbed(tmp_path):
    def handler(conn, header, blob):
        if header["op"] == "ours":
            raise VerdictError("rows not from the running batch (password pw123)")
        raise KeyError("pw123")

    server = serve(tmp_path, handler)
    try:
        box = mailbox.MailboxConnection(server.directory)
        with pytest.raises(VerdictError, match=r"not from the running batch \(password \*\*\*\)"):
            box.call({"op": "ours"}, timeout=10)
        with pytest.raises(Exception, match=r"KeyError") as e:
            box.call({"op": "other"}, timeout=10)
        assert "pw123" not in str(e.value)
    finally:
        server.close()


def test_a_malformed_request_is_answered_with_an_error_and_the_mailbox_goes_on(tmp_path):
    server = serve(tmp_path, lambda conn, h, b: ({"ok": True}, b""))
    try:
        with open(os.path.join(server.directory, "requests", "bad.req"), "wb") as f:
            f.write(b"\x00\x00\x00\x05\x00\x00\x00\x00\x00\x00\x00\x00[1,2]")  # a header that is not an object
        reply = os.path.join(server.directory, "replies", "bad.rep")
        deadline = time.monotonic() + 10
        while not os.path.exists(reply) and time.monotonic() < deadline:
            time.sleep(0.01)  # polling a file: nothing else tells when it appears
        with open(reply, "rb") as f:
            assert "malformed frame header" in decode_frame(f.read())[0]["_error"]
        assert mailbox.MailboxConnection(server.directory).call({"op": "x"}, timeout=10)[0] == {"ok": True}
    finally:
        server.close()


def test_concurrent_callers_each_get_their_own_reply_once(tmp_path):
    calls = []
    server = serve(tmp_path, lambda conn, h, b: (calls.append(h["n"]) or {"n": h["n"]}, b""))
    try:
        box = mailbox.MailboxConnection(server.directory)
        got: dict[int, dict] = {}
        threads = [threading.Thread(target=lambda n=n: got.__setitem__(n, box.call({"n": n}, timeout=30)[0]))
                   for n in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert got == {n: {"n": n} for n in range(16)}
        assert sorted(calls) == list(range(16))  # each request answered once
    finally:
        server.close()


def test_a_stopped_trackers_mailbox_is_gone_and_a_call_to_it_fails_at_once(tmp_path):
    server = serve(tmp_path, lambda conn, h, b: ({}, b""))
    box = mailbox.MailboxConnection(server.directory)
    server.close()
    assert not os.path.exists(server.directory)
    with pytest.raises(PeerConnectionError, match="stopped before it answered"):
        box.call({"op": "x"}, timeout=10)


def test_a_call_nobody_answers_times_out(tmp_path):
    d = tmp_path / "x" / "frozen"
    for sub in ("requests", "replies"):
        (d / sub).mkdir(parents=True)
    with pytest.raises(PeerConnectionError, match="did not answer within"):
        mailbox.MailboxConnection(str(d)).call({"op": "x"}, timeout=0.3)


def test_stale_mailboxes_are_not_offered_and_day_old_ones_are_pruned(tmp_path):
    location = tmp_path / "x"
    stale = serve(tmp_path, lambda conn, h, b: ({}, b""), tracker_id="stale")
    stale._stop.set()
    stale._thread.join(10)  # a tracker killed: its mailbox stays, untouched
    alive = os.path.join(stale.directory, "alive")

    def said_alive(at: float) -> None:
        with open(alive, "w") as f:
            f.write(repr(at))

    said_alive(time.time() - mailbox.STALE_AFTER_S - 5)
    fresh = serve(tmp_path, lambda conn, h, b: ({}, b""), tracker_id="fresh")
    try:
        assert [b.directory for b in mailbox.live_mailboxes(str(location))] == [fresh.directory]
        said_alive(time.time() - mailbox.PRUNE_AFTER_S - 5)
        later = serve(tmp_path, lambda conn, h, b: ({}, b""), tracker_id="later")
        later.close()
        assert sorted(os.listdir(location)) == ["fresh"]
    finally:
        fresh.close()


def test_one_trackers_mailbox_is_found_by_its_id_and_nothing_else_is(tmp_path):
    """The listener finds a drain's tracker by the id and location its offset names (a progress report): an id
    that is not a tracker's names no directory, wherever it points."""
    server = serve(tmp_path, lambda conn, header, blob: ({"drained": False}, b""), tracker_id="0123456789abcdef")
    try:
        box = mailbox.live_mailbox(str(tmp_path / "x"), "0123456789abcdef")
        assert box is not None and box.call({"op": "drain"}, timeout=10)[0] == {"drained": False}
        for other in ("fedcba9876543210", "../x/0123456789abcdef", "0123456789ABCDEF", ".", ""):
            assert mailbox.live_mailbox(str(tmp_path / "x"), other) is None, other
    finally:
        server.close()
    assert mailbox.live_mailbox(str(tmp_path / "x"), "0123456789abcdef") is None  # stopped


def test_decode_frame_checks_the_lengths():
    head, blob = encode_frame({"op": "x"}, b"12345")
    assert decode_frame(head + blob) == ({"op": "x"}, b"12345")
    for bad in (head + blob[:-1], head[:5], head + blob + b"!"):
        with pytest.raises(ProtocolError):
            decode_frame(bad)


def test_rows_collected_to_a_list_reach_the_mailbox_the_call_names(tmp_path, monkeypatch):
    """A list of Rows carries no schema, nor do a batch's on Spark < 4.2: reject(..., exchange_location=)
    names the source's exchangeLocation itself."""
    from pyspark.sql import Row, SparkSession

    from spark_share.user import verdicts

    seen = []

    def handler(conn, header, blob):
        seen.append(header)
        return {"match": True, "records": 2}, b""

    server = serve(tmp_path, handler)
    monkeypatch.setattr(SparkSession, "getActiveSession", staticmethod(lambda: object()))
    monkeypatch.setattr(verdicts.connect, "is_connect", lambda spark: False)
    monkeypatch.setattr(verdicts, "_current_batch", lambda spark: ("q1", 4))  # what foreachBatch's thread says
    monkeypatch.setattr(verdicts, "tracker_for", lambda query_id: None)  # no tracker of this host knows the query
    rows = [Row(topic="t", partition=0, offset=5), Row(topic="t", partition=1, offset=7)]
    try:
        assert verdicts.reject(rows, reason="bad", exchange_location=str(tmp_path / "x")) == 2
        assert [(h["op"], h["spark_batch"], h["kind"], h["query_id"], h["reason"]) for h in seen] == \
            [("verdicts", 4, "reject", "q1", "bad")]
        with pytest.raises(VerdictError, match=r"exchange_location='x' must be the absolute directory path"):
            verdicts.release(rows, exchange_location="x")
        assert len(seen) == 1
    finally:
        server.close()
    assert "exchange_location=" in verdicts._unreached(None)  # what a call that found no tracker says to do
