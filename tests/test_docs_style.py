"""The user-facing pages read in a minute and on their own: no commit hashes, issue numbers or GPU-machine
logistics; the README's results are one short claim | verdict | figure table; each table appears once;
abbreviations are glossed where a page first uses them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from .conftest import ROOT

PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "layout.md")]
README_WORDS = 2000
CELL_WORDS = 30
# Each abbreviation, and words that gloss it; the gloss must stand near the page's first use.
GLOSSES = {
    "MFU": "model FLOPs utilization",
    "SQNR": "signal-to-quantization-noise",
    "DLE": "DeepLearningExamples",
    "O2": "optimization level",
    "LogMax": "log2 of the largest gradient",
}
NEAR = 250  # characters either side of the first use


def prose(text: str) -> str:
    """The text a reader reads as words: code spans and blocks, and link targets, left out."""
    text = re.sub(r"```.*?```", " ", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", " ", text)
    return re.sub(r"\]\([^)\s]*\)", "]", text)


def hashes_and_logistics(text: str) -> list[str]:
    found = re.findall(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b", text)
    found += re.findall(r"\bissues? \d+", text, flags=re.I)
    return found + re.findall(r"\bloans?\b", text, flags=re.I)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_a_page_names_no_commit_issue_or_loan(page: Path):
    assert hashes_and_logistics(prose(page.read_text())) == []


def test_the_checks_find_what_they_look_for():
    text = "fixed in commit 8f2c7b0 (issue 24), measured on the third loan; `results/gpu-h100-loan2/` is a path"
    assert hashes_and_logistics(prose(text)) == ["8f2c7b0", "issue 24", "loan"]
    assert tables("| a | b |\n|---|---|\n| 1 | 2 |\n\n| A |  B |\n|---|---|\n") == ["| a | b |", "| a | b |"]


def reproduced_table(readme: str) -> list[list[str]]:
    section = readme[readme.index("## What we reproduced") :]
    section = section[: section.index("\n## ", 1)]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row.strip().strip("|").split(" | ")] for row in rows]


def test_the_readmes_results_are_a_short_claim_verdict_figure_table():
    readme = (ROOT / "README.md").read_text()
    rows = reproduced_table(readme)
    assert [c.lower() for c in rows[0]] == ["claim", "verdict", "figure"] and len(rows) > 5
    for row in rows[2:]:
        for cell in row:
            assert len(prose(cell).split()) <= CELL_WORDS, cell
        # a figure is labelled by what it shows, never by its file name
        for label, target in re.findall(r"\[([^\]]+)\]\(([^)]+)\)", row[2]):
            assert (ROOT / target).is_file(), target
            assert not label.endswith((".png", ".md")) and "_" not in label, label
    assert len(prose(readme).split()) <= README_WORDS


def tables(text: str) -> list[str]:
    lines = text.splitlines()
    heads = [
        lines[i] for i in range(len(lines) - 1) if lines[i].startswith("|") and re.match(r"^\|[-| :]+\|$", lines[i + 1])
    ]
    return [re.sub(r"\s+", " ", h.lower()).strip() for h in heads]


def test_each_table_appears_once_across_the_pages():
    seen: dict[str, str] = {}
    for page in PAGES:
        for head in tables(page.read_text()):
            assert head not in seen, f"{page.name} repeats a table of {seen[head]}: {head}"
            seen[head] = page.name


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_an_abbreviation_is_glossed_where_a_page_first_uses_it(page: Path):
    text = "\n".join(line for line in page.read_text().splitlines() if not line.startswith("#"))
    for term, gloss in GLOSSES.items():
        first = re.search(rf"(?<![\w-]){re.escape(term)}(?![\w-])", text)
        if first:
            near = text[max(0, first.start() - NEAR) : first.end() + NEAR]
            assert gloss in near, f"{page.name}: {term} first used without '{gloss}' beside it"
