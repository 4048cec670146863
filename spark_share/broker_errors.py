"""What a Kafka client's connection errors mean to a user: a failed SASL authentication or TLS handshake,
told as that, promptly, instead of a timeout.

Owns: an ``error_cb`` for librdkafka clients that keeps the first authentication or TLS failure
(librdkafka reports them there ~0.3 s after connecting and then retries for ever, so a call on the
client only times out), and the message a user gets for one: which failure, for which user and
mechanism, at which bootstrap address, and what to check.

Must never: put a secret in a message (the broker's text is scrubbed with the query's secret values;
a SASL username is not a secret), or raise from the callback (it runs inside librdkafka's poll).
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

# librdkafka's codes (confluent_kafka.KafkaError): the local _AUTHENTICATION and _SSL, and the broker's
# SASL_AUTHENTICATION_FAILED.
ERR_AUTHENTICATION = -169
ERR_SSL = -181
ERR_SASL_AUTHENTICATION_FAILED = 58
FAILURES = (ERR_AUTHENTICATION, ERR_SSL, ERR_SASL_AUTHENTICATION_FAILED)


def describe(code: int, text: str, config: Mapping[str, str]) -> str:
    """The user's message for a connection failure with client ``config`` (librdkafka names)."""
    where = f"the Kafka cluster at kafka.bootstrap.servers={config.get('bootstrap.servers', '')!r}"
    if code == ERR_SSL:
        return (f"TLS with {where} failed: {text}. If the broker's certificate is not trusted, set "
                "kafka.ssl.ca.location to the CA that signed it (on the driver and every executor)")
    user = config.get("sasl.username")
    who = f"user {user!r}" if user else "the configured principal"
    mechanism = config.get("sasl.mechanism") or config.get("sasl.mechanisms") or "GSSAPI"
    return (f"authentication to {where} failed for {who} with {mechanism}: {text}. Check "
            "kafka.sasl.username, kafka.sasl.password and kafka.sasl.mechanism")


class FailureWatch:
    """An ``error_cb`` that keeps the first authentication or TLS failure a client reports; ``failure``
    is the user's message for it (None while there is none)."""

    def __init__(self, config: Mapping[str, str], scrub: Callable[[str], str] = lambda s: s):
        self._config = {k: v for k, v in config.items() if k in ("bootstrap.servers", "sasl.username",
                                                                   "sasl.mechanism", "sasl.mechanisms")}
        self._scrub = scrub
        self._lock = threading.Lock()
        self.failure: str | None = None

    def __call__(self, err) -> None:
        try:
            code = err.code()
            if code not in FAILURES or self.failure is not None:
                return
            text = self._scrub(err.str())
            with self._lock:
                if self.failure is None:
                    self.failure = describe(code, text, self._config)
        except Exception:  # a callback must not raise into librdkafka
            pass
