"""``spark_share.driver.acks``: the Acknowledger against fake agent connections.

The fakes answer ``protocol.call`` (an ``Ack``: queued on the agent's consumers) and
``protocol.call_async`` (a ``DeadLetter`` write, an ``AckResult``: what the broker answered) the
way an agent does, and record every message they receive. Covers: a committed batch is ACCEPTed and
an uncommitted one RELEASEd, by every agent that read a slot (an empty read too); verdicts override
the default per record; dead letters are written before any REJECT, an agent REJECTs only what it
wrote itself, and a failed (or short) dead-letter write sends no REJECT at all: the whole batch is
released and the failure names the target option without a secret; a lost agent's records count as
failed; the broker's answers are added up and batches finish in the order they were acknowledged;
the log line of each batch.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future

import pytest

from spark_share.acknowledgement import ACCEPT, REJECT, RELEASE, AckOutcome
from spark_share.driver.acks import AGENT_LOST, Acknowledger, log_batch
from spark_share.driver.batches import QUEUED, BatchState
from spark_share.driver.policy import BatchPolicy
from spark_share.errors import DeadLetterError
from spark_share.options import parse_options
from spark_share.transport.protocol import Ack
from spark_share.verdict_set import VerdictSet

SECRET = "pw-hunter2-xyz"
WAIT_S = 10.0  # bound of every wait on the finisher thread


class FakeAgent:
    """An agent's connection as the tracker holds it: records each request header it gets, in order."""

    def __init__(self, agent_id: str, *, slots: dict | None = None, written: int | None = None,
                 ack_error: Exception | None = None, dead_letter_error: Exception | None = None,
                 result_error: Exception | None = None, hold_result: threading.Event | None = None,
                 hang_ack: bool = False):
        self.info = {"agent_id": agent_id}
        self.sent: list[dict] = []
        self.closed = False
        self.staged: dict[tuple[int, str], list] = {}  # (batch, purpose) -> verdict chunks
        self.slots = slots if slots is not None else {}
        self.written = written
        self.ack_error = ack_error
        self.dead_letter_error = dead_letter_error
        self.result_error = result_error
        self.hold_result = hold_result  # the AckResult answers only once this is set
        self.hang_ack = hang_ack  # never answers an Ack (a hung agent, or one cut off)
        self.result_asked = threading.Event()

    def call_async(self, header: dict, blob: bytes = b"") -> Future:
        f: Future = Future()
        if header["op"] == "stage":  # verdict chunks ahead of the Ack or DeadLetter that uses them
            self.staged.setdefault((header["batch"], header["purpose"]), []).append(blob)
            f.set_result(({"staged": True}, b""))
            return f
        self.sent.append(header)
        if header["op"] == "ack":
            if self.ack_error is not None:
                f.set_exception(self.ack_error)
            elif not self.hang_ack:
                f.set_result(({"queued": 1}, b""))
        elif header["op"] == "deadletter":
            if self.dead_letter_error is not None:
                f.set_exception(self.dead_letter_error)
            else:
                staged = VerdictSet.from_chunks(self.staged.get((header["batch"], "deadletter"), []))
                f.set_result(({"written": len(staged) if self.written is None else self.written}, b""))
        elif header["op"] == "ack_result":
            self.result_asked.set()
            if self.result_error is not None:
                f.set_exception(self.result_error)
            elif self.hold_result is not None:
                gate = self.hold_result
                threading.Thread(target=lambda: (gate.wait(WAIT_S), f.set_result(({"slots": self.slots}, b""))),
                                 daemon=True).start()
            else:
                f.set_result(({"slots": self.slots}, b""))
        else:
            raise AssertionError(f"unexpected request {header['op']}")
        return f

    def close(self) -> None:
        self.closed = True

    def ops(self) -> list[str]:
        return [h["op"] for h in self.sent]

    def acks(self) -> list[dict]:
        """The Acks it got, every field (a header leaves out what equals its default), with ``verdicts``:
        the [topic, partition, offset, kind] of the chunks staged before it."""
        out = []
        for h in self.sent:
            if h["op"] == "ack":
                ack = vars(Ack.parse(h))
                chunks = self.staged.get((ack["batch"], "ack"), [])
                assert len(chunks) == ack["staged"], "the Ack names the chunks sent before it"
                ack["verdicts"] = sorted(list(r) for r in VerdictSet.from_chunks(chunks).records())
                out.append(ack)
        return out

    def dead_letters(self) -> list[dict]:
        """Each DeadLetter it got, with ``records``: the [topic, partition, offset, reason] staged before it."""
        out = []
        for h in self.sent:
            if h["op"] == "deadletter":
                staged = VerdictSet.from_chunks(self.staged.get((h["batch"], "deadletter"), []))
                rows = staged.to_table().to_pylist()
                out.append({**h, "records": [[r["topic"], r["partition"], r["offset"], r["reason"]] for r in rows]})
        return out


