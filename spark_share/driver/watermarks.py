"""The high watermarks of the subscribed partitions, kept in memory by a background thread.

Owns: a plain Kafka client and an admin client kept alive for the whole run (the embedded broker drops
every share session when any client disconnects), the check at start that the cluster answers and the
topics exist, the broker's in-flight cap per partition, its cap on a share group's members and the
group's lock (asked once), and the partitions' high watermarks: all of them in one batched ListOffsets
call per refresh (one request per leader, whatever the partitions), while an idle stream needs them,
and at least every BACKLOG_REFRESH_S for the backlog estimate (``on_refresh`` is told). A partition
whose leader does not answer keeps its last value and is named in ``unanswered``; ``complete_high``
retries until every partition has one (a drain's target must not lose a partition), or says which not.

Must never: be called on Spark's ``latestOffset`` path for anything but reading memory, or quote a
credential in an error.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, NamedTuple

from ..broker_errors import FailureWatch
from ..errors import SourceError
from ..options import ShareSourceOptions, scrub

# A request that times out makes librdkafka drop the connection (socket.max.fails=1), and on the
# embedded broker any client's disconnect ends every share session: a broker stalled for a few
# seconds must not be met with a short timeout here (the refresh runs off Spark's planning path).
REFRESH_TIMEOUT_S = 15.0
COMPLETE_TIMEOUT_S = 60.0  # how long a drain's start retries for partitions whose watermark did not come
# The first metadata request at start is asked in slices this long: between two, the client's error
# callback says whether authentication or TLS failed (librdkafka retries those for ever).
CONNECT_SLICE_S = 2.0
# A busy stream needs no watermarks to decide on batches; the backlog estimate gets them this often.
BACKLOG_REFRESH_S = 10.0
# While an idle stream wants them, refreshes follow one another this closely at most, and never take
# more than a tenth of the thread's time (10,000 partitions: one refresh costs about 0.5 s of Python).
MIN_INTERVAL_S = 0.25
REFRESH_DUTY = 0.1

log = logging.getLogger("spark_share.driver.tracker")
RECORD_LOCKS_CONFIG = "group.share.partition.max.record.locks"  # the default of groups that set none
GROUP_RECORD_LOCKS_CONFIG = "share.partition.max.record.locks"  # the group's own (Kafka 4.3+, KIP-1240)
GROUP_LOCK_CONFIG = "share.record.lock.duration.ms"  # the group's own
BROKER_LOCK_CONFIG = "group.share.record.lock.duration.ms"  # the default of groups that set none
MAX_MEMBERS_CONFIG = "group.share.max.size"  # members a share group may have (Kafka: 200 by default)
GROUP_SESSION_CONFIG = "share.session.timeout.ms"  # the group's own: how long a lost member keeps its partitions
BROKER_SESSION_CONFIG = "group.share.session.timeout.ms"  # the default of groups that set none


class ShareLimits(NamedTuple):
    record_locks: int | None
    lock_ms: int | None
    max_members: int | None
    session_ms: int | None
    group_record_locks: int | None = None  # the group's own, where it set one (record_locks is then that)


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
        from confluent_kafka.admin import AdminClient

        # Kept until close(): on the embedded broker a client's disconnect ends every share session.
        self._admin: Any = AdminClient(dict(self._opts.producer_config()))
        self.high: dict[tuple[str, int], int] = {}
        self.unanswered: list[tuple[str, int]] = []  # partitions the last refresh got no high watermark for
        self.version = 0
        self._wanted = wanted
        self._on_refresh = on_refresh
        self._refreshed_at = 0.0
        self._refresh_took = 0.0
        self._stop = threading.Event()
        self.refresh()
        self._thread = threading.Thread(target=self._loop, name="spark-share-watermarks", daemon=True)
        self._thread.start()

    def share_limits(self, timeout_s: float = 10.0) -> ShareLimits:
        """What the cluster says of the group, asked once when the query starts: the records of a partition
        the group may have in flight (the group's ``share.partition.max.record.locks``, Kafka 4.3+, else the
        broker's ``group.share.partition.max.record.locks``), the group's record lock duration in ms (its ``share.record.lock.duration.ms``, else the
        broker's ``group.share.record.lock.duration.ms``) and the broker's ``group.share.max.size``
        (members a share group may have) and the group's session timeout (how long a lost member keeps its
        partitions). None where the cluster does not say (no DescribeConfigs
        permission; the embedded broker does not implement it)."""
        from confluent_kafka.admin import ConfigResource, ResourceType

        if not self._brokers:
            return ShareLimits(None, None, None, None)
        broker = self._configs(ConfigResource(ResourceType.BROKER, str(self._brokers[0])), timeout_s)
        if broker is None:  # the embedded broker, or no permission: the group will not answer either
            return ShareLimits(None, None, None, None)
        group = self._configs(ConfigResource(ResourceType.GROUP, self._opts.group_id), timeout_s) or {}
        own = group.get(GROUP_RECORD_LOCKS_CONFIG)
        own_locks = None if own is None or getattr(own, "is_default", False) else _int(own)
        return ShareLimits(own_locks or _int(broker.get(RECORD_LOCKS_CONFIG)),
                           _int(group.get(GROUP_LOCK_CONFIG)) or _int(broker.get(BROKER_LOCK_CONFIG)),
                           _int(broker.get(MAX_MEMBERS_CONFIG)),
                           _int(group.get(GROUP_SESSION_CONFIG)) or _int(broker.get(BROKER_SESSION_CONFIG)),
                           own_locks)

    def _configs(self, resource, timeout_s: float) -> dict | None:
        try:
            futs = self._admin.describe_configs([resource], request_timeout=timeout_s)
            return next(iter(futs.values())).result(timeout=timeout_s + 5)
        except Exception:
            return None

    def refresh(self) -> list[tuple[str, int]]:
        """Every partition's high watermark, in one batched call; the partitions that did not answer
        (they keep their last value) are returned and kept in ``unanswered``."""
        from confluent_kafka import TopicPartition
        from confluent_kafka.admin import OffsetSpec

        started = time.monotonic()
        deadline = started + REFRESH_TIMEOUT_S + 5
        missing = []
        changed = False
        try:
            futures = self._admin.list_offsets({TopicPartition(t, p): OffsetSpec.latest() for t, p in self.partitions},
                                               request_timeout=REFRESH_TIMEOUT_S)
        except Exception as e:  # refused outright (the client is closing): nothing answered
            log.debug("listing offsets failed: %s", scrub(str(e), self._secrets))
            futures = {}
        answered = set()
        for tp, f in futures.items():
            key = (tp.topic, tp.partition)
            try:
                high = f.result(timeout=max(0.0, deadline - time.monotonic())).offset
            except Exception:
                continue
            answered.add(key)
            if self.high.get(key) != high:
                self.high[key] = high
                changed = True
        missing = [tp for tp in self.partitions if tp not in answered]
        if changed:
            self.version += 1
        if missing and missing != self.unanswered:
            log.warning("no high watermark for %d of %d partitions (e.g. %s): their leaders did not answer within "
                        "%.0f s; their last known values stand", len(missing), len(self.partitions),
                        ", ".join(f"{t}-{p}" for t, p in missing[:5]), REFRESH_TIMEOUT_S)
        self.unanswered = missing
        self._refreshed_at = time.monotonic()
        self._refresh_took = self._refreshed_at - started
        return missing

    def complete_high(self, timeout_s: float = COMPLETE_TIMEOUT_S) -> dict[tuple[str, int], int]:
        """Every partition's high watermark, refreshing until each has answered at least once: what a
        drain reads up to must leave no partition out. SourceError after ``timeout_s``, naming them."""
        deadline = time.monotonic() + timeout_s
        while True:
            missing = [tp for tp in self.partitions if tp not in self.high]
            if not missing:
                return dict(self.high)
            if time.monotonic() > deadline:
                raise SourceError(f"the high watermarks of {len(missing)} partitions ({', '.join(f'{t}-{p}' for t, p in missing[:10])}) "
                                  f"could not be read within {timeout_s:.0f} s: their leaders did not answer. Nothing "
                                  "was read; a drain must know where each partition's queue ends. Check the brokers, "
                                  "then run it again")
            self.refresh()

    def _loop(self) -> None:
        # A refresh that waited on the network (the first one connects) stretches the pause no further
        # than the backlog's own interval: the estimate must move while a backlog lasts.
        while not self._stop.wait(min(BACKLOG_REFRESH_S, max(MIN_INTERVAL_S, self._refresh_took / REFRESH_DUTY))):
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
