"""One share consumer, driven by one thread, in explicit acknowledgement mode.

Owns: a confluent-kafka ``ShareConsumer`` and the records it has acquired but not yet
acknowledged (at most one poll's worth, which the client requires). Work arrives as commands
(poll, acknowledge, close) on a queue and runs in order on the session's own thread, so an
acknowledgement queued before the next poll is always sent first.

Must never: poll while it holds unacknowledged records, acknowledge a record it did not acquire,
or be touched from another thread (the client is not thread-safe).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from . import records

log = logging.getLogger("spark_share.session")

ACCEPT, RELEASE, REJECT = 1, 2, 3
VERDICT_NAMES = {ACCEPT: "accepted", RELEASE: "released", REJECT: "rejected"}
POLL_SLICE_S = 0.05  # how often an empty poll asks whether to give up
STATS_INTERVAL_MS = "200"  # how often librdkafka reports the group state a first poll waits on
ERR_INVALID_RECORD_STATE = 121  # the lock expired (or the record is no longer acquired by us)


@dataclass
class Holding:
    batch: int
    slot: int
    acquired: records.Acquired
    rows: int
    acquired_at: float  # time.time() of the poll's return; the broker's lock clock started earlier


@dataclass
class AckOutcome:
    accepted: int = 0
    released: int = 0
    rejected: int = 0
    expired: int = 0
    failed: int = 0
    errors: Dict[str, int] = field(default_factory=dict)  # error name/code -> records

    def add(self, other: "AckOutcome") -> None:
        for k in ("accepted", "released", "rejected", "expired", "failed"):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        for k, v in other.errors.items():
            self.errors[k] = self.errors.get(k, 0) + v

    def as_dict(self) -> dict:
        return {"accepted": self.accepted, "released": self.released, "rejected": self.rejected,
                "expired": self.expired, "failed": self.failed, "errors": dict(self.errors)}

    @classmethod
    def from_dict(cls, d: dict) -> "AckOutcome":
        return cls(**{k: d.get(k, 0) for k in ("accepted", "released", "rejected", "expired", "failed")},
                   errors=dict(d.get("errors", {})))


def _error_code(exc) -> Tuple[int, str]:
    """(code, "NAME(code)") of a KafkaException; the label is what counts and logs show."""
    err = exc.args[0] if getattr(exc, "args", None) else None
    if err is not None and hasattr(err, "code"):
        return err.code(), f"{err.name()}({err.code()})"
    return -1, type(exc).__name__


class ShareSession:
    """A share consumer with its own thread. Methods return Futures."""

    def __init__(self, session_id: str, conf: Dict[str, str], topics: List[str], include_headers: bool,
                 scrub: Callable[[str], str] = lambda s: s):
        from confluent_kafka import ShareConsumer

        self.session_id = session_id
        self.include_headers = include_headers
        self.holding: Optional[Holding] = None
        self.polls = 0
        self.created_at = time.monotonic()
        self._scrub = scrub
        self._queue: "queue.Queue[Optional[Tuple[Callable, Future]]]" = queue.Queue()
        self._closed = False
        self.max_poll_records = int(conf.get("max.poll.records", 500))
        # Set once the consumer has joined with partitions and a fetch went out after that: an empty
        # poll then means "nothing to read", not "not joined yet".
        self.ready = False
        self._fetches_at_join: Optional[int] = None
        conf = dict(conf)
        conf.setdefault("statistics.interval.ms", STATS_INTERVAL_MS)
        conf["stats_cb"] = self._on_stats
        self.consumer = ShareConsumer(conf)
        try:
            self.consumer.subscribe(list(topics))
        except Exception:
            self.consumer.close()
            raise
        self._thread = threading.Thread(target=self._run, name=f"share-session-{session_id}", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        return self.holding is not None

    def _on_stats(self, text: str) -> None:
        """librdkafka's statistics (served inside poll): the group state and the ShareFetch count."""
        if self.ready:
            return
        import json

        try:
            st = json.loads(text)
            cgrp = st.get("cgrp") or {}
            fetches = sum(b.get("req", {}).get("ShareFetch", 0) for b in st.get("brokers", {}).values())
        except (ValueError, AttributeError):
            return
        if self._fetches_at_join is None:
            if cgrp.get("join_state") == "steady" and cgrp.get("assignment_size", 0) > 0:
                self._fetches_at_join = fetches
        elif fetches >= self._fetches_at_join + 2:  # one fetch was sent, and answered, after the join
            self.ready = True

    def _submit(self, fn: Callable) -> Future:
        fut: Future = Future()
        if self._closed:
            fut.set_exception(RuntimeError(f"session {self.session_id} is closed"))
            return fut
        self._queue.put((fn, fut))
        return fut

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, fut = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # reported to whoever waits on the future
                fut.set_exception(e)

    # commands ---------------------------------------------------------------------------
    def poll(self, batch: int, slot: int, max_records: Optional[int], timeout_ms: int,
             give_up: Optional[Callable[[], bool]] = None) -> Future:
        """Acquire one poll for (batch, slot). Result: (RecordBatch, Holding). While nothing has
        arrived, ``give_up()`` is asked every POLL_SLICE_S whether to return empty before the timeout."""
        return self._submit(lambda: self._poll(batch, slot, max_records, timeout_ms, give_up))

    def acknowledge(self, verdicts: Dict[Tuple[str, int, int], int], timeout_s: float) -> Future:
        """Acknowledge everything held: ACCEPT unless ``verdicts`` says otherwise. Result: AckOutcome."""
        return self._submit(lambda: self._acknowledge(verdicts, ACCEPT, timeout_s))

    def release_all(self, timeout_s: float) -> Future:
        return self._submit(lambda: self._acknowledge({}, RELEASE, timeout_s))

    def close(self) -> Future:
        """Release what is held (close() does) and leave the group."""
        fut = self._submit(self._close)
        self._closed = True
        self._queue.put(None)
        return fut

    # on the session thread ----------------------------------------------------------------
    def _poll(self, batch, slot, max_records, timeout_ms, give_up=None):
        if self.holding is not None:
            raise RuntimeError(f"session {self.session_id} still holds batch {self.holding.batch} "
                               f"slot {self.holding.slot}; it must be acknowledged first")
        self.polls += 1
        deadline = time.monotonic() + timeout_ms / 1000.0
        msgs: list = []
        asked = False
        while True:
            left = max(0.0, deadline - time.monotonic())
            msgs = list(self.consumer.poll(min(left, POLL_SLICE_S) if give_up else left))
            if msgs or time.monotonic() >= deadline:
                break
            # Give up only if asked twice in a row: records a fetch brought just before are
            # returned by the poll in between.
            if give_up is not None and give_up():
                if asked:
                    break
                asked = True
            else:
                asked = False
        good = [m for m in msgs if m.error() is None]
        for m in msgs:
            if m.error() is not None:
                log.warning("session %s: poll returned an error for %s-%s: %s", self.session_id,
                            m.topic(), m.partition(), self._scrub(str(m.error())))
        excess = []
        if max_records is not None and len(good) > max_records:
            good, excess = good[:max_records], good[max_records:]
        rb, acquired, _ = records.to_record_batch(good, self.include_headers)
        holding = Holding(batch, slot, acquired, rb.num_rows, time.time())
        if rb.num_rows:
            self.holding = holding
        if excess:
            # More than this batch may take (e.g. the batch size was just lowered): give the rest back now.
            for m in excess:
                self.consumer.acknowledge(m, RELEASE)
            res = self.consumer.commit_sync(30.0)
            bad = {str(tp.topic) + "-" + str(tp.partition): str(e) for tp, e in (res or {}).items() if e is not None}
            if bad:
                log.warning("session %s: releasing %d excess records failed: %s", self.session_id, len(excess), bad)
        return rb, holding

    def _acknowledge(self, verdicts, default, timeout_s) -> AckOutcome:
        out = AckOutcome()
        h = self.holding
        if h is None:
            return out
        per_tp: Dict[Tuple[str, int], Dict[int, int]] = {}
        c = self.consumer
        for topic, parts in h.acquired.items():
            for part, offsets in parts.items():
                counts = per_tp.setdefault((topic, part), {})
                for off in offsets:
                    kind = verdicts.get((topic, part, off), default) if verdicts else default
                    try:
                        c.acknowledge_offset(topic, part, off, kind)
                    except Exception as e:  # no longer in flight for us: counted, comes back from the broker
                        code, name = _error_code(e)
                        out.failed += 1
                        out.errors[name] = out.errors.get(name, 0) + 1
                        continue
                    counts[kind] = counts.get(kind, 0) + 1
        self.holding = None
        try:
            result = c.commit_sync(timeout_s)
        except Exception as e:
            code, name = _error_code(e)
            n = sum(sum(v.values()) for v in per_tp.values())
            out.failed += n
            out.errors[name] = out.errors.get(name, 0) + n
            log.warning("session %s: commit_sync failed (%s); %d records will come back from the broker",
                        self.session_id, self._scrub(str(e)), n)
            return out
        failed_tps = {}
        for tp, err in (result or {}).items():
            if err is not None:
                failed_tps[(tp.topic, tp.partition)] = _error_code(err)
        for tp, counts in per_tp.items():
            n = sum(counts.values())
            if tp in failed_tps:
                code, name = failed_tps[tp]
                if code == ERR_INVALID_RECORD_STATE:
                    out.expired += n
                else:
                    out.failed += n
                out.errors[name] = out.errors.get(name, 0) + n
            else:
                out.accepted += counts.get(ACCEPT, 0)
                out.released += counts.get(RELEASE, 0)
                out.rejected += counts.get(REJECT, 0)
        if failed_tps:
            log.warning("session %s: acknowledgement of batch %d failed for %s",
                        self.session_id, h.batch,
                        ", ".join(f"{t}-{p}: {name}" for (t, p), (code, name) in failed_tps.items()))
        return out

    def _close(self) -> None:
        self.holding = None
        self.consumer.close()
