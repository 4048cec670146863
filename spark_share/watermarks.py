"""The high watermarks of the subscribed partitions, kept in memory by a background thread.

Owns: one plain Kafka client kept alive for the whole run (the embedded broker drops every share
session when any client disconnects), the check at start that the cluster answers and the topics
exist, the broker's in-flight cap per partition (asked once), and the partitions' high watermarks,
refreshed while an idle stream needs them.

Must never: be called on Spark's ``latestOffset`` path for anything but reading memory, or quote a
credential in an error.
"""
from __future__ import annotations

import threading
from typing import Any

from .errors import SourceError
from .options import ShareSourceOptions, scrub

# A request that times out makes librdkafka drop the connection (socket.max.fails=1), and on the
# embedded broker any client's disconnect ends every share session: a broker stalled for a few
# seconds must not be met with a short timeout here (the refresh runs off Spark's planning path).
REFRESH_TIMEOUT_S = 15.0
RECORD_LOCKS_CONFIG = "group.share.partition.max.record.locks"


class MetadataWatcher:
    """A plain Kafka client kept alive for the whole run (the embedded broker drops every share
    session when any client disconnects) that refreshes high watermarks in the background while
    ``wanted()`` says they matter (an idle stream), and not otherwise."""

    def __init__(self, opts: ShareSourceOptions, timeout_s: float = 15.0, wanted=lambda: True):
        from confluent_kafka import Consumer, KafkaException

        self._opts = opts
        self._secrets = opts.secret_values()
        try:
            self.client = Consumer(opts.metadata_config())
        except (KafkaException, ValueError, TypeError) as e:
            raise SourceError(scrub(f"invalid Kafka client configuration: {e}", self._secrets)) from None
        try:
            md = self.client.list_topics(timeout=timeout_s)
        except KafkaException as e:
            self.client.close()
            raise SourceError(
                f"could not reach the Kafka cluster at kafka.bootstrap.servers={opts.bootstrap_servers!r} "
                f"within {timeout_s:.0f} s ({scrub(str(e.args[0]) if e.args else str(e), self._secrets)}); "
                "check the address, the network and the security settings") from None
        missing = [t for t in opts.topics if t not in md.topics or md.topics[t].error is not None]
        if missing:
            self.client.close()
            raise SourceError(f"topic(s) {missing} do not exist on {opts.bootstrap_servers!r}; create them first "
                              f"(existing topics: {sorted(t for t in md.topics if not t.startswith('__'))[:20]})")
        self.partitions: list[tuple[str, int]] = sorted(
            (t, p) for t in opts.topics for p in md.topics[t].partitions)
        self._brokers = sorted(md.brokers)
        self._admin: Any = None
        self.high: dict[tuple[str, int], int] = {}
        self.version = 0
        self._wanted = wanted
        self._stop = threading.Event()
        self.refresh()
        self._thread = threading.Thread(target=self._loop, name="spark-share-watermarks", daemon=True)
        self._thread.start()

    def record_locks(self, timeout_s: float = 10.0) -> int | None:
        """The broker's ``group.share.partition.max.record.locks`` (records of a partition the group may
        have in flight), or None when the cluster does not say (no DescribeConfigs permission; the
        embedded broker does not implement it). Asked once, when the query starts."""
        from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

        if not self._brokers:
            return None
        try:
            # Kept until close(): on the embedded broker a client's disconnect ends every share session.
            self._admin = AdminClient(dict(self._opts.producer_config()))
            futs = self._admin.describe_configs([ConfigResource(ResourceType.BROKER, str(self._brokers[0]))],
                                                request_timeout=timeout_s)
            configs = next(iter(futs.values())).result(timeout=timeout_s + 5)
            entry = configs.get(RECORD_LOCKS_CONFIG)
            return int(entry.value) if entry is not None and entry.value else None
        except Exception:
            return None

    def refresh(self) -> None:
        from confluent_kafka import TopicPartition

        changed = False
        for t, p in self.partitions:
            try:
                _, high = self.client.get_watermark_offsets(TopicPartition(t, p), timeout=REFRESH_TIMEOUT_S,
                                                            cached=False)
            except Exception:
                break  # the broker did not answer in time: the other partitions' requests would wait too
            if self.high.get((t, p)) != high:
                self.high[(t, p)] = high
                changed = True
        if changed:
            self.version += 1

    def _loop(self) -> None:
        interval = max(0.25, 0.02 * len(self.partitions))  # one ListOffsets request per partition
        while not self._stop.wait(interval):
            if self._wanted():
                self.refresh()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(REFRESH_TIMEOUT_S + 5)  # a refresh under way ends first
        self._admin = None
        try:
            self.client.close()
        except Exception:
            pass
