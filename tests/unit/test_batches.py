"""``spark_share.driver.batches``: what the driver knows of one batch, as plain data.

Covers the life-cycle states (every state is either in flight or finished, never both), what a
batch acquired (rows, the lowest offset per partition, which agents hold a record, what one agent
holds), how long it held its records, the summary status() reports in each state, and
``AckOutcome``: the broker's answers counted by kind, added up across agents and slots, and carried
across a socket as a dict. The module guards no transitions (the ledger moves batches between
states), so none are tested here.
"""
from __future__ import annotations

import time

import pytest

from spark_share.acknowledgement import REJECT, AckOutcome
from spark_share.driver.batches import ACKED, ACKING, FINISHED, IN_FLIGHT, PLANNED, QUEUED, RELEASED, VOID, BatchState


def slot(agent: str, rows: int, offsets: dict, acquired_at: float | None = 100.0, **extra) -> dict:
    return {"agent": agent, "session": f"{agent}-s", "rows": rows, "offsets": offsets,
            "acquired_at": acquired_at, **extra}


def two_agent_batch() -> BatchState:
    """Batch 3: agent a read slot 0 (t-0 offsets 10-19 and 30-34), agent b slot 1 (t-0 offsets 20-24,
    t-1 offsets 0-4), and slot 2 read nothing on agent a."""
    b = BatchState(batch=3, slots=3, max_records=None)
    b.acquired[0] = slot("a", 15, {"t": {"0": [[10, 19], [30, 34]]}}, acquired_at=100.0)
    b.acquired[1] = slot("b", 10, {"t": {"0": [[20, 24]], "1": [[0, 4]]}}, acquired_at=101.0)
    b.acquired[2] = slot("a", 0, {}, acquired_at=None)
    return b


def test_the_acknowledgement_kinds_are_kafkas():
    # The numbers go to the agents' ShareConsumer.acknowledge_offset as they are: Kafka's AcknowledgeType.
    from confluent_kafka import AcknowledgeType

    from spark_share import acknowledgement

    assert (acknowledgement.ACCEPT, acknowledgement.RELEASE, acknowledgement.REJECT) == (
        int(AcknowledgeType.ACCEPT), int(AcknowledgeType.RELEASE), int(AcknowledgeType.REJECT))


def test_every_state_is_in_flight_or_finished_never_both():
    states = {PLANNED, ACKING, QUEUED, ACKED, RELEASED, VOID}
    assert set(IN_FLIGHT) | set(FINISHED) == states
    assert not set(IN_FLIGHT) & set(FINISHED)
    assert set(IN_FLIGHT) == {PLANNED, ACKING, QUEUED}  # acknowledgements queued: the broker has not answered


def test_a_new_batch_is_planned_and_has_read_nothing():
    b = BatchState(batch=0, slots=2, max_records=500)
    assert b.state == PLANNED
    assert (b.rows, b.min_offsets(), b.held_ms(), b.timed_out) == (0, {}, None, False)
    assert b.outcome == AckOutcome()
    assert b.runs_by_agent() == {} and not b.verdicts


def test_rows_and_what_each_agent_holds():
    b = two_agent_batch()
    assert b.rows == 25
    assert (b.rows_held_by("a"), b.rows_held_by("b"), b.rows_held_by("gone")) == (15, 10, 0)


def test_min_offsets_is_the_first_offset_acquired_per_partition_across_slots():
    b = two_agent_batch()
    assert b.min_offsets() == {("t", 0): 10, ("t", 1): 0}
    b.acquired[3] = slot("c", 5, {"t": {"0": [[5, 9]]}})
    assert b.min_offsets()[("t", 0)] == 5


def test_each_agent_holds_the_records_of_its_runs():
    from spark_share.verdict_set import VerdictSet

    b = two_agent_batch()

    def holders(t, p, o):
        one = VerdictSet.from_records([(t, p, o)], kind=REJECT)
        return sorted(a for a, runs in b.runs_by_agent().items() if one.within(runs))

    assert holders("t", 0, 10) == ["a"] and holders("t", 0, 19) == ["a"] and holders("t", 0, 34) == ["a"]
    assert holders("t", 0, 25) == [] and holders("t", 0, 9) == []  # between and before the runs
    assert holders("t", 1, 4) == ["b"] and holders("t", 2, 4) == [] and holders("u", 0, 10) == []
    # A lost agent's records handed by the broker to another agent, read for another slot: two holders.
    b.acquired[3] = slot("c", 10, {"t": {"0": [[10, 19]]}})
    assert holders("t", 0, 12) == ["a", "c"]


