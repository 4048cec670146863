"""The agent's part in acknowledgement: a batch's verdicts staged as they come, its acknowledgements queued
on the consumers that acquired its records, what the broker answered, its rejected records written
to the dead-letter target, and, once its executor is gone, leaving when nothing it holds is unacknowledged.

A mixin of ``agent.Agent``, which owns the state named below; ``Cached`` is what an acquired (batch, slot)
holds until its acknowledgement. Must never: acknowledge a batch the tracker did not ask for (only ``Ack`` queues one), or poll: an
acknowledgement is queued ahead of its session's next poll, which the pool hands out once released.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..acknowledgement import ACCEPT
from ..errors import AgentError
from ..transport.protocol import Ack, AckResult, DeadLetter, Stage
from ..verdict_set import VerdictSet
from .pool import SessionPool
from .spill import SpillBudget

log = logging.getLogger("spark_share.consumers.agent")

if TYPE_CHECKING:
    from .session import ShareSession


@dataclass
class Cached:
    batch: int
    slot: int
    session: ShareSession | None  # that holds the records; None when the poll was empty
    ipc: Any                   # what read tasks get: an Arrow IPC stream (pyarrow Buffer)
    rows: int                  # rows read tasks get
    held: int                  # records the session holds for this slot (poison ones included)
    full: object | None = None  # every record acquired, headers included: the dead-letter source
    query_id: str | None = None
    in_memory: int = 0  # bytes of ipc and full the agent's SpillBudget counts in memory (0: none, or mapped)


class AgentAcknowledgements:
    # The agent's, set in its constructor.
    tracker_id: str
    pool: SessionPool
    _lock: threading.Lock
    _cache: dict[tuple[int, int], Cached]
    _budget: SpillBudget | None
    _acks: dict[int, tuple]
    _staged: dict[tuple[int, str], list]
    _deadletters: Any

    _orphaned: bool
    agent_id: str

    def shutdown(self) -> None: ...  # the agent's

    def _on_stage(self, conn, m: Stage, blob) -> dict:
        with self._lock:
            self._staged.setdefault((m.batch, m.purpose), []).append(blob)
        return {"staged": True}

    def _staged_set(self, batch: int, purpose: str, chunks: int) -> VerdictSet:
        """The verdict chunks staged for (batch, purpose), which came before the request that uses them."""
        with self._lock:
            blobs = self._staged.pop((batch, purpose), [])
        if len(blobs) != chunks:
            raise AgentError(f"batch {batch}: {len(blobs)} of the {chunks} verdict chunks for its {purpose} came")
        return VerdictSet.from_chunks(blobs)

    def _on_ack(self, conn, m: Ack) -> dict:
        return self._ack(m.batch, self._staged_set(m.batch, "ack", m.staged), m.default, m.timeout_s)

    def _on_ack_result(self, conn, m: AckResult) -> tuple:
        # The broker's answers reach the tracker before an agent whose executor is gone leaves (``then``).
        return self._ack_result(m.batch), b"", self.leave_if_orphaned

    def _on_dead_letter(self, conn, m: DeadLetter) -> dict:
        return self._dead_letter(m.batch, self._staged_set(m.batch, "deadletter", m.staged), m.query_id)

    def _dead_letter(self, batch: int, want: VerdictSet, query_id: str | None = None) -> dict:
        """Write the rejected records of ``batch`` held here to the dead-letter target."""
        from .deadletter import rejected_table

        with self._lock:
            entries = [e for (b, _), e in self._cache.items() if b == batch and e.full is not None]
        assert self._deadletters is not None, "dead letters asked of an agent started without a target"
        written = 0
        for e in entries:
            table = rejected_table(e.full, want, e.query_id or query_id, batch)
            written += self._deadletters.write(table, batch, f"{self.tracker_id}-slot{e.slot}")
        return {"written": written}

    def _ack(self, batch: int, verdicts: VerdictSet, default: int, timeout_s: float) -> dict:
        """Queue the acknowledgement of every slot of ``batch`` held here (``default`` unless a
        verdict says otherwise) on the consumers that acquired them, ahead of their next poll, and
        return: ``ack_result`` reports what the broker answered."""
        with self._lock:
            entries = [e for (b, _), e in self._cache.items() if b == batch]
            futs = {}
            for e in entries:
                self._cache.pop((e.batch, e.slot), None)
                if self._budget is not None:
                    self._budget.release(e)
                if e.session is None:
                    continue
                if default == ACCEPT:
                    futs[e.slot] = (e.held, e.session.acknowledge(verdicts, timeout_s))
                else:
                    futs[e.slot] = (e.held, e.session.release_all(timeout_s))
                self.pool.release(e.session)  # free for the next batch: its poll queues behind this
            self._acks[batch] = (futs, timeout_s)
        return {"queued": len(futs)}

    def _ack_result(self, batch: int) -> dict:
        with self._lock:
            futs, timeout_s = self._acks.pop(batch, ({}, 0.0))
        wait_futures([f for _, f in futs.values()], timeout=timeout_s + 5)
        out = {}
        for slot, (held, f) in futs.items():
            try:
                out[str(slot)] = f.result(timeout=0).as_dict()
            except Exception as ex:
                out[str(slot)] = {"failed": held, "errors": {type(ex).__name__: held}}
        return {"slots": out}

    def executor_gone(self) -> None:
        """The executor that started this agent exited (dynamic allocation removed it, its pod ended): no read
        task reaches this agent again, so it leaves once the tracker has acknowledged what it holds."""
        log.info("agent %s: its executor exited; leaving once the %d slots it holds are acknowledged",
                 self.agent_id, len(self._cache))
        self._orphaned = True
        self.leave_if_orphaned()

    def leave_if_orphaned(self) -> None:
        with self._lock:
            done = self._orphaned and not self._cache and not self._acks
        if done:
            threading.Thread(target=self.shutdown, name="agent-shutdown", daemon=True).start()
