"""The high watermarks of the subscribed partitions, kept in memory by a background thread.

Owns: one plain Kafka client kept alive for the whole run (the embedded broker drops every share
session when any client disconnects), the check at start that the cluster answers and the topics
exist, the broker's in-flight cap per partition and the group's lock (asked once), and the partitions'
high watermarks, refreshed while an idle stream needs them, and at least every BACKLOG_REFRESH_S for the
backlog estimate (``on_refresh`` is told).

Must never: be called on Spark's ``latestOffset`` path for anything but reading memory, or quote a
credential in an error.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ..broker_errors import FailureWatch
from ..errors import SourceError
from ..options import ShareSourceOptions, scrub

# A request that times out makes librdkafka drop the connection (socket.max.fails=1), and on the
# embedded broker any client's disconnect ends every share session: a broker stalled for a few
# seconds must not be met with a short timeout here (the refresh runs off Spark's planning path).
REFRESH_TIMEOUT_S = 15.0
# The first metadata request at start is asked in slices this long: between two, the client's error
# callback says whether authentication or TLS failed (librdkafka retries those for ever).
CONNECT_SLICE_S = 2.0
# A busy stream needs no watermarks to decide on batches; the backlog estimate gets them this often.
BACKLOG_REFRESH_S = 10.0

log = logging.getLogger("spark_share.driver.tracker")
RECORD_LOCKS_CONFIG = "group.share.partition.max.record.locks"
GROUP_LOCK_CONFIG = "share.record.lock.duration.ms"  # the group's own
BROKER_LOCK_CONFIG = "group.share.record.lock.duration.ms"  # the default of groups that set none


def _int(entry) -> int | None:
    try:
        return int(entry.value) if entry is not None and entry.value else None
    except ValueError:
        return None


class MetadataWatcher:
    """A plain Kafka client kept alive for the whole run (the embedded broker drops every share
    session when any client disconnects) that refreshes high watermarks in the background while
    ``wanted()`` says they matter (an idle stream), and not otherwise."""

    def __init__(self, opts: ShareSourceOptions, timeout_s: float = 15.0, wanted=lambda: True,
                 on_refresh=lambda: None):
        from confluent_kafka import Consumer, KafkaException

        self._opts = opts
        self._secrets = opts.secret_values()
        config = opts.metadata_config()
        failures = FailureWatch(config, lambda s: scrub(s, self._secrets))
        try:
            self.client = Consumer({**config, "error_cb": failures})
        except (KafkaException, ValueError, TypeError) as e:
            raise SourceError(scrub(f"invalid Kafka client configuration: {e}", self._secrets)) from None
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                md = self.client.list_topics(timeout=max(0.1, min(CONNECT_SLICE_S, deadline - time.monotonic())))
                break
            except KafkaException as e:
                self.client.poll(0)  # serves the error callback: an authentication or TLS failure says so now
                if failures.failure is None and time.monotonic() < deadline:
                    continue
                self.client.close()
                raise SourceError(failures.failure or (
                    f"could not reach the Kafka cluster at kafka.bootstrap.servers={opts.bootstrap_servers!r} "
                    f"within {timeout_s:.0f} s ({scrub(str(e.args[0]) if e.args else str(e), self._secrets)}); "
                    "check the address, the network and the security settings")) from None
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
        self._on_refresh = on_refresh
        self._refreshed_at = 0.0
        self._stop = threading.Event()
        self.refresh()
        self._thread = threading.Thread(target=self._loop, name="spark-share-watermarks", daemon=True)
        self._thread.start()

    def share_limits(self, timeout_s: float = 10.0) -> tuple[int | None, int | None]:
        """(the broker's ``group.share.partition.max.record.locks``: records of a partition the group
        may have in flight; the group's record lock duration in ms: its ``share.record.lock.duration.ms``,
        else the broker's ``group.share.record.lock.duration.ms``). None where the cluster does not say
        (no DescribeConfigs permission; the embedded broker does not implement it). Asked once, when
        the query starts."""
        from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

        if not self._brokers:
            return None, None
        # Kept until close(): on the embedded broker a client's disconnect ends every share session.
        self._admin = AdminClient(dict(self._opts.producer_config()))
        broker = self._configs(ConfigResource(ResourceType.BROKER, str(self._brokers[0])), timeout_s)
        if broker is None:  # the embedded broker, or no permission: the group will not answer either
            return None, None
        group = self._configs(ConfigResource(ResourceType.GROUP, self._opts.group_id), timeout_s) or {}
        return (_int(broker.get(RECORD_LOCKS_CONFIG)),
                _int(group.get(GROUP_LOCK_CONFIG)) or _int(broker.get(BROKER_LOCK_CONFIG)))

    def _configs(self, resource, timeout_s: float) -> dict | None:
        try:
            futs = self._admin.describe_configs([resource], request_timeout=timeout_s)
            return next(iter(futs.values())).result(timeout=timeout_s + 5)
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
        self._refreshed_at = time.monotonic()

    def _loop(self) -> None:
        interval = max(0.25, 0.02 * len(self.partitions))  # one ListOffsets request per partition
        while not self._stop.wait(interval):
            if self._wanted() or time.monotonic() - self._refreshed_at >= BACKLOG_REFRESH_S:
                self.refresh()
                try:
                    self._on_refresh()
                except Exception:  # the estimate is a report: it must never stop the watermarks
                    log.exception("the backlog estimate failed")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(REFRESH_TIMEOUT_S + 5)  # a refresh under way ends first
        self._admin = None
        try:
            self.client.close()
        except Exception:
            pass
