"""What each supported Spark has and lacks: the one module that looks at PySpark's version.

spark-share runs on PySpark 4.0, 4.1, 4.2 and 4.3 (EMR's emr-spark-8.0.0 and Databricks 17.3 LTS ship
4.0, Databricks 18 LTS 4.1, Databricks 19 4.2). Spark 4.2 gave Python streaming sources what 4.0 and
4.1 lack, measured with pyspark 4.0.5 and 4.1.4 (docs/architecture.md, "Spark versions"):

- **Admission control.** 4.2 calls ``latestOffset(start, limit)`` with the end of the last committed
  batch and a ``ReadLimit``; 4.0/4.1 call ``latestOffset()`` with neither. The reader then keeps the
  start itself (the end of the last batch Spark planned: a restart first calls
  ``partitions(end, end)`` with the last offset in the checkpoint), and applies
  ``maxRecordsPerTrigger`` itself.
- **reportLatestOffset.** On 4.0/4.1 the progress JSON shows the source's offset, not its counters:
  ``spark_share.status()`` and ``spark-share status`` have them, and the commit listener finds the
  query's tracker by the query id instead.
- **Schema metadata.** 4.0/4.1 fail a streaming query whose Python source's schema carries field
  metadata (``java.lang.AssertionError: assertion failed``, measured with pyspark 4.0.5 and 4.1.4; 4.2.1
  keeps it and shows it in foreachBatch): ``exchangeLocation`` does not travel that way there; the user's
  code names it to ``reject()``/``release()`` (``exchange_location=``).
- **SupportsTriggerAvailableNow.** 4.0/4.1 run ``Trigger.AvailableNow`` of a Python source as one
  batch, with Spark's ``triggerAvailableNowWrapper`` setting or without it, and end: a drain must
  start through :func:`spark_share.drain` there, which runs batches until the queue held at the start
  is drained and then stops the query.

Owns: the supported range and the error for a missing or older PySpark, the base classes and read
limits the reader uses on each version, and what a feature's absence means (``NATIVE_AVAILABLE_NOW``).
Must never: be imported by code that runs before PySpark is known to be there without going through
:func:`require` (a clear error, never a bare ``ModuleNotFoundError``).
"""
from __future__ import annotations

import re
from typing import Any

from .errors import UnsupportedSparkError

SUPPORTED = ">=4.0,<5"
MINIMUM = (4, 0)
ADMISSION_CONTROL_SINCE = (4, 2)  # latestOffset(start, limit), ReadLimit, reportLatestOffset, AvailableNow


def _parse(text: str) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def _installed() -> str | None:
    """PySpark's version string, from the module itself: Databricks and EMR put their PySpark on the
    path without a pip distribution, so package metadata may not know it."""
    try:
        import pyspark
    except ImportError:
        return None
    return str(getattr(pyspark, "__version__", "") or "")


def require() -> tuple[int, int]:
    """The (major, minor) of the PySpark this process imports; a clear error if it is missing or too old."""
    text = _installed()
    if text is None:
        raise UnsupportedSparkError(
            f"spark-share needs PySpark {SUPPORTED} (Apache Spark 4.0 or newer), and none is installed here. "
            "On Databricks or EMR use a runtime with Spark >= 4.0 (Databricks 17.3 LTS or newer, emr-spark-8.0.0 or "
            "newer); elsewhere: pip install 'spark-share[pyspark]' (or pip install 'pyspark>=4.0,<5')")
    version = _parse(text)
    if version is None or version < MINIMUM or version[0] >= 5:
        raise UnsupportedSparkError(
            f"spark-share needs PySpark {SUPPORTED} (Apache Spark 4.0 or newer for its Python streaming data "
            f"sources); this process has PySpark {text!r}. Use a runtime with Spark 4.0-4.x (Databricks 17.3 LTS "
            "or newer, emr-spark-8.0.0 or newer), or pip install 'pyspark>=4.0,<5'")
    return version


SPARK = require()
# Spark >= 4.2: latestOffset(start, limit) with read limits, reportLatestOffset, and
# Trigger.AvailableNow run to the end for a Python source.
ADMISSION_CONTROL = SPARK >= ADMISSION_CONTROL_SINCE
NATIVE_AVAILABLE_NOW = ADMISSION_CONTROL
SCHEMA_METADATA = ADMISSION_CONTROL  # a Python source's field metadata kept through the query (4.2 on)
# Declarative pipelines (spark-pipelines) came with 4.1. 4.1 runs a Python source's flow as one batch per update
# and ends it with no signal spark-share sees: that batch is acknowledged by the next update (docs/deploy.md).
PIPELINES = SPARK >= (4, 1)
VERSION_TEXT = _installed() or ""

if ADMISSION_CONTROL:
    from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows, SupportsTriggerAvailableNow
else:
    class SupportsTriggerAvailableNow:  # type: ignore[no-redef]
        """Spark < 4.2 has no such mixin: it never calls prepareForTriggerAvailableNow."""

    class ReadAllAvailable:  # type: ignore[no-redef]
        """Spark < 4.2 passes no read limit; the reader stands for 'everything' with this."""

    class ReadMaxRows:  # type: ignore[no-redef]
        """Spark < 4.2 passes no read limit; the reader stands for maxRecordsPerTrigger with this."""

        def __init__(self, max_rows: int):
            self.max_rows = max_rows


def max_rows(limit: Any) -> int | None:
    """The row cap of a read limit Spark passed (or the reader stood in with), None for no cap."""
    return limit.max_rows if isinstance(limit, ReadMaxRows) else None


def available_now_refusal(trigger_class: str) -> str | None:
    """The error for a query started with Trigger.AvailableNow on a Spark that runs it as one batch for a
    Python source (None where Spark runs it to the end, or for any other trigger)."""
    if NATIVE_AVAILABLE_NOW or "AvailableNow" not in trigger_class:
        return None
    return (f"Trigger.AvailableNow on Spark {VERSION_TEXT} runs a Python data source for one batch only (Spark "
            "4.2 added the rest; spark.sql.streaming.triggerAvailableNowWrapper.enabled does not change that), so "
            "this run would end after one batch with records still queued. Start the query with "
            "spark_share.drain(writer) instead: on every supported Spark it drains what the queue holds at the "
            "start and stops. What this run acquired is released")


def in_pipeline_definitions() -> bool:
    """Whether this code runs inside a declarative pipeline's definitions file (``spark-pipelines run``
    executes each file with a graph element registry set in a context variable, Spark >= 4.1)."""
    try:
        from pyspark.pipelines import graph_element_registry
    except Exception:  # noqa: BLE001 - no pipelines in this PySpark
        return False
    active = getattr(graph_element_registry, "_graph_element_registry_context_var", None)
    return active is not None and active.get() is not None
