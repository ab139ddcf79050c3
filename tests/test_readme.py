"""The README is the front door: short, for a user, and every number in it generated or checked here.

- the support summary is rendered from ``src/padfree/proof/support.json`` (``PADFREE_UPDATE_DOCS=1`` rewrites it);
- each figure of the performance table is one that ``BENCHMARKS.md`` holds;
- the extras table names exactly the extras ``pyproject.toml`` declares for users;
- every relative link points at a file of the repository;
- no words of the project's own housekeeping.

The README's example itself is a doctest (``--doctest-glob=*.md``), and ``scripts/check_wheel.sh`` runs it again
against the installed wheel.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from padfree.proof import registry

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
UPDATE = os.environ.get("PADFREE_UPDATE_DOCS") == "1"
MAX_LINES = 250
BEGIN, END = "<!-- support-summary:begin -->", "<!-- support-summary:end -->"


def section(text: str, heading: str) -> str:
    """The body of the ``## heading`` section."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    assert match, f"the README has no '## {heading}' section"
    return match.group(1)


def table_rows(body: str) -> list[list[str]]:
    """The cells of a markdown table's body rows (header and rule left out)."""
    rows = [line for line in body.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]


def test_the_readme_fits_on_a_few_screens():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; at most {MAX_LINES}"


def test_the_support_summary_is_rendered_from_support_json():
    text = README.read_text()
    block = f"{BEGIN}\n{registry.support_summary()}\n{END}"
    if UPDATE:
        text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S)
        README.write_text(text)
    assert block in text, "the README's support summary is stale: rerun with PADFREE_UPDATE_DOCS=1"


def test_the_summary_counts_every_type_of_support_json():
    table = registry.load()
    summary = registry.support_summary(table)
    causal, vision = table["types"], table.get("multimodal", {})
    exact = sum(e["verdict"] == "exact" for e in causal.values())
    assert f"{len(causal)} model types of transformers {table['transformers']} — **{exact} exact**" in summary
    assert f"{len(causal) - exact} refused" in summary
    for name, entry in {**causal, **vision}.items():
        if entry["verdict"] != "exact":  # every refused type is named
            assert re.search(rf"[(, ]{re.escape(name)}[,)]", summary), name
    with_images = sum((e.get("images") or {}).get("verdict") == "exact" for s in (causal, vision) for e in s.values())
    assert f"**{with_images} types exact with images**" in summary
    assert len(summary.splitlines()) == 5


def test_every_performance_figure_is_one_benchmarks_md_holds():
    benchmarks = (ROOT / "BENCHMARKS.md").read_text()
    body = section(README.read_text(), "Performance")
    assert len(table_rows(body)) == 3
    figures = re.findall(r"(?<![\w.])\d[\d,.]*\d(?:×| ms|%|M)?|(?<![\w.])\d(?:×| ms|%|M)?", body)
    assert len(figures) >= 12
    missing = [f for f in figures if f not in benchmarks]
    assert not missing, f"README performance figures not found in BENCHMARKS.md: {missing}"


def test_the_strategy_count_is_the_packers():
    from padfree import Packer

    counts = re.findall(r"its (\d+) strategies", README.read_text())
    assert counts == [str(len(Packer.strategies()))]


def test_the_extras_table_names_the_declared_extras():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    rows = table_rows(section(README.read_text(), "Install"))
    listed = {row[0].strip("`") for row in rows} - {"*(none)*"}
    assert listed == declared - {"dev", "bench"}  # the project's own extras are not for users


def test_every_relative_link_resolves():
    for page in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to {target}, which is missing"


@pytest.mark.parametrize("word", ["issue", "VM", "latest run", "this machine", "session"])
def test_no_housekeeping_words(word):
    text = README.read_text()
    found = re.findall(rf"\b{re.escape(word)}\b", text, flags=re.I if word.islower() else 0)
    assert not found, f"README.md says {word!r}"
    assert not re.search(r"\bcommit [0-9a-f]{7,}\b", text)


def test_the_tested_versions_table_is_tested_versions_json():
    import json

    versions = json.loads((ROOT / "src" / "padfree" / "tested_versions.json").read_text())
    page = (ROOT / "docs" / "install.md").read_text()
    block = page.split("<!-- tested-versions:begin -->")[1].split("<!-- tested-versions:end -->")[0]
    rows = {row[0]: (row[1], row[2]) for row in table_rows(block)}
    assert rows == {name: (v["newest"], v["floor"]) for name, v in versions.items()}
