"""The scheduled job (jobs/queue_to_table.py), its configs, and the quickstart notebook."""
from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
import types
from collections import Counter

import pytest

import spark_share
from harness.support import kafka_options, summary_count
from spark_share import job
from spark_share.job import ConfigError, load_config, parse_config
from spark_share.job.command import _find_config
from spark_share.job.pipeline import _check_against_schema, _check_release_if
from spark_share.job.workload import produce_waiting, synthetic_order
from spark_share.options import is_secret

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB_FILE = os.path.join(ROOT, "jobs", "queue_to_table.py")


def synthetic_orders(kafka, topic: str, n: int, partitions: int, seed: int = 7) -> dict[str, int]:
    """job.synthetic_orders (the same orders, from the same seed) through a producer with the broker's
    client configs: the job's own takes a bootstrap address only."""
    from confluent_kafka import Producer

    rnd = random.Random(seed)
    p = Producer({**kafka.client(), "linger.ms": 5})
    kinds: Counter[str] = Counter()
    for i in range(n):
        kind, value = synthetic_order(i, rnd)
        kinds[kind] += 1
        produce_waiting(p, topic, key=str(i).encode(), value=value, partition=i % partitions)
    assert p.flush(60) == 0, f"synthetic orders not delivered to {topic}"
    return dict(kinds)


def test_job_end_to_end_on_the_embedded_broker(spark, kafka, tmp_path, capsys):
    topic = kafka.create_topic("orders", 4)
    kinds = synthetic_orders(kafka, topic, 2000, 4)
    assert kinds["no_status"] > 0  # release_if is NULL for these: they must be written, not lost
    cfg = job.demo_config(kafka.bootstrap_servers, str(tmp_path))
    # The demo's group and topic, under the broker's names; its client configs as kafka.* options.
    cfg.group_id, cfg.topics, cfg.source_options = kafka.group(cfg.group_id), [topic], kafka_options(kafka)
    t0 = time.monotonic()
    s = job.run(spark, cfg)
    first = time.monotonic() - t0
    job.print_summary(spark, cfg, s, produced=2000)
    out = spark.read.parquet(cfg.output_path)
    assert out.count() == kinds["ok"] + kinds["pending"] + kinds["no_status"] == s.written
    assert out.select("topic", "partition", "offset").distinct().count() == out.count()
    assert "event_date" in out.columns and "_spark_share_verdict" not in out.columns
    assert s.rejected["unparseable JSON"] == kinds["malformed"]
    assert s.rejected["missing required fields"] == kinds["invalid"]
    assert s.released == kinds["pending"]
    assert s.records == 2000 + kinds["pending"] == s.written + sum(s.rejected.values()) + s.released
    dead = spark.read.parquet(cfg.dead_letter_path)
    reasons = {r["reason"]: r["count"] for r in dead.groupBy("reason").count().collect()}
    assert reasons == {"unparseable JSON": kinds["malformed"],
                       "missing required field(s) ['order_id', 'amount']": kinds["invalid"]}
    text = capsys.readouterr().out
    assert "spark-share job summary" in text and "duplicates in table          0" in text
    assert "batch 0: read" in text  # progress, a line per batch
    assert f"output table        {cfg.output_path}" in text
    assert f"dead-letter table   {cfg.dead_letter_path}" in text
    # A second run finds nothing and ends quickly (relative to the first run, on the same machine).
    t0 = time.monotonic()
    s2 = job.run(spark, cfg, quiet=True)
    second = time.monotonic() - t0
    print(f"first run {first:.1f} s, second run {second:.1f} s")
    assert s2.records == 0 and spark.read.parquet(cfg.output_path).count() == out.count()
    # Both runs pay the same start-up (query, agents, a first batch); the second, with nothing to read, must
    # not wait beyond the first (idle probes, acknowledgement timeouts, a record lock: 5-30 s each), and it
    # needs one batch at most. (A drain confirms every partition empty by a poll of its own: an empty
    # run can take a second empty batch, about a second; 0.7 of the first run was too tight for that, and on
    # PySpark 4.1.4 under load the empty run once took 5.2 s against the first's 4.8 s: the bound is the
    # first run plus less than the shortest of those waits.)
    assert s2.batches <= 1 and second < first + 4, f"second run {second:.1f} s, first {first:.1f} s"