def test_timed_out_only_when_nothing_was_acquired_and_a_poll_ran_out_of_time():
    b = BatchState(batch=1, slots=2, max_records=None)
    b.acquired[0] = slot("a", 0, {}, acquired_at=None)
    assert not b.timed_out  # the broker said the queue was empty
    b.acquired[1] = slot("a", 0, {}, acquired_at=None, timed_out=True)
    assert b.timed_out
    b.acquired[2] = slot("b", 3, {"t": {"0": [[0, 2]]}})
    assert not b.timed_out  # something came back: the broker answered


def test_held_ms_runs_from_the_first_poll_with_records_to_the_acknowledgement():
    b = two_agent_batch()
    b.acquired[2]["acquired_at"] = 50.0  # an empty slot's poll time does not count: it holds nothing
    b.acked_at = 103.5
    assert b.held_ms() == 3500.0
    b.acked_at = None  # not acknowledged yet: until now
    before = (time.time() - 100.0) * 1000
    held = b.held_ms()
    assert before - 1 <= held <= (time.time() - 100.0) * 1000 + 1


def test_summary_per_state():
    b = two_agent_batch()
    b.claims.update({0: "a", 1: "b", 2: "a", 3: "b"})  # slot 3 claimed, its poll not back yet
    s = b.summary()
    assert (s["batch"], s["acquired"], s["state"], s["polling"]) == (3, 25, PLANNED, 1)
    assert "sparkBatch" not in s and "errors" not in s and "ackLatencyMs" not in s
    b.spark_batch = 7  # Spark's ids ran ahead of the source's
    b.state = ACKED
    b.committed_at, b.acked_at = 102.0, 102.25
    b.outcome = AckOutcome(accepted=20, failed=5, errors={"AGENT_LOST": 5})
    s = b.summary()
    assert "polling" not in s
    assert (s["sparkBatch"], s["state"], s["accepted"], s["failed"], s["errors"]) == (7, ACKED, 20, 5, {"AGENT_LOST": 5})
    assert s["ackLatencyMs"] == 250.0 and s["holdMs"] == 2250.0 and s["ackedAt"] == 102.25
    b.spark_batch = 3  # the same id as the source's: not repeated
    assert "sparkBatch" not in b.summary()


def test_ack_outcomes_add_up_by_kind_and_by_error():
    total = AckOutcome()
    total.add(AckOutcome(accepted=8, rejected=1, released=1, errors={"INVALID_RECORD_STATE": 2}, expired=2))
    total.add(AckOutcome(accepted=5, failed=3, errors={"INVALID_RECORD_STATE": 1, "AGENT_LOST": 3}))
    assert (total.accepted, total.released, total.rejected, total.expired, total.failed) == (13, 1, 1, 2, 3)
    assert total.errors == {"INVALID_RECORD_STATE": 3, "AGENT_LOST": 3}


def test_an_ack_outcome_crosses_a_socket_as_a_dict_and_back():
    o = AckOutcome(accepted=1, released=2, rejected=3, expired=4, failed=5, errors={"X": 5})
    d = o.as_dict()
    assert d == {"accepted": 1, "released": 2, "rejected": 3, "expired": 4, "failed": 5, "errors": {"X": 5}}
    assert AckOutcome.from_dict(d) == o
    d["errors"]["X"] = 99  # a copy: the dict sent does not alias the outcome kept
    assert o.errors == {"X": 5}
    # An agent's answer names only the kinds it saw.
    assert AckOutcome.from_dict({"accepted": 4}) == AckOutcome(accepted=4)


@pytest.mark.parametrize("field", ["accepted", "released", "rejected", "expired", "failed"])
def test_each_kind_is_counted_on_its_own(field):
    o = AckOutcome()
    o.add(AckOutcome(**{field: 7}))
    assert o.as_dict()[field] == 7 and sum(v for k, v in o.as_dict().items() if k != "errors") == 7


def test_an_acknowledged_batch_says_where_its_time_went():
    """Planned at 100.0; the first poll returned at 100.2, the slots reached their read tasks by
    100.5 (the slower one converted for 40 ms), Spark committed at 101.0, the broker confirmed at
    101.1: in flight 0.9 s, and the phases add up to it."""
    b = BatchState(3, 2, None, planned_at=100.0)
    b.acquired = {0: {"rows": 10, "acquired_at": 100.2, "reported_at": 100.4, "convert_ms": 25.0},
                  1: {"rows": 12, "acquired_at": 100.3, "reported_at": 100.5, "convert_ms": 40.0},
                  2: {"rows": 0, "acquired_at": 100.1, "reported_at": 100.1}}
    assert b.phases_ms() is None and "phasesMs" not in b.summary(), "not before the acknowledgement"
    b.committed_at, b.acked_at = 101.0, 101.1
    p = b.summary()["phasesMs"]
    assert p == {"poll": 200.0, "toRead": 300.0, "convert": 40.0, "spark": 500.0, "ack": 100.0}
    assert p["toRead"] + p["spark"] + p["ack"] == b.summary()["holdMs"]
