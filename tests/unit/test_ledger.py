"""The tracker's ledger of batches (spark_share/driver/ledger.py), without Spark, Kafka or sockets:
one batch per id, reads of what this run did not plan read nothing, a slot is read by the agent that
acquired it, verdicts are all or nothing, and only batches Spark committed become due."""
from __future__ import annotations

import threading

import pytest

from spark_share.acknowledgement import ACCEPT, REJECT, RELEASE, AckOutcome
from spark_share.driver.batches import ACKED, ACKING, PLANNED, QUEUED, RELEASED, VOID
from spark_share.driver.ledger import KEEP_FINISHED, BatchLedger
from spark_share.driver.policy import BatchPolicy
from spark_share.errors import BatchRefused, VerdictError
from spark_share.transport.protocol import Acquired, Claim, Verdicts


@pytest.fixture
def ledger() -> BatchLedger:
    return BatchLedger(BatchPolicy(2, idle_probe_ms=1000), max_delivery_count=5)


def verdicts(ledger: BatchLedger, spark_batch, kind: str, rows: list, reason=None, connect_session=None,
             query_id=None, ours=True) -> dict:
    """A reject()/release() call of the user's process, as the tracker gets it: chunks under one token."""
    import uuid

    import pyarrow as pa

    from spark_share.verdict_set import VerdictSet

    table = pa.table({"topic": [r[0] for r in rows], "partition": pa.array([r[1] for r in rows], pa.int32()),
                      "offset": pa.array([r[2] for r in rows], pa.int64())})
    chunks = VerdictSet.of(table, {"reject": REJECT, "release": RELEASE}[kind], reason).chunks(rows=1)
    msg = Verdicts(spark_batch, kind, uuid.uuid4().hex, parts=len(chunks), reason=reason,
                   connect_session=connect_session, query_id=query_id)
    rep: dict = {}
    for part, chunk in enumerate(chunks):
        msg.part = part
        rep = ledger.record_verdicts(msg, chunk, ours=ours)
        if not rep.get("match", True):
            break
    return rep


def given(b) -> list:
    """A batch's verdicts as (topic, partition, offset, kind, reason)."""
    return sorted((r["topic"], r["partition"], r["offset"], r["kind"], r["reason"]) for r in b.verdicts.to_table().to_pylist())


def acquired(ledger: BatchLedger, batch: int, slot: int, agent: str, runs: dict, poison=()) -> None:
    rows = sum(hi - lo + 1 for parts in runs.values() for rs in parts.values() for lo, hi in rs)
    ledger.acquired(Acquired(batch, slot, rows=rows, offsets=runs, poison=[list(p) for p in poison]), agent)


def test_a_batch_is_planned_once_and_nothing_once_stopping(ledger):
    b, new = ledger.plan(0, None, version=1)
    assert new and b.state == PLANNED and b.slots == 2
    again, new_again = ledger.plan(0, None, version=1)
    assert again is b and not new_again
    assert ledger.due_at_stop() == [b] and b.state == ACKING
    assert ledger.plan(1, None, version=1) == (None, False)
    assert 1 not in ledger.batches


def test_a_batch_this_run_did_not_plan_is_read_as_void(ledger):
    assert ledger.batch_to_read(7) is None
    assert ledger.batches[7].state == VOID
    with pytest.raises(BatchRefused, match="earlier run of this query"):
        ledger.claim(Claim(7, 0), "a1", {"a1"})
    b, _ = ledger.plan(8, None, version=1)
    assert ledger.batch_to_read(8) is b


def test_a_slot_is_read_by_the_agent_that_acquired_it(ledger):
    ledger.plan(0, None, version=1)
    assert ledger.claim(Claim(0, 0, spark_batch=3), "a1", {"a1", "a2"}) == "a1"
    acquired(ledger, 0, 0, "a1", {"t": {"0": [[0, 9]]}})
    # A retried task on another host reads the same rows, from the agent that holds them.
    assert ledger.claim(Claim(0, 0), "a2", {"a1", "a2"}) == "a1"
    assert ledger.batches[0].spark_batch == 3
    # The holder is gone: its rows may be in a sink already, so the slot reads nothing new.
    assert ledger.claim(Claim(0, 0), "a2", {"a2"}) is None
    # Claimed by an agent that left before acquiring anything: another may poll it.
    ledger.claim(Claim(0, 1), "a1", {"a1"})
    assert ledger.claim(Claim(0, 1), "a2", {"a2"}) == "a2"


