"""The README's options table says what the code accepts."""
import pathlib
import re

from spark_share.options import SOURCE_OPTIONS

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
REQUIRED_KAFKA = {"kafka.bootstrap.servers", "kafka.group.id"}


def options_table() -> dict:
    text = README.read_text()
    section = text.split("### Options", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \|([^|]*)\|", section, flags=re.M)
    assert rows, "no options table under '### Options' in the README"
    return {name: default.strip() for name, default in rows}


def test_the_readme_lists_exactly_the_options_the_source_accepts():
    table = options_table()
    documented = set(table) - REQUIRED_KAFKA - {"kafka.*"}
    assert documented == set(SOURCE_OPTIONS), (
        f"in the README only: {sorted(documented - set(SOURCE_OPTIONS))}; "
        f"in the code only: {sorted(set(SOURCE_OPTIONS) - documented)}")
    assert REQUIRED_KAFKA <= set(table) and "kafka.*" in table


def test_the_readme_defaults_are_the_code_defaults():
    table = options_table()
    for name, (default, _) in SOURCE_OPTIONS.items():
        if default is not None:
            assert table[name] == f"`{default}`", f"{name}: README says {table[name]!r}, the code {default!r}"
        else:
            assert not table[name].startswith("`"), f"{name}: README gives a default, the code has none"
