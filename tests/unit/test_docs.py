"""The README, tests/README.md and the docs/ pages say what the repository holds.

Every relative link and image resolves to a file of the repository (and a ``#fragment`` to a heading of
that page), every ```python block compiles, every repository path named in backticks or in a code block
exists, the README stays a landing page that links to every page, and one page only has a top section
called "Guarantees". The options table (docs/options.md) is checked against the code by
tests/unit/test_options_doc.py.
"""
from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
README_MAX_LINES = 400
PAGES = [README, ROOT / "tests" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A path in backticks is the repository's when its first part is one of these.
TOP_LEVEL = {"spark_share", "jobs", "benchmarks", "tests", "conf", "notebooks", "docs", ".ci"}
PATH_TOKEN = re.compile(r"^(?:\./)?([A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.*-]+)+/?)")
# Files the pages tell you to write yourself, not files of the repository.
YOURS = {"orders.py"}
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")


def _ids(pages):
    return [str(p.relative_to(ROOT)) for p in pages]


def _prose(text: str) -> str:
    """The text without its fenced code blocks (a link inside one is not a link)."""
    return FENCE.sub("", text)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    s = re.sub(r"`|\*|_(?=\W)|(?<=\W)_", "", heading.strip().lower())
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def _anchors(page: pathlib.Path) -> set[str]:
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", _prose(page.read_text()), flags=re.M)}


def _headings(page: pathlib.Path) -> list[tuple[int, str]]:
    return [(len(m[0]), m[1].strip()) for m in re.findall(r"^(#{1,6}) (.+)$", _prose(page.read_text()), flags=re.M)]


def _repo_paths(text: str) -> set[str]:
    """Paths of the repository named in inline code or in code blocks (`tests/unit/test_wire.py`,
    `python jobs/queue_to_table.py --config conf/local.json`), and bare module names (`tracker.py`)."""
    found: set[str] = set()
    spans = INLINE.findall(_prose(text)) + [body for _, body in FENCE.findall(text)]
    for span in spans:
        for token in re.split(r"[\s=,;()\[\]{}\"']+", span):
            m = PATH_TOKEN.match(token)
            if m and m[1].split("/", 1)[0] in TOP_LEVEL:
                found.add(m[1].rstrip("/.:"))
            elif re.fullmatch(r"[A-Za-z0-9_]+\.py", token) and token not in YOURS:
                found.add(token)
    return found


def _exists(path: str) -> bool:
    if "/" not in path:  # a bare module name: somewhere in the repository
        return any(p for p in ROOT.rglob(path) if ".venv" not in p.parts and ".git" not in p.parts)
    if "*" in path:
        return any(ROOT.glob(path))
    return (ROOT / path).exists()


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_every_relative_link_and_image_resolves(page):
    broken = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists() or ROOT not in dest.parents and dest != ROOT:
            broken.append(f"{target} (no file {dest})")
        elif fragment and dest.suffix == ".md" and fragment not in _anchors(dest):
            broken.append(f"{target} (no heading #{fragment} in {dest.name})")
    assert not broken, f"{page.name}: broken links: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_every_code_block_is_closed(page):
    fences = [n for n, line in enumerate(page.read_text().split("\n"), 1) if line.startswith("```")]
    assert len(fences) % 2 == 0, f"{page.name}: a code block opened at line {fences[-1]} is never closed"


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_every_python_block_compiles(page):
    for n, (lang, body) in enumerate(FENCE.findall(page.read_text())):
        if lang == "python":
            compile(body, f"{page.name} python block {n}", "exec")


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_every_repository_path_named_exists(page):
    missing = sorted(p for p in _repo_paths(page.read_text()) if not _exists(p))
    assert not missing, f"{page.name} names paths the repository does not have: {missing}"


def test_the_readme_is_a_landing_page():
    lines = README.read_text().count("\n")
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; move detail to a docs/ page"


def test_the_readme_links_to_every_page():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in LINK.findall(_prose(README.read_text()))}
    missing = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not missing, f"README.md does not link to {missing}"


def test_one_guarantees_section():
    tops = [(p.name, h) for p in PAGES for level, h in _headings(p) if level <= 2 and h.lower().startswith("guarantees")]
    assert len(tops) == 1, f"one top section on guarantees, in one page: {tops}"


def test_the_checks_catch_what_they_check(tmp_path):
    """Each check can fail: a broken link, an image that is not there, a missing path, a block that does
    not compile are all found in a page made of them."""
    page = tmp_path / "page.md"
    page.write_text("# T\n\n[gone](nowhere.md) ![img](results/none.png) [anchor](#not-here)\n\n"
                    "`spark_share/tracker.py` and `jobs/benchmark.py`, `clusters.py`\n\n"
                    "```python\ndef broken(:\n```\n")
    assert {"spark_share/tracker.py", "jobs/benchmark.py", "clusters.py"} <= _repo_paths(page.read_text())
    assert not any(_exists(p) for p in ("spark_share/tracker.py", "jobs/benchmark.py", "clusters.py"))
    assert _exists("spark_share/driver/tracker.py") and _exists("tracker.py") and _exists("docs/results/chaos/*.png")
    assert LINK.findall(_prose(page.read_text())) == ["nowhere.md", "results/none.png", "#not-here"]
    assert "not-here" not in _anchors(page) and "t" in _anchors(page)
    for check in (test_every_relative_link_and_image_resolves, test_every_repository_path_named_exists):
        with pytest.raises(AssertionError):
            check(page)
    with pytest.raises(SyntaxError):
        test_every_python_block_compiles(page)
    page.write_text("# T\n\n```python\nx = 1\n\n## Next\n")
    with pytest.raises(AssertionError):
        test_every_code_block_is_closed(page)
