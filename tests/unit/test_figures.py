"""A measured figure a page quotes is a link to its mark in the current-figures table of benchmarks/RESULTS.md
(``<a id="ID"></a>**VALUE**``) and reads as the figure there: a page that quotes a stale figure, or a mark that is
gone, fails here. The docs site includes RESULTS.md as docs/results.md, so docs pages link to ``results.md#ID``."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
RESULTS = (ROOT / "benchmarks" / "RESULTS.md").read_text()
CURRENT = RESULTS[RESULTS.index("## Current figures"):RESULTS.index("## History")]
MARKS = dict(re.findall(r'<a id="([a-z0-9-]+)"></a>\*\*(.+?)\*\*', CURRENT))
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "examples").glob("*.yaml")),
         *sorted((ROOT / "plugins").glob("*/*/README.md"))]
LINK = re.compile(r"\[([^\]]+)\]\((?:\.\./)*(?:benchmarks/RESULTS|results)\.md#([a-z0-9-]+)\)")


def norm(text: str) -> str:
    return " ".join(text.replace("**", "").split())


def test_the_marks_are_unique_and_in_the_current_figures():
    ids = re.findall(r'<a id="([a-z0-9-]+)"></a>', RESULTS)
    assert len(ids) == len(set(ids)) and set(ids) == set(MARKS), "marks belong in the current-figures table, once"
    assert {"quickstart-heldout", "quickstart-heldout-sampled"} <= set(MARKS)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_quoted_figure_is_the_current_one(page):
    for text, mark in LINK.findall(page.read_text()):
        assert mark in MARKS, f"{page.relative_to(ROOT)} links to RESULTS.md#{mark}, which is no mark"
        assert norm(text) == norm(MARKS[mark]), (f"{page.relative_to(ROOT)} quotes {text!r} for {mark}; the current "
                                                 f"figure is {MARKS[mark]!r}")
    if page.is_relative_to(ROOT / "docs"):  # the site has no benchmarks/ folder: `mkdocs build --strict` refuses it
        assert "benchmarks/RESULTS.md#" not in page.read_text(), f"{page.relative_to(ROOT)}: link to results.md#ID"


def test_the_quickstart_figure_is_quoted_where_a_new_user_reads_it():
    for page in ("README.md", "docs/getting-started.md"):
        assert "quickstart-heldout" in {m for _, m in LINK.findall((ROOT / page).read_text())}, page
