import pytest

from spark_share.options import OptionError, parse_options, redact, scrub

BASE = {"kafka.bootstrap.servers": "b:9092", "kafka.group.id": "g", "subscribe": "orders"}


def opts(**kw):
    d = dict(BASE)
    for k, v in kw.items():
        k = k.replace("__", ".")
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    return d


def test_minimal_options_and_defaults():
    o = parse_options(BASE)
    assert (o.bootstrap_servers, o.group_id, o.topics) == ("b:9092", "g", ("orders",))
    assert o.include_headers is False and o.num_partitions is None and o.max_records_per_trigger is None
    conf = o.consumer_config()
    assert conf["share.acknowledgement.mode"] == "explicit" and conf["group.id"] == "g"


def test_option_names_are_case_insensitive_and_kafka_options_pass_through():
    o = parse_options(dict(BASE, includeheaders="TRUE", NUMPARTITIONS="3", **{"kafka.security.protocol": "SASL_SSL",
                                                                            "kafka.sasl.password": "hunter22"}))
    assert o.include_headers and o.num_partitions == 3
    conf = o.consumer_config()
    assert conf["security.protocol"] == "SASL_SSL" and conf["sasl.password"] == "hunter22"
    assert "hunter22" not in repr(o) and "hunter22" not in str(o)


@pytest.mark.parametrize("missing,needle", [("kafka.bootstrap.servers", "kafka.bootstrap.servers"),
                                            ("kafka.group.id", "kafka.group.id"),
                                            ("subscribe", "subscribe")])
def test_required_options(missing, needle):
    d = dict(BASE)
    del d[missing]
    with pytest.raises(OptionError, match=needle):
        parse_options(d)


@pytest.mark.parametrize("key", ["subscribePattern", "assign", "startingOffsets", "maxOffsetsPerTrigger",
                                 "failOnDataLoss", "endingOffsets"])
def test_spark_kafka_options_that_do_not_apply_say_why(key):
    with pytest.raises(OptionError, match=key) as e:
        parse_options(dict(BASE, **{key: "x"}))
    assert "share" in str(e.value) or "use" in str(e.value)


@pytest.mark.parametrize("key", ["session.timeout.ms", "auto.offset.reset", "enable.auto.commit", "group.protocol",
                                 "group.instance.id", "isolation.level", "share.acknowledgement.mode",
                                 "group.share.record.lock.duration.ms", "share.auto.offset.reset"])
def test_consumer_configs_a_share_consumer_rejects(key):
    with pytest.raises(OptionError, match="kafka." + key.replace(".", r"\.")):
        parse_options(dict(BASE, **{"kafka." + key: "1"}))


LIBRDKAFKA_REFUSES = {"queued.min.messages": "10", "queued.max.messages.kbytes": "4096", "fetch.queue.backoff.ms": "10",
                      "fetch.error.backoff.ms": "10", "group.remote.assignor": "uniform", "enable.partition.eof": "true",
                      "isolation.level": "read_committed"}  # each with a value a classic consumer takes


@pytest.mark.parametrize("key,value", LIBRDKAFKA_REFUSES.items())
def test_what_librdkafka_refuses_a_share_consumer_is_refused_at_start_naming_it(key, value):
    """The share consumer of the confluent-kafka we ship with refuses these (only once an agent or the source
    runner creates one, deep in the query's start): the options refuse them first, saying why."""
    from confluent_kafka import ShareConsumer

    with pytest.raises(Exception, match="not applicable for share consumer"):
        ShareConsumer({"bootstrap.servers": "127.0.0.1:1", "group.id": "g", key: value}).close()
    with pytest.raises(OptionError, match=r"option 'kafka\." + key.replace(".", r"\.") + "' is not accepted by a share consumer"):
        parse_options(dict(BASE, **{"kafka." + key: value}))


def test_unknown_option_is_named():
    with pytest.raises(OptionError, match="'subscibe'"):
        parse_options(dict(BASE, subscibe="x"))


