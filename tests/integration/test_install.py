"""The release as a user installs it: the wheel built from this tree (``python -m build``: an sdist, and the
wheel built from the unpacked sdist, so a file the sdist forgets fails here), installed into a fresh venv
with the README's install line (``spark-share[pyspark]``, not editable, no test extras) and PySpark's
``pipelines`` extra for ``spark-pipelines``; from that venv, ``spark-share --version``, ``spark-share demo``
and the example declarative pipeline.

Nothing of the repository is on that venv's path: it runs from the test's directory with no PYTHONPATH.
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

from harness.pipelines import OrdersPipeline
from harness.support import check_no_loss, summary_count, uid
from spark_share import __version__, spark_versions

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = [pytest.mark.slow]


def _run(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    assert out.returncode == 0, f"{' '.join(cmd)} exited {out.returncode}:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> str:
    """A fresh venv with the wheel of this tree installed as the README says; its Python."""
    base = tmp_path_factory.mktemp("install")
    dist = base / "dist"
    _run([sys.executable, "-m", "build", "--outdir", str(dist), ROOT], timeout=600)
    wheels = glob.glob(str(dist / f"spark_share-{__version__}-py3-none-any.whl"))
    assert len(wheels) == 1, f"python -m build made {os.listdir(dist)}, not one wheel of {__version__}"
    venv = base / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], timeout=300)
    python = str(venv / "bin" / "python")
    # The PySpark of the suite's own venv, so that this pass runs the Spark the others ran.
    _run([python, "-m", "pip", "install", "--quiet", f"{wheels[0]}[pyspark]",
          f"pyspark[pipelines]=={spark_versions.VERSION_TEXT}"], timeout=1200)
    return python


def _venv_env(python: str) -> dict[str, str]:
    env = dict(os.environ, PYSPARK_PYTHON=python, PYSPARK_DRIVER_PYTHON=python,
               PATH=os.path.dirname(python) + os.pathsep + os.environ.get("PATH", ""))
    env.pop("PYTHONPATH", None)
    return env


def test_the_installed_wheel_names_its_version_and_runs_the_demo(installed, tmp_path):
    tool = os.path.join(os.path.dirname(installed), "spark-share")
    version = _run([tool, "--version"], timeout=120, env=_venv_env(installed), cwd=str(tmp_path))
    assert version.stdout.strip().endswith(__version__), version.stdout
    where = _run([installed, "-c", "import spark_share; print(spark_share.__file__)"], timeout=120,
                 env=_venv_env(installed), cwd=str(tmp_path))
    assert where.stdout.startswith(os.path.dirname(os.path.dirname(installed))), \
        f"the venv imports spark_share from {where.stdout.strip()}, not from its own site-packages"

    out = _run([tool, "demo", "--records", "1200", "--out", str(tmp_path / "demo")], timeout=600,
               env=_venv_env(installed), cwd=str(tmp_path))
    produced, written, rejected = (summary_count(out.stdout, label) for label in ("produced", "written", "rejected"))
    assert produced == 1200 and written + rejected == produced, out.stdout[-3000:]
    assert summary_count(out.stdout, "duplicates in table") == 0, out.stdout[-3000:]
    print(f"installed wheel: spark-share {__version__}; the demo wrote {written} and rejected {rejected} of {produced}")


@pytest.mark.skipif(not spark_versions.NATIVE_AVAILABLE_NOW, reason="kafka-share in a pipeline needs Spark >= 4.2")
def test_the_installed_wheel_runs_the_example_pipeline(installed, kafka, produce, tmp_path):
    topic = kafka.create_topic(uid("orders"), 4)
    pipeline = OrdersPipeline(str(tmp_path), kafka.bootstrap_servers, kafka.group(uid("pipeline")), topic,
                              python=installed)
    try:
        queued = produce(kafka, topic, [{"id": i, "order_id": i, "customer": "c", "amount": 1.0}
                                        for i in range(1, 401)])
        update = pipeline.run()
        assert update.completed(), f"the update failed (exit {update.returncode}):\n{update.output[-4000:]}"
        held = check_no_loss(queued, [int(k) for k in pipeline.table("orders").column("key").to_pylist()])
        print(f"installed wheel: the example pipeline (exit 0): the table holds {held.delivered} of {len(queued)}")
    finally:
        pipeline.stop()
