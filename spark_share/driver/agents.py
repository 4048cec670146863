"""The agents of one query run, as the tracker sees them: who joined, from which host, what each is told.

Owns: the agents' connections by id (``conns``), the answer to an agent's hello (how many sessions it
starts and what they read), starting a batch's polls on this host's agent (``prefetch``),
relaying a re-read to the agent that holds a slot, an agent leaving, the per-host view of status(),
and asking every agent to stop.

Must never: send a Kafka client credential to an agent (credentials reach agents with the read task,
never over the tracker's socket), or prefetch on a cluster (Spark does not say where a batch's tasks run).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from concurrent.futures import Future, InvalidStateError

from ..errors import BatchRefused, ProtocolError
from ..options import ShareSourceOptions
from ..transport import wire
from ..transport.loop import get_loop
from ..transport.protocol import Fetch, Hello, Prefetch, Shutdown, call_async
from .batches import PLANNED, BatchState
from .members import MemberBook
from .policy import BatchPolicy

log = logging.getLogger("spark_share.driver.tracker")

RELAY_TIMEOUT_S = 120.0  # a read relayed to another agent is answered within this, or fails


def one_host() -> bool:
    """Local mode (or a master ``register()`` did not pass): every read task runs on this host."""
    master = os.environ.get("SPARK_SHARE_MASTER", "")
    return not master or master.startswith("local")


def agent_of(conn: wire.RpcConnection) -> str:
    if "agent_id" in conn.info:
        return conn.info["agent_id"]
    raise ProtocolError("request from a connection that did not say hello")


class AgentRoster:
    def __init__(self, opts: ShareSourceOptions, policy: BatchPolicy, lock: threading.RLock):
        self.opts = opts
        self.policy = policy
        self.lock = lock  # the ledger's: claims look at who is alive
        self.conns: dict[str, wire.RpcConnection] = {}
        self.members = MemberBook(policy.num_slots)  # the tracker gives its own once the slots are known
        self.relays = 0  # re-reads served from another host's agent, through this process
        self.relayed_bytes = 0
        self.lost_at: float | None = None  # time.monotonic() of the last agent that left while the query ran

    def joined(self, conn: wire.RpcConnection, m: Hello, latest: BatchState | None) -> dict:
        """Note an agent and tell it how to start; a batch planned before it joined starts polling now."""
        with self.lock:
            self.conns[m.agent_id] = conn
        conn.info["agent_id"] = m.agent_id
        conn.info["host"] = m.host
        conn.set_keepalive(self.policy.dead_after_s)
        log.info("agent %s joined (pid %s on %s)", m.agent_id, m.pid, m.host)
        if (latest is not None and latest.state == PLANNED and latest.slots and not latest.claims
                and latest.replay is None):  # a replay polls with its own wait (driver.reads)
            latest.prefetched = self.prefetch(latest) or latest.prefetched  # it polls once its sessions have joined
        limit = self.policy.current_limit(latest)
        # The sessions an agent joins with. One host reads every slot. On a cluster each host's pool
        # grows with the slots its tasks read in a batch (a session serves one slot per batch), so
        # the group has about numPartitions members, never executors x numPartitions.
        slots = self.policy.slots_for(limit) if one_host() else 1
        with self.lock:
            self.members.joined(m.agent_id, m.host, slots)
        o = self.opts
        return {"max_poll_records": self.policy.poll_size(latest), "topics": list(o.topics),
                "include_headers": o.include_headers, "slots": slots, "dead_letter": o.dead_letter,
                "dead_letter_topic": o.dead_letter_topic, "dead_letter_path": o.dead_letter_path,
                "max_delivery_count": o.max_delivery_count, "dead_after_s": self.policy.dead_after_s,
                "partitions": self.policy.partitions, "cache_bytes": o.agent_cache_bytes}

    def left(self, conn: wire.RpcConnection, stopping: bool) -> None:
        agent_id = conn.info.get("agent_id")
        if not agent_id:
            return
        with self.lock:
            if self.conns.get(agent_id) is conn:
                del self.conns[agent_id]
                self.members.left(agent_id)
            self.policy.forget_agent(agent_id)  # what it carried goes back to the group with its sessions
        if not stopping:
            self.lost_at = time.monotonic()
            log.warning("agent %s disconnected; records it held go back to the share group", agent_id)

    def prefetch(self, b: BatchState) -> bool:
        """On one host, ask its agent to start every poll of ``b`` now (``Tracker.plan`` says when:
        ``BatchPolicy.prefetches``). A batch planned before the agent joined is sent when it joins.
        Nothing on a cluster: a Python source has no preferred locations, and records polled on a
        host where no task of the batch lands would be held until a later batch reads there. True if
        the polls were asked for."""
        if not one_host():
            return False
        with self.lock:
            conns = list(self.conns.values())
        if len(conns) != 1:  # local mode: one executor, so one agent per query run
            return False
        call_async(conns[0], Prefetch(b.batch, b.slots, self.policy.slot_budgets(b)[0], self.opts.poll_timeout_ms,
                                      self.policy.carry_ms))
        return True

    def relay(self, m: Fetch, owner: str | None) -> Future:
        """A re-read of a slot another host's agent holds, or a read lent to it at the members' cap (it reads
        the slot first), passed through here and let go once sent on. The answer is a future, so no
        tracker thread waits for the agent: a lent read may ask the tracker for a member and be lent on,
        and threads waiting on such reads would fill the handler pool and wait on each other."""
        with self.lock:
            agent = self.conns.get(owner) if owner else None
        if agent is None:
            raise BatchRefused(f"batch {m.batch} slot {m.slot} is held by no live agent")
        out: Future = Future()
        # The timeout's only hold on the answer, emptied once it came: the loop keeps its timer for 120 s,
        # and through ``out`` it would keep the relayed rows as long.
        waiting = [out]

        def settle(fut: Future, result=None, error: BaseException | None = None) -> None:
            try:
                fut.set_exception(error) if error is not None else fut.set_result(result)
            except InvalidStateError:  # the other of the answer and the timeout came first
                pass

        def answered(f: Future) -> None:
            waiting.clear()
            try:
                rep, blob = f.result(timeout=0)
            except BaseException as e:  # noqa: BLE001 - cancelled too: the read must get an answer
                settle(out, error=e)
                return
            with self.lock:
                self.relays += 1
                self.relayed_bytes += len(blob)
            settle(out, (rep, blob))

        def expire(text=f"batch {m.batch} slot {m.slot}: agent {owner} did not answer a relayed read within "
                        f"{RELAY_TIMEOUT_S:.0f} s") -> None:
            for fut in waiting:
                settle(fut, error=TimeoutError(text))

        call_async(agent, m).add_done_callback(answered)
        get_loop().call_later(RELAY_TIMEOUT_S, expire)
        return out

    def hosts(self, claims: list[str]) -> dict[str, dict]:
        """Per host: its agents, their group members (share consumers, as each agent last reported), and
        the slots of the last batch read (``claims``: the agent of each slot) that its agents hold."""
        hosts: dict[str, dict] = {}
        per_agent = Counter(claims)
        with self.lock:
            for agent_id, conn in self.conns.items():
                h = hosts.setdefault(conn.info.get("host") or "?", {"agents": 0, "members": 0, "slots": 0})
                h["agents"] += 1
                a = self.members.agents.get(agent_id)
                h["members"] += a.members if a is not None else 0
                h["slots"] += per_agent[agent_id]
        return hosts

    def stop_all(self, wait_s: float) -> bool:
        """Ask every agent to stop (closing its consumers releases what it still holds); wait, bounded.
        True when every one had closed its consumers and its connection in time."""
        with self.lock:
            conns = list(self.conns.values())
        for c in conns:
            call_async(c, Shutdown())
        deadline = time.monotonic() + wait_s
        return all([c.wait_closed(max(0.0, deadline - time.monotonic())) for c in conns])
