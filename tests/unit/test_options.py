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


@pytest.mark.parametrize("given, protocol, encrypted", [
    (None, None, False), (None, "SASL_SSL", True), (None, "ssl", True), (None, "SASL_PLAINTEXT", False),
    ("true", None, True), ("false", "SSL", False), ("AUTO", "SSL", True)])
def test_network_encryption_follows_kafkas_tls_unless_told(given, protocol, encrypted):
    opts = dict(BASE)
    if given is not None:
        opts["networkEncryption"] = given
    if protocol is not None:
        opts["kafka.security.protocol"] = protocol
    assert parse_options(opts).encrypt_network is encrypted


def test_network_encryption_takes_true_false_or_auto():
    with pytest.raises(OptionError, match="networkEncryption"):
        parse_options(dict(BASE, networkEncryption="yes"))
