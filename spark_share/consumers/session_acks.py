"""Acknowledging what one poll of a share consumer acquired: each record once, with its verdict, then
one commit; the broker's answer counted by kind.

Owns: ``Holding`` (one poll's records, as a session holds them until they are acknowledged),
``acknowledge_held`` (runs on the session's thread: the client is not thread-safe), the error
codes that matter (a lock that expired is counted ``expired``, anything else ``failed``), and naming
a client error for counts and logs (``error_code``).

Must never: acknowledge a record the poll did not acquire, or stop at a record the client refuses
(no longer in flight for us: it is counted, and the broker delivers it again).
"""
from __future__ import annotations

import logging
import operator
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import repeat

from ..acknowledgement import ACCEPT, REJECT, RELEASE, AckOutcome
from ..verdict_set import VerdictSet
from . import records

log = logging.getLogger("spark_share.consumers.session")

@dataclass
class Holding:
    batch: int
    slot: int
    acquired: records.Acquired
    rows: int
    acquired_at: float  # time.time() of the poll's return; the broker's lock clock started earlier
    # Empty because the poll ran out of time, not because a fetch came back without records: a slow
    # broker (a first fetch behind a big backlog, an assignment still to come), not an empty queue.
    timed_out: bool = False
    convert_s: float = 0.0  # the poll's messages -> Arrow
    # An empty poll the broker answered: the partitions it answered for (nothing of theirs was
    # available to this consumer), which lets a drain tell a drained partition from an unpolled one.
    answered: frozenset = frozenset()



ERR_INVALID_RECORD_STATE = 121  # the lock expired (or the record is no longer acquired by us)


def error_code(exc) -> tuple[int, str]:
    """(code, "NAME(code)") of a KafkaException; the label is what counts and logs show."""
    err = exc.args[0] if getattr(exc, "args", None) else None
    if err is not None and hasattr(err, "code"):
        return err.code(), f"{err.name()}({err.code()})"
    return -1, type(exc).__name__


def acknowledge_held(consumer, h: Holding | None, verdicts: VerdictSet | None, default: int,
                     timeout_s: float, scrub: Callable[[str], str], session_id: str) -> AckOutcome:
    """Acknowledge every record ``h`` acquired, ``default`` unless ``verdicts`` says otherwise, then commit;
    what the broker answered, counted by kind. A record the client refuses is counted, not raised."""
    out = AckOutcome()
    if h is None:
        return out
    per_tp: dict[tuple[str, int], dict[int, int]] = {}
    ack = consumer.acknowledge_offset

    def ack_run(topic: str, part: int, lo: int, hi: int, kind: int, counts: dict[int, int]) -> None:
        """Records lo..hi, all ``kind``: one C-level pass; after a refused record, one by one."""
        if lo > hi:
            return
        offsets = iter(range(lo, hi + 1))
        try:
            deque(map(ack, repeat(topic), repeat(part), offsets, repeat(kind)), maxlen=0)
            counts[kind] = counts.get(kind, 0) + hi - lo + 1
            return
        except Exception as e:
            failed_at = hi - operator.length_hint(offsets)
            counts[kind] = counts.get(kind, 0) + failed_at - lo
            _ack_failed(out, e)
        for off in offsets:
            try:
                ack(topic, part, off, kind)
            except Exception as e:  # no longer in flight for us: counted, comes back from the broker
                _ack_failed(out, e)
                continue
            counts[kind] = counts.get(kind, 0) + 1

    for topic, parts in h.acquired.items():
        for part, runs in parts.items():
            counts = per_tp.setdefault((topic, part), {})
            for lo, hi in runs:
                marked: list[int] = []
                kinds: list[int] = []
                if verdicts:
                    found = verdicts.kinds_in(topic, part, lo, hi)
                    marked, kinds = found[0].tolist(), found[1].tolist()
                at = lo
                for off, kind in zip(marked, kinds):
                    ack_run(topic, part, at, off - 1, default, counts)  # the default up to the next verdict
                    ack_run(topic, part, off, off, kind, counts)
                    at = off + 1
                ack_run(topic, part, at, hi, default, counts)
    try:
        result = consumer.commit_sync(timeout_s)
    except Exception as e:
        code, name = error_code(e)
        n = sum(sum(v.values()) for v in per_tp.values())
        out.failed += n
        out.errors[name] = out.errors.get(name, 0) + n
        log.warning("session %s: commit_sync failed (%s); %d records will come back from the broker",
                    session_id, scrub(str(e)), n)
        return out
    failed_tps = {}
    for topic_partition, err in (result or {}).items():
        if err is not None:
            failed_tps[(topic_partition.topic, topic_partition.partition)] = error_code(err)
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
                    session_id, h.batch,
                    ", ".join(f"{t}-{p}: {name}" for (t, p), (code, name) in failed_tps.items()))
    return out


def _ack_failed(out: AckOutcome, e: Exception) -> None:
    """One record could not be acknowledged (no longer in flight for us): counted; it comes back
    from the broker."""
    _, name = error_code(e)
    out.failed += 1
    out.errors[name] = out.errors.get(name, 0) + 1
