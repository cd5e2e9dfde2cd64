"""The README and docs/ as a set of pages: every relative link leads to a file of the repository
(and to a heading of it, for a link with an anchor); every measured figure of docs/performance.md
and of the README's table links a record in bench/results/ that exists. The oracle is the tree
itself and GitHub's rule for heading anchors."""

import pathlib
import re

import pytest

from conftest import REPO

PAGES = [REPO / "README.md"] + sorted((REPO / "docs").rglob("*.md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A measured figure: a number with a unit of time, bandwidth, share or speedup.
FIGURE = re.compile(r"\d(?:[\d.,–-]*\d)?\s?(?:s|ms|µs|us|GB/s|TB/s|%|x)(?![\w/])")
RECORD = re.compile(r"\]\(((?:\.\./)*bench/results/[^)#\s]+)\)")


def without_code(text: str) -> str:
    """The page without fenced code blocks (their brackets are code, not links)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation other than - and _ dropped, each space
    a hyphen."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    return {anchor(h) for h in re.findall(r"^#{1,6} (.+)$", without_code(path.read_text(encoding="utf-8")), re.M)}


def test_the_anchor_rule():
    assert anchor("Across nodes: fabric handles (multi-node NVLink, NVL72 / GB200)") == (
        "across-nodes-fabric-handles-multi-node-nvlink-nvl72--gb200"
    )
    assert (
        anchor("`torpor stress`") == "torpor-stress" and anchor("The class × level table") == "the-class--level-table"
    )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_leads_somewhere(page):
    broken = []
    for target in LINK.findall(without_code(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target):
            continue  # http:, https:, mailto:
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists() or REPO not in [dest, *dest.parents]:
            broken.append(target)
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(target)
    assert broken == []


def blocks(text: str):
    """Paragraphs, list items and table rows (header and rule rows left out) of a page."""
    for chunk in re.split(r"\n\s*\n", without_code(text)):
        lines = chunk.strip("\n").splitlines()
        if not lines or lines[0].startswith("#"):
            continue
        if lines[0].startswith("|"):
            yield from (line for line in lines[2:] if line.startswith("|"))
        else:
            items, current = [], []
            for line in lines:
                if re.match(r"(?:[-*]|\d+\.) ", line) and current:
                    items.append(" ".join(current))
                    current = []
                current.append(line.strip())
            yield from items + [" ".join(current)]


def unrecorded_figures(page: pathlib.Path) -> list[str]:
    out = []
    for block in blocks(page.read_text(encoding="utf-8")):
        if not FIGURE.search(block):
            continue
        records = [(page.parent / r).resolve() for r in RECORD.findall(block)]
        if not records or not all(r.is_file() for r in records):
            out.append(block[:100])
    return out


def test_every_figure_of_the_performance_page_links_its_record():
    page = REPO / "docs" / "performance.md"
    assert len([b for b in blocks(page.read_text(encoding="utf-8")) if FIGURE.search(b)]) > 10
    assert unrecorded_figures(page) == []


def test_every_figure_of_the_readme_table_links_its_record():
    text = (REPO / "README.md").read_text(encoding="utf-8").split("## Measured", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in text.splitlines() if line.startswith("|")][2:]
    assert len(rows) == 5
    for row in rows:
        assert FIGURE.search(row), row
        records = RECORD.findall(row)
        assert records and all((REPO / r).is_file() for r in records), row


def test_a_figure_without_a_record_is_found(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("A sleep took 0.5 s.\n\n| a | 3 ms |\n| --- | --- |\n| b | 4 ms |\n\nNo figure here.\n")
    assert sorted(unrecorded_figures(page)) == ["A sleep took 0.5 s.", "| b | 4 ms |"]