@pytest.mark.parametrize("value,needle", [("", "empty"), (" , ", "empty"), ("a,,b", "empty topic"),
                                          ("a,b,a", "more than once"), ("bad topic!", "invalid")])
def test_bad_topic_lists(value, needle):
    with pytest.raises(OptionError, match=needle):
        parse_options(dict(BASE, subscribe=value))


@pytest.mark.parametrize("key,value,needle", [("numPartitions", "two", "integer"), ("numPartitions", "0", "between"),
                                              ("maxRecordsPerTrigger", "-5", "between"),
                                              ("pollTimeoutMs", "1.5", "integer"),
                                              ("includeHeaders", "maybe", "true or false"),
                                              ("kafka.max.poll.records", "0", "between")])
def test_bad_numbers_and_booleans(key, value, needle):
    with pytest.raises(OptionError, match=needle) as e:
        parse_options(dict(BASE, **{key: value}))
    assert key in str(e.value)


def test_the_poll_size_is_the_trackers_unless_the_user_gave_a_smaller_one():
    from spark_share.options import DEFAULT_MAX_POLL_RECORDS, sized

    o = parse_options(BASE)
    assert "max.poll.records" not in o.consumer_config()
    assert sized(o.consumer_config(), 16_000)["max.poll.records"] == "16000"
    assert sized(o.consumer_config(), None)["max.poll.records"] == str(DEFAULT_MAX_POLL_RECORDS)
    capped = parse_options(dict(BASE, **{"kafka.max.poll.records": "500"}))
    assert sized(capped.consumer_config(), 16_000)["max.poll.records"] == "500"
    assert sized(capped.consumer_config(), 50)["max.poll.records"] == "50"


def test_max_record_locks_is_a_positive_count():
    assert parse_options(dict(BASE, maxRecordLocks="10000")).max_record_locks == 10_000
    assert parse_options(BASE).max_record_locks is None
    with pytest.raises(OptionError, match="maxRecordLocks"):
        parse_options(dict(BASE, maxRecordLocks="0"))


def test_redact_and_scrub():
    conf = {"sasl.password": "pw", "ssl.key.password": "kp", "sasl.oauthbearer.client.secret": "s",
            "bootstrap.servers": "b"}
    r = redact(conf)
    assert r["bootstrap.servers"] == "b" and {r["sasl.password"], r["ssl.key.password"],
                                              r["sasl.oauthbearer.client.secret"]} == {"***"}
    assert scrub("login failed for hunter22 at b", ["hunter22"]) == "login failed for *** at b"


def test_each_option_is_declared_once_and_sets_its_own_field():
    from dataclasses import fields

    from spark_share.options import OPTIONS, ShareSourceOptions

    names = [o.name.lower() for o in OPTIONS]
    assert len(names) == len(set(names))
    assert sorted(o.field for o in OPTIONS) == sorted(f.name for f in fields(ShareSourceOptions) if f.name != "kafka")
    for o in OPTIONS:  # a default is parsed like a given value, so it is within the option's own bounds
        assert o.required == (o.example is not None) and not (o.required and o.default is not None), o.name
        if o.default is not None:
            assert getattr(parse_options(BASE), o.field) == o.parser.parse(o.name, o.default), o.name


def test_an_option_not_given_takes_its_declared_default_or_none():
    o = parse_options(BASE)
    assert (o.poll_timeout_ms, o.ack_timeout_ms, o.idle_probe_ms, o.tracker_ports) == (1000, 30000, 10000, (0, 0))
    assert o.dead_letter_topic is None and o.dead_letter_path is None and o.max_delivery_count is None
    assert o.kafka == {}


@pytest.mark.parametrize("key,good,bad", [("pollTimeoutMs", "600000", "600001"), ("ackTimeoutMs", "100", "99"),
                                          ("idleProbeIntervalMs", "86400000", "86400001"),
                                          ("numPartitions", "10000", "10001"), ("maxDeliveryCount", "1000", "1001")])
