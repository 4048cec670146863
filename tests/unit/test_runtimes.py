"""The declared ranges admit what the supported runtimes ship (tests/runtimes.json): installing
spark-share on Databricks 17.3/18 LTS, 19 or emr-spark-8.0.0 changes none of their Python libraries."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from spark_share import spark_versions

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11 (./dev's venv)

ROOT = Path(__file__).resolve().parents[2]
RUNTIMES = json.loads((ROOT / "tests" / "runtimes.json").read_text())
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
DEPENDENCIES = {r.name: r.specifier for r in map(Requirement, PROJECT["dependencies"])}


@pytest.mark.parametrize("runtime", RUNTIMES["runtimes"] + RUNTIMES["ci"],
                         ids=lambda r: r.get("name") or f"ci-pyspark-{r['pyspark']}")
def test_the_ranges_admit_the_runtime(runtime):
    spark = runtime.get("spark") or runtime["pyspark"]
    assert SpecifierSet(spark_versions.SUPPORTED).contains(spark), f"Spark {spark} is outside {spark_versions.SUPPORTED}"
    python = runtime["python"] if runtime["python"].count(".") == 2 else runtime["python"] + ".0"
    assert SpecifierSet(PROJECT["requires-python"]).contains(python), python
    for name, version in runtime["libraries"].items():
        assert name in DEPENDENCIES, f"{name} is not a dependency: list what the runtime ships that we need"
        assert DEPENDENCIES[name].contains(version), f"{name} {version} is outside {DEPENDENCIES[name]}"


def test_pyspark_is_not_a_dependency_and_its_extra_is_the_supported_range():
    """Databricks and EMR put their PySpark on the path without a pip distribution: a declared pyspark
    would make pip install PyPI's over the runtime's."""
    assert "pyspark" not in DEPENDENCIES
    extra = [Requirement(r) for r in PROJECT["optional-dependencies"]["pyspark"]]
    assert [(r.name, r.specifier) for r in extra] == [("pyspark", SpecifierSet(spark_versions.SUPPORTED))]


def test_ci_covers_every_minor_spark_below_this_one():
    """CI runs the core on the newest patch of each supported minor version besides the one of ./dev's venv."""
    versions = [tuple(int(x) for x in c["pyspark"].split(".")) for c in RUNTIMES["ci"]]
    assert {(4, 0), (4, 1), (4, 2)} <= {v[:2] for v in versions}
    assert versions == sorted(versions), "the oldest first: spark_matrix.py runs its whole core (ON_THE_OLDEST) there"