def test_refusals_say_why(ledger):
    with pytest.raises(BatchRefused, match="never planned"):
        ledger.claim(Claim(4, 0), "a1", {"a1"})
    b, _ = ledger.plan(0, None, version=1)
    ledger.due(0)
    ledger.finished(b, ACCEPT)
    with pytest.raises(BatchRefused, match="already committed"):
        ledger.claim(Claim(0, 0), "a1", {"a1"})
    ledger.plan(1, None, version=1)
    ledger.due_at_stop()
    with pytest.raises(BatchRefused, match="stopping"):
        ledger.claim(Claim(1, 0), "a1", {"a1"})


def test_records_at_the_delivery_limit_are_rejected_with_the_reason(ledger):
    ledger.plan(0, None, version=1)
    acquired(ledger, 0, 0, "a1", {"t": {"0": [[5, 7]]}}, poison=[("t", 0, 6, 5)])
    b = ledger.batches[0]
    assert given(b) == [("t", 0, 6, REJECT, "deliveryCount 5 reached maxDeliveryCount 5")]
    assert b.rows == 3 and ledger.total_acquired == 3


def test_verdicts_are_all_or_nothing(ledger):
    ledger.plan(0, None, version=1)
    ledger.claim(Claim(0, 0, spark_batch=4), "a1", {"a1"})
    acquired(ledger, 0, 0, "a1", {"t": {"0": [[0, 9]]}})
    with pytest.raises(VerdictError, match="batch 5 has no kafka-share records"):
        verdicts(ledger, 5, "reject", [["t", 0, 1]])
    with pytest.raises(VerdictError, match="1 of 2 rows are not from batch 4"):
        verdicts(ledger, 4, "reject", [["t", 0, 1], ["t", 0, 50]])
    assert given(ledger.batches[0]) == []
    assert verdicts(ledger, 4, "reject", [["t", 0, 1]], reason="bad") == {"ok": True, "match": True, "records": 1}
    with pytest.raises(VerdictError, match="opposite verdict"):
        verdicts(ledger, 4, "release", [["t", 0, 2], ["t", 0, 1]])
    assert given(ledger.batches[0]) == [("t", 0, 1, REJECT, "bad")]


def test_verdicts_under_connect_find_the_batch_by_session(ledger):
    ledger.plan(0, None, version=1)
    ledger.claim(Claim(0, 0, connect_session="s1"), "a1", {"a1"})
    acquired(ledger, 0, 0, "a1", {"t": {"0": [[0, 3]]}})
    assert verdicts(ledger, None, "release", [["t", 0, 2]], connect_session="other") == {"match": False}
    assert verdicts(ledger, None, "release", [["t", 0, 2]], connect_session="s1")["records"] == 1
    assert given(ledger.batches[0]) == [("t", 0, 2, RELEASE, None)]


def test_a_batch_no_read_named_is_found_by_its_rows(ledger):
    """readMode=driver: the reads never reach the tracker, so no claim names Spark's batch id. Verdicts
    sent to every tracker of the host (not known to be this query's) match the running batch only when
    it holds their rows; verdicts sent to this query's tracker take the running batch, and its rows are
    checked as always. Either way the batch takes Spark's id for the next calls."""
    ledger.plan(0, None, version=1)
    ledger.claim(Claim(0, 0), "driver", {"driver"})
    acquired(ledger, 0, 0, "driver", {"t": {"0": [[0, 9]]}})
    assert verdicts(ledger, 7, "reject", [["t", 0, 50]], query_id="q", ours=False) == {"match": False}
    assert ledger.batches[0].spark_batch is None
    assert verdicts(ledger, 7, "reject", [["t", 0, 1]], query_id="q", ours=False)["records"] == 1
    assert ledger.batches[0].spark_batch == 7
    with pytest.raises(VerdictError, match="1 of 2 rows are not from batch 7"):
        verdicts(ledger, 7, "release", [["t", 0, 2], ["t", 0, 50]])
    ledger.plan(1, None, version=1)
    ledger.claim(Claim(1, 0), "driver", {"driver"})
    acquired(ledger, 1, 0, "driver", {"t": {"0": [[10, 19]]}})
    with pytest.raises(VerdictError, match="1 of 1 rows are not from batch 9"):  # ours: the running batch, checked
        verdicts(ledger, 9, "reject", [["t", 0, 1]])
    assert ledger.batches[1].spark_batch == 9 and given(ledger.batches[0]) == [("t", 0, 1, REJECT, None)]