def test_bounds_are_inclusive_and_named_in_the_error(key, good, bad):
    dead_letter = {"deadLetterPath": "/tmp/dl"} if key == "maxDeliveryCount" else {}
    parse_options(dict(BASE, **dead_letter, **{key: good}))
    with pytest.raises(OptionError, match=f"option '{key}' must be between .* got {bad}"):
        parse_options(dict(BASE, **dead_letter, **{key: bad}))


def test_a_required_option_says_what_it_is_and_gives_an_example():
    with pytest.raises(OptionError, match=r"option 'kafka.group.id' is required: the share group, "
                                          r"e.g. .option\('kafka.group.id', 'orders'\)"):
        parse_options(opts(kafka__group__id=None))
    with pytest.raises(OptionError, match="option 'kafka.bootstrap.servers' is required"):
        parse_options(opts(kafka__bootstrap__servers="  "))


def test_options_that_only_make_sense_together():
    with pytest.raises(OptionError, match="'deadLetterTopic' and 'deadLetterPath' conflict"):
        parse_options(dict(BASE, deadLetterTopic="dlq", deadLetterPath="/tmp/dl"))
    with pytest.raises(OptionError, match="option 'deadLetterTopic' = 'orders' is also subscribed"):
        parse_options(dict(BASE, deadLetterTopic="orders"))
    with pytest.raises(OptionError, match="option 'maxDeliveryCount' needs a dead-letter target"):
        parse_options(dict(BASE, maxDeliveryCount="3"))
    o = parse_options(dict(BASE, deadLetterTopic=" dlq ", maxDeliveryCount="3"))
    assert (o.dead_letter_topic, o.max_delivery_count, o.dead_letter) == ("dlq", 3, True)


def test_a_path_is_refused():
    with pytest.raises(OptionError, match="takes no path"):
        parse_options(dict(BASE, path="/data"))


def test_network_encryption_is_no_option_any_more():
    # The channel between our processes is always TLS: nothing to choose.
    with pytest.raises(OptionError, match="unknown option 'networkEncryption'"):
        parse_options(dict(BASE, networkEncryption="true"))
    assert not hasattr(parse_options(BASE), "encrypt_network")


def test_read_mode_is_driver_unless_executors_is_asked_for():
    assert parse_options(BASE).read_mode == "driver"  # runs wherever Spark does: nothing of ours on executors
    assert parse_options(dict(BASE, readmode="Executors")).read_mode == "executors"
    with pytest.raises(OptionError, match=r"option 'readMode' must be one of driver, executors, got 'driver-side'"):
        parse_options(dict(BASE, readMode="driver-side"))


def test_an_agents_memory_budget_is_for_executors_mode_only():
    assert parse_options(dict(BASE, readMode="executors")).agent_cache_bytes is None  # the agent's default
    assert parse_options(dict(BASE, readMode="executors", agentCacheBytes="0")).agent_cache_bytes == 0
    with pytest.raises(OptionError, match=r"'agentCacheBytes' bounds the memory of the agents of readMode=executors.*"
                                          r"remove it, or set readMode to executors"):
        parse_options(dict(BASE, agentCacheBytes="1000000"))  # readMode=driver: no agent on the executors
    with pytest.raises(OptionError, match=r"option 'agentCacheBytes' must be between 0 and"):
        parse_options(dict(BASE, readMode="executors", agentCacheBytes="-1"))


def test_an_exchange_location_is_an_absolute_directory_path():
    assert parse_options(BASE).exchange_location is None  # the driver host's runtime directory serves
    assert parse_options(dict(BASE, exchangeLocation="/Volumes/main/ops/q")).exchange_location == "/Volumes/main/ops/q"
    for bad in ("dbfs:/ops/q", "s3://bucket/q", "relative/dir"):
        with pytest.raises(OptionError, match=r"option 'exchangeLocation' = .*must be an absolute directory path"):
            parse_options(dict(BASE, exchangeLocation=bad))