class Rig:
    """An Acknowledger as the tracker builds it: its agents by id, its lock, a ``finished`` callback."""

    def __init__(self, agents: dict, **options: str):
        self.opts = parse_options({"kafka.bootstrap.servers": "broker:9092", "kafka.group.id": "orders",
                                   "subscribe": "t", "ackTimeoutMs": "2000", "kafka.sasl.password": SECRET,
                                   **options})
        self.lock = threading.RLock()
        self.agents = agents
        self.finished: list[tuple[int, int]] = []
        self.queued: list[int] = []
        self._done: dict[int, threading.Event] = {}
        self.acks = Acknowledger(self.opts, BatchPolicy(2, 1000), self.lock, agents, self._finished)

    def _finished(self, b: BatchState, default: int) -> None:
        assert self.lock._is_owned(), "finished must run under the tracker's lock"  # type: ignore[attr-defined]
        self.finished.append((b.batch, default))
        self._done.setdefault(b.batch, threading.Event()).set()

    def acknowledge(self, b: BatchState, default: int) -> str | None:
        self._done.setdefault(b.batch, threading.Event())
        return self.acks.acknowledge(b, default, queued=lambda: self.queued.append(b.batch))

    def wait_finished(self, batch: int) -> None:
        assert self._done[batch].wait(WAIT_S), f"batch {batch} never finished"

    def close(self):
        self.acks.close()
        # The tracker does not wait for its finisher thread; a test does, or that thread logs a batch
        # into the next test's captured records.
        self.acks._finisher.shutdown(wait=True)


@pytest.fixture
def rig():
    made = []

    def make(agents: dict, **options) -> Rig:
        made.append(Rig(agents, **options))
        return made[-1]
    yield make
    for r in made:
        r.close()


def batch(n: int, *slots: tuple[str, int, int, int, int]) -> BatchState:
    """Batch ``n`` with one acquired slot per (agent, rows, partition, first, last)."""
    b = BatchState(batch=n, slots=len(slots), max_records=None)
    for i, (agent, rows, p, first, last) in enumerate(slots):
        b.acquired[i] = {"agent": agent, "session": f"{agent}-s0", "rows": rows, "acquired_at": time.time(),
                         "offsets": {"t": {str(p): [[first, last]]}} if rows else {}}
    return b


def give(b: BatchState, *verdicts: tuple) -> None:
    """reject()/release() of (topic, partition, offset, kind[, reason]) rows of ``b``."""
    b.verdicts.update(VerdictSet.from_records(verdicts))


def answer(**counts) -> dict:
    return AckOutcome(**counts).as_dict()


# --- the default: ACCEPT once committed, RELEASE otherwise -------------------------------------------
def test_a_committed_batch_is_accepted_by_every_agent_that_read_a_slot(rig):
    a = FakeAgent("a", slots={"0": answer(accepted=10)})
    e = FakeAgent("e")  # read its slot and got nothing: it must still be told, to forget the empty read
    r = rig({"a": a, "e": e})
    b = batch(0, ("a", 10, 0, 0, 9), ("e", 0, 1, 0, 0))
    assert r.acknowledge(b, ACCEPT) is None
    assert b.state == QUEUED and r.queued == [0]
    r.wait_finished(0)
    for agent in (a, e):
        assert agent.ops() == ["ack", "ack_result"]  # queued first, then asked what the broker said
        (ack,) = agent.acks()
        assert (ack["batch"], ack["default"], ack["verdicts"], ack["timeout_s"]) == (0, ACCEPT, [], 2.0)
    assert r.finished == [(0, ACCEPT)]
    assert b.outcome == AckOutcome(accepted=10) and b.acked_at is not None


