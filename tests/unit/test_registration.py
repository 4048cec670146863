"""How the user's process finds a query's tracker (spark_share/driver/registration.py), in a private
runtime directory of the test's: the run's entry at once, the query's on the first read that names it,
owner-only files, a second kafka-share source of the same query refused, both entries removed at the stop."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading

import pytest

from spark_share import runtime
from spark_share.driver.registration import TWO_SOURCES, Registration
from spark_share.errors import SourceError


@pytest.fixture(autouse=True)
def runtime_dir(tmp_path, monkeypatch):
    d = tmp_path / "rt"
    d.mkdir(mode=0o700)
    monkeypatch.setenv("SPARK_SHARE_RUNTIME_DIR", str(d))
    return d


def entry(tracker_id: str, pid: int | None = None) -> dict:
    return {"host": "127.0.0.1", "port": 1, "secret": "s3cret", "tracker_id": tracker_id, "pid": pid or os.getpid()}


def test_the_run_entry_is_written_at_once_and_the_query_entry_once(runtime_dir):
    r = Registration("aaaa1111", entry("aaaa1111"))
    run_file = runtime.run_registry_path("aaaa1111")
    assert runtime.read_json(run_file)["tracker_id"] == "aaaa1111"
    assert stat.S_IMODE(os.stat(run_file).st_mode) == 0o600  # the secret is in it
    assert not r.serve(None)
    assert r.serve("q-1") and r.query_id == "q-1"
    assert not r.serve("q-1") and not r.serve("q-2")  # one query per run
    assert runtime.live_registry_entry("q-1")["tracker_id"] == "aaaa1111"
    r.remove()
    assert runtime.registry_entry("q-1") is None and runtime.read_json(run_file) is None


def test_reads_naming_the_query_at_once_register_it_once():
    r = Registration("bbbb2222", entry("bbbb2222"))
    results: list[bool] = []
    threads = [threading.Thread(target=lambda: results.append(r.serve("q-1"))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sorted(results) == [False] * 7 + [True]


def test_a_second_source_of_the_same_query_is_refused():
    first = Registration("cccc3333", entry("cccc3333"))
    assert first.serve("q-1")
    second = Registration("dddd4444", entry("dddd4444"))
    with pytest.raises(SourceError) as e:
        second.serve("q-1")
    assert str(e.value) == TWO_SOURCES
    assert runtime.live_registry_entry("q-1")["tracker_id"] == "cccc3333"


def test_the_entry_of_a_tracker_that_is_gone_does_not_block_a_new_run():
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    runtime.write_private_json(runtime.registry_path("q-1"), entry("eeee5555", pid=int(gone.stdout)))
    r = Registration("ffff6666", entry("ffff6666"))
    assert r.serve("q-1")
    assert runtime.live_registry_entry("q-1")["tracker_id"] == "ffff6666"


def test_a_run_with_an_exchange_location_answers_in_its_mailbox_until_it_stops(tmp_path):
    from spark_share.transport.mailbox import live_mailboxes

    location = tmp_path / "exchange"
    r = Registration("cccc3333", entry("cccc3333"), str(location), handler=lambda conn, h, b: ({"echo": h["op"]}, b""))
    assert stat.S_IMODE(os.stat(location / "cccc3333").st_mode) == 0o700
    (box,) = live_mailboxes(str(location))
    assert box.call({"op": "verdicts"}, timeout=10)[0] == {"echo": "verdicts"}
    r.remove()
    assert live_mailboxes(str(location)) == [] and not (location / "cccc3333").exists()


def test_an_exchange_location_the_driver_cannot_write_is_refused_naming_the_option(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(SourceError, match=r"option 'exchangeLocation' = .*cannot make this run's directory"):
        Registration("dddd4444", entry("dddd4444"), str(blocker / "sub"), handler=lambda *a: ({}, b""))
    assert runtime.read_json(runtime.run_registry_path("dddd4444")) is None  # nothing left registered
