"""What the tracker answers: one ``_on_<message>`` handler per request that agents, read tasks and the
user's process send it (``protocol.TO_TRACKER``), and the server they reach it on.

A mixin of ``tracker.Tracker``, which owns the state named below; kept apart so the tracker's module is
the run's life (start, planning, acknowledgement, stop) and this one the conversation with its peers.

Must never: wait on a peer on the wire's loop (handlers ``_on_the_loop`` picks take the ledger's lock
briefly and return), or acknowledge anything: a ``Committed`` only calls ``batch_committed``.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future

from ..errors import SourceError
from ..options import ShareSourceOptions, scrub
from ..transport import endpoints, wire
from ..transport.protocol import (
    BUNDLED,
    TO_TRACKER,
    Acquired,
    Bundle,
    Claim,
    Committed,
    Drain,
    Fetch,
    Hello,
    Member,
    More,
    Status,
    Verdicts,
    dispatcher,
)
from .agents import AgentRoster, agent_of
from .batches import FINISHED, BatchState
from .ledger import BatchLedger
from .members import MemberBook
from .policy import BatchPolicy
from .registration import Registration
from .watermarks import MetadataWatcher

log = logging.getLogger("spark_share.driver.tracker")

# A read lent at the members' cap finds the consumer it was lent to taken by a read of that host that claimed
# after it: it is lent on, this many times at most (the book of free consumers is right again by then).
MAX_LENDS = 3


def _on_the_loop(header: dict) -> bool:
    """The requests every read sends (two or three per slot and batch: thousands at scale), alone or bundled, are
    handled on the wire's loop, not handed to a thread: each takes the ledger's lock briefly and waits on
    no peer. A read that needs another agent to give up a member waits for it (``Member``): that goes to
    a thread."""
    return header.get("op") in BUNDLED or header.get("op") == Bundle.op


def _port_text(ports: tuple[int, int]) -> str:
    return str(ports[0]) if ports[0] == ports[1] else f"{ports[0]}-{ports[1]}"


class TrackerRequests:
    # The tracker's, set in its constructor.
    opts: ShareSourceOptions
    tracker_id: str
    secret: str
    _secrets: list[str]
    failure: str | None
    refusal: str | None
    policy: BatchPolicy
    ledger: BatchLedger
    roster: AgentRoster
    members: MemberBook
    agents: dict
    metadata: MetadataWatcher
    start_high: dict
    _drain_decided: int
    registration: Registration
    _serve_query: Callable[[str | None], None]
    _decide: Callable[[BatchState | None], bool]
    batch_committed: Callable[..., None]
    status: Callable[[], dict]

    def _listen(self, host: str) -> endpoints.RpcServer:
        """Listen for agents on ``host``, on a port of the option 'trackerPort' (any free one by default)."""
        first, last = self.opts.tracker_ports
        error: OSError | None = None
        for port in range(first, last + 1):
            try:
                return endpoints.RpcServer((host, port), self.secret, dispatcher(self, TO_TRACKER), name="tracker",
                                           on_close=lambda conn: self.roster.left(conn, self.ledger.stopping),
                                           scrub=lambda s: scrub(s, self._secrets), inline=_on_the_loop)
            except OSError as e:  # taken: try the next one
                error = e
        raise SourceError(f"option 'trackerPort' = {_port_text(self.opts.tracker_ports)!r}: no port of it is free on "
                          f"{host} ({error}); give a wider range, or 0 for any free port")

    def _on_hello(self, conn: wire.RpcConnection, m: Hello) -> dict:
        # Under the ledger's lock, which the stop takes to set ``stopping``: an agent admitted here is one the
        # stop asks to leave; one that says hello after (its connection came as the stop began) is refused,
        # or its consumers would join the group and hold what they acquired with nobody to acknowledge it.
        with self.ledger.lock:
            if self.ledger.stopping:
                raise SourceError(f"spark-share tracker {self.tracker_id} is stopping: agent {m.agent_id} not admitted")
            return self.roster.joined(conn, m, self.ledger.latest())

    def _on_claim(self, conn: wire.RpcConnection, m: Claim) -> dict:
        agent_id = agent_of(conn)
        self._serve_query(m.query_id)
        if self.refusal:
            raise SourceError(self.refusal)
        owner = self.ledger.claim(m, agent_id, self.agents)
        if owner is None:
            return {"owner": None}
        if owner == agent_id:
            with self.ledger.lock:
                self.members.claimed(agent_id, m.batch, m.slot)
        return {"owner": owner, "carry_ms": self.policy.carry_ms, "max_records": self.ledger.granted(m.batch, m.slot)}

    def _on_member(self, conn: wire.RpcConnection, m: Member) -> dict:
        """A read of (batch, slot) finds no free consumer on its host: it opens one within the cap; at the cap,
        an agent with a consumer free in this batch reads the slot for it (``relay``: the rows come through
        here, ``Fetch``); else the slot reads nothing."""
        agent_id = agent_of(conn)
        with self.ledger.lock:
            if self.members.may_open(agent_id, m.batch, m.slot):
                return {"open": True}
            helper = self.members.lend(agent_id, m.batch, m.slot) if m.lent < MAX_LENDS else None
            if helper is not None and helper in self.agents and self.ledger.reassign(m.batch, m.slot, helper):
                return {"open": False, "relay": helper}
        log.warning("batch %d slot %d: agent %s has no free share consumer and the query has its %d members elsewhere, "
                    "all in use: the slot reads nothing", m.batch, m.slot, agent_id, self.members.cap)
        return {"open": False}

    def _on_more(self, conn: wire.RpcConnection, m: More) -> dict:
        """A read polled more than its claim granted: how many more it may hand out in this batch."""
        return {"more": self.ledger.more(m.batch, m.slot, m.want, agent_of(conn))}

    def _on_acquired(self, conn: wire.RpcConnection, m: Acquired) -> dict:
        agent_id = agent_of(conn)
        self.ledger.acquired(m, agent_id)
        with self.ledger.lock:
            if m.refused:
                self._member_refused(agent_id, m)
            else:
                self.members.read(agent_id, m.batch, m.slot, m.session, m.opened)
        return {"ok": True}

    def _member_refused(self, agent_id: str, m: Acquired) -> None:
        """The group refused a member of this query (group.share.max.size). It reads on with the members
        the group admitted (fewer slots from the next batch on), or fails if it admitted none. Call
        with the ledger's lock held."""
        before = self.members.cap
        group = self.opts.group_id
        if not self.members.refuse(agent_id, m.batch, m.slot):
            if not self.failure:
                self.failure = (f"share group {group!r} refused this query's share consumers: it has reached the "
                                "broker's group.share.max.size (the most members a share group may have; 200 by "
                                f"default). The query asked for {self.members.wanted} (numPartitions) and the group "
                                "admitted none: other consumers of the group hold every place. Raise "
                                "group.share.max.size on the brokers, or stop the group's other consumers")
                log.error("spark-share tracker %s: %s", self.tracker_id, self.failure)
            return
        self.policy.num_slots = min(self.policy.num_slots, self.members.cap)
        if self.members.cap < before:
            log.warning("spark-share tracker %s: share group %r refused a share consumer: it has reached the broker's "
                        "group.share.max.size (the most members a share group may have; 200 by default). The query "
                        "asked for %d (numPartitions) and reads on with the %d the group admitted, %d read tasks a "
                        "batch from now on. Raise group.share.max.size on the brokers, or lower numPartitions (other "
                        "consumers of the group count towards the limit too)", self.tracker_id, group,
                        self.members.wanted, self.members.cap, self.policy.num_slots)

    def _on_fetch(self, conn: wire.RpcConnection, m: Fetch) -> Future:
        with self.ledger.lock:
            owner = self.ledger.batches[m.batch].claims.get(m.slot)
        return self.roster.relay(m, owner)

    def _on_committed(self, conn: wire.RpcConnection, m: Committed) -> dict:
        self._serve_query(m.query_id)  # when the reads did not carry it (foreachBatch under Connect)
        upto = m.source_batch if m.source_batch is not None else self.ledger.source_batch_of(m.spark_batch)
        if upto is not None:
            self.batch_committed(upto, wait=True)
        return {"ok": True}

    def _on_verdicts(self, conn: wire.RpcConnection, m: Verdicts, blob) -> dict:
        if m.query_id is not None and self.registration.query_id not in (None, m.query_id):
            return {"match": False}  # the user's process asks every tracker of its host: another query's
        rep = self.ledger.record_verdicts(m, blob, ours=m.query_id is None or m.query_id == self.registration.query_id)
        if rep.get("match") and m.query_id is not None and m.part == 0:
            self._serve_query(m.query_id)  # readMode=driver: no read task told it which query it serves
        return rep

    def _on_status(self, conn: wire.RpcConnection, m: Status) -> dict:
        return self.status()

    def _on_drain(self, conn: wire.RpcConnection, m: Drain) -> dict:
        self._serve_query(m.query_id)
        missing = [tp for tp in self.metadata.partitions if tp not in self.start_high]
        if missing and self.policy.available_now_target is None:
            # Their leaders did not answer when the run started: their watermarks as of now, then.
            self.start_high.update({tp: v for tp, v in self.metadata.complete_high().items() if tp in missing})
        with self.ledger.lock:
            if self.policy.available_now_target is None:
                # From now on the batches run as under Trigger.AvailableNow, towards what was queued
                # when this run started (the batches so far count: their records are seen).
                self.policy.start_available_now(self.start_high)
                log.info("spark-share tracker %s drains what was queued when it started, then plans no batch",
                         self.tracker_id)
            settled = all(b.state in FINISHED for b in self.ledger.batches.values())
            latest = self.ledger.batches[max(self.ledger.batches)] if self.ledger.batches else None
            if settled and latest is not None and latest.batch != self._drain_decided and not self.policy.finished:
                # Every batch is acknowledged: decide now, once per batch, whether the drain goes on,
                # rather than at the next latestOffset (the listener asks again only at the next event).
                self._drain_decided = latest.batch
                self._decide(latest)
            # Done once the run plans nothing more (or only its last batch, which reads nothing) and
            # every batch is acknowledged.
            drained = settled and (self.policy.finished or self.policy.closing)
        return {"drained": drained}
