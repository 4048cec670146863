"""Drives a kafka-share reader (readMode=driver) the way Spark's source runner does, outside Spark, through
batch 0 and no further, so that a test can kill it (SIGKILL, as a lost driver) with batch 0's records held
and unacknowledged (test_replayed_batches.py).

    python replay_harness.py GROUP TOPIC

Its first line on stdin is the Kafka client configuration as JSON. It plans and reads batch 0 (every record
available, as under Trigger.AvailableNow), prints ``OFFSET <batch 0's end offset as JSON>`` and ``IDS <the ids it read, JSON>``,
then waits for stdin to close (the test kills it first).
"""
from __future__ import annotations

import json
import sys

from spark_share.options import parse_options
from spark_share.reader import ShareStreamReader
from spark_share.spark_versions import ReadAllAvailable


def main() -> None:
    group, topic = sys.argv[1], sys.argv[2]
    client = json.loads(sys.stdin.readline())
    reader = ShareStreamReader(parse_options({**{f"kafka.{k}": v for k, v in client.items()}, "kafka.group.id": group,
                                              "subscribe": topic, "numPartitions": "2"}))
    start = reader.initialOffset()
    end = reader.latestOffset(start, ReadAllAvailable())
    ids = [json.loads(v)["id"] for p in reader.partitions(start, end) for rb in reader.read(p)
           for v in rb.column("value").to_pylist()]
    sys.stdout.write(f"OFFSET {json.dumps(end)}\nIDS {json.dumps(ids)}\n")
    sys.stdout.flush()
    sys.stdin.read()


if __name__ == "__main__":
    main()
