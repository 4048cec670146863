"""What the tracker reports: the counters of each progress report (Spark logs them, bounded whatever the
partitions and hosts), ``status()`` (everything, for ``spark_share.status`` and the CLI), and the backlog
estimate's log line.

A mixin of ``tracker.Tracker``, which owns the state named below. Must never: talk to Kafka (the
watermark thread refreshes what it reads), or put a secret in a report.
"""
from __future__ import annotations

import logging
import time

from . import backlog
from .agents import AgentRoster
from .ledger import BatchLedger
from .members import MemberBook
from .policy import BatchPolicy
from .registration import Registration

log = logging.getLogger("spark_share.driver.tracker")

BACKLOG_LOG_S = 60.0  # the backlog estimate's INFO line, at most this often


class TrackerReports:
    # The tracker's, set in its constructor.
    tracker_id: str
    policy: BatchPolicy
    ledger: BatchLedger
    roster: AgentRoster
    members: MemberBook
    agents: dict
    backlog: dict
    _backlog_logged: float
    registration: Registration

    def _estimate_backlog(self) -> None:
        """After a watermark refresh (the watermark thread): the backlog estimate that progress and
        status() report, and its log line once a minute."""
        metadata = getattr(self, "metadata", None)  # None while its constructor runs
        if metadata is None:
            return
        self.backlog = view = backlog.estimate(metadata.high, self.policy.max_seen, backlog.in_flight(self.ledger.held()))
        now = time.monotonic()
        if now - self._backlog_logged >= BACKLOG_LOG_S:
            self._backlog_logged = now
            log.info("%s", backlog.line(view))

    def progress(self, hosts: int = 20) -> dict:
        """The counters of each progress report (Spark logs it): bounded whatever the partitions and hosts."""
        ledger = self.ledger.progress()
        with self.ledger.lock:
            members = self.members.view(top=hosts)
        last = ledger.pop("lastAcked")
        sorter = getattr(self, "sorter", None)
        if sorter is not None and sorter.accepted_again:  # records of a committed batch, ACCEPTed unseen
            ledger["acceptedAgain"] = sorter.accepted_again
        return {"v": 1, "tracker": self.tracker_id, "batch": ledger.pop("batch"),
                "inflightRecords": ledger.pop("inflightRecords"), "agents": len(self.agents),
                "maxRecordsPerConsumer": self.policy.lock_safe_records, "lockBudget": self.policy.lock_budget,
                "lockDurationMs": self.policy.lock_ms,
                "lockHeadroomMs": self.policy.headroom_ms(last.get("holdMs") if last else None),
                **ledger, "relayed": {"reads": self.roster.relays, "bytes": self.roster.relayed_bytes},
                "lastAcked": last, "backlogEstimate": self.backlog.get("backlogEstimate"),
                "backlogTop": backlog.top(self.backlog), **members}

    def status(self) -> dict:
        out = self.progress(hosts=1 << 30)
        out["query"] = self.registration.query_id
        out["backlog"] = self.backlog.get("partitions")
        view = self.ledger.status()
        out["batches"], out["sessions"] = view["batches"], view["sessions"]
        out["hosts"] = self.roster.hosts(view["claims"])
        if self.policy.available_now_target is not None:
            with self.ledger.lock:
                unresolved = self.policy.unresolved()
                out["drain"] = {"partitions": len(self.policy.available_now_target),
                                "unresolved": [f"{t}-{p}" for t, p in unresolved[:20]],
                                "unresolvedCount": len(unresolved),
                                "leftUnread": [f"{t}-{p}" for t, p in self.policy.left_unread[:20]],
                                "waitedForLockedRecords": self.policy.waiting_for_locks}
        return out
