"""Options of ``format("kafka-share")``: declare, parse, validate, redact, document.

Owns: the one declaration of each option (``OPTIONS``: name, default, parser with its bounds, doc),
every "bad option" error message, the ``kafka.*`` pass-through rules and the client configurations
derived from them, redaction of secrets, and the text of docs/options.md
(``python -m spark_share.options_doc > docs/options.md``).

Must never: do I/O (it runs wherever Spark instantiates the source), put a secret value in an
error message or a repr, or silently accept an option it does not act on.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import OptionError

# Poll size when neither the tracker (which fills the lock budget) nor the user chose one.
DEFAULT_MAX_POLL_RECORDS = 10000


# --- parsers: (option name, text) -> value, or an OptionError that names the option ---------------
@dataclass(frozen=True)
class Parser:
    accepts: str  # the values it takes, as docs/options.md shows them
    parse: Callable[[str, str], Any]


def integer(lo: int, hi: int) -> Parser:
    def parse(name: str, raw: str) -> int:
        try:
            v = int(raw.strip())
        except ValueError:
            raise OptionError(f"option '{name}' must be an integer, got {raw!r}") from None
        if not lo <= v <= hi:
            raise OptionError(f"option '{name}' must be between {lo} and {hi}, got {v}")
        return v

    return Parser(f"{lo:,} or more" if hi >= 2**62 else f"{lo:,} to {hi:,}", parse)


def duration_ms(lo: int, hi: int) -> Parser:
    """Milliseconds, from ``lo`` to ``hi``."""
    return Parser(f"{_ms_text(lo)} to {_ms_text(hi)}", integer(lo, hi).parse)


def _ms_text(ms: int) -> str:
    for unit, size in (("h", 3_600_000), ("min", 60_000), ("s", 1000)):
        if ms >= size and ms % size == 0:
            return f"{ms // size} {unit}"
    return f"{ms} ms"


def _boolean(name: str, raw: str) -> bool:
    v = raw.strip().lower()
    if v in ("true", "1", "yes"):
        return True
    if v in ("false", "0", "no"):
        return False
    raise OptionError(f"option '{name}' must be true or false, got {raw!r}")


def _text(name: str, raw: str) -> str | None:
    return raw.strip() or None


def _topics(name: str, raw: str) -> tuple[str, ...]:
    topics = [t.strip() for t in raw.split(",")]
    if not any(topics):
        raise OptionError(f"option '{name}' is empty: give at least one topic")
    if not all(topics):
        raise OptionError(f"option '{name}' has an empty topic name in {raw!r}")
    bad = [t for t in topics if not re.fullmatch(r"[A-Za-z0-9._-]{1,249}", t)]
    if bad:
        raise OptionError(f"option '{name}' has invalid topic names {bad}: use letters, digits, '.', '_' and '-'")
    dups = sorted({t for t in topics if topics.count(t) > 1})
    if dups:
        raise OptionError(f"option '{name}' lists {dups} more than once")
    return tuple(topics)


def _port_range(name: str, raw: str) -> tuple[int, int]:
    """'0' (any), 'N' or 'N-M' -> (first, last)."""
    lo, sep, hi = raw.strip().partition("-")
    try:
        first, last = int(lo), int(hi if sep else lo)
    except ValueError:
        raise OptionError(f"option '{name}' must be a port (e.g. 40100) or a range (e.g. 40100-40199), "
                          f"got {raw!r}") from None
    if not (0 <= first <= last <= 65535) or (first == 0 and last != 0):
        raise OptionError(f"option '{name}' = {raw!r}: give 0 (any free port), a port between 1 and 65535, "
                          "or a range N-M with N <= M")
    return first, last


def choice(*values: str) -> Parser:
    def parse(name: str, raw: str) -> str:
        v = raw.strip().lower()
        if v not in values:
            raise OptionError(f"option '{name}' must be one of {', '.join(values)}, got {raw!r}")
        return v

    return Parser(" or ".join(f"`{v}`" for v in values), parse)


boolean = Parser("`true` or `false`", _boolean)
plain_text = Parser("text", _text)
topic_list = Parser("topic names, comma-separated", _topics)
port_range = Parser("`0`, a port `N` or a range `N-M`", _port_range)


# --- the options ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Option:
    name: str  # as documented; matched case-insensitively, as Spark does
    field: str  # the ShareSourceOptions field it sets
    default: str | None  # parsed like a given value; None: the field is None unless given
    parser: Parser
    doc: str  # Markdown, one paragraph; a required option's doc is also its error message
    example: str | None = None  # only a required option has one (it has no default)

    @property
    def required(self) -> bool:
        return self.example is not None


OPTIONS: tuple[Option, ...] = (
    Option("kafka.bootstrap.servers", "bootstrap_servers", None, plain_text,
           "the Kafka cluster (Kafka >= 4.2 with share groups enabled)", example="broker:9092"),
    Option("kafka.group.id", "group_id", None, plain_text,
           "the share group", example="orders"),
    Option("subscribe", "topics", None, topic_list,
           "the topics to read", example="orders,payments"),
    Option("includeHeaders", "include_headers", "false", boolean,
           "add the `headers` column, `array<struct<key string, value binary>>`"),
    Option("numPartitions", "num_partitions", None, integer(1, 10_000),
           "Spark tasks per micro-batch, and so share consumers (one poll each per batch). "
           "Default: the number of subscribed topic-partitions, at most the task slots Spark has "
           "(`spark.default.parallelism`, which `spark_share.register()` passes on)"),
    Option("maxRecordsPerTrigger", "max_records_per_trigger", None, integer(1, 2**62),
           "upper bound of records per micro-batch (admission control; ignored under `ReadAllAvailable`, "
           "as Spark requires). Default: no bound beyond one poll per consumer"),
    Option("pollTimeoutMs", "poll_timeout_ms", "1000", duration_ms(0, 600_000),
           "the longest a read task waits for records. A poll returns as soon as records arrive, and an "
           "empty one as soon as a fetch sent after it began came back empty; a consumer's very first poll "
           "may wait until the consumer is 5 s old, for the group join"),
    Option("ackTimeoutMs", "ack_timeout_ms", "30000", duration_ms(100, 3_600_000),
           "how long the driver side waits for the broker to confirm a batch's acknowledgements"),
    Option("idleProbeIntervalMs", "idle_probe_ms", "10000", duration_ms(100, 86_400_000),
           "with no sign of new records (high watermarks unchanged), how often a probe batch runs; it "
           "catches records released or expired elsewhere"),
    Option("deadLetterTopic", "dead_letter_topic", None, plain_text,
           "Kafka topic (same cluster, same security settings) that receives rejected records before "
           "their REJECT; it must exist and must not be subscribed"),
    Option("deadLetterPath", "dead_letter_path", None, plain_text,
           "Parquet table path that receives rejected records before their REJECT (every executor must "
           "reach it). Give `deadLetterTopic` or `deadLetterPath`, not both"),
    Option("maxDeliveryCount", "max_delivery_count", None, integer(1, 1000),
           "records delivered this many times are rejected to the dead-letter target before they reach "
           "your code; needs `deadLetterTopic` or `deadLetterPath`"),
    Option("maxRecordLocks", "max_record_locks", None, integer(1, 1_000_000),
           "records of one partition the group may have in flight: the broker's "
           "`group.share.partition.max.record.locks`. A batch holds its records until Spark commits it, so "
           "partitions x this caps a batch; each consumer's polls are sized to its share of that budget (and "
           "of `maxRecordsPerTrigger`; a `kafka.max.poll.records` you give caps them). Default: the source "
           "asks the broker once at start (`describe_configs`, needs DescribeConfigs on the cluster), else "
           "Kafka's default 2000; the group's own `share.partition.max.record.locks` (Kafka >= 4.3) comes before the "
           "broker's; set the option when describing configs is refused (docs/performance.md, \"The group's "
           "record-lock budget\")"),
    Option("trackerPort", "tracker_ports", "0", port_range,
           "the port (`40100`) or port range (`40100-40199`) where the driver side listens for the "
           "executors' agents, for firewalled clusters; `0`: any free port"),
    Option("readMode", "read_mode", "driver", choice("driver", "executors"),
           "where the share consumers run. `driver` (the default): the consumers run beside Spark's driver, a "
           "batch's records are acquired as Spark plans it and travel to the read tasks inside their task "
           "payloads: executors run nothing of spark-share's but Arrow decoding, so it runs wherever Spark "
           "does (serverless, standard access mode, Kubernetes, dynamic allocation). `executors`: an agent "
           "process of spark-share on each executor host acquires the records its read tasks return, so "
           "reading scales past one driver's network and CPU (needs executors that may start a process that "
           "outlives a task, open a Unix socket and reach `trackerPort` on the driver). See "
           "docs/performance.md"),
    Option("agentCacheBytes", "agent_cache_bytes", None, integer(0, 2**40),
           "`readMode=executors` only: how many bytes of acquired, not yet acknowledged batches an executor's "
           "agent keeps in memory (re-reads and retries get them from there). Past it, a batch waits in a file "
           "in the executor's Spark local dir, memory-mapped (the operating system may drop its pages). "
           "Default: 256 MiB"),
    Option("exchangeLocation", "exchange_location", None, plain_text,
           "a directory that both the source's process on the driver and your foreachBatch code see as files "
           "(a Unity Catalog volume such as `/Volumes/main/ops/spark_share`, a mounted file system). Give it "
           "where the platform runs your code in a sandbox apart from Spark's own processes: `reject()` and "
           "`release()` then reach the source through it: the batch's DataFrame names it (Spark >= 4.2); on "
           "Spark 4.0 and 4.1, or for rows collected to a list, pass it to them too (`exchange_location=`). Not "
           "needed elsewhere (they use the driver host's runtime directory)"),
)
_BY_NAME = {o.name.lower(): o for o in OPTIONS}

# The key of the batch DataFrame's offset-column metadata that names the source's exchangeLocation.
EXCHANGE_METADATA = "spark_share.exchangeLocation"

# kafka.* options we check before passing them on.
CHECKED_KAFKA = {"max.poll.records": integer(1, 1_000_000)}

# Spark Kafka source options that mean nothing for a share group, with what to do instead.
NOT_FOR_SHARE_GROUPS = {
    "subscribePattern": "share groups subscribe to explicit topic names; list them in 'subscribe'",
    "assign": "share groups do not assign partitions to consumers; use 'subscribe' and let the broker share partitions",
    "startingOffsets": "where a new share group starts is the group config share.auto.offset.reset, set on the broker "
                       "(kafka-configs.sh --alter --entity-type groups --entity-name <group> --add-config share.auto.offset.reset=earliest)",
    "endingOffsets": "a share group has no ending offsets; start the query with spark_share.drain(writer) (Trigger.AvailableNow) to drain the queue and stop",
    "startingTimestamp": "share groups start at share.auto.offset.reset (a broker-side group config)",
    "startingOffsetsByTimestamp": "share groups start at share.auto.offset.reset (a broker-side group config)",
    "maxOffsetsPerTrigger": "use 'maxRecordsPerTrigger' (share groups have no offset ranges)",
    "minOffsetsPerTrigger": "not supported; the source runs a batch as soon as records are available",
    "failOnDataLoss": "not applicable: the broker tracks every record's state in a share group",
    "kafkaConsumer.pollTimeoutMs": "use 'pollTimeoutMs'",
    "minPartitions": "use 'numPartitions'",
    "groupIdPrefix": "set the share group explicitly with 'kafka.group.id'",
}
_NOT_FOR_SHARE_GROUPS = {k.lower(): k for k in NOT_FOR_SHARE_GROUPS}

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
    # librdkafka refuses these for a share consumer ("is not applicable for share consumer"): said here, at start.
    "queued.min.messages": "a share consumer has no prefetch queue to size (librdkafka refuses it)",
    "queued.max.messages.kbytes": "a share consumer has no prefetch queue to size (librdkafka refuses it); "
                                  "bound a poll with kafka.max.poll.records or kafka.fetch.max.bytes",
    "fetch.queue.backoff.ms": "a share consumer has no prefetch queue (librdkafka refuses it)",
    "fetch.error.backoff.ms": "not applicable to a share consumer (librdkafka refuses it)",
    "group.remote.assignor": "the broker assigns partitions of a share group",
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


@dataclass(frozen=True)
class ShareSourceOptions:
    """The parsed options; ``OPTIONS`` declares how each field is set (``parse_options``)."""
    bootstrap_servers: str
    group_id: str
    topics: tuple[str, ...]
    include_headers: bool
    num_partitions: int | None
    max_records_per_trigger: int | None
    poll_timeout_ms: int
    ack_timeout_ms: int
    idle_probe_ms: int
    dead_letter_topic: str | None
    dead_letter_path: str | None
    max_delivery_count: int | None
    max_record_locks: int | None  # the broker's in-flight cap per partition, if the user gave it
    tracker_ports: tuple[int, int]  # first and last port the tracker may listen on; (0, 0): any
    read_mode: str  # "executors" (an agent per executor) or "driver" (the consumers beside the tracker)
    agent_cache_bytes: int | None  # an agent's cached batches in memory (consumers.spill), if the user gave it
    exchange_location: str | None  # a directory the user's code and the source both see (transport.mailbox)
    # kafka.* options other than bootstrap servers and group id, prefix removed.
    kafka: dict[str, str]

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
    given: dict[str, str] = {}  # declared name -> text
    kafka: dict[str, str] = {}
    for key, value in options.items():
        low, raw = key.lower(), "" if value is None else str(value)
        if low == "path":
            raise OptionError("kafka-share takes no path; use option('subscribe', 'topic1,topic2')")
        if low in _BY_NAME:
            given[_BY_NAME[low].name] = raw
        elif low.startswith("kafka."):
            config = low[len("kafka."):]
            if config in REJECTED_KAFKA:
                raise OptionError(f"option '{key}' is not accepted by a share consumer: {REJECTED_KAFKA[config]}")
            if config in CHECKED_KAFKA:
                CHECKED_KAFKA[config].parse(f"kafka.{config}", raw)
            kafka[config] = raw
        elif low in _NOT_FOR_SHARE_GROUPS:
            name = _NOT_FOR_SHARE_GROUPS[low]  # Spark hands options over lower-cased; name them as documented
            raise OptionError(f"option '{name}' is not supported by kafka-share: {NOT_FOR_SHARE_GROUPS[name]}")
        else:
            known = sorted(o.name for o in OPTIONS if not o.name.startswith("kafka."))
            raise OptionError(f"unknown option '{key}' for kafka-share; known options: {', '.join(known)} "
                              "and kafka.* (passed to the share consumer)")

    values: dict[str, Any] = {}
    for option in OPTIONS:
        written = given.get(option.name, option.default)
        values[option.field] = None if written is None else option.parser.parse(option.name, written)
        if values[option.field] is None and option.required:
            raise OptionError(f"option '{option.name}' is required: {option.doc}, "
                              f"e.g. .option('{option.name}', '{option.example}')")
    opts = ShareSourceOptions(**values, kafka=kafka)
    _check_together(opts)
    return opts


def _check_together(opts: ShareSourceOptions) -> None:
    """The checks that involve more than one option."""
    if opts.dead_letter_topic and opts.dead_letter_path:
        raise OptionError("options 'deadLetterTopic' and 'deadLetterPath' conflict: choose one dead-letter target")
    if opts.dead_letter_topic in opts.topics:
        raise OptionError(f"option 'deadLetterTopic' = {opts.dead_letter_topic!r} is also subscribed: "
                          "rejected records would come back")
    if opts.agent_cache_bytes is not None and opts.read_mode != "executors":
        raise OptionError("option 'agentCacheBytes' bounds the memory of the agents of readMode=executors; "
                          "with readMode=driver no agent runs on the executors: remove it, or set readMode to executors")
    if opts.exchange_location is not None and not opts.exchange_location.startswith("/"):
        raise OptionError(f"option 'exchangeLocation' = {opts.exchange_location!r} must be an absolute directory path "
                          "that both the driver's processes and your code open as files (e.g. /Volumes/main/ops/"
                          "spark_share, or /dbfs/... rather than dbfs:/...), not a URI or a relative path")
    if opts.max_delivery_count is not None and not opts.dead_letter:
        raise OptionError("option 'maxDeliveryCount' needs a dead-letter target ('deadLetterTopic' or 'deadLetterPath') "
                          "so the records it rejects can be found")
