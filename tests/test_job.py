"""The scheduled job (jobs/queue_to_table.py), its configs, and the quickstart notebook."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from spark_share import job
from spark_share.job import ConfigError, load_config, parse_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_job_end_to_end_on_the_embedded_broker(spark, kafka, tmp_path, capsys):
    kafka.create_topic("orders", 4)
    kinds = job.synthetic_orders(kafka.bootstrap_servers, "orders", 3000, 4)
    cfg = job.demo_config(kafka.bootstrap_servers, str(tmp_path))
    s = job.run(spark, cfg)
    job.print_summary(spark, cfg, s, produced=3000)
    out = spark.read.parquet(cfg.output_path)
    assert out.count() == kinds["ok"] + kinds["pending"]
    assert out.select("topic", "partition", "offset").distinct().count() == out.count()
    assert "event_date" in out.columns
    assert s.rejected["unparseable JSON"] == kinds["malformed"]
    assert s.rejected["missing required fields"] == kinds["invalid"]
    assert s.released == kinds["pending"]
    dead = spark.read.parquet(cfg.dead_letter_path)
    reasons = {r["reason"]: r["count"] for r in dead.groupBy("reason").count().collect()}
    assert reasons == {"unparseable JSON": kinds["malformed"],
                       "missing required field(s) ['order_id', 'amount']": kinds["invalid"]}
    text = capsys.readouterr().out
    assert "spark-share job summary" in text and "duplicates in table          0" in text
    assert "batch 0: read" in text  # progress, a line per batch
    # A second run finds nothing and ends quickly.
    s2 = job.run(spark, cfg, quiet=True)
    assert s2.records == 0 and spark.read.parquet(cfg.output_path).count() == out.count()


def write(tmp_path, cfg, name="c.json"):
    p = tmp_path / name
    p.write_text(json.dumps(cfg) if not isinstance(cfg, str) else cfg)
    return str(p)


GOOD = {"source": {"bootstrap_servers": "b:9092", "group_id": "g", "topics": ["t"]},
        "schema": "id long", "output": {"path": "/tmp/o", "dead_letter_path": "/tmp/d", "checkpoint_path": "/tmp/c"}}


@pytest.mark.parametrize("mutate,needle", [
    (lambda c: c["source"].pop("group_id"), "'source.group_id' is missing"),
    (lambda c: c.update(schema=5), "'schema' must be a str"),
    (lambda c: c["source"].update(topics="t"), "'source.topics' must be a list"),
    (lambda c: c.update(schema="@no-such.ddl"), "'schema': cannot read"),
    (lambda c: c.update(trigger="hourly"), "'trigger'"),
    (lambda c: c["source"].update(options={"kafka.sasl.password": "plain"}), "holds a credential"),
    (lambda c: c["source"].update(bootstrap_servers="${env:SPARK_SHARE_NO_SUCH_VAR}"), "SPARK_SHARE_NO_SUCH_VAR"),
])
def test_bad_configs_name_the_field(tmp_path, mutate, needle):
    cfg = json.loads(json.dumps(GOOD))
    mutate(cfg)
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace("[", r"\[")):
        load_config(write(tmp_path, cfg))


def test_invalid_schema_is_named(spark, tmp_path):
    cfg = parse_config(dict(GOOD, schema="id lng,,"))
    with pytest.raises(ConfigError, match="'schema' is not a valid DDL schema"):
        job.run(spark, cfg)


def test_credentials_come_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("KAFKA_PW", "pw-from-env")
    cfg = json.loads(json.dumps(GOOD))
    cfg["source"]["options"] = {"kafka.sasl.password": "${env:KAFKA_PW}"}
    assert load_config(write(tmp_path, cfg)).source_options["kafka.sasl.password"] == "pw-from-env"


@pytest.mark.parametrize("name", ["local.json", "databricks.json", "emr.json"])
def test_shipped_configs_parse(monkeypatch, name):
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "b:9092")
    monkeypatch.setenv("KAFKA_USERNAME", "u")
    monkeypatch.setenv("KAFKA_PASSWORD", "p")
    path = os.path.join(ROOT, "conf", name)
    if name == "databricks.json":  # secret scopes exist only on Databricks: the file must still be well formed
        raw = json.load(open(path))
        assert raw["source"]["options"]["kafka.sasl.password"].startswith("${secret:")
        with pytest.raises(ConfigError, match="secret scopes"):
            load_config(path)
        return
    cfg = load_config(path)
    assert cfg.topics == ["orders"] and cfg.trigger == "availableNow"
    json.load(open(os.path.join(ROOT, "conf", "databricks-job.json")))
    json.load(open(os.path.join(ROOT, "conf", "emr-step.json")))


def test_job_file_runs_as_a_script_with_a_bad_config(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "jobs", "queue_to_table.py"), "--config",
                          write(tmp_path, {"source": {}, "output": {}})], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "config field 'source.topics' is missing" in out.stderr


@pytest.mark.slow
def test_quickstart_notebook_executes(tmp_path):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(os.path.join(ROOT, "notebooks", "quickstart.ipynb"), as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "orders: 980  dead letters: 20" in outputs
