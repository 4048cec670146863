"""The driver side at cluster sizes this machine cannot hold: the real tracker, driven through its real
protocol on real TLS sockets by simulated agents (tests/harness/scale_sim.py), at 10, 100 and 500 agents
x 8 read slots, on a 10,000-partition topic, for many batches; then two million rejects in one batch.

    .venv/bin/python benchmarks/scale.py                       # 10/100/500 agents, 1,000 batches each
    .venv/bin/python benchmarks/scale.py --batches 50 --agents 10,100 --out /tmp/scale
    .venv/bin/python benchmarks/scale.py --batches 1000,1000,200       # batches per size
    .venv/bin/python benchmarks/scale.py --agents 500 --batches 100 --random-batches 0 --rejects 0 --burst-batches 50

Per size, per batch (the first batches, while connections and caches warm up, are left out):

- ``tracker adds``: what the batch waits for the tracker: ``latestOffset`` + ``partitions`` (Spark calls
  them in turn before the batch's tasks start) + the time the tracker took to answer one read's Claim and
  Acquired (each read task waits for both, before and after its poll), from the simulated agent's send to
  the tracker's reply, queueing in the tracker included; the median over the batch's reads, then over
  batches. The round trips the simulated agents saw are shown beside it: they add the agents' own
  process, which holds 500 agents' TLS in one Python process on the same 2 cores (a cluster spreads it
  over 500 hosts);
- the tracker process's CPU per batch (every request it served for that batch, its acknowledgements, its
  watermark thread), its threads, its memory (RSS: at the start, the end, and the slope per 100 batches
  after the warm-up), the bytes it sent per batch;
- the group's members: at most numPartitions at any time (the agents' process counts every consumer);
- reads at once: the simulation paces them (4 per agent, at most 256), then, with ``--burst-batches``, starts
  every read of a batch at once, as a cluster with that many task slots would, against a tracker stopped
  (SIGSTOP) for ``BURST_HOLD_S`` meanwhile: each agent's first claim waits in its sockets with every other's
  (the simulated agents, on the same 2 cores, could not otherwise send them faster than the tracker answers),
  and the tracker's answers are timed from when it resumes; the row says how many were queued and how long
  the slowest claim waited;
- with ``--rejects``: a reject() of that many rows of one batch, sent as the user's process sends it (Arrow
  chunks over TLS): chunks and bytes, the tracker's time to check and keep them, its memory before and
  after, and the verdicts every agent received (each only those on records it holds).

Writes ``results.json`` and ``scale.md`` (the table of docs/performance.md) to ``--out``. Not part of the
test run; the sizes' small versions are in tests/integration/test_scale_sim.py. It runs no Spark and no
broker, and must never time the simulated agents' side as the tracker's: "tracker adds" is the tracker's
answer time, the round trips are shown apart.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from harness import scale_sim  # noqa: E402

# A burst's start: the tracker stopped this long while every read starts (within the 5 s keepalive; long
# enough for 4,000 read threads to start and each agent's first claim to leave, which the row says).
BURST_HOLD_S = 2.0
WARMUP = 20  # batches left out of the figures (connections, caches, the ledger reaching its steady size)


def _slope(ys: list[float], at_least: int = 11) -> float:
    """Least-squares growth per step (0 for too few steps to say)."""
    n = len(ys)
    if n < at_least:
        return 0.0
    mean_x, mean_y = (n - 1) / 2, statistics.fmean(ys)
    return sum((i - mean_x) * (y - mean_y) for i, y in enumerate(ys)) / sum((i - mean_x) ** 2 for i in range(n))


def _steady_growth(ys: list[int], window: int = 20) -> int | None:
    """Growth per 100 batches over the second half of ``ys``, from the medians of ``window`` batches (a
    sample taken during a transient peak moves a median, not the slope); None for runs too short."""
    half = ys[len(ys) // 2:]
    medians = [statistics.median(half[i:i + window]) for i in range(0, len(half) - window + 1, window)]
    return None if len(medians) < 4 else round(_slope(medians, at_least=4) * 100 / window)


def summarize(r: scale_sim.SimResult, agents: int, slots: int, placement: str) -> dict:
    rows = r.batches[WARMUP:] if len(r.batches) > 2 * WARMUP else r.batches
    adds = [b["latestOffsetMs"] + b["partitionsMs"] + b["claimServedP50Ms"] + b["acquiredServedP50Ms"] for b in rows]
    rss = [b["rssMb"] for b in rows]
    blocks = [b["pyBlocks"] for b in rows]

    def median(key: str) -> float:  # of the batches after the warm-up
        return round(statistics.median(b[key] for b in rows), 1)

    return {"agents": agents, "slotsPerAgent": slots, "slots": agents * slots, "batches": len(r.batches),
            "placement": placement,
            "trackerAddsMsMedian": round(statistics.median(adds), 1),
            "trackerAddsMsP95": round(sorted(adds)[int(0.95 * (len(adds) - 1))], 1),
            "latestOffsetMsMedian": median("latestOffsetMs"), "partitionsMsMedian": median("partitionsMs"),
            "claimServedMsMedian": median("claimServedP50Ms"), "acquiredServedMsMedian": median("acquiredServedP50Ms"),
            "claimServedMaxMsMedian": median("claimServedMaxMs"),
            "claimRttMsMedian": median("claimP50Ms"), "acquiredRttMsMedian": median("acquiredP50Ms"),
            "trackerCpuMsPerBatch": median("cpuMs"),
            "threadsMax": max(b["threads"] for b in r.batches),
            "rssMbStart": rss[0], "rssMbEnd": rss[-1], "rssMbPer100Batches": round(_slope(rss) * 100, 2),
            # The Python heap in blocks, over the second half of the run: a leak of objects grows it batch
            # after batch. RSS also keeps the allocator's high-water mark of transient peaks (a watermark
            # refresh of 10,000 partitions holds about 150,000 blocks for a moment), and the first backlog
            # view (a dict per partition, kept for status()) comes a few hundred batches in.
            "pyBlocksEnd": blocks[-1], "pyBlocksPer100Batches": _steady_growth(blocks),
            "bytesSentPerBatch": int(statistics.median(b["bytesSent"] for b in rows)),
            "mostMembers": r.most_members, "memberLimit": r.member_limit,
            "lentReads": r.batches[-1].get("relayed", 0), "idleClosed": r.batches[-1].get("closed", 0),
            "reads": agents * slots * len(r.batches),
            "acked": r.final.get("accepted"), "failed": r.final.get("failed"),
            # a burst: the fewest of the agents' first claims that waited in the stopped tracker, of those reading
            "queuedInBurstMin": min((b["queuedInBurst"] for b in rows if b.get("queuedInBurst") is not None),
                                    default=None),
            "agentsReading": max(b.get("agentsReading", 0) for b in rows)}


def _signed(n: int | None) -> str:
    return "-" if n is None else f"{n:+,}"


def table(sizes: list[dict]) -> str:
    head = ("| agents x slots | tracker adds per batch, median (p95) | latestOffset | claim / acquired answered in "
            "(round trip seen by the simulated agents) | "
            "tracker CPU per batch | threads | RSS start -> end (per 100 batches); Python heap blocks per 100 batches, "
            "second half | "
            "sent per batch | members (cap) | "
            "reads lent at the cap |")
    lines = [head, "|" + "---|" * 10]
    for s in sizes:
        if "error" in s:
            lines.append(f"| {s['agents']} x {s['slotsPerAgent']}, {s['placement']} placement | failed: {s['error'][:200]} |"
                         + " |" * 8)
            continue
        burst = ("" if s.get("queuedInBurstMin") is None else
                 f" (a burst: at least {s['queuedInBurstMin']} of {s['agentsReading']} agents' first claims queued "
                 f"in the stopped tracker; the slowest claim answered in {s['claimServedMaxMsMedian']} ms)")
        lines.append(f"| {s['agents']} x {s['slotsPerAgent']}, {s['batches']} batches, {s['placement']} placement, "
                     f"{s.get('readsAtOnce', 256):,} reads at once{burst} | "
                     f"{s['trackerAddsMsMedian']} ms ({s['trackerAddsMsP95']}) | "
                     f"{s['latestOffsetMsMedian']} ms | {s['claimServedMsMedian']} / {s['acquiredServedMsMedian']} ms "
                     f"({s['claimRttMsMedian']} / {s['acquiredRttMsMedian']}) | "
                     f"{s['trackerCpuMsPerBatch']} ms | {s['threadsMax']} | {s['rssMbStart']} -> {s['rssMbEnd']} MB "
                     f"({s['rssMbPer100Batches']:+.2f}); {_signed(s['pyBlocksPer100Batches'])} of {s['pyBlocksEnd']:,} | "
                     f"{s['bytesSentPerBatch'] / 1024:.0f} KB | "
                     f"{s['mostMembers']} ({s['memberLimit']}) | {s['lentReads']:,} of {s['reads']:,} |")
    return "\n".join(lines)


def write(args, sizes: list[dict], rejects: dict | None) -> None:
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"sizes": sizes, "rejects": rejects, "partitions": args.partitions, "placement": args.placement},
                  f, indent=1)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", default="10,100,500", help="agent counts, comma-separated")
    ap.add_argument("--slots", type=int, default=8, help="read slots per agent")
    ap.add_argument("--partitions", type=int, default=10_000)
    ap.add_argument("--batches", default="1000", help="batches per size: one count, or one per agent count")
    ap.add_argument("--placement", choices=["sticky", "random"], default="sticky")
    ap.add_argument("--rejects", type=int, default=2_000_000, help="rows reject()ed in one batch (0: none)")
    ap.add_argument("--random-batches", type=int, default=200,
                    help="then the largest size with random placement (Spark's tasks anywhere) for this many batches")
    ap.add_argument("--burst-batches", type=int, default=50,
                    help="then the largest size with every read of a batch started at once, for this many batches")
    ap.add_argument("--out", default="docs/results/scale")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    sizes = []
    counts = [int(a) for a in args.agents.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    if len(batches) not in (1, len(counts)):
        ap.error(f"--batches names {len(batches)} counts for {len(counts)} agent counts: give one, or one per agent count")
    def measure(agents: int, n: int, placement: str, at_once: int | None = None, hold_s: float = 0.0) -> None:
        """One size: its figures (or, for a run that failed, why) printed and written as it ends, so a later
        size that fails keeps these. ``at_once``: reads under way at once (the simulation's pace unless
        given); ``hold_s``: each batch a burst (scale_sim)."""
        t0 = time.monotonic()
        at_once = at_once or min(4 * agents, 256)
        try:
            r = scale_sim.run(agents, args.slots, args.partitions, n, placement, concurrency=at_once, hold_s=hold_s)
            s = summarize(r, agents, args.slots, placement)
        except AssertionError as e:  # a failed run is a result too: the table says so
            s = {"agents": agents, "slotsPerAgent": args.slots, "placement": placement, "error": str(e)[:500]}
        s["readsAtOnce"] = at_once
        s["wallS"] = round(time.monotonic() - t0)
        sizes.append(s)
        print(json.dumps(s), flush=True)
        write(args, sizes, None)

    for agents, n in zip(counts, batches * len(counts) if len(batches) == 1 else batches):
        measure(agents, n, args.placement)
    if args.random_batches:
        measure(max(counts), args.random_batches, "random")
    if args.burst_batches:  # every read of a batch at once, as a cluster with that many task slots starts them
        measure(max(counts), args.burst_batches, args.placement, at_once=max(counts) * args.slots, hold_s=BURST_HOLD_S)
    rejects = None
    if args.rejects:
        agents = max(counts)
        rows = -(-args.rejects // (agents * args.slots))
        r = scale_sim.run(agents, args.slots, args.partitions, 4, args.placement, concurrency=min(4 * agents, 256),
                          rows_per_slot=rows, rejects=args.rejects)
        rejects = {**(r.rejects or {}), "agents": agents, "rowsPerSlot": rows, "rejected": r.final.get("rejected")}
        print(json.dumps({"rejects": rejects}), flush=True)
    write(args, sizes, rejects)
    text = table(sizes)
    if rejects:
        text += (f"\n\n{rejects['rows']:,} rejects in one batch of {rejects['agents']} agents: {rejects['chunks']} chunks, "
                 f"{rejects['bytes'] / 1e6:.1f} MB from the user's process; the tracker checked and kept them in "
                 f"{rejects['trackerMs']:.0f} ms, its memory {rejects['trackerRssBeforeMb']} -> "
                 f"{rejects['trackerRssAfterMb']} MB; the agents received {rejects['received']:,} verdicts in all.")
    with open(os.path.join(args.out, "scale.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
