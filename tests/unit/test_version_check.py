"""The supported PySpark range and what a missing or older one gets: a clear error, never a bare
ModuleNotFoundError deep in a query (spark_share/spark_versions.py)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from spark_share import spark_versions

REGISTER = "import spark_share\ntry:\n    spark_share.register(None)\nexcept spark_share.UnsupportedSparkError as e:\n    print('REFUSED', e)\n"


def _run(code: str, path: str | None = None) -> str:
    env = {"PYTHONPATH": path} if path else {}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**env, "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.mark.parametrize("version", ["3.5.2", "2.4.8", "5.0.0"])
def test_a_pyspark_outside_the_range_is_named(tmp_path, version):
    fake = tmp_path / "pyspark"
    fake.mkdir()
    (fake / "__init__.py").write_text(f"__version__ = {version!r}\n")
    out = _run(REGISTER, str(tmp_path))
    assert out.startswith("REFUSED") and f"PySpark '{version}'" in out and ">=4.0,<5" in out, out


def test_no_pyspark_at_all_is_named():
    out = _run("import sys\nsys.modules['pyspark'] = None\n" + REGISTER)
    assert out.startswith("REFUSED") and "none is installed" in out and "spark-share[pyspark]" in out, out


def test_import_needs_no_pyspark():
    """`import spark_share` works without PySpark (the CLI's help, a job's config check); register()
    is where PySpark is needed."""
    import spark_share

    out = _run("import sys\nsys.modules['pyspark'] = None\nimport spark_share\nprint(spark_share.__version__)")
    assert out.strip() == spark_share.__version__


def test_the_refusal_of_available_now_names_the_version_and_what_to_do(monkeypatch):
    monkeypatch.setattr(spark_versions, "NATIVE_AVAILABLE_NOW", False)
    monkeypatch.setattr(spark_versions, "VERSION_TEXT", "4.0.5")
    text = spark_versions.available_now_refusal("org.apache.spark.sql.execution.streaming.AvailableNowTrigger$")
    assert text is not None
    assert "Spark 4.0.5" in text and "spark_share.drain(writer)" in text and "one batch" in text
    assert spark_versions.available_now_refusal("org.apache.spark.sql.streaming.Trigger.ProcessingTimeTrigger") is None
    assert spark_versions.available_now_refusal("") is None
    monkeypatch.setattr(spark_versions, "NATIVE_AVAILABLE_NOW", True)
    assert spark_versions.available_now_refusal("AvailableNowTrigger$") is None


def test_read_limits_on_every_version():
    assert spark_versions.max_rows(spark_versions.ReadMaxRows(7)) == 7
    assert spark_versions.max_rows(spark_versions.ReadAllAvailable()) is None
    assert spark_versions.max_rows(None) is None


def test_this_runs_pyspark_in_the_supported_range():
    assert (4, 0) <= spark_versions.SPARK < (5, 0)
    assert spark_versions.ADMISSION_CONTROL == (spark_versions.SPARK >= (4, 2))


def test_only_spark_versions_looks_at_the_version():
    """The differences between Sparks live in one module: nothing else reads PySpark's version."""
    import pathlib

    import spark_share

    root = pathlib.Path(spark_share.__file__).parent
    readers = [str(p.relative_to(root)) for p in root.rglob("*.py")
               if p.name != "spark_versions.py" and ("pyspark.__version__" in p.read_text()
                                                     or "streaming.datasource" in p.read_text())]
    assert readers == [], readers



def test_an_exchange_location_is_in_the_schema_only_where_spark_keeps_a_schema_with_metadata():
    """Spark 4.0 and 4.1 fail a query whose Python source's schema carries field metadata (measured with 4.0.5
    and 4.1.4), which is how exchangeLocation reaches reject() from 4.2 on: there the schema is the plain
    one, and the user's code names the location (reject(rows, exchange_location=...))."""
    from spark_share.consumers import records
    from spark_share.options import EXCHANGE_METADATA
    from spark_share.source import KafkaShareDataSource

    options = {"kafka.bootstrap.servers": "b:9092", "kafka.group.id": "g", "subscribe": "t",
               "exchangeLocation": "/Volumes/a/b/c"}
    source = KafkaShareDataSource(options)
    assert source.share_options.exchange_location == "/Volumes/a/b/c"  # the tracker's mailbox is there either way
    if spark_versions.SCHEMA_METADATA:
        assert source.schema()["offset"].metadata == {EXCHANGE_METADATA: "/Volumes/a/b/c"}
    else:
        assert source.schema() == records.spark_schema(False)
    assert spark_versions.SCHEMA_METADATA == (spark_versions.SPARK >= (4, 2))


class _NoRegistration:
    """A session whose registrations fail the test: register() must not reach them in a pipeline file."""

    @property
    def dataSource(self):
        raise AssertionError("register() registered a source from a pipeline's definitions file")


def test_register_in_a_pipeline_definitions_file_keeps_the_static_source(capsys):
    registry = pytest.importorskip("pyspark.pipelines.graph_element_registry",
                                   reason="PySpark < 4.1 has no declarative pipelines")
    import spark_share

    graph_element_registration_context = registry.graph_element_registration_context

    assert not spark_versions.in_pipeline_definitions()
    with graph_element_registration_context(object()):  # what spark-pipelines run sets around each file
        assert spark_versions.in_pipeline_definitions()
        spark_share.register(_NoRegistration())
        assert "spark_share.register: in a pipeline's definitions file" in capsys.readouterr().out