def test_an_uncommitted_batch_is_released(rig):
    a = FakeAgent("a", slots={"0": answer(released=10)})
    r = rig({"a": a}, deadLetterPath="/nowhere")
    b = batch(1, ("a", 10, 0, 0, 9))
    give(b, ("t", 0, 3, REJECT, "bad"))
    assert r.acknowledge(b, RELEASE) is None
    r.wait_finished(1)
    assert a.ops() == ["ack", "ack_result"], "a batch that is not committed writes no dead letters"
    assert a.acks()[0]["default"] == RELEASE
    assert a.acks()[0]["verdicts"] == [], "a batch given back carries no REJECT: that needs a dead letter"
    assert r.finished == [(1, RELEASE)] and b.outcome.released == 10


def test_verdicts_override_the_default_per_record(rig):
    a = FakeAgent("a", slots={"0": answer(accepted=8, rejected=1, released=1)})
    r = rig({"a": a})  # no dead-letter target: a REJECT needs no write first
    b = batch(2, ("a", 10, 0, 0, 9))
    give(b, ("t", 0, 3, REJECT, "unparseable"), ("t", 0, 4, RELEASE))
    assert r.acknowledge(b, ACCEPT) is None
    r.wait_finished(2)
    assert a.ops() == ["ack", "ack_result"]
    ack = a.acks()[0]
    assert ack["default"] == ACCEPT
    assert sorted(ack["verdicts"]) == [["t", 0, 3, REJECT], ["t", 0, 4, RELEASE]]
    assert (b.outcome.accepted, b.outcome.rejected, b.outcome.released) == (8, 1, 1)


# --- dead letters ----------------------------------------------------------------------------------
def test_dead_letters_are_written_before_any_reject_by_the_agent_that_holds_them(rig):
    a = FakeAgent("a", slots={"0": answer(accepted=9, rejected=1)})
    other = FakeAgent("o", slots={"1": answer(accepted=10)})
    r = rig({"a": a, "o": other}, deadLetterPath="/dlq")
    b = batch(3, ("a", 10, 0, 0, 9), ("o", 10, 1, 0, 9))
    give(b, ("t", 0, 3, REJECT, "bad"))
    assert r.acknowledge(b, ACCEPT) is None
    r.wait_finished(3)
    assert a.ops() == ["deadletter", "ack", "ack_result"]
    assert [d["records"] for d in a.dead_letters()] == [[["t", 0, 3, "bad"]]] and a.dead_letters()[0]["batch"] == 3
    assert a.acks()[0]["verdicts"] == [["t", 0, 3, REJECT]]
    # The agent that does not hold the record writes nothing, and is never told to REJECT it.
    assert other.ops() == ["ack", "ack_result"]
    assert all(v[3] != REJECT for v in other.acks()[0]["verdicts"])
    assert b.outcome.rejected == 1 and not b.outcome.errors


def test_a_failed_dead_letter_write_sends_no_reject_and_releases_the_whole_batch(rig):
    a = FakeAgent("a", dead_letter_error=DeadLetterError(f"disk full (sasl.password={SECRET})"))
    other = FakeAgent("o")
    r = rig({"a": a, "o": other}, deadLetterPath="/dlq")
    b = batch(4, ("a", 10, 0, 0, 9), ("o", 10, 1, 0, 9))
    give(b, ("t", 0, 3, REJECT, "bad"), ("t", 1, 5, REJECT, "bad"), ("t", 0, 6, RELEASE))
    failure = r.acknowledge(b, ACCEPT)
    r.wait_finished(4)
    assert failure is not None
    assert "deadLetterPath='/dlq'" in failure and "disk full" in failure and "batch 4" in failure
    assert SECRET not in failure and "***" in failure
    for agent in (a, other):
        for ack in agent.acks():
            assert ack["default"] == RELEASE and ack["verdicts"] == [], "nothing of the batch may be acknowledged"
    assert a.ops() == ["deadletter", "ack", "ack_result"]
    assert b.outcome.errors == {"DEADLETTER_WRITE_FAILED": 2}
    assert r.finished == [(4, RELEASE)]


