"""The scheduled job: drain a share group into a Parquet table, set bad records aside, stop.

``jobs/queue_to_table.py`` is the file people run; with no ``--config`` it runs on the embedded
broker with a synthetic workload, and so does a config whose ``source.bootstrap_servers`` is
``"embedded"`` (conf/local.json). The parts: ``config`` (the JSON config, credentials from the
environment or a Databricks secret scope), ``pipeline`` (one verdict per row, the query, the
summary), ``workload`` (the embedded broker's synthetic orders) and ``command`` (``main``).

Must never: hold credentials in a config file or print them, or accept a row before its batch has
committed (it only names verdicts; the source acknowledges).
"""
from __future__ import annotations

from ..errors import ConfigError
from .command import main
from .config import EMBEDDED, JobConfig, load_config, parse_config, resolve_secrets
from .pipeline import VERDICT, Summary, classify, output_columns, print_summary, run
from .workload import demo_config, prepare_embedded_paths, produce_waiting, synthetic_order, synthetic_orders

__all__ = ["main", "load_config", "parse_config", "ConfigError", "JobConfig", "EMBEDDED", "resolve_secrets",
           "run", "Summary", "classify", "output_columns", "VERDICT", "print_summary", "produce_waiting",
           "synthetic_order", "synthetic_orders", "demo_config", "prepare_embedded_paths"]
