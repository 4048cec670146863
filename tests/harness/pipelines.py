"""Runs the example declarative pipeline (jobs/orders_pipeline) with ``spark-pipelines`` against a test's
Kafka, and reads back what its tables hold.

Owns: a copy of the pipeline in a test's directory with the spec pointed at the test's broker, group,
topic and paths; one ``spark-pipelines`` command as a process of its own (the command starts its own
Spark: a local Connect server in a JVM), stopped by whoever started it; a table's rows as Spark reads
them (the files its ``_spark_metadata`` log lists, not every file in the directory: a batch that failed
before its commit may have left files that Spark never reads).

Must never: share a pipeline's storage or warehouse between tests (a pipeline's checkpoints are its state).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.json as pj
import pyarrow.parquet as pq
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "jobs", "orders_pipeline")
RUN_TIMEOUT_S = 300.0
# A catalog that outlives the command (a Derby metastore in the run's directory): with Spark's default
# in-memory one, the next update finds the tables' directories but not the tables, and fails.
CATALOG = ("--conf", "spark.sql.catalogImplementation=hive")


@dataclass
class Update:
    """One ``spark-pipelines run``: its exit code and output."""
    returncode: int
    output: str
    took: float

    def completed(self) -> bool:
        return self.returncode == 0 and "Run is COMPLETED" in self.output


class OrdersPipeline:
    """The example pipeline in ``base`` (a test's directory), reading ``topic`` as share group ``group``."""

    def __init__(self, base: str, bootstrap: str, group: str, topic: str, max_delivery_count: int = 4,
                 configuration: dict[str, str] | None = None, python: str = sys.executable,
                 register_call: bool = False):
        """``python``: the interpreter whose PySpark and spark-share run the pipeline (a venv's);
        ``register_call``: the definitions call ``spark_share.register(spark)``, as the docs have users
        write it everywhere else."""
        self.base, self.group, self.topic, self.python = base, group, topic, python
        self.project = os.path.join(base, "orders_pipeline")
        shutil.copytree(EXAMPLE, self.project, ignore=shutil.ignore_patterns("__pycache__"))
        if register_call:
            definitions = os.path.join(self.project, "transformations", "orders.py")
            with open(definitions) as f:
                text = f.read()
            anchor = "conf = spark.conf"
            assert anchor in text, "the example's definitions changed: put the call after its session"
            with open(definitions, "w") as f:
                f.write(text.replace(anchor, "import spark_share\nspark_share.register(spark)\n" + anchor, 1))
        self.spec = os.path.join(self.project, "spark-pipeline.yml")
        with open(self.spec) as f:
            spec = yaml.safe_load(f)
        spec["storage"] = "file://" + os.path.join(base, "storage")
        spec["configuration"].update({
            "orders.kafka.bootstrap.servers": bootstrap, "orders.kafka.group.id": group, "orders.subscribe": topic,
            "orders.maxDeliveryCount": str(max_delivery_count),
            "orders.deadLetterPath": os.path.join(base, "dead-letters"),
            "orders.invalidPath": os.path.join(base, "invalid-orders"),
            **(configuration or {}),
        })
        with open(self.spec, "w") as f:
            yaml.safe_dump(spec, f)
        self.proc: subprocess.Popen | None = None
        self._out: str = ""

    # --- running -----------------------------------------------------------------------------
    def _pyspark_home(self) -> str:
        found = subprocess.run([self.python, "-c", "import os, pyspark; print(os.path.dirname(pyspark.__file__))"],
                               capture_output=True, text=True, timeout=120, check=True)
        return found.stdout.strip()

    def _env(self) -> dict[str, str]:
        py = self.python
        bin_dir = os.path.dirname(py)
        env = dict(os.environ, SPARK_HOME=self._pyspark_home(), PYSPARK_PYTHON=py, PYSPARK_DRIVER_PYTHON=py,
                   PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""))
        env.pop("PYTHONPATH", None)  # the pipeline imports what the interpreter has installed, nothing else
        return env

    def start(self, *args: str) -> None:
        """``spark-pipelines run [args]`` in the background (its output to a file in the base)."""
        assert self.proc is None, "an update is already running"
        env = self._env()
        script = os.path.join(env["SPARK_HOME"], "bin", "spark-pipelines")
        self._out = os.path.join(self.base, f"update-{time.monotonic_ns()}.log")
        self._t0 = time.monotonic()
        with open(self._out, "w") as out:
            self.proc = subprocess.Popen([script, *CATALOG, "run", "--spec", self.spec, *args], cwd=self.base,
                                         env=env, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def output(self) -> str:
        with open(self._out, errors="replace") as f:
            return f.read()

    def wait(self, timeout: float = RUN_TIMEOUT_S) -> Update:
        assert self.proc is not None
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"spark-pipelines did not end within {timeout:.0f} s:\n{self.output()[-4000:]}")
        self.proc = None
        return Update(rc, self.output(), time.monotonic() - self._t0)

    def run(self, *args: str, timeout: float = RUN_TIMEOUT_S) -> Update:
        self.start(*args)
        return self.wait(timeout)

    def stop(self, sig: int = signal.SIGKILL) -> None:
        """End the command and every process it started (its session: the JVM and the JVM's Python
        processes), as a user's Ctrl-C or a killed job would, and wait for them."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass
        self.proc.wait(60)
        self.proc = None

    # --- reading -----------------------------------------------------------------------------
    def table(self, name: str) -> pa.Table:
        """What Spark reads of the pipeline's table ``name``: the files its ``_spark_metadata`` log adds."""
        return read_file_sink(os.path.join(self.base, "spark-warehouse", name))  # the run's cwd is the base

    def invalid_orders(self) -> pa.Table:
        """What the sink ``invalid_orders`` (transformations/invalid_orders.py) holds: JSON files."""
        return read_file_sink(os.path.join(self.base, "invalid-orders"))

    def dead_letters(self) -> pa.Table:
        """The records the source set aside in the pipeline's dead-letter directory (Parquet files)."""
        files = [os.path.join(d, f) for d, _s, fs in os.walk(os.path.join(self.base, "dead-letters"))
                 for f in fs if f.endswith(".parquet") and not f.startswith(".")]
        return pa.concat_tables([pq.read_table(f) for f in files]) if files else pa.table({})


def read_file_sink(path: str) -> pa.Table:
    """The rows of a streaming file sink's directory as Spark reads them: the files of its metadata log
    (the last compacted entry and the ones after it), never a file a failed batch left behind."""
    log_dir = os.path.join(path, "_spark_metadata")
    if not os.path.isdir(log_dir):
        return pa.table({})
    batches = sorted((int(n.split(".")[0]), n) for n in os.listdir(log_dir)
                     if n.split(".")[0].isdigit() and not n.startswith("."))
    compacts = [i for i, (_b, n) in enumerate(batches) if n.endswith(".compact")]
    files: list[str] = []
    for _b, name in batches[compacts[-1] if compacts else 0:]:
        with open(os.path.join(log_dir, name)) as f:
            lines = f.read().splitlines()[1:]  # the first line is the log's version
        for line in lines:
            entry = json.loads(line)
            if entry.get("action", "add") == "add":
                files.append(entry["path"])
            else:
                files = [p for p in files if p != entry["path"]]
    paths = [p[len("file:"):] if p.startswith("file:") else p for p in files]
    paths = [p for p in paths if os.path.getsize(p)]  # an empty JSON part holds no rows
    tables = [pj.read_json(p) if ".json" in p else pq.read_table(p) for p in paths]
    return pa.concat_tables(tables, promote_options="default") if tables else pa.table({})
