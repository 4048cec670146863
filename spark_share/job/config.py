"""The job's config: a JSON file checked field by field, with credentials resolved at run time.

Owns: :class:`JobConfig`, :func:`load_config` / :func:`parse_config` (every error is a
``ConfigError`` naming its field; ``schema`` may be ``@file`` beside the config), ``${env:NAME}``
resolution when the config is read, and :func:`resolve_secrets`, which reads ``${secret:scope/key}``
from a Databricks secret scope once a Spark session exists. ``EMBEDDED`` is the
``source.bootstrap_servers`` value that asks for the embedded broker (conf/local.json).

Must never: hold credentials in a config file (an option that names a credential must be a
``${env:..}``/``${secret:..}`` reference, not the value), print a credential or put one in an error
message or a ``repr``, or start Spark or Kafka to check a config.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import sys
from dataclasses import dataclass, field

from ..errors import ConfigError
from ..options import is_secret, scrub

EMBEDDED = "embedded"  # source.bootstrap_servers: start the embedded broker and produce synthetic orders


@dataclass
class JobConfig:
    bootstrap_servers: str
    group_id: str
    topics: list[str]
    schema: str
    output_path: str
    dead_letter_path: str
    checkpoint_path: str
    required: list[str] = field(default_factory=list)
    release_if: str | None = None
    partition_by: str = "event_date"
    trigger: str = "availableNow"
    source_options: dict[str, str] = field(default_factory=dict, repr=False)  # may hold credentials
    spark_master: str | None = None


_REF = re.compile(r"\$\{(env|secret):([^}]*)\}")
_SECRET_REF = re.compile(r"\$\{secret:([^}]*)\}")


def _dbutils_available() -> bool:
    if "pyspark.dbutils" in sys.modules:
        return True
    try:
        return importlib.util.find_spec("pyspark.dbutils") is not None
    except (ImportError, ValueError):
        return False


def _resolve_env(value: str, where: str) -> str:
    """Replace ``${env:NAME}`` by the environment variable; check ``${secret:scope/key}`` references
    (resolved later, by :func:`resolve_secrets`, once a Spark session exists)."""
    def sub(m):
        kind, ref = m.group(1), m.group(2)
        if kind == "env":
            if not ref:
                raise ConfigError(f"config field '{where}': ${{env:}} needs a variable name")
            if ref not in os.environ:
                raise ConfigError(f"config field '{where}': environment variable {ref} is not set")
            return os.environ[ref]
        scope, _, key = ref.partition("/")
        if not scope or not key:
            raise ConfigError(f"config field '{where}': write a secret as ${{secret:scope/key}}, "
                              f"got ${{secret:{ref}}}")
        if not _dbutils_available():
            raise ConfigError(f"config field '{where}': ${{secret:{ref}}} needs Databricks secret scopes; "
                              "use ${env:NAME} elsewhere")
        return m.group(0)
    return _REF.sub(sub, value)


def resolve_secrets(cfg: JobConfig, spark=None) -> JobConfig:
    """``cfg`` with every ``${secret:scope/key}`` read from the Databricks secret scope. Needs a Spark
    session (the active one, or one is created); any failure is a ConfigError naming the field and
    never holding a secret value."""
    fields = [("source.bootstrap_servers", cfg.bootstrap_servers), ("source.group_id", cfg.group_id)]
    fields += [(f"source.options.{k}", v) for k, v in cfg.source_options.items()]
    if not any(_SECRET_REF.search(v) for _, v in fields):
        return cfg
    found: list[str] = []
    dbutils = None

    def sub(m, where):
        nonlocal dbutils
        ref = m.group(1)
        scope, _, key = ref.partition("/")
        try:
            if dbutils is None:
                from pyspark.dbutils import DBUtils  # Databricks only
                from pyspark.sql import SparkSession

                session = spark or SparkSession.getActiveSession() or SparkSession.builder.getOrCreate()
                dbutils = DBUtils(session)
            value = dbutils.secrets.get(scope=scope, key=key)
        except ImportError:
            raise ConfigError(f"config field '{where}': ${{secret:{ref}}} needs Databricks secret scopes; "
                              "use ${env:NAME} elsewhere") from None
        except Exception as e:
            detail = scrub(str(e).strip().splitlines()[0][:200] if str(e).strip() else "", found)
            raise ConfigError(f"config field '{where}': cannot read ${{secret:{ref}}} from the Databricks "
                              f"secret scope ({type(e).__name__}{': ' + detail if detail else ''})") from None
        if not isinstance(value, str):
            raise ConfigError(f"config field '{where}': ${{secret:{ref}}} did not return a string")
        found.append(value)
        return value

    def res(value: str, where: str) -> str:
        return _SECRET_REF.sub(lambda m: sub(m, where), value)

    return dataclasses.replace(
        cfg,
        bootstrap_servers=res(cfg.bootstrap_servers, "source.bootstrap_servers"),
        group_id=res(cfg.group_id, "source.group_id"),
        source_options={k: res(v, f"source.options.{k}") for k, v in cfg.source_options.items()},
    )


def _need(d: dict, key: str, kind, where: str):
    if key not in d:
        raise ConfigError(f"config field '{where}{key}' is missing")
    v = d[key]
    if not isinstance(v, kind):
        want = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise ConfigError(f"config field '{where}{key}' must be a {want}, got {type(v).__name__}")
    return v


def _optional_str(raw: dict, key: str, default: str | None, allow_none: bool = True) -> str | None:
    v = raw.get(key, default)
    if v is None and allow_none:
        return None
    if not isinstance(v, str) or not v.strip():
        raise ConfigError(f"config field '{key}' must be a non-empty string, got {type(v).__name__} {v!r}")
    return v


_JAAS_LITERAL = re.compile(r"(password|secret|token|credential)\w*\s*=\s*(\"[^\"]+\"|'[^']+'|[^\s\"';]+)",
                           re.I)


def _check_credential(key: str, value: str) -> None:
    """A credential option must come from ``${env:..}``/``${secret:..}``, not be written in the file."""
    if not is_secret(key):
        return
    rest = _REF.sub("", value)
    literal = bool(_JAAS_LITERAL.search(rest)) if "jaas" in key.lower() else bool(rest.strip())
    if literal:
        raise ConfigError(f"config field 'source.options.{key}' holds a credential: use ${{env:NAME}} or "
                          "${secret:scope/key} instead of the value")


def _option_text(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)  # Spark options say true/false


def load_config(path: str) -> JobConfig:
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"config file {path} is not valid JSON: {e}") from None
    return parse_config(raw, base=os.path.dirname(os.path.abspath(path)))


def parse_config(raw: dict, base: str = ".") -> JobConfig:
    """Check a config (every error names its field) and resolve ``${env:NAME}``. ``${secret:..}``
    references are checked here and read by :func:`resolve_secrets` (``run`` calls it)."""
    if not isinstance(raw, dict):
        raise ConfigError("the config must be a JSON object")
    src = _need(raw, "source", dict, "")
    out = _need(raw, "output", dict, "")
    topics = _need(src, "topics", list, "source.")
    if not topics or not all(isinstance(t, str) and t for t in topics):
        raise ConfigError("config field 'source.topics' must be a non-empty list of topic names")
    schema = _need(raw, "schema", str, "")
    if schema.startswith("@"):  # @file: a DDL schema in a file beside the config
        p = os.path.join(base, schema[1:])
        try:
            with open(p) as f:
                schema = f.read().strip()
        except OSError as e:
            raise ConfigError(f"config field 'schema': cannot read {p}: {e.strerror}") from None
    opts = _need(src, "options", dict, "source.") if "options" in src else {}
    for k, v in opts.items():
        if not isinstance(v, (str, int, float, bool)):
            raise ConfigError(f"config field 'source.options.{k}' must be a string or number")
        _check_credential(k, _option_text(v))
    trigger = raw.get("trigger", "availableNow")
    if not isinstance(trigger, str) or not (trigger == "availableNow"
                                            or trigger.startswith("processingTime:")):
        raise ConfigError("config field 'trigger' must be 'availableNow' or 'processingTime:<interval>', "
                          f"got {trigger!r}")
    required = raw.get("required", [])
    if not isinstance(required, list) or not all(isinstance(c, str) and c for c in required):
        raise ConfigError("config field 'required' must be a list of column names")
    return JobConfig(
        bootstrap_servers=_resolve_env(_need(src, "bootstrap_servers", str, "source."),
                                       "source.bootstrap_servers"),
        group_id=_resolve_env(_need(src, "group_id", str, "source."), "source.group_id"),
        topics=topics,
        schema=schema,
        output_path=_need(out, "path", str, "output."),
        dead_letter_path=_need(out, "dead_letter_path", str, "output."),
        checkpoint_path=_need(out, "checkpoint_path", str, "output."),
        required=required,
        release_if=_optional_str(raw, "release_if", None),
        partition_by=_optional_str(raw, "partition_by", "event_date", allow_none=False) or "event_date",
        trigger=trigger,
        source_options={k: _resolve_env(_option_text(v), f"source.options.{k}") for k, v in opts.items()},
        spark_master=_optional_str(raw, "spark_master", None),
    )
