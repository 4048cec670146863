"""Fixtures of the integration tests: one local Spark session (with kafka-share registered), the Kafka
of one test (a fresh embedded broker; or uniquely named topics and groups on a real broker the harness
started from SPARK_SHARE_TEST_KAFKA_START, or on a cluster of yours with SPARK_SHARE_TEST_BOOTSTRAP:
tests/harness/brokers.py), and a long-lived producer of records with unique ids. Tests marked ``embedded_only``
are skipped on a real broker, ``real_only`` on the embedded one, before any fixture runs."""
from __future__ import annotations

import os
import sys

import pytest

# Executors' Python workers must be this interpreter (the venv with the project installed).
os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable

from harness.brokers import BrokerChoice, choose_broker  # noqa: E402
from harness.support import ProducerPool  # noqa: E402


def _broker_choice() -> BrokerChoice:
    try:
        return choose_broker()
    except ValueError as e:  # a malformed SPARK_SHARE_TEST_KAFKA_OPTIONS: stop before any test runs
        raise pytest.UsageError(str(e)) from None


def pytest_collection_modifyitems(config, items):
    """Skip what the run's broker cannot serve, saying why: ``embedded_only`` tests on a real Kafka
    (error injection), ``real_only`` ones on the embedded broker (they assert what only real Kafka
    promises, or run where the suite proves users' behaviour, once)."""
    real = _broker_choice().external
    for item in items:
        marker = item.get_closest_marker("real_only" if not real else "embedded_only")
        if marker is None:
            continue
        reason = marker.args[0] if marker.args else marker.kwargs.get("reason", "")
        where = "real Kafka only" if not real else "embedded broker only"
        item.add_marker(pytest.mark.skip(reason=f"{where}: {reason}"))


def pytest_generate_tests(metafunc):
    """``both_read_modes`` tests run once per readMode (the invariants hold in both); SPARK_SHARE_TEST_READ_MODES
    (comma-separated) narrows them (the other Sparks' pass runs executors only)."""
    if metafunc.definition.get_closest_marker("both_read_modes") is not None:
        modes = os.environ.get("SPARK_SHARE_TEST_READ_MODES", "executors,driver").split(",")
        metafunc.parametrize("read_mode", [m.strip() for m in modes if m.strip()], indirect=True)


@pytest.fixture(autouse=True)
def read_mode(request):
    """The readMode the test's source options carry: ``executors`` unless the test runs in both modes."""
    from harness import support

    support.READ_MODE = getattr(request, "param", "executors")
    try:
        yield support.READ_MODE
    finally:
        support.READ_MODE = "executors"


def pytest_collection_finish(session):
    """One line before the tests run: which Kafka they run against (never a client option's value)."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(_broker_choice().describe())


@pytest.fixture(scope="session")
def spark(tmp_path_factory):
    """local[2,2]: two cores, and one retry per task so that task-retry tests can inject a failure. Its
    local dir is the test run's own: agents keep their files there (``support.agent_files``)."""
    from pyspark.sql import SparkSession

    session = (SparkSession.builder.master("local[2,2]").appName("spark-share-tests")
               .config("spark.local.dir", str(tmp_path_factory.mktemp("spark-local")))
               .config("spark.ui.enabled", "false")
               .config("spark.sql.shuffle.partitions", "2")
               .config("spark.driver.memory", "2g")
               .config("spark.sql.streaming.stopTimeout", "60s")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    import spark_share

    spark_share.register(session)
    try:
        yield session
    finally:
        session.stop()


@pytest.fixture(scope="session")
def namespace_cluster():
    """A Spark standalone cluster of network-namespace hosts (tests/harness/spark_hosts.py), started once for
    the run by the first test that asks for it: its driver programs reach the test's broker through it."""
    from harness.cluster_runs import start_cluster
    from harness.spark_hosts import INSTALL_HINT, missing_requirements

    missing = missing_requirements()
    if missing:
        pytest.skip(f"the namespace-cluster tests need {', '.join(missing)}: {INSTALL_HINT}")
    cluster = start_cluster()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def broker_choice():
    """Which Kafka the tests run against (a broker from a start script is started here, once, and
    stopped after the run); an external cluster must answer first (checked once: a cluster that does
    not answer fails the first test that needs it within seconds, and every later one at once)."""
    choice = _broker_choice().start()
    try:
        choice.check_reachable()
        yield choice
    finally:
        choice.stop()


@pytest.fixture
def kafka(broker_choice):
    """The Kafka of one test: a fresh embedded broker (destroyed after it), or the external cluster
    with this test's own topic and group names (its topics and groups deleted after it)."""
    with broker_choice.open() as cluster:
        yield cluster


@pytest.fixture
def produce(kafka):
    """``produce(kafka, topic, values_or_count, partitions=None) -> ids``: records with unique ids
    (JSON value with an "id" field, key = id) through one producer per broker that lives until
    the end of the test (a disconnecting client ends every share session on the mock)."""
    pool = ProducerPool()
    try:
        yield pool
    finally:
        pool.close()
