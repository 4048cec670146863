"""Every exception spark-share raises on purpose, under one base class.

Owns: the error hierarchy and the wire names of errors (so an error raised in another process is
raised again here as the same class). Must never: import anything of spark_share, Spark or Kafka.

Each class keeps a builtin second parent (``ValueError`` for bad input, ``RuntimeError`` for failures,
``ConnectionError`` for a failed handshake) so ``except ValueError`` and the like keep working.
"""
from __future__ import annotations


class SparkShareError(Exception):
    """Base class of every error spark-share raises on purpose."""


class OptionError(SparkShareError, ValueError):
    """A bad option of the kafka-share source; the message names it and says what to do."""


class ConfigError(SparkShareError, ValueError):
    """A bad job config; the message names the field."""


class SourceError(SparkShareError, RuntimeError):
    """A problem with the source's setup that the user must fix (topic, broker, options)."""


class BatchRefused(SparkShareError, RuntimeError):
    """A read of a batch that cannot be served with its original rows, so it acquires nothing."""


class VerdictError(SparkShareError, RuntimeError):
    """reject()/release() could not be applied; nothing of the batch is acknowledged wrongly."""


class DeadLetterError(SparkShareError, RuntimeError):
    """Rejected records could not be written to the dead-letter target; they are not REJECTed."""


class EmbeddedKafkaError(SparkShareError, RuntimeError):
    """The embedded (mock) broker could not be started or driven."""


class AuthError(SparkShareError, ConnectionError):
    """The peer did not prove knowledge of the per-query secret."""


class RemoteError(SparkShareError, RuntimeError):
    """The peer handled our request and answered with an error of a kind not listed here."""


# An error crosses a socket as (name, message) and is raised again here as the same class, so a
# caller's ``except BatchRefused`` works whichever process raised it. Only these names are trusted.
WIRE_ERRORS: dict[str, type[SparkShareError]] = {
    cls.__name__: cls
    for cls in (OptionError, ConfigError, SourceError, BatchRefused, VerdictError, DeadLetterError)
}


def from_wire(name: str, message: str) -> SparkShareError:
    """The local exception for an error a peer reported; unknown names become ``RemoteError``."""
    return WIRE_ERRORS.get(name, RemoteError)(message)