def test_a_dead_letter_write_that_finds_fewer_records_fails_too(rig):
    a = FakeAgent("a", written=0)
    r = rig({"a": a}, deadLetterTopic="orders-dlq")
    b = batch(5, ("a", 10, 0, 0, 9))
    give(b, ("t", 0, 3, REJECT, "bad"))
    failure = r.acknowledge(b, ACCEPT)
    r.wait_finished(5)
    assert failure is not None and "deadLetterTopic='orders-dlq'" in failure and "only 0 of the 1" in failure
    assert a.acks()[0]["default"] == RELEASE and a.acks()[0]["verdicts"] == []


def test_a_record_two_agents_held_is_written_and_rejected_by_the_live_one_only(rig):
    """The broker gave a lost agent's records to another agent for another slot of the same batch."""
    live = FakeAgent("live", slots={"1": answer(accepted=9, rejected=1)})
    r = rig({"live": live}, deadLetterPath="/dlq")  # "lost" is no longer among the agents
    b = batch(6, ("lost", 10, 0, 0, 9), ("live", 10, 0, 0, 9))
    give(b, ("t", 0, 3, REJECT, "bad"))
    assert r.acknowledge(b, ACCEPT) is None
    r.wait_finished(6)
    assert [d["records"] for d in live.dead_letters()] == [[["t", 0, 3, "bad"]]]
    assert live.acks()[0]["default"] == ACCEPT and live.acks()[0]["verdicts"] == [["t", 0, 3, REJECT]]
    assert (b.outcome.failed, b.outcome.errors) == (10, {AGENT_LOST: 10})


def test_an_agent_lost_during_its_dead_letter_write_rejects_nothing_and_the_batch_goes_on(rig):
    gone = FakeAgent("g", dead_letter_error=ConnectionError("reset"), ack_error=ConnectionError("reset"))
    live = FakeAgent("l", slots={"1": answer(accepted=10)})
    r = rig({"g": gone, "l": live}, deadLetterPath="/dlq")
    b = batch(7, ("g", 10, 0, 0, 9), ("l", 10, 1, 0, 9))
    give(b, ("t", 0, 3, REJECT, "bad"))
    assert r.acknowledge(b, ACCEPT) is None, "a lost agent is not a broken dead-letter target"
    r.wait_finished(7)
    assert gone.acks()[0]["verdicts"] == [["t", 0, 3, RELEASE]], "what it did not write, it must not REJECT"
    assert live.acks()[0]["default"] == ACCEPT
    assert (b.outcome.accepted, b.outcome.failed, b.outcome.errors) == (10, 10, {AGENT_LOST: 10})
    assert r.finished == [(7, ACCEPT)]


# --- lost agents and failed answers ------------------------------------------------------------------
def test_an_agent_that_is_gone_counts_what_it_held_as_failed(rig):
    live = FakeAgent("live", slots={"0": answer(accepted=10)})
    r = rig({"live": live})
    b = batch(8, ("live", 10, 0, 0, 9), ("gone", 7, 1, 0, 6), ("gone", 3, 1, 7, 9), ("gone-empty", 0, 1, 0, 0))
    assert r.acknowledge(b, ACCEPT) is None
    r.wait_finished(8)
    assert (b.outcome.accepted, b.outcome.failed, b.outcome.errors) == (10, 10, {AGENT_LOST: 10})
    assert r.finished == [(8, ACCEPT)]


@pytest.mark.parametrize("error, name", [(ConnectionError("reset by peer"), AGENT_LOST),
                                         (TimeoutError("no answer"), "TimeoutError")])
