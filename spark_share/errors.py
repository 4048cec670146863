"""Every exception spark-share raises on purpose, under one base class.

Owns: the error hierarchy and the wire names of errors (so an error raised in another process is
raised again here as the same class). Must never: import anything of spark_share, Spark or Kafka.

Each class keeps a builtin second parent (``ValueError`` for bad input, ``RuntimeError`` for failures,
``ConnectionError`` for a peer, ``PermissionError`` for a file) so ``except ValueError`` and the like
keep working.
"""
from __future__ import annotations


class SparkShareError(Exception):
    """Base class of every error spark-share raises on purpose."""


class OptionError(SparkShareError, ValueError):
    """A bad option of the kafka-share source; the message names it and says what to do."""


class ConfigError(SparkShareError, ValueError):
    """A bad job config; the message names the field."""


class ArgumentError(SparkShareError, ValueError):
    """A bad argument to a function or command of spark-share (the embedded broker's); the message
    names it."""


class SourceError(SparkShareError, RuntimeError):
    """The source cannot go on: a problem with its setup that the user must fix (topic, broker,
    options, checkpoint), or it is stopping."""


class UnsupportedSparkError(SparkShareError, ImportError):
    """PySpark is missing or older than spark-share supports, or a feature needs a newer Spark."""


class BatchRefused(SparkShareError, RuntimeError):
    """A read of a batch that cannot be served with its original rows, so it acquires nothing."""


class VerdictError(SparkShareError, RuntimeError):
    """reject()/release() could not be applied; nothing of the batch is acknowledged wrongly."""


class VerdictClash(SparkShareError, ValueError):
    """Verdicts that give one row two kinds (a row cannot be both rejected and released): ``count`` rows,
    ``rows`` a few of them. The tracker turns it into a ``VerdictError`` for the user."""

    def __init__(self, rows: list[tuple[str, int, int]], count: int):
        super().__init__(f"{count} rows given two kinds")
        self.rows, self.count = rows, count


class DeadLetterError(SparkShareError, RuntimeError):
    """Rejected records could not be written to the dead-letter target; they are not REJECTed."""


class AgentError(SparkShareError, RuntimeError):
    """This host's spark-share agent did not start, or its share session could not take a read."""


class JobError(SparkShareError, RuntimeError):
    """The scheduled job could not account for every row of a batch, or could not produce its
    synthetic workload."""


class MemberRefused(AgentError):
    """The share group refused a new consumer of the query: it has reached ``group.share.max.size``."""


class EmbeddedKafkaError(SparkShareError, RuntimeError):
    """The embedded (mock) broker could not be started or driven."""


class RuntimeDirError(SparkShareError, PermissionError):
    """The runtime directory (sockets, locks, the query registry) is not private to this user."""


class AuthError(SparkShareError, ConnectionError):
    """The peer did not prove knowledge of the per-query secret."""


class PeerConnectionError(SparkShareError, ConnectionError):
    """A process of ours could not reach another (an agent the driver's tracker), or the connection
    to it ended before the reply."""


class ProtocolError(SparkShareError, ValueError):
    """A message of our protocol that cannot be handled: a malformed frame, an unknown request, a
    request before its hello, a receiver with no handler for a message routed to it (another
    version of spark-share, or a bug)."""


class RemoteError(SparkShareError, RuntimeError):
    """The peer handled our request and answered with an error of a kind not listed here."""


# An error crosses a socket as (name, message) and is raised again here as the same class, so a
# caller's ``except BatchRefused`` works whichever process raised it. Only these names are trusted.
# Not listed: errors whose builtin parent a caller takes as news about its own connection
# (``ConnectionError``, ``OSError``), and errors that never leave their process.
WIRE_ERRORS: dict[str, type[SparkShareError]] = {
    cls.__name__: cls
    for cls in (OptionError, ConfigError, SourceError, BatchRefused, VerdictError, DeadLetterError, AgentError,
                ProtocolError)
}


def wire_name(error: BaseException) -> str | None:
    """The name ``error`` crosses a socket under, or None if it crosses as a ``RemoteError``."""
    name = type(error).__name__
    return name if WIRE_ERRORS.get(name) is type(error) else None


def from_wire(name: str, message: str) -> SparkShareError:
    """The local exception for an error a peer reported; unknown names become ``RemoteError``."""
    return WIRE_ERRORS.get(name, RemoteError)(message)
