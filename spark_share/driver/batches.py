"""What the driver knows of one batch: its slots, who acquired which records, the verdicts on them,
and how its acknowledgement went.

Owns: ``BatchState`` and its life cycle (planned -> acking -> queued -> acked | released, or void).
The acknowledgement kinds and ``AckOutcome`` live below driver/ and executor/ (``acknowledgement``).
Must never: talk to a socket or to Kafka (it is plain data, shared by the tracker, the
policy and the agents' reports).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..acknowledgement import AckOutcome
from ..verdict_set import VerdictSet, runs_of

# planned: its read tasks may claim slots; acking: its acknowledgements are being sent; queued: they
# are on the consumers, ahead of their next poll; acked / released: the broker answered. void: a
# batch this run did not plan (Spark replays an earlier run's batch): it reads nothing.
PLANNED, ACKING, QUEUED, ACKED, RELEASED, VOID = "planned", "acking", "queued", "acked", "released", "void"
IN_FLIGHT = (PLANNED, ACKING, QUEUED)
FINISHED = (ACKED, RELEASED, VOID)


@dataclass
class BatchState:
    batch: int
    slots: int
    max_records: int | None
    planned_at: float = field(default_factory=time.time)
    claims: dict[int, str] = field(default_factory=dict)         # slot -> agent id
    granted: dict[int, int | None] = field(default_factory=dict)  # slot -> records its read may hand out
    granted_total: int = 0                                    # the sum of ``granted`` (a claim must not sum it)
    prefetched: bool = False                                  # its polls started at planning (static budgets)
    acquired: dict[int, dict] = field(default_factory=dict)      # slot -> {agent, session, rows, offsets, acquired_at}
    verdicts: VerdictSet = field(default_factory=VerdictSet)    # reject() / release() and poison records
    spark_batch: int | None = None                            # Spark's batch id, learnt from the read tasks
    connect_sessions: set[str] = field(default_factory=set)   # Spark Connect sessions whose jobs read it
    state: str = PLANNED
    # A batch an earlier run planned, read again here with the records its offset names: how many it names,
    # and how many of them the broker no longer held for this query (another member took them, archived).
    replay: dict | None = None
    committed_at: float | None = None
    acked_at: float | None = None
    outcome: AckOutcome = field(default_factory=AckOutcome)

    @property
    def rows(self) -> int:
        return sum(a.get("rows", 0) for a in self.acquired.values())

    @property
    def timed_out(self) -> bool:
        """Acquired nothing because its polls ran out of time: the broker did not say the queue was empty."""
        return not self.rows and any(a.get("timed_out") for a in self.acquired.values())

    def min_offsets(self) -> dict[tuple[str, int], int]:
        """Lowest offset acquired per partition (offsets arrive as sorted [first, last] runs)."""
        out: dict[tuple[str, int], int] = {}
        for a in self.acquired.values():
            for t, parts in a.get("offsets", {}).items():
                for p, runs in parts.items():
                    k = (t, int(p))
                    out[k] = min(runs[0][0], out.get(k, runs[0][0]))
        return out

    def runs_by_agent(self) -> dict[str, dict]:
        """Each agent's acquisitions in this batch as offset runs per partition (``verdict_set.runs_of``):
        which verdicts it holds. A record is usually held by one agent; by two when an agent was lost
        mid-batch and the broker handed its records to another for another slot."""
        mine: dict[str, list] = {}
        for a in self.acquired.values():
            mine.setdefault(a["agent"], []).append(a)
        return {agent: runs_of(slots) for agent, slots in mine.items()}

    def slim(self) -> None:
        """An acknowledged batch kept for status(): its counts and times, not its offsets, verdicts or
        grants (at 4,000 slots a batch's offsets are megabytes, and twenty are kept)."""
        for a in self.acquired.values():
            a["offsets"] = {}
        self.verdicts = VerdictSet()
        self.granted.clear()

    def rows_held_by(self, agent_id: str) -> int:
        return sum(a["rows"] for a in self.acquired.values() if a["agent"] == agent_id)

    def held_ms(self) -> float | None:
        """How long the batch held its records: from the first poll's return to its acknowledgement
        (or now). The broker's lock clock started a little earlier."""
        starts = [a["acquired_at"] for a in self.acquired.values() if a.get("rows") and a.get("acquired_at")]
        if not starts:
            return None
        return round(((self.acked_at or time.time()) - min(starts)) * 1000, 1)

    def summary(self) -> dict:
        d = {"batch": self.batch, "acquired": self.rows, "state": self.state}
        if self.replay is not None:
            d["replay"] = dict(self.replay)
        if self.spark_batch is not None and self.spark_batch != self.batch:
            d["sparkBatch"] = self.spark_batch
        if self.state == PLANNED:
            d["polling"] = len(self.claims) - len(self.acquired)  # read tasks waiting for their poll
        held = self.held_ms()
        if held is not None:
            d["holdMs"] = held
        d.update({k: v for k, v in self.outcome.as_dict().items() if k != "errors"})
        if self.outcome.errors:
            d["errors"] = dict(self.outcome.errors)
        if self.committed_at and self.acked_at:
            d["ackLatencyMs"] = round((self.acked_at - self.committed_at) * 1000, 1)
            d["ackedAt"] = round(self.acked_at, 3)
            phases = self.phases_ms()
            if phases:
                d["phasesMs"] = phases
        return d

    def phases_ms(self) -> dict[str, float] | None:
        """Where an acknowledged batch's time went, in ms: ``poll`` (planned -> the first poll's
        return: the broker's answer), then the records' time in flight: ``toRead`` (-> the last slot
        handed to its read task: Spark scheduling the tasks, the agent converting, ``convert`` of it
        on the slowest slot), ``spark`` (-> Spark's commit: Arrow into the JVM, the sink, the commit
        log) and ``ack`` (-> the broker confirmed the acknowledgements)."""
        slots = [a for a in self.acquired.values() if a.get("rows") and a.get("acquired_at") and a.get("reported_at")]
        if not slots or not self.committed_at or not self.acked_at:
            return None
        acquired = min(a["acquired_at"] for a in slots)
        read = max(a["reported_at"] for a in slots)

        def ms(a: float, b: float) -> float:
            return round(max(0.0, b - a) * 1000, 1)

        return {"poll": ms(self.planned_at, acquired), "toRead": ms(acquired, read),
                "convert": round(max(a.get("convert_ms", 0.0) for a in slots), 1),
                "spark": ms(read, self.committed_at), "ack": ms(self.committed_at, self.acked_at)}
