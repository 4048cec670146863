"""The backlog (lag) of the query's partitions, estimated from what the source itself sees.

Owns: per topic-partition, from the high watermarks (the watermark thread) and the batches (the
tracker): the high watermark, the highest offset this run of the query acquired, the records acquired
and not yet acknowledged, and the estimated backlog, the records at or beyond the highest acquired
offset still below the high watermark; their total, ``backlogEstimate``.

It is an estimate, and says so (``"kind": "estimate"``): the broker's own share-partition lag (Kafka
4.2's DescribeShareGroupOffsets v1, Java ``Admin.listShareGroupOffsets``) has no call in confluent-kafka
2.16.1. It counts too few when records below the highest acquired offset are available again (released
or expired, here or by another member of the group) and too many when a compacted or deleted range, or
records other members have acquired beyond ours, lie below the high watermark. A partition this run has
not acquired from yet has no estimate (``None``): where the group starts in it is the broker's.

Must never: do I/O, or take long (the tracker calls it under its lock).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

Partition = tuple[str, int]


def in_flight(acquired_slots: Iterable[Mapping]) -> dict[Partition, int]:
    """Records per partition of the slots given (``BatchState.acquired`` values of batches in flight)."""
    out: dict[Partition, int] = {}
    for a in acquired_slots:
        for topic, parts in (a.get("offsets") or {}).items():
            for p, runs in parts.items():
                k = (topic, int(p))
                out[k] = out.get(k, 0) + sum(hi - lo + 1 for lo, hi in runs)
    return out


def estimate(high: Mapping[Partition, int], max_acquired: Mapping[Partition, int],
             held: Mapping[Partition, int]) -> dict:
    """The backlog view of the progress JSON and ``status()``."""
    partitions = {}
    total = 0
    for (topic, p), hw in sorted(high.items()):
        seen = max_acquired.get((topic, p))
        backlog = None if seen is None else max(0, hw - (seen + 1))
        total += backlog or 0
        partitions[f"{topic}-{p}"] = {"highWatermark": hw, "maxAcquired": seen,
                                      "inFlight": held.get((topic, p), 0), "backlog": backlog}
    return {"kind": "estimate", "backlogEstimate": total, "partitions": partitions}


def top(view: Mapping, n: int = 10) -> dict[str, int]:
    """The ``n`` partitions with the most backlog (the progress JSON carries these, not every partition:
    Spark logs each report, and a topic may have thousands; ``status()`` has them all)."""
    parts = [(v["backlog"], name) for name, v in (view.get("partitions") or {}).items() if v["backlog"]]
    return {name: b for b, name in sorted(parts, key=lambda x: (-x[0], x[1]))[:n]}


def line(view: Mapping) -> str:
    """One log line: the total and the partitions that have a backlog."""
    behind = [f"{name} {v['backlog']}" for name, v in view["partitions"].items() if v["backlog"]]
    unknown = sum(1 for v in view["partitions"].values() if v["backlog"] is None)
    return (f"backlog estimate {view['backlogEstimate']}" + (f" ({', '.join(behind[:10])})" if behind else "")
            + (f"; {unknown} partitions not read yet" if unknown else ""))
