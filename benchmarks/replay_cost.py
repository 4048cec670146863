"""What replayable batches cost (readMode=driver), side by side in one run on a real Kafka: throughput at
Kafka's default record locks (2,000 per partition) and at 10,000, this tree beside an earlier one (a
source tree you check out, e.g. ``git worktree add /tmp/before <commit>``); the offset and progress sizes
at 8 and 2,000 partitions; and the deliveries a replay spends.

    KAFKA_HOME=~/kafka_2.13-4.2.1 .venv/bin/python benchmarks/replay_cost.py \\
        --kafka-start tests/harness/kafka_dist/start.sh --before /tmp/before [--rounds 2] [--out DIR]

Throughput: one broker per lock setting (removed after its runs), one topic of ``--records`` records on
``--partitions`` partitions, each run a fresh share group reading it whole with ``Trigger.AvailableNow``
into the noop sink, in a process of its own (the tree's ``spark_share`` first on its path, Spark's Python
workers included), the two trees alternating, in the reverse order every other round.

Sizes: the offset Spark writes per batch (the offset log's entries of a run at ``--partitions``, and a
batch of 2,000 partitions with one run each far into their logs, as ``tests/unit/test_record_ranges.py``
makes it) and a progress report, which shows the offset twice (start and end).

A replay: a ``foreachBatch`` that skips a batch id it wrote raises after writing batch 2; the query is
started again and drains. Every record's deliveries are counted from the rows written (``deliveryCount``),
with the records of a committed batch ACCEPTed on return (``acceptedAgain``).

Prints the table and writes ``results.json`` to ``--out``. Not part of the test run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import uuid

from bench_common import HERE, ROOT, backlog, comma_ints, local_session, parse_args, real_cluster, write_json

from harness.kafka_cluster import add_cluster_arguments

LOCKS_PROP = "group.share.partition.max.record.locks"


def one_run(bootstrap: str, topic: str, records: int) -> dict:
    """In the child process: one AvailableNow run of the default source over ``topic``; its throughput and
    the sizes of what it wrote to the offset log and reported in progress."""
    from bench_runs import share_run

    import spark_share
    from harness.kafka_cluster import ExternalCluster

    spark = local_session()
    tmp = tempfile.mkdtemp(prefix="bench-replay-")
    try:
        with ExternalCluster(bootstrap, {}, prefix="spark-share-replay-cost") as kafka:
            run = share_run(spark, kafka, topic, None, records, tmp, readMode="driver")
    finally:
        spark.stop()
    offsets = [os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(tmp) if d.endswith("offsets")
               for f in fs if f.isdigit()]
    return {"from_start": records / run["seconds"], "after_first": run["steady_records"] / run["steady_seconds"],
            "batches": run["batches"], "mean_batch": run["mean_batch"], "offset_entry_max": max(offsets, default=0),
            "progress_max": run["progress_max_bytes"], "code": os.path.dirname(os.path.dirname(spark_share.__file__))}


def run_tree(tree: str, bootstrap: str, topic: str, records: int) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, HERE, os.path.join(ROOT, "tests")]))
    out = subprocess.run([sys.executable, __file__, "--child", json.dumps([bootstrap, topic, records])], env=env,
                         capture_output=True, text=True, timeout=1800)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if out.returncode != 0 or line is None:
        raise RuntimeError(f"the run of {tree} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def throughput(args, locks: int) -> dict:
    trees = {"before": os.path.abspath(args.before), "now": ROOT}
    with real_cluster(args, {LOCKS_PROP: str(locks)}, "spark-share-replay-cost") as kafka:
        topic = backlog(kafka, args.partitions, args.records)
        run_tree(ROOT, kafka.bootstrap_servers, topic, args.records)  # not measured: the topic's first reader
        rounds = []
        for rnd in range(args.rounds):
            got = {}
            for name in (list(trees) if rnd % 2 == 0 else list(trees)[::-1]):
                got[name] = run_tree(trees[name], kafka.bootstrap_servers, topic, args.records)
                print(f"locks {locks} round {rnd + 1} {name}: {got[name]['from_start']:,.0f}/s from start, "
                      f"{got[name]['after_first']:,.0f}/s after the first batch, {got[name]['batches']} batches",
                      flush=True)
            rounds.append(got)
    return {"locks": locks, "rounds": rounds}


def sizes(partitions: int) -> dict:
    """The offset of one batch at ``partitions`` partitions (one run each, far into their logs) and a progress
    report's source entry showing it as start and end."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "unit"))
    from test_record_ranges import ranges_like_a_batch

    from spark_share.offsets import offset_of

    offset = json.dumps(offset_of(123, uuid.uuid4().hex[:16], None, ranges_like_a_batch(partitions)))
    before = json.dumps(offset_of(123, uuid.uuid4().hex[:16]))
    return {"partitions": partitions, "offset_bytes": len(offset), "offset_bytes_before": len(before),
            "progress_offsets_bytes": 3 * len(offset)}  # a source's progress: its start, end and latest offset