@pytest.mark.slow
@pytest.mark.embedded_only("runs the embedded demo")
def test_job_file_without_arguments_runs_the_embedded_demo(tmp_path):
    """The README's first command (through `spark-share demo`): the real entry point, as a process."""
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    out = subprocess.run([sys.executable, JOB_FILE, "--records", "1500", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600, env=env, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout

    def count(label):
        return summary_count(text, label)

    produced, read, written = count("produced"), count("records read"), count("written")
    rejected, released = count("rejected"), count("released")
    assert produced == 1500
    assert written + rejected == produced  # every record ends written or rejected: nothing lost
    assert read == written + rejected + released and released > 0
    assert count("duplicates in table") == 0
    assert re.search(r"^batch 0: read", text, re.M)
    assert f"output table        {tmp_path / 'orders'}   ({written:,} rows" in text
    assert f"dead-letter table   {tmp_path / 'dead_letters'}" in text


# --- the per-row verdicts, without a broker ---------------------------------------------------------
SOURCE_ROWS = "key binary, value binary, topic string, partition int, offset long, timestamp timestamp, deliveryCount int"


def _batch(spark, values):
    import datetime

    ts = datetime.datetime(2026, 1, 2, 3, 4, 5)
    rows = [(None, v.encode() if v is not None else None, "t", 0, i, ts, 1) for i, v in enumerate(values)]
    return spark.createDataFrame(rows, SOURCE_ROWS)


def _verdicts(spark, cfg, values):
    schema = _check_against_schema(spark, cfg)
    got = job.classify(_batch(spark, values), cfg, schema).orderBy("offset").collect()
    return [r[job.VERDICT] for r in got], got


def test_every_row_gets_one_verdict_and_null_release_condition_is_written(spark):
    cfg = parse_config(dict(GOOD, schema="id long, status string", release_if="rec.status = 'pending'"))
    values = ['{"id": 1, "status": "ok"}',
              '{"id": 2}',                       # status NULL: release_if is NULL -> written
              '{"id": 3, "status": null}',       # the same
              '{"id": 4, "status": "pending"}',  # released
              '{"id": 5, "status": ',            # malformed
              "{broken", "", None,               # unparseable
              "[1, 2]", "42", '{"id": "x"}']     # JSON, but not this schema
    verdicts, rows = _verdicts(spark, cfg, values)
    assert verdicts == ["write", "write", "write", "release"] + ["unparseable JSON"] * 4 + \
        ["JSON does not match the schema"] * 3
    assert [r["rec"]["id"] for r in rows[:4]] == [1, 2, 3, 4]
    assert rows[0]["event_date"].isoformat() == "2026-01-02"


def test_malformed_values_are_rejected_with_required_empty(spark):
    cfg = parse_config(dict(GOOD, schema="id long, amount double"))
    assert cfg.required == []
    verdicts, rows = _verdicts(spark, cfg, ['{"id": 1, "amount": 2.5}', '{"id": 2, "amount": ', "not json", "{}"])
    assert verdicts == ["write", "unparseable JSON", "unparseable JSON", "write"]  # {} is JSON: no required field
    assert job.output_columns(cfg, ["id", "amount"])[:2] == ["rec.`id`", "rec.`amount`"]


def test_required_fields_come_before_release(spark):
    cfg = parse_config(dict(GOOD, schema="id long, amount double", required=["amount"], release_if="rec.id = 1"))
    verdicts, _ = _verdicts(spark, cfg, ['{"id": 1}', '{"id": 1, "amount": 1.0}', '{"id": 2, "amount": 1.0}'])
    assert verdicts == ["missing required field(s) ['amount']", "release", "write"]


@pytest.mark.parametrize("change,needle", [
    (dict(release_if="rec.nope = 1"), "'release_if' is not a valid condition"),
    (dict(release_if="rec.id + 1"), "'release_if' must be a true/false condition"),
    (dict(partition_by="id"), "'partition_by' = 'id' is already a column"),
    (dict(required=["nope"]), "'required' names ['nope']"),
    (dict(schema="id long, offset long"), "'schema': field(s) ['offset'] clash"),
])
def test_config_errors_found_by_spark_name_the_field(spark, change, needle):
    cfg = parse_config(dict(GOOD, **change))
    with pytest.raises(ConfigError, match=re.escape(needle)):
        schema = _check_against_schema(spark, cfg)
        _check_release_if(_batch(spark, []), cfg, schema)


# --- configs ----------------------------------------------------------------------------------------
def write(tmp_path, cfg, name="c.json"):
    p = tmp_path / name
    p.write_text(json.dumps(cfg) if not isinstance(cfg, str) else cfg)
    return str(p)


GOOD = {"source": {"bootstrap_servers": "b:9092", "group_id": "g", "topics": ["t"]},
        "schema": "id long", "output": {"path": "/tmp/o", "dead_letter_path": "/tmp/d", "checkpoint_path": "/tmp/c"}}


def _opts(**o):
    return lambda c: c["source"].update(options=o)


@pytest.mark.parametrize("mutate,needle", [
    (lambda c: c["source"].pop("group_id"), "'source.group_id' is missing"),
    (lambda c: c.update(schema=5), "'schema' must be a str"),
    (lambda c: c["source"].update(topics="t"), "'source.topics' must be a list"),
    (lambda c: c.update(schema="@no-such.ddl"), "'schema': cannot read"),
    (lambda c: c.update(trigger="hourly"), "'trigger'"),
    (lambda c: c.update(release_if=True), "'release_if' must be a non-empty string"),
    (lambda c: c.update(partition_by=["d"]), "'partition_by' must be a non-empty string"),
    (lambda c: c.update(spark_master=2), "'spark_master' must be a non-empty string"),
    (lambda c: c.update(required="id"), "'required' must be a list"),
    (_opts(**{"kafka.sasl.password": "plain"}), "'source.options.kafka.sasl.password' holds a credential"),
    (_opts(**{"kafka.sasl.jaas.config": 'org.apache.kafka.common.security.plain.PlainLoginModule required '
                                        'username="u" password="hunter2";'}),
     "'source.options.kafka.sasl.jaas.config' holds a credential"),
    (_opts(**{"kafka.sasl.jaas.config": 'x required username="${env:HOME}" password=hunter2;'}), "holds a credential"),
    (_opts(**{"kafka.ssl.key.pem": "-----BEGIN PRIVATE KEY-----\nMII..."}), "'source.options.kafka.ssl.key.pem'"),
    (_opts(**{"kafka.ssl.truststore.password": "x${env:HOME}"}), "holds a credential"),
    (lambda c: c["source"].update(bootstrap_servers="${env:SPARK_SHARE_NO_SUCH_VAR}"),
     "'source.bootstrap_servers': environment variable SPARK_SHARE_NO_SUCH_VAR"),
    (lambda c: c["source"].update(group_id="${env:SPARK_SHARE_NO_SUCH_VAR}"),
     "'source.group_id': environment variable SPARK_SHARE_NO_SUCH_VAR"),
    (lambda c: c["source"].update(group_id="${secret:nokey}"), "'source.group_id': write a secret as"),
    (_opts(**{"kafka.sasl.password": "${secret:kafka/password}"}),
     "'source.options.kafka.sasl.password': ${secret:kafka/password} needs Databricks secret scopes"),
])
def test_bad_configs_name_the_field(tmp_path, mutate, needle):
    cfg = json.loads(json.dumps(GOOD))
    mutate(cfg)
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_config(write(tmp_path, cfg))


def test_invalid_schema_is_named(spark, tmp_path):
    cfg = parse_config(dict(GOOD, schema="id lng,,"))
    with pytest.raises(ConfigError, match="'schema' is not a valid DDL schema"):
        job.run(spark, cfg)


def test_credentials_come_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("KAFKA_PW", "pw-from-env")
    monkeypatch.setenv("KAFKA_GROUP", "orders")
    cfg = json.loads(json.dumps(GOOD))
    cfg["source"]["group_id"] = "${env:KAFKA_GROUP}"
    cfg["source"]["options"] = {
        "kafka.sasl.password": "${env:KAFKA_PW}",
        "kafka.sasl.jaas.config": 'org.apache.kafka.common.security.plain.PlainLoginModule required '
                                  'username="u" password="${env:KAFKA_PW}";',
        "kafka.ssl.key.pem": "${env:KAFKA_PW}",
        "kafka.security.protocol": "SASL_SSL", "includeHeaders": True}
    c = load_config(write(tmp_path, cfg))
    assert c.group_id == "orders"
    assert c.source_options["kafka.sasl.password"] == c.source_options["kafka.ssl.key.pem"] == "pw-from-env"
    assert 'password="pw-from-env";' in c.source_options["kafka.sasl.jaas.config"]
    assert c.source_options["includeHeaders"] == "true"
    assert "pw-from-env" not in repr(c)


def _fake_dbutils(monkeypatch, secrets=None, error=None):
    """A stand-in for Databricks' pyspark.dbutils: DBUtils(spark).secrets.get(scope=, key=)."""
    calls = []

    class Secrets:
        def get(self, scope, key):
            calls.append((scope, key))
            if error is not None:
                raise error
            return secrets[f"{scope}/{key}"]

    class DBUtils:
        def __init__(self, spark):
            assert spark is not None
            self.secrets = Secrets()

    mod = types.ModuleType("pyspark.dbutils")
    mod.DBUtils = DBUtils
    monkeypatch.setitem(sys.modules, "pyspark.dbutils", mod)
    return calls


def test_secrets_are_read_once_a_session_exists(monkeypatch):
    vals = {"kafka/bootstrap-servers": "h:9093", "kafka/username": "user", "kafka/password": "s3cr3t-pw"}
    calls = _fake_dbutils(monkeypatch, vals)
    cfg = load_config(os.path.join(ROOT, "conf", "databricks.json"))
    assert calls == [] and cfg.source_options["kafka.sasl.password"] == "${secret:kafka/password}"
    got = job.resolve_secrets(cfg, spark=object())
    assert got.bootstrap_servers == "h:9093" and got.source_options["kafka.sasl.username"] == "user"
    assert got.source_options["kafka.sasl.password"] == "s3cr3t-pw"
    assert sorted(calls) == sorted(("kafka", k) for k in ("bootstrap-servers", "username", "password"))


def test_a_failing_secret_scope_is_a_config_error_naming_the_field(monkeypatch):
    _fake_dbutils(monkeypatch, error=RuntimeError("Secret does not exist with scope: kafka and key: password"))
    cfg = parse_config(dict(GOOD, source=dict(GOOD["source"], options={"kafka.sasl.password": "${secret:kafka/password}"})))
    with pytest.raises(ConfigError, match=re.escape("'source.options.kafka.sasl.password': cannot read "
                                                    "${secret:kafka/password}")) as e:
        job.resolve_secrets(cfg, spark=object())
    assert "RuntimeError" in str(e.value)


# --- shipped configs --------------------------------------------------------------------------------
def _keys(node):
    """Every key of a JSON document, at any depth."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield k
            yield from _keys(v)
    elif isinstance(node, list):
        for v in node:
            yield from _keys(v)


@pytest.mark.parametrize("name", ["local.json", "local-broker.json", "emr.json"])
def test_shipped_configs_parse(monkeypatch, name):
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "b:9092")
    monkeypatch.setenv("KAFKA_USERNAME", "u")
    monkeypatch.setenv("KAFKA_PASSWORD", "p")
    cfg = load_config(os.path.join(ROOT, "conf", name))
    assert cfg.topics == ["orders"] and cfg.trigger == "availableNow" and cfg.required == ["order_id", "amount"]
    assert cfg.bootstrap_servers == ("embedded" if name == "local.json" else "b:9092")
    if name == "emr.json":
        assert cfg.source_options["kafka.sasl.password"] == "p"


@pytest.mark.parametrize("job_file", ["databricks-job.json", "databricks-serverless-job.json"])
def test_shipped_databricks_job(monkeypatch, job_file):
    conf = os.path.join(ROOT, "conf")
    raw = json.load(open(os.path.join(conf, "databricks.json")))
    creds = {k: v for k, v in raw["source"]["options"].items() if "username" in k or is_secret(k)}
    assert creds and all(v.startswith("${secret:") for v in creds.values())
    assert raw["source"]["bootstrap_servers"].startswith("${secret:")
    with pytest.raises(ConfigError, match="secret scopes"):  # off Databricks, before Spark starts
        load_config(os.path.join(conf, "databricks.json"))

    spec = json.load(open(os.path.join(conf, job_file)))
    (task,) = spec["tasks"]
    py = task["spark_python_task"]
    assert py["python_file"] == "jobs/queue_to_table.py" and os.path.exists(os.path.join(ROOT, py["python_file"]))
    assert py["parameters"][:2] == ["--config", "conf/databricks.json"]
    # The job file finds conf/ from jobs/ (a Python file task's working directory on Databricks).
    monkeypatch.chdir(os.path.join(ROOT, "jobs"))
    assert _find_config(py["parameters"][1], [ROOT]) == os.path.join(ROOT, "conf", "databricks.json")
    wheel = f"/spark_share-{spark_share.__version__}-py3-none-any.whl"
    if "serverless" in job_file:  # Spark Connect: an environment, no cluster
        assert "Serverless" in spec["description"] and "job_clusters" not in spec
        (env,) = spec["environments"]
        assert task["environment_key"] == env["environment_key"] and env["spec"]["environment_version"]
        (dep,) = env["spec"]["dependencies"]
        assert dep.endswith(wheel)
    else:  # classic PySpark: a job cluster in dedicated access mode
        assert "dedicated" in spec["description"]
        (lib,) = task["libraries"]
        assert set(lib) == {"whl"} and lib["whl"].endswith(wheel)
        (cluster,) = spec["job_clusters"]
        assert cluster["new_cluster"]["data_security_mode"] == "SINGLE_USER"
        assert cluster["new_cluster"]["spark_version"]  # a supported runtime: tests/unit/test_deploy_definitions.py
    assert not any(is_secret(k) for k in _keys(spec))


@pytest.mark.skipif(sys.platform == "win32", reason="bash")
def test_shipped_emr_step_runs_the_job_file_with_a_config_that_parses(tmp_path):
    """conf/emr-step.json, run with stand-ins for `aws` (S3 = a directory, Secrets Manager = a JSON
    string) and `spark-submit` (loads the config it is given, with the environment it inherits)."""
    (step,) = json.load(open(os.path.join(ROOT, "conf", "emr-step.json")))
    args = step["HadoopJarStep"]["Args"]
    assert args[:2] == ["bash", "-c"] and "PASSWORD" not in json.dumps(step)
    s3 = tmp_path / "s3"
    for rel in ("jobs/queue_to_table.py", "conf/emr.json", "conf/emr-step.sh"):  # what docs/deploy.md says to upload
        (s3 / "spark-share" / os.path.dirname(rel)).mkdir(parents=True, exist_ok=True)
        (s3 / "spark-share" / rel).write_bytes(open(os.path.join(ROOT, rel), "rb").read())
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "aws").write_text(f"""#!/usr/bin/env bash
case "$1" in
  s3) cp "{s3}/${{4#s3://bucket/}}" "$5" ;;
  secretsmanager) echo '{{"bootstrap_servers": "k:9096", "username": "u", "password": "p$w d"}}' ;;
