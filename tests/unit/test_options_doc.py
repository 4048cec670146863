"""docs/options.md is generated from the option declarations, and its example's options parse."""
import pathlib
import re

from spark_share.options import OPTIONS, parse_options
from spark_share.options_doc import EXAMPLE, options_markdown

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "options.md"
REGENERATE = "PYTHONPATH=. .venv/bin/python -m spark_share.options_doc > docs/options.md"


def test_the_options_page_is_what_the_code_generates():
    assert PAGE.read_text() == options_markdown(), (
        f"docs/options.md is not what spark_share/options_doc.py generates; regenerate it: {REGENERATE}")


def test_the_page_lists_every_option_with_its_default():
    page = PAGE.read_text()
    for o in OPTIONS:
        default = "required" if o.required else "none" if o.default is None else f"`{o.default}`"
        assert f"| `{o.name}` | {default} |" in page, o.name


def test_the_examples_options_are_accepted():
    reader = EXAMPLE.split('format("kafka-share")', 1)[1].split(".load()", 1)[0]
    given = dict(re.findall(r'\.option\("([^"]+)", "([^"]*)"\)', reader))
    assert {"kafka.group.id", "subscribe"} <= set(given)
    o = parse_options(dict(given, **{"kafka.bootstrap.servers": "127.0.0.1:9092"}))
    assert o.topics == ("orders",) and o.kafka == {"max.poll.records": "2000"}
    assert EXAMPLE in PAGE.read_text()
