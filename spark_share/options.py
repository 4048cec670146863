"""Options of ``format("kafka-share")``: parse, validate, redact.

Owns: the list of options and their defaults, every "bad option" error message, the share
consumer configuration derived from ``kafka.*`` options, and redaction of secrets.

Must never: do I/O (it runs wherever Spark instantiates the source), put a secret value in an
error message or a repr, or silently accept an option it does not act on.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from .errors import OptionError

DEFAULT_POLL_TIMEOUT_MS = 1000
DEFAULT_MAX_POLL_RECORDS = 10000
DEFAULT_ACK_TIMEOUT_MS = 30000
DEFAULT_IDLE_PROBE_MS = 10000

# Our own options: name -> (default, description). Lookups are case-insensitive like Spark's.
SOURCE_OPTIONS: dict[str, tuple[str | None, str]] = {
    "subscribe": (None, "comma-separated topics (required)"),
    "includeHeaders": ("false", "add a headers column"),
    "numPartitions": (None, "Spark tasks, and so share consumers, per micro-batch; default: the number of subscribed topic-partitions"),
    "maxRecordsPerTrigger": (None, "upper bound of records per micro-batch; default: no limit beyond one poll per consumer"),
    "pollTimeoutMs": (str(DEFAULT_POLL_TIMEOUT_MS), "how long a read task waits for its first records"),
    "ackTimeoutMs": (str(DEFAULT_ACK_TIMEOUT_MS), "how long the driver side waits for acknowledgements to be confirmed"),
    "idleProbeIntervalMs": (str(DEFAULT_IDLE_PROBE_MS), "with no sign of new records, how often a (cheap) probe batch runs"),
    "deadLetterTopic": (None, "Kafka topic (same cluster) where rejected records are written before their REJECT"),
    "deadLetterPath": (None, "Parquet table path where rejected records are written before their REJECT"),
    "maxDeliveryCount": (None, "records delivered this many times are rejected to the dead-letter target before reaching your code"),
    "maxRecordLocks": (None, "records each partition may have in flight for the group (the broker's group.share.partition.max.record.locks); polls are sized to fill it; default: read from the broker, else Kafka's default 2000"),
    "networkEncryption": ("auto", "encrypt what crosses the network between the driver side and executors (records re-read from another host, verdicts): true, false, or auto (on when kafka.security.protocol is SSL or SASL_SSL)"),
    "trackerPort": ("0", "port (N) or port range (N-M) where the driver side listens for executors; 0: any free port"),
}

# Spark Kafka source options that mean nothing for a share group, with what to do instead.
NOT_FOR_SHARE_GROUPS = {
    "subscribePattern": "share groups subscribe to explicit topic names; list them in 'subscribe'",
    "assign": "share groups do not assign partitions to consumers; use 'subscribe' and let the broker share partitions",
    "startingOffsets": "where a new share group starts is the group config share.auto.offset.reset, set on the broker "
                       "(kafka-configs.sh --alter --entity-type groups --entity-name <group> --add-config share.auto.offset.reset=earliest)",
    "endingOffsets": "a share group has no ending offsets; use trigger(availableNow=True) to drain the queue and stop",
    "startingTimestamp": "share groups start at share.auto.offset.reset (a broker-side group config)",
    "startingOffsetsByTimestamp": "share groups start at share.auto.offset.reset (a broker-side group config)",
    "maxOffsetsPerTrigger": "use 'maxRecordsPerTrigger' (share groups have no offset ranges)",
    "minOffsetsPerTrigger": "not supported; the source runs a batch as soon as records are available",
    "failOnDataLoss": "not applicable: the broker tracks every record's state in a share group",
    "kafkaConsumer.pollTimeoutMs": "use 'pollTimeoutMs'",
    "minPartitions": "use 'numPartitions'",
    "groupIdPrefix": "set the share group explicitly with 'kafka.group.id'",
}

# Consumer configs a share consumer rejects, or that are group configs on the broker.
REJECTED_KAFKA = {
    "session.timeout.ms": "share groups take the session timeout from the broker (group.share.session.timeout.ms)",
    "heartbeat.interval.ms": "share groups take the heartbeat interval from the broker (group.share.heartbeat.interval.ms)",
    "auto.offset.reset": "for a share group this is the group config share.auto.offset.reset, set on the broker "
                         "(kafka-configs.sh --alter --entity-type groups --entity-name <group> --add-config share.auto.offset.reset=earliest)",
    "enable.auto.commit": "a share group has no offsets to commit; spark-share acknowledges each record after its batch commits",
    "auto.commit.interval.ms": "a share group has no offsets to commit",
    "enable.auto.offset.store": "a share group has no offsets to store",
    "group.protocol": "spark-share always uses the share-group protocol",
    "group.instance.id": "share groups have no static membership",
    "isolation.level": "share groups take the isolation level from the broker group config share.isolation.level",
    "partition.assignment.strategy": "the broker assigns partitions of a share group",
    "group.share.record.lock.duration.ms": "the record lock duration is a group config on the broker "
                                           "(kafka-configs.sh --alter --entity-type groups --entity-name <group> --add-config share.record.lock.duration.ms=60000)",
    "share.record.lock.duration.ms": "the record lock duration is a group config on the broker (kafka-configs.sh --entity-type groups)",
    "share.auto.offset.reset": "share.auto.offset.reset is a group config set on the broker (kafka-configs.sh --entity-type groups)",
    "group.share.delivery.count.limit": "the delivery count limit is a broker/group config (group.share.delivery.count.limit)",
    "share.acknowledgement.mode": "spark-share acknowledges explicitly, after each batch commits; remove this option",
    "key.deserializer": "keys are returned as binary; cast or decode them in Spark",
    "value.deserializer": "values are returned as binary; cast or decode them in Spark",
    "enable.partition.eof": "not applicable to a share consumer",
}

_SECRET_KEY = re.compile(r"(password|secret|token|credential|\.key$|key\.pem|keystore\.pem|jaas)", re.I)


def is_secret(key: str) -> bool:
    return bool(_SECRET_KEY.search(key))


def redact(conf: Mapping[str, object]) -> dict[str, object]:
    return {k: ("***" if is_secret(k) else v) for k, v in conf.items()}


def scrub(text: str, secrets: list[str]) -> str:
    """Remove any secret value from free text (e.g. a client's error message)."""
    for s in secrets:
        if s and len(s) >= 3:
            text = text.replace(s, "***")
    return text


def _int(name: str, raw: str, lo: int, hi: int = 2**31 - 1) -> int:
    try:
        v = int(str(raw).strip())
    except ValueError:
        raise OptionError(f"option '{name}' must be an integer, got {raw!r}") from None
    if not lo <= v <= hi:
        raise OptionError(f"option '{name}' must be between {lo} and {hi}, got {v}")
    return v


def _bool(name: str, raw: str) -> bool:
    v = str(raw).strip().lower()
    if v in ("true", "1", "yes"):
        return True
    if v in ("false", "0", "no"):
        return False
    raise OptionError(f"option '{name}' must be true or false, got {raw!r}")


def _port_range(raw: str) -> tuple[int, int]:
    """'0' (any), 'N' or 'N-M' -> (first, last)."""
    text = str(raw).strip()
    lo, sep, hi = text.partition("-")
    try:
        first, last = int(lo), int(hi if sep else lo)
    except ValueError:
        raise OptionError(f"option 'trackerPort' must be a port (e.g. 40100) or a range (e.g. 40100-40199), "
                          f"got {raw!r}") from None
    if not (0 <= first <= last <= 65535) or (first == 0 and last != 0):
        raise OptionError(f"option 'trackerPort' = {raw!r}: give 0 (any free port), a port between 1 and 65535, "
                          "or a range N-M with N <= M")
    return first, last


@dataclass(frozen=True)
class ShareSourceOptions:
    bootstrap_servers: str
    group_id: str
    topics: tuple[str, ...]
    include_headers: bool = False
    num_partitions: int | None = None
    max_records_per_trigger: int | None = None
    poll_timeout_ms: int = DEFAULT_POLL_TIMEOUT_MS
    ack_timeout_ms: int = DEFAULT_ACK_TIMEOUT_MS
    idle_probe_ms: int = DEFAULT_IDLE_PROBE_MS
    dead_letter_topic: str | None = None
    dead_letter_path: str | None = None
    max_delivery_count: int | None = None
    tracker_ports: tuple[int, int] = (0, 0)  # first and last port the tracker may listen on; (0, 0): any
    max_record_locks: int | None = None  # the broker's in-flight cap per partition, if the user gave it
    encrypt_network: bool = False  # the tracker's connections encrypt their frames (wire.py)
    # kafka.* options other than bootstrap servers and group id, prefix removed.
    kafka: dict[str, str] = field(default_factory=dict)

    def consumer_config(self) -> dict[str, str]:
        """The share consumer's config; ``max.poll.records`` only if the user gave it (see ``sized``)."""
        conf = dict(self.kafka)
        conf.update({"bootstrap.servers": self.bootstrap_servers, "group.id": self.group_id,
                     "share.acknowledgement.mode": "explicit"})
        return conf

    @property
    def dead_letter(self) -> bool:
        return bool(self.dead_letter_topic or self.dead_letter_path)

    def producer_config(self) -> dict[str, str]:
        """Config for the dead-letter producer: connection and security settings only."""
        consumer_only = ("max.poll.records", "share.", "fetch.", "group.", "max.partition.fetch.bytes",
                         "client.rack", "check.crcs", "max.poll.interval.ms", "queued.")
        conf = {k: v for k, v in self.kafka.items() if not k.startswith(consumer_only)}
        conf["bootstrap.servers"] = self.bootstrap_servers
        return conf

    def metadata_config(self) -> dict[str, str]:
        """Config for the driver's plain client that reads metadata and high watermarks."""
        share_only = ("max.poll.records", "share.")
        conf = {k: v for k, v in self.kafka.items() if not k.startswith(share_only)}
        conf.update({"bootstrap.servers": self.bootstrap_servers, "enable.auto.commit": "false",
                     "group.id": f"{self.group_id}.spark-share-metadata"})
        return conf

    def secret_values(self) -> list[str]:
        return [v for k, v in self.kafka.items() if is_secret(k)]

    def __repr__(self) -> str:  # never show secrets
        return (f"ShareSourceOptions(bootstrap_servers={self.bootstrap_servers!r}, group_id={self.group_id!r}, "
                f"topics={list(self.topics)}, kafka={redact(self.kafka)})")

    __str__ = __repr__


def sized(consumer_config: Mapping[str, str], chosen: int | None) -> dict[str, str]:
    """``consumer_config`` with the poll size the tracker ``chosen`` (it fills the lock budget), capped
    by a ``kafka.max.poll.records`` the user gave."""
    conf = dict(consumer_config)
    sizes = [int(n) for n in (conf.get("max.poll.records"), chosen) if n is not None]
    conf["max.poll.records"] = str(min(sizes) if sizes else DEFAULT_MAX_POLL_RECORDS)
    return conf


def parse_options(options: Mapping[str, str]) -> ShareSourceOptions:
    """Validate the options a user gave ``readStream.format("kafka-share")``."""
    ours = {k.lower(): k for k in SOURCE_OPTIONS}
    foreign = {k.lower(): k for k in NOT_FOR_SHARE_GROUPS}
    given: dict[str, str] = {}
    kafka: dict[str, str] = {}
    for key, value in options.items():
        low = key.lower()
        if low == "path":
            raise OptionError("kafka-share takes no path; use option('subscribe', 'topic1,topic2')")
        if low.startswith("kafka."):
            kkey = key[len("kafka."):].lower()
            if kkey in REJECTED_KAFKA:
                raise OptionError(f"option '{key}' is not accepted by a share consumer: {REJECTED_KAFKA[kkey]}")
            kafka[kkey] = "" if value is None else str(value)
        elif low in foreign:
            name = foreign[low]  # Spark hands options over lower-cased; name them as documented
            raise OptionError(f"option '{name}' is not supported by kafka-share: {NOT_FOR_SHARE_GROUPS[name]}")
        elif low in ours:
            given[ours[low]] = str(value)
        else:
            raise OptionError(
                f"unknown option '{key}' for kafka-share; known options: {', '.join(sorted(SOURCE_OPTIONS))} "
                "and kafka.* (passed to the share consumer)")

    bootstrap = kafka.pop("bootstrap.servers", "").strip()
    if not bootstrap:
        raise OptionError("option 'kafka.bootstrap.servers' is required, e.g. .option('kafka.bootstrap.servers', 'broker:9092')")
    group = kafka.pop("group.id", "").strip()
    if not group:
        raise OptionError("option 'kafka.group.id' is required: it names the share group, e.g. .option('kafka.group.id', 'orders')")
    raw_topics = given.get("subscribe")
    if raw_topics is None:
        raise OptionError("option 'subscribe' is required: a comma-separated list of topics")
    topics = [t.strip() for t in raw_topics.split(",")]
    if not any(topics):
        raise OptionError("option 'subscribe' is empty: give at least one topic")
    if any(not t for t in topics):
        raise OptionError(f"option 'subscribe' has an empty topic name in {raw_topics!r}")
    bad = [t for t in topics if not re.fullmatch(r"[A-Za-z0-9._-]{1,249}", t)]
    if bad:
        raise OptionError(f"option 'subscribe' has invalid topic names {bad}: use letters, digits, '.', '_' and '-'")
    dups = sorted({t for t in topics if topics.count(t) > 1})
    if dups:
        raise OptionError(f"option 'subscribe' lists {dups} more than once")

    dlt = given.get("deadLetterTopic", "").strip() or None
    dlp = given.get("deadLetterPath", "").strip() or None
    if dlt and dlp:
        raise OptionError("options 'deadLetterTopic' and 'deadLetterPath' conflict: choose one dead-letter target")
    if dlt and dlt in topics:
        raise OptionError(f"option 'deadLetterTopic' = {dlt!r} is also subscribed: rejected records would come back")
    mdc = given.get("maxDeliveryCount")
    max_delivery = _int("maxDeliveryCount", mdc, 1, 1000) if mdc is not None else None
    if max_delivery is not None and not (dlt or dlp):
        raise OptionError("option 'maxDeliveryCount' needs a dead-letter target ('deadLetterTopic' or 'deadLetterPath') "
                          "so the records it rejects can be found")
    num = given.get("numPartitions")
    mrt = given.get("maxRecordsPerTrigger")
    if "max.poll.records" in kafka:
        _int("kafka.max.poll.records", kafka["max.poll.records"], 1, 1_000_000)
    encryption = given.get("networkEncryption", "auto").strip().lower()
    if encryption not in ("auto", "true", "false"):
        raise OptionError(f"option 'networkEncryption' must be true, false or auto, not {given['networkEncryption']!r}")
    tls = kafka.get("security.protocol", "").upper() in ("SSL", "SASL_SSL")
    return ShareSourceOptions(
        encrypt_network=encryption == "true" or (encryption == "auto" and tls),
        bootstrap_servers=bootstrap,
        group_id=group,
        topics=tuple(topics),
        include_headers=_bool("includeHeaders", given.get("includeHeaders", "false")),
        num_partitions=_int("numPartitions", num, 1, 10_000) if num is not None else None,
        max_records_per_trigger=_int("maxRecordsPerTrigger", mrt, 1, 2**62) if mrt is not None else None,
        poll_timeout_ms=_int("pollTimeoutMs", given.get("pollTimeoutMs", str(DEFAULT_POLL_TIMEOUT_MS)), 0, 600_000),
        ack_timeout_ms=_int("ackTimeoutMs", given.get("ackTimeoutMs", str(DEFAULT_ACK_TIMEOUT_MS)), 100, 3_600_000),
        idle_probe_ms=_int("idleProbeIntervalMs", given.get("idleProbeIntervalMs", str(DEFAULT_IDLE_PROBE_MS)), 100, 86_400_000),
        dead_letter_topic=dlt,
        dead_letter_path=dlp,
        max_delivery_count=max_delivery,
        tracker_ports=_port_range(given.get("trackerPort", "0")),
        max_record_locks=_int("maxRecordLocks", given["maxRecordLocks"], 1, 1_000_000) if "maxRecordLocks" in given else None,
        kafka=kafka,
    )
