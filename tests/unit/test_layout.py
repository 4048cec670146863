"""The package's layering, as docs/architecture.md states it: ``driver/`` and ``executor/`` import nothing
from each other; ``consumers/`` (what both read modes run) imports neither; ``transport/`` none of them."""
from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "spark_share"
FORBIDDEN = {
    "driver": {"executor"},
    "executor": {"driver"},
    "consumers": {"driver", "executor", "user"},
    "transport": {"driver", "executor", "consumers", "user"},
}


def _imported_subpackages(path: pathlib.Path) -> set[str]:
    """The spark_share subpackages a module imports, at any depth of its code (lazy imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                parts = (node.module or "").split(".")
                if parts[0] == "spark_share" and len(parts) > 1:
                    found.add(parts[1])
            elif node.level == 2:  # inside a subpackage: from ..x import y, or from .. import x
                found.update([node.module.split(".")[0]] if node.module else (a.name for a in node.names))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "spark_share" and len(parts) > 1:
                    found.add(parts[1])
    return found


@pytest.mark.parametrize("subpackage", sorted(FORBIDDEN))
def test_a_subpackage_imports_nothing_it_must_not(subpackage):
    modules = sorted((PACKAGE / subpackage).glob("*.py"))
    assert modules, f"spark_share/{subpackage}/ has no modules"
    wrong = {m.name: sorted(_imported_subpackages(m) & FORBIDDEN[subpackage]) for m in modules}
    assert not {m: w for m, w in wrong.items() if w}, f"spark_share/{subpackage}/ imports what it must not: {wrong}"


def test_the_check_sees_a_forbidden_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from ..driver.tracker import Tracker\n    import spark_share.executor.launcher\n")
    assert {"driver", "executor"} <= _imported_subpackages(module)
