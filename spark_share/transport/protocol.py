"""The messages between our processes: one named type each, one handler each on the side that gets it.

Owns: every request the tracker, the agents, the read tasks and the user's process send one another,
as small dataclasses (on the wire a request is its JSON header: ``op`` plus the fields), which side
receives which (``TO_TRACKER``, ``TRACKER_TO_AGENT``, ``TASK_TO_AGENT``), and the dispatch from a
received header to the receiver's handler. Replies are plain dicts, plus an Arrow IPC blob for rows.

Must never: carry a Kafka credential (client configs reach an agent on a pipe from the read task
that starts it), or decode anything but JSON headers (``wire`` authenticates every connection).
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..errors import ProtocolError


@dataclass
class Message:
    op: ClassVar[str] = ""
    carries_blob: ClassVar[bool] = False  # its handler gets the frame's blob too (Arrow IPC)

    def header(self) -> dict:
        """``op`` and the fields that differ from their defaults (``parse`` restores those): a read sends
        two messages per slot and batch, thousands at scale, and JSON costs per byte."""
        defaults = _DEFAULTS.get(type(self))
        if defaults is None:
            defaults = _DEFAULTS[type(self)] = {
                f.name: (f.default if f.default is not dataclasses.MISSING
                         else f.default_factory() if f.default_factory is not dataclasses.MISSING else _REQUIRED)
                for f in dataclasses.fields(self)}
        out = {"op": self.op}
        for name, default in defaults.items():
            value = getattr(self, name)
            if value != default or default is _REQUIRED:
                out[name] = value
        return out

    @classmethod
    def parse(cls, header: dict) -> Message:
        names = _FIELDS.get(cls)
        if names is None:  # dataclasses.fields() costs more than the rest of a small message's handling
            names = _FIELDS[cls] = frozenset(f.name for f in dataclasses.fields(cls))
        return cls(**{k: v for k, v in header.items() if k in names})


_FIELDS: dict[type, frozenset[str]] = {}
_DEFAULTS: dict[type, dict] = {}
_REQUIRED = object()


# --- to the tracker ------------------------------------------------------------------------------
@dataclass
class Hello(Message):
    """An agent joins; the reply is its settings (topics, slots, poll size, dead-letter target)."""
    op: ClassVar[str] = "hello"
    agent_id: str
    host: str = ""
    pid: int = 0


@dataclass
class Claim(Message):
    """Which agent reads (batch, slot)? The reply's ``owner`` is the asking agent (it polls, handing out
    at most the reply's ``max_records``), another one (it acquired the slot: relay its rows), or None
    (its agent is gone: read nothing)."""
    op: ClassVar[str] = "claim"
    batch: int
    slot: int
    query_id: str | None = None
    spark_batch: int | None = None
    connect_session: str | None = None  # the Spark Connect session of the reading job (foreachBatch under Connect)
    carrying: int = 0  # records the asking agent's session for this read carries from earlier polls


@dataclass
class Member(Message):
    """The asking agent's read of (batch, slot) finds no free consumer there: may it start one? The
    reply's ``open`` says so; at the query's members' cap, ``relay`` names the agent that reads the slot
    instead (``lent``: how many times the read was lent already; bounded)."""
    op: ClassVar[str] = "member"
    batch: int
    slot: int
    lent: int = 0


@dataclass
class More(Message):
    """The asking agent's read of (batch, slot) polled ``want`` records beyond what its claim granted: may it
    hand them out in this batch? The reply's ``more`` is how many (what the batch's cap has left: slots
    not claimed yet, or reads that handed out less than they were granted); the rest is carried."""
    op: ClassVar[str] = "more"
    batch: int
    slot: int
    want: int = 0


@dataclass
class Acquired(Message):
    """What a (batch, slot) acquired, reported before any row of it reaches Spark."""
    op: ClassVar[str] = "acquired"
    batch: int
    slot: int
    rows: int = 0
    session: str | None = None
    acquired_at: float | None = None
    offsets: dict[str, dict[str, list[list[int]]]] = field(default_factory=dict)  # topic -> partition -> runs
    poison: list[list] = field(default_factory=list)  # [topic, partition, offset, deliveryCount]
    redelivered: int = 0
    spark_batch: int | None = None
    members: int = 0  # the share consumers (group members) the reporting agent has, for its log
    opened: bool = False  # the read started the consumer it polled with (a member the tracker granted)
    timed_out: bool = False  # nothing acquired because the poll ran out of time, not because the queue was empty
    carried: int = 0  # records the session acquired beyond this slot's size: its next poll's records
    convert_ms: float = 0.0  # the agent's work on these rows: messages -> Arrow -> IPC
    # An empty poll the broker answered: the [topic, partition]s it answered for (nothing available)
    answered: list[list] = field(default_factory=list)
    refused: str | None = None  # the group refused the member this read opened (group.share.max.size): why


@dataclass
class Fetch(Message):
    """The cached rows of (batch, slot): to the tracker, which relays it to the agent that holds them. With
    ``poll_timeout_ms``, a read lent to that agent at the members' cap: it reads the slot first, with a free
    consumer of its own, unless it has."""
    op: ClassVar[str] = "fetch"
    batch: int
    slot: int
    max_records: int | None = None
    poll_timeout_ms: int | None = None
    query_id: str | None = None
    spark_batch: int | None = None
    lent: int = 0


@dataclass
class Committed(Message):
    """Spark committed its batch ``spark_batch``, which ended at our ``source_batch`` (its progress
    event's endOffset), from the listener; ``query_id`` lets a tracker whose reads did not carry it
    (foreachBatch under Spark Connect) register the query."""
    op: ClassVar[str] = "committed"
    spark_batch: int
    source_batch: int | None = None
    query_id: str | None = None


@dataclass
class Verdicts(Message):
    """reject() / release() of rows of the running batch; all or nothing. The rows travel as the blob,
    a ``verdict_set`` chunk (Arrow IPC), ``part`` of ``parts`` under one ``token``: the last part applies
    them all, or none. The batch is Spark's ``spark_batch`` (classic) or the one the ``connect_session``
    is reading (under Spark Connect, where foreachBatch sees no batch id): a tracker that reads no batch
    for that session answers the first part ``{"match": False}`` and records nothing. A batch no read task
    named (readMode=driver) is found by its rows: the running batch that acquired the first part's."""
    op: ClassVar[str] = "verdicts"
    carries_blob: ClassVar[bool] = True
    spark_batch: int | None
    kind: str  # "reject" | "release"
    token: str
    part: int = 0
    parts: int = 1
    reason: str | None = None
    connect_session: str | None = None
    # Set when the user's process asks every tracker on its host (it found none registered under its query):
    # a tracker that is not this query's, or whose running batch lacks these rows, answers ``match: False``.
    query_id: str | None = None


@dataclass
class Status(Message):
    op: ClassVar[str] = "status"


@dataclass
class Drain(Message):
    """From ``spark_share.drain()`` on a Spark that runs Trigger.AvailableNow as one batch: run as
    AvailableNow does (drain what was queued when the run started, then plan nothing); the reply's
    ``drained`` says whether that is done and acknowledged."""
    op: ClassVar[str] = "drain"
    query_id: str | None = None


# --- from the tracker to an agent ----------------------------------------------------------------
@dataclass
class Prefetch(Message):
    """Start ``count`` polls of a planned batch now, before its read tasks arrive."""
    op: ClassVar[str] = "prefetch"
    batch: int
    count: int
    max_records: int | None = None
    poll_timeout_ms: int = 1000
    carry_ms: float | None = None  # records carried from an earlier poll may be handed out until this old


@dataclass
class Stage(Message):
    """A chunk of ``batch``'s verdicts on records held here (a ``verdict_set`` chunk, the blob), for the
    ``DeadLetter`` (``purpose`` "deadletter": the rejects, with reasons) or the ``Ack`` ("ack") that follows."""
    op: ClassVar[str] = "stage"
    carries_blob: ClassVar[bool] = True
    batch: int
    purpose: str


@dataclass
class Ack(Message):
    """Queue the acknowledgement of every slot of ``batch`` held here: ``default`` (ACCEPT or RELEASE)
    unless one of the ``staged`` verdict chunks sent before it says otherwise."""
    op: ClassVar[str] = "ack"
    batch: int
    default: int
    staged: int = 0
    timeout_s: float = 30.0


@dataclass
class AckResult(Message):
    """What the broker answered to the acknowledgements of ``batch`` (waits for them, bounded)."""
    op: ClassVar[str] = "ack_result"
    batch: int


@dataclass
class DeadLetter(Message):
    """Write the rejected records of ``batch`` held here, named by the ``staged`` chunks sent before it."""
    op: ClassVar[str] = "deadletter"
    batch: int
    staged: int
    query_id: str | None = None  # the dead letters' spark-share.queryId when the reads did not name it (readMode=driver)


@dataclass
class Trim(Message):
    """Close the free consumers (none holding or carrying records) that polled neither in a batch from
    ``not_since_batch`` on nor in the last ``idle_s`` seconds, at most ``at_most``; the reply says how
    many left the group (``closed``) and how many are left (``members``)."""
    op: ClassVar[str] = "trim"
    not_since_batch: int
    idle_s: float = 0.0
    at_most: int | None = None


@dataclass
class Shutdown(Message):
    """Release everything, close the consumers and exit."""
    op: ClassVar[str] = "shutdown"


@dataclass
class Ping(Message):
    op: ClassVar[str] = "ping"


# --- from a read task to its host's agent ----------------------------------------------------------
@dataclass
class Read(Message):
    """The rows of (batch, slot): polled now, or the ones cached when it was first read."""
    op: ClassVar[str] = "read"
    batch: int
    slot: int
    max_records: int | None = None
    poll_timeout_ms: int = 1000
    query_id: str | None = None
    spark_batch: int | None = None
    connect_session: str | None = None


@dataclass
class Bundle(Message):
    """Requests of one agent's reads to the tracker, sent together (a host's read tasks start at once: the
    tracker reads one message where it would read eight). Only ``BUNDLED`` requests; the reply's
    ``replies`` hold, in their order, each one's reply or error (``_error``, ``_type``)."""
    op: ClassVar[str] = "bundle"
    requests: list[dict] = field(default_factory=list)


BUNDLED = frozenset(("claim", "more", "acquired"))  # answered at once, without a blob, never by another peer

TO_TRACKER: tuple[type[Message], ...] = (Hello, Claim, Member, More, Acquired, Fetch, Committed, Verdicts, Status,
                                         Drain, Bundle)
USER_TO_TRACKER_BY_FILE: tuple[type[Message], ...] = (Verdicts, Drain)  # through a ``mailbox``
TRACKER_TO_AGENT: tuple[type[Message], ...] = (Prefetch, Stage, Ack, AckResult, DeadLetter, Fetch, Trim, Shutdown,
                                                Ping)
TASK_TO_AGENT: tuple[type[Message], ...] = (Read, Ping)


def handler_name(message: type[Message]) -> str:
    """The one naming rule for handlers, tracker and agent alike: ``Acquired`` -> ``_on_acquired``,
    ``AckResult`` -> ``_on_ack_result``."""
    return "_on_" + re.sub(r"(?<!^)(?=[A-Z])", "_", message.__name__).lower()


def dispatcher(receiver: Any, receives: tuple[type[Message], ...]):
    """A ``wire`` handler that parses each request into its message and calls the receiver's
    ``_on_<message>`` method for it. The receiver must have one for every message it ``receives``."""
    own = [m for m in receives if m is not Bundle]  # a bundle is unpacked here, each request to its handler
    missing = [handler_name(m) for m in own if not callable(getattr(receiver, handler_name(m), None))]
    if missing:
        raise ProtocolError(f"{type(receiver).__name__} receives {sorted(m.op for m in receives)} but has no {missing}")
    by_op: dict[str, tuple[type[Message], Callable]] = {m.op: (m, getattr(receiver, handler_name(m))) for m in own}
    bundles = Bundle in receives

    def handle(conn, header: dict, blob: bytes) -> tuple[dict, bytes] | Future:
        op = header.get("op")
        if bundles and op == Bundle.op:
            requests = header.get("requests")
            if not isinstance(requests, list):
                raise ProtocolError("a bundle without its list of requests")
            return {"replies": [one_of_bundle(conn, h) for h in requests]}, b""
        if op not in by_op:
            raise ProtocolError(f"unknown request {op!r}")
        cls, fn = by_op[op]
        out = fn(conn, cls.parse(header), blob) if cls.carries_blob else fn(conn, cls.parse(header))
        return out if isinstance(out, (tuple, Future)) else (out, b"")  # a future: answered later

    def one_of_bundle(conn, header: dict) -> dict:
        op = header.get("op") if isinstance(header, dict) else None
        try:
            if op not in BUNDLED or op not in by_op:
                raise ProtocolError(f"request {op!r} cannot come in a bundle")
            rep = handle(conn, header, b"")
            if not isinstance(rep, tuple) or rep[1]:
                raise ProtocolError(f"{op} answered with a blob or later: it cannot come in a bundle")
            return dict(rep[0] or {})
        except Exception as e:  # this request's error; the others of the bundle are answered
            return conn.error_reply(op, e)

    return handle


def call(conn, msg: Message, timeout: float | None = None, blob=b"") -> tuple[dict, bytes]:
    if blob:
        return conn.call(msg.header(), blob, timeout=timeout)
    return conn.call(msg.header(), timeout=timeout)


def call_async(conn, msg: Message, blob=b"") -> Future:
    return conn.call_async(msg.header(), blob) if blob else conn.call_async(msg.header())