esac
""")
    (bin_ / "spark-submit").write_text(f"""#!/usr/bin/env bash
echo "ARGS $*"
exec {sys.executable} -c 'import sys; from spark_share.job import load_config; c = load_config(sys.argv[1]); \
print("CONFIG", c.bootstrap_servers, c.source_options["kafka.sasl.username"], c.source_options["kafka.sasl.password"] == "p$w d")' "${{@: -1}}"
""")
    os.symlink(sys.executable, bin_ / "python3")
    for f in bin_.iterdir():
        f.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_}{os.pathsep}{os.environ['PATH']}")
    out = subprocess.run(["bash", "-c", args[2].replace("<your-bucket>", "bucket")], capture_output=True,
                         text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    submitted = re.search(r"^ARGS (.*)$", out.stdout, re.M).group(1).split()
    assert submitted[-3].endswith("/queue_to_table.py") and submitted[-2:][0] == "--config"
    assert submitted[-1].endswith("/emr.json")
    assert "CONFIG k:9096 u True" in out.stdout
    for script in ("emr-step.sh", "emr-bootstrap.sh"):
        subprocess.run(["bash", "-n", os.path.join(ROOT, "conf", script)], check=True)


def test_embedded_runs_replace_only_their_own_tables(tmp_path):
    cfg = job.demo_config(job.EMBEDDED, str(tmp_path / "run"))
    job.prepare_embedded_paths(cfg)
    (tmp_path / "run" / "orders" / "part-0.parquet").write_text("x")
    assert job.prepare_embedded_paths(cfg) == [str(tmp_path / "run" / "orders")]  # an earlier embedded run's
    assert os.listdir(tmp_path / "run" / "orders") == [".spark-share-embedded"]
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "data.parquet").write_text("x")
    other = job.demo_config(job.EMBEDDED, str(tmp_path))
    other.output_path = str(tmp_path / "mine")
    with pytest.raises(ConfigError, match="'output.path': .* not from an embedded-broker run"):
        job.prepare_embedded_paths(other)
    assert (tmp_path / "mine" / "data.parquet").exists()
    with pytest.raises(ConfigError, match="'output.path': an embedded-broker run writes local paths"):
        job.prepare_embedded_paths(job.demo_config(job.EMBEDDED, "s3://bucket/x"))


def test_summary_before_any_output(spark, tmp_path, capsys):
    """An empty first run: no table yet (no directory, or a directory without files)."""
    (tmp_path / "empty").mkdir()
    for path in (str(tmp_path / "none"), str(tmp_path / "empty")):
        cfg = parse_config(dict(GOOD, output={"path": path, "dead_letter_path": str(tmp_path / "dl"),
                                               "checkpoint_path": str(tmp_path / "c")}))
        job.print_summary(spark, cfg, job.Summary())
        text = capsys.readouterr().out
        assert f"output table        {path}   (no files yet)" in text
        assert f"dead-letter table   {tmp_path / 'dl'}" in text and "rejected                     0" in text


def test_job_file_runs_as_a_script_with_a_bad_config(tmp_path):
    out = subprocess.run([sys.executable, JOB_FILE, "--config", write(tmp_path, {"source": {}, "output": {}})],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "config field 'source.topics' is missing" in out.stderr


@pytest.mark.slow
@pytest.mark.embedded_only("the notebook starts its own embedded broker")
def test_quickstart_notebook_executes(tmp_path):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(os.path.join(ROOT, "notebooks", "quickstart.ipynb"), as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "orders: 980  dead letters: 20" in outputs
    assert "|order_id|amount|partition|offset|" in outputs.replace(" ", "")  # the output table is shown
