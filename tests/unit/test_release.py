"""The release: one version, written in spark_share/_version.py, that the package, the command, the wheel's
metadata, the changelog and the README's install lines all say."""
from __future__ import annotations

import importlib.metadata
import pathlib
import re
import subprocess
import sys

import pytest

import spark_share
from spark_share import cli
from spark_share._version import __version__ as WRITTEN

ROOT = pathlib.Path(__file__).resolve().parents[2]
RELEASE = re.compile(r"^\d+\.\d+\.\d+(?:(?:a|b|rc)\d+)?(?:\.post\d+)?(?:\.dev\d+)?$")  # PEP 440, plain


def test_the_package_reports_the_one_written_version():
    assert spark_share.__version__ == WRITTEN
    assert RELEASE.match(spark_share.__version__), spark_share.__version__
    assert "__version__" in spark_share.__all__


def test_pyproject_reads_the_version_instead_of_writing_its_own():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"], "pyproject.toml writes a version: keep it in spark_share/_version.py"
    assert "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "spark_share._version.__version__"}


def test_the_installed_metadata_says_the_same():
    """What pip installed (editable here, a wheel elsewhere) names the same version; a stale install says how
    to refresh it."""
    installed = importlib.metadata.version("spark-share")
    assert installed == spark_share.__version__, f"installed {installed}: run ./dev setup to reinstall"


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"spark-share {spark_share.__version__}"


def test_version_flag_of_the_command_needs_no_pyspark():
    code = ("import sys\nsys.modules['pyspark'] = None\nfrom spark_share import cli\n"
            "sys.argv = ['spark-share', '--version']\nsys.exit(cli.main())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == f"spark-share {spark_share.__version__}"


def test_the_changelog_names_this_version_first():
    text = (ROOT / "CHANGELOG.md").read_text()
    entries = re.findall(r"^## \[([^\]]+)\](?: - (\d{4}-\d{2}-\d{2}))?$", text, re.M)
    assert entries and entries[0] == ("Unreleased", ""), entries[:2]
    released = entries[1:]
    assert released and released[0][0] == spark_share.__version__, f"CHANGELOG.md's latest release: {released[:1]}"
    assert all(d for _, d in released), "every released entry carries its date"


def test_the_readme_installs_this_version():
    text = (ROOT / "README.md").read_text()
    pins = re.findall(r"pip install '?spark-share(?:\[[a-z,]+\])?==([^'\s`]+)", text)
    assert pins, "README.md has no `pip install spark-share==<version>` line"
    assert set(pins) == {spark_share.__version__}, pins


def test_every_wheel_the_docs_name_is_this_version():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    named = {(p.name, v) for p in pages for v in re.findall(r"spark_share-([^-\s/`]+)-py3-none-any\.whl", p.read_text())}
    assert named, "no page names the wheel"
    assert {v for _, v in named} == {spark_share.__version__}, sorted(named)