def replay_deliveries(args) -> dict:
    """A batch run again after its foreachBatch raised: every record's deliveries, from the rows written."""
    from bench_runs import share_stream

    import spark_share

    spark = local_session()
    tmp = tempfile.mkdtemp(prefix="bench-replay-")
    written: dict[int, list] = {}
    fail = {"at": 2}

    def sink(df, batch_id):
        if batch_id not in written:  # idempotent per batch id
            written[batch_id] = df.select("offset", "partition", "deliveryCount").collect()
        if batch_id == fail["at"]:
            fail["at"] = None
            raise RuntimeError("the sink fails after its write")

    try:
        with real_cluster(args, {}, "spark-share-replay-cost") as kafka:
            topic = backlog(kafka, 4, args.replay_records)
            group = f"replay-{uuid.uuid4().hex[:6]}"
            ck = os.path.join(tmp, "ck")
            for attempt in (1, 2):
                df = share_stream(spark, kafka, topic, group=group, readMode="driver", maxRecordsPerTrigger=500).load()
                q = spark_share.drain(df.writeStream.foreachBatch(sink).option("checkpointLocation", ck))
                try:
                    q.awaitTermination(600)
                except Exception:  # the first run's sink fails, as it is meant to
                    if attempt == 2:
                        raise
            counts = spark_share.status(q)
    finally:
        spark.stop()
    rows = [r for rs in written.values() for r in rs]
    keys = [(r["partition"], r["offset"]) for r in rows]
    return {"records": args.replay_records, "written": len(rows), "duplicates": len(keys) - len(set(keys)),
            "extra_deliveries": sum(r["deliveryCount"] - 1 for r in rows), "replayed_batch": len(written.get(2, [])),
            "accepted_again": counts.get("acceptedAgain"), "replay_missing": counts.get("replayMissing")}


def report(results: dict) -> None:
    print("\nthroughput, readMode=driver (median of rounds; before = the tree given with --before: "
          f"{results['throughput'][0]['rounds'][0]['before']['code']})")
    print(f"{'locks':>7} | {'before from start':>17} | {'now from start':>14} | {'ratio':>5} | "
          f"{'before after 1st':>16} | {'now after 1st':>13} | {'ratio':>5}")
    for s in results["throughput"]:
        med = {k: {m: statistics.median(r[k][m] for r in s["rounds"]) for m in ("from_start", "after_first")}
               for k in ("before", "now")}
        print(f"{s['locks']:>7,} | {med['before']['from_start']:>17,.0f} | {med['now']['from_start']:>14,.0f} | "
              f"{med['now']['from_start'] / med['before']['from_start']:>5.2f} | {med['before']['after_first']:>16,.0f} | "
              f"{med['now']['after_first']:>13,.0f} | {med['now']['after_first'] / med['before']['after_first']:>5.2f}")
        now = s["rounds"][-1]["now"]
        print(f"        offset log entry at {results['partitions']} partitions: now {now['offset_entry_max']} bytes, "
              f"before {s['rounds'][-1]['before']['offset_entry_max']}; progress report up to {now['progress_max']} bytes")
    for z in results["sizes"]:
        print(f"offset of one batch at {z['partitions']:,} partitions: {z['offset_bytes']:,} bytes (before "
              f"{z['offset_bytes_before']}); in a progress report (start, end, latest) {z['progress_offsets_bytes']:,}")
    r = results.get("replay")
    if r:
        print(f"a replay ({r['records']:,} records, batch 2 run again with {r['replayed_batch']} records): "
              f"{r['written']:,} written, {r['duplicates']} duplicates, {r['extra_deliveries']} extra deliveries "
              f"in what was written, acceptedAgain {r['accepted_again']}, replayMissing {r['replay_missing']}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        print("RESULT " + json.dumps(one_run(*json.loads(argv[1]))), flush=True)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_cluster_arguments(ap)
    ap.add_argument("--before", required=True, help="a source tree of the version to compare with")
    ap.add_argument("--locks", default="2000,10000")
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--replay-records", type=int, default=4000)
    ap.add_argument("--out", default="bench-out")
    args = parse_args(ap, argv)
    if not os.path.isfile(os.path.join(args.before, "spark_share", "__init__.py")):
        ap.error(f"--before {args.before!r} is not a spark-share source tree (no spark_share/__init__.py)")
    results = {"records": args.records, "partitions": args.partitions,
               "sizes": [sizes(8), sizes(2000)], "throughput": [throughput(args, n) for n in comma_ints(args.locks)]}
    results["replay"] = replay_deliveries(args)
    write_json(os.path.join(args.out, "results.json"), results)
    report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