def test_an_ack_the_agent_does_not_take_counts_its_records_as_failed(rig, error, name):
    a = FakeAgent("a", ack_error=error)
    r = rig({"a": a})
    b = batch(9, ("a", 10, 0, 0, 9))
    assert r.acknowledge(b, ACCEPT) is None
    r.wait_finished(9)
    assert a.ops() == ["ack"], "an agent that did not queue the acknowledgement is not asked for its answer"
    assert (b.outcome.failed, b.outcome.errors) == (10, {name: 10})


def test_acks_leave_at_once_and_a_hung_agent_costs_one_ack_timeout_off_sparks_path(rig):
    """Acknowledgements go to every holder at once and latestOffset does not wait for their answers (an
    agent queues an Ack on its consumers as it arrives, ahead of the next batch's claims on the same
    connection: at 500 agents that wait was most of latestOffset). An agent that never answers (hung,
    or cut off from the driver) is given ackTimeoutMs, off Spark's path: its records count as failed
    (the broker's lock brings them back) and its connection is closed, so no later batch waits for it."""
    hung = FakeAgent("h", hang_ack=True)
    fine = [FakeAgent(f"a{i}", slots={"0": answer(accepted=10)}) for i in range(20)]
    r = rig({"h": hung, **{a.info["agent_id"]: a for a in fine}}, ackTimeoutMs="500")
    b = batch(0, ("h", 7, 0, 0, 6), *[(a.info["agent_id"], 10, 1, 10 * i, 10 * i + 9) for i, a in enumerate(fine)])
    t0 = time.monotonic()
    assert r.acknowledge(b, ACCEPT) is None
    # The hung agent never answers, so a call that waited for answers would return with the batch finished.
    assert b.state == QUEUED, "latestOffset waited for the agents' answers"
    assert all(a.ops()[0] == "ack" for a in fine + [hung])
    r.wait_finished(0)
    took = time.monotonic() - t0
    # One ackTimeoutMs, not one per batch or agent, nor the record locks' 30 s (bounds loose for busy cores).
    assert 0.5 <= took < 5.0, f"the batch finished {took:.2f} s after its acks (ackTimeoutMs 0.5 s)"
    assert hung.closed and not any(a.closed for a in fine)
    assert b.outcome.failed == 7 and b.outcome.errors == {"ACK_TIMEOUT": 7}
    assert b.outcome.accepted == 200 and all(a.ops() == ["ack", "ack_result"] for a in fine)


def test_an_answer_that_does_not_come_counts_the_agents_records_as_failed(rig):
    a = FakeAgent("a", result_error=ConnectionError("the agent went away"))
    r = rig({"a": a})
    b = batch(10, ("a", 10, 0, 0, 9))
    assert r.acknowledge(b, ACCEPT) is None
    r.wait_finished(10)
    assert (b.outcome.failed, b.outcome.errors) == (10, {"ConnectionError": 10})


def test_the_brokers_answers_from_every_agent_and_slot_add_up(rig):
    a = FakeAgent("a", slots={"0": answer(accepted=4, expired=1, errors={"INVALID_RECORD_STATE": 1}),
                              "2": answer(accepted=5)})
    c = FakeAgent("c", slots={"1": answer(accepted=3, failed=2, errors={"TOPIC_AUTHORIZATION_FAILED(29)": 2})})
    r = rig({"a": a, "c": c})
    b = batch(11, ("a", 5, 0, 0, 4), ("c", 5, 1, 0, 4), ("a", 5, 0, 5, 9))
    assert r.acknowledge(b, ACCEPT) is None
    r.wait_finished(11)
    o = b.outcome
    assert (o.accepted, o.expired, o.failed) == (12, 1, 2)
    assert o.errors == {"INVALID_RECORD_STATE": 1, "TOPIC_AUTHORIZATION_FAILED(29)": 2}


