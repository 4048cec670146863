"""Drives a kafka-share reader (readMode=driver) the way Spark's source runner does, outside Spark, through
batch 0 and no further, so that a test can kill it (SIGKILL, as a lost driver) with batch 0's records held
and unacknowledged (test_replayed_batches.py).

    python replay_harness.py GROUP TOPIC MAX_ROWS

Its first line on stdin is the Kafka client configuration as JSON. It plans and reads batch 0 with a limit
of MAX_ROWS records, prints ``OFFSET <batch 0's end offset as JSON>`` and ``IDS <the ids it read, JSON>``,
then waits for stdin to close (the test kills it first).
"""
from __future__ import annotations

import json
import sys

from spark_share.options import parse_options
from spark_share.reader import ShareStreamReader
from spark_share.spark_versions import ReadMaxRows


def main() -> None:
    group, topic, max_rows = sys.argv[1], sys.argv[2], int(sys.argv[3])
    client = json.loads(sys.stdin.readline())
    reader = ShareStreamReader(parse_options({**{f"kafka.{k}": v for k, v in client.items()}, "kafka.group.id": group,
                                              "subscribe": topic, "numPartitions": "2",
                                              "maxRecordsPerTrigger": str(max_rows)}))
    start = reader.initialOffset()
    end = reader.latestOffset(start, ReadMaxRows(max_rows))
    ids = [json.loads(v)["id"] for p in reader.partitions(start, end) for rb in reader.read(p)
           for v in rb.column("value").to_pylist()]
    sys.stdout.write(f"OFFSET {json.dumps(end)}\nIDS {json.dumps(ids)}\n")
    sys.stdout.flush()
    sys.stdin.read()


if __name__ == "__main__":
    main()