def test_under_connect_a_batch_no_read_named_is_found_by_its_rows(ledger):
    ledger.plan(0, None, version=1)
    ledger.claim(Claim(0, 0), "driver", {"driver"})  # readMode=driver: no session in the claim
    acquired(ledger, 0, 0, "driver", {"t": {"0": [[0, 3]]}})
    assert verdicts(ledger, None, "reject", [["t", 0, 9]], connect_session="s1") == {"match": False}
    assert verdicts(ledger, None, "reject", [["t", 0, 2]], connect_session="s1")["records"] == 1
    assert ledger.batches[0].connect_sessions == {"s1"}
    assert verdicts(ledger, None, "release", [["t", 0, 1]], connect_session="s2") == {"match": False}


def test_only_batches_spark_committed_are_due(ledger):
    for n in range(3):
        ledger.plan(n, None, version=1)
    due = ledger.due(1)
    assert [b.batch for b in due] == [0, 1] and all(b.state == ACKING and b.committed_at for b in due)
    assert ledger.batches[2].state == PLANNED and ledger.committed_upto == 1
    assert ledger.due(1) == []  # already under way
    pending = ledger.due_at_stop()
    assert [b.batch for b in pending] == [2]
    assert ledger.due_at_stop() is None  # a second stop waits for the first
    assert ledger.due(2) == [] and ledger.committed_upto == 2  # remembered: the stop ACCEPTs it
    assert ledger.committed(ledger.batches[2], commit_log=None)


def test_finished_batches_are_counted_and_old_ones_dropped(ledger):
    for n in range(KEEP_FINISHED + 3):
        b, _ = ledger.plan(n, None, version=1)
        ledger.due(n)
        b.outcome = AckOutcome(accepted=2)
        ledger.finished(b, ACCEPT if n % 2 == 0 else RELEASE)
    assert len(ledger.batches) == KEEP_FINISHED
    assert min(ledger.batches) == 3
    assert ledger.batches[4].state == ACKED and ledger.batches[5].state == RELEASED
    assert ledger.totals.accepted == 2 * (KEEP_FINISHED + 3)
    assert ledger.progress()["lastAcked"]["batch"] == KEEP_FINISHED + 2


def test_a_wait_for_acknowledgements_ends_when_the_batch_finishes(ledger):
    b, _ = ledger.plan(0, None, version=1)
    ledger.due(0)
    waiting = threading.Thread(target=ledger.wait_acked, args=(0,), kwargs={"timeout": 30})
    waiting.start()
    with ledger.lock:
        b.state = QUEUED
        ledger.notify()
    assert waiting.is_alive()  # queued is not answered
    ledger.finished(b, ACCEPT)
    waiting.join(10)
    assert not waiting.is_alive()


def test_progress_and_status_show_what_is_held(ledger):
    ledger.plan(0, None, version=1)
    ledger.claim(Claim(0, 0), "a1", {"a1"})
    acquired(ledger, 0, 0, "a1", {"t": {"0": [[0, 4]]}})
    p = ledger.progress()
    assert p["batch"] == 0 and p["inflightRecords"] == 5 and p["acquired"] == 5 and p["lastAcked"] is None
    s = ledger.status()
    assert s["claims"] == ["a1"] and s["batches"][0]["acquired"] == 5
    assert [a["rows"] for a in ledger.held()] == [5]
