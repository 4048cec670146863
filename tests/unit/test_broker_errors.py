"""A client's authentication and TLS failures become the user's message at once (spark_share.broker_errors)."""
from __future__ import annotations

from confluent_kafka import KafkaError

from spark_share.broker_errors import FailureWatch

CONF = {"bootstrap.servers": "b1:9093", "sasl.username": "alice", "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.password": "hunter2-secret"}


def test_the_first_authentication_failure_is_kept_naming_user_mechanism_and_address():
    watch = FailureWatch(CONF, lambda s: s.replace("hunter2-secret", "***"))
    watch(KafkaError(KafkaError._TRANSPORT, "Connection refused"))
    assert watch.failure is None, "a refused connection is not an authentication failure: the broker may come"
    watch(KafkaError(KafkaError._AUTHENTICATION, "invalid credentials (password hunter2-secret)"))
    watch(KafkaError(KafkaError._SSL, "certificate verify failed"))
    assert watch.failure.startswith("authentication to the Kafka cluster at kafka.bootstrap.servers='b1:9093' "
                                    "failed for user 'alice' with SCRAM-SHA-512: invalid credentials")
    assert "hunter2-secret" not in watch.failure and "kafka.sasl.password" in watch.failure


def test_a_tls_failure_says_which_option_to_set():
    watch = FailureWatch(CONF)
    watch(KafkaError(KafkaError._SSL, "certificate verify failed"))
    assert "TLS with the Kafka cluster at kafka.bootstrap.servers='b1:9093' failed" in watch.failure
    assert "kafka.ssl.ca.location" in watch.failure


def test_the_callback_never_raises():
    watch = FailureWatch(CONF)
    watch(object())  # not a KafkaError: ignored, as librdkafka must never see an exception
    assert watch.failure is None
