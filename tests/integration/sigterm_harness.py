"""Drives a kafka-share reader the way Spark's source runner does, outside Spark, and holds one thread
at a phase of batch 0's commit so that a test can send SIGTERM exactly there (test_replay.py).

    python sigterm_harness.py GROUP TOPIC PHASE QUERY_ID

Its first line on stdin is the Kafka client configuration as JSON (``bootstrap.servers`` and, for a
cluster of yours, its security settings: on stdin, since a command line is visible to every user).
It reads batch 0 (spawning this host's agent), prints ``READ <rows> <tracker id>``, waits for a line
on stdin (the test produces more records meanwhile), then calls latestOffset(end of batch 0) as
Spark does once batch 0 is in its commit log: that ACCEPTs batch 0 and plans batch 1, whose polls
start at once (its 2 read tasks queue for Spark's 1 task slot, as this harness tells the source).
At PHASE it prints ``PHASE <name>`` and holds until the stop has begun:

- ``latest_offset``: the main thread, inside latestOffset, about to send batch 0's acknowledgements;
- ``planning``: the main thread, inside latestOffset, right after batch 1's polls were started;
- ``acknowledging``: the thread that collects the broker's answers to batch 0's acknowledgements.

Nothing here sleeps: the held thread waits on an event set when the stop begins.
"""
from __future__ import annotations

import json
import os
import sys
import threading

os.environ["SPARK_SHARE_FORCE_SIGTERM"] = "1"  # the runner's SIGTERM handling, outside the runner
os.environ["SPARK_SHARE_PARALLELISM"] = "1"  # as register() says of a Spark with one task slot

from spark_share.driver.acks import Acknowledger  # noqa: E402
from spark_share.driver.agents import AgentRoster  # noqa: E402
from spark_share.driver.tracker import Tracker  # noqa: E402
from spark_share.options import parse_options  # noqa: E402
from spark_share.reader import ShareStreamReader  # noqa: E402

HOLD_S = 60.0
_say_lock = threading.Lock()


def say(*words) -> None:
    """One whole line to the test. ``print`` writes each word apart, and at the ``acknowledging`` phase
    two threads print at once: their words interleaved ("LATEST_OFFSET_RETURNEDPHASE ...") and the
    test missed the PHASE line."""
    with _say_lock:
        sys.stdout.write(" ".join(map(str, words)) + "\n")
        sys.stdout.flush()


def main() -> None:
    group, topic, phase, query_id = sys.argv[1:5]
    client = json.loads(sys.stdin.readline())
    stop_begun = threading.Event()

    def hold(name: str) -> None:
        say("PHASE", name)
        stop_begun.wait(HOLD_S)

    shutdown = Tracker.shutdown

    def shutdown_and_say(self):
        stop_begun.set()
        return shutdown(self)

    Tracker.shutdown = shutdown_and_say
    reader = ShareStreamReader(parse_options({**{f"kafka.{k}": v for k, v in client.items()}, "kafka.group.id": group,
                                              "subscribe": topic, "pollTimeoutMs": "5000",
                                              "numPartitions": "2"}))
    try:  # as the runner: stop() when the main thread leaves, however it leaves
        start = reader.initialOffset()
        t = reader._t()
        end = reader.latestOffset(start, None)
        rows = sum(rb.num_rows for p in reader.partitions(start, end) for rb in reader.read(p))
        t._serve_query(query_id)
        say("READ", rows, t.tracker_id)
        sys.stdin.readline()

        if phase == "latest_offset":
            acknowledge = Tracker._acknowledge

            def held_acknowledge(self, b, default):
                if threading.current_thread() is threading.main_thread():
                    hold(phase)
                return acknowledge(self, b, default)

            Tracker._acknowledge = held_acknowledge
        elif phase == "planning":
            prefetch = AgentRoster.prefetch

            def held_prefetch(self, b):
                prefetch(self, b)
                hold(phase)

            AgentRoster.prefetch = held_prefetch
        elif phase == "acknowledging":
            collect = Acknowledger._collect

            def held_collect(self, *args):
                hold(phase)
                return collect(self, *args)

            Acknowledger._collect = held_collect
        else:
            raise SystemExit(f"unknown phase {phase!r}")
        reader.latestOffset(end, None)
        say("LATEST_OFFSET_RETURNED")
        sys.stdin.readline()  # the test ends us with SIGTERM
    finally:
        reader.stop()


if __name__ == "__main__":
    main()