def test_batches_finish_in_the_order_they_were_acknowledged(rig):
    gate = threading.Event()
    slow = FakeAgent("slow", slots={"0": answer(accepted=1)}, hold_result=gate)
    fast = FakeAgent("fast", slots={"0": answer(accepted=1)})
    r = rig({"slow": slow, "fast": fast})
    first, second = batch(12, ("slow", 1, 0, 0, 0)), batch(13, ("fast", 1, 1, 0, 0))
    assert r.acknowledge(first, ACCEPT) is None
    assert r.acknowledge(second, ACCEPT) is None
    assert slow.result_asked.wait(WAIT_S)
    # The second batch's answer is there at once, but it must not finish while the first waits.
    assert not r._done[13].wait(0.3) and r.finished == []
    assert second.state == QUEUED
    gate.set()
    r.wait_finished(12)
    r.wait_finished(13)
    assert r.finished == [(12, ACCEPT), (13, ACCEPT)]


# --- the log line of each batch ----------------------------------------------------------------------
def test_each_batch_is_logged_with_its_counts(caplog):
    b = batch(14, ("a", 10, 0, 0, 9))
    b.outcome = AckOutcome(accepted=9, rejected=1, errors={"X": 1})
    with caplog.at_level(logging.DEBUG, logger="spark_share.driver.tracker"):
        log_batch(b, "orders", BatchPolicy(1, 1000))
    (rec,) = caplog.records
    assert rec.levelno == logging.INFO
    assert rec.getMessage().startswith("spark-share batch 14 (group orders): acquired 10, accepted 9, released 0, "
                                       "rejected 1, expired 0, failed 0")
    assert "errors {'X': 1}" in rec.getMessage()


def test_an_idle_probe_batch_logs_at_debug(caplog):
    with caplog.at_level(logging.DEBUG, logger="spark_share.driver.tracker"):
        log_batch(batch(15), "orders", BatchPolicy(1, 1000))
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]


def test_expired_locks_are_warned_about_with_advice(caplog):
    b = batch(16, ("a", 10, 0, 0, 9))
    b.outcome = AckOutcome(accepted=6, expired=4)
    policy = BatchPolicy(1, 1000)
    policy.lock_safe_records = 5
    with caplog.at_level(logging.INFO, logger="spark_share.driver.tracker"):
        log_batch(b, "orders", policy)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "4 records' locks expired" in warnings[0] and "share.record.lock.duration.ms" in warnings[0]
    assert "at most 5 records per consumer" in warnings[0]


def test_a_committed_batchs_accepted_records_are_sorted_out_of_later_polls_until_the_broker_took_them(rig):
    """readMode=driver: before a committed batch's ACCEPTs leave, the run's sorter holds the records they
    ACCEPT (not those a verdict RELEASEs or REJECTs: those must come back to be handled); the batch is
    forgotten once the broker took them all, kept when an ACCEPT was refused (its lock had expired: the record
    comes back and must not be emitted again)."""
    from spark_share.record_ranges import RecordRanges, RecordSorter

    gate = threading.Event()
    a = FakeAgent("a", slots={"0": answer(accepted=7, expired=1, released=1, rejected=1,
                                          errors={"INVALID_RECORD_STATE(121)": 1})}, hold_result=gate)
    r = rig({"a": a})
    r.acks.sorter = sorter = RecordSorter()
    b = batch(4, ("a", 10, 0, 0, 9))
    give(b, ("t", 0, 3, REJECT, "bad"), ("t", 0, 4, RELEASE), ("t", 0, 5, RELEASE))
    assert r.acknowledge(b, ACCEPT) is None
    assert sorter.committed == RecordRanges({("t", 0): [(0, 2), (6, 9)]}), "set before the broker answers"
    gate.set()
    r.wait_finished(4)
    assert sorter.committed == RecordRanges({("t", 0): [(0, 2), (6, 9)]}), "an ACCEPT was refused: kept"

    ok = FakeAgent("a", slots={"0": answer(accepted=10)})
    r2 = rig({"a": ok})
    r2.acks.sorter = sorter2 = RecordSorter()
    assert r2.acknowledge(batch(5, ("a", 10, 0, 0, 9)), ACCEPT) is None
    r2.wait_finished(5)
    assert not sorter2.committed and not sorter2.active, "every ACCEPT went through: nothing can come back"
    assert r2.acknowledge(batch(6, ("a", 10, 0, 10, 19)), RELEASE) is None
    r2.wait_finished(6)
    assert not sorter2.active, "a batch given back is never committed"
