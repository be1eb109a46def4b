"""The README and docs/ state the present once: counts that two pages state agree, the pages stay short enough to
read, they name hardware as users do (not the benchmark harness's machines or output placeholders), and the
README's layout map names what foundry/ holds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
README = REPO_ROOT / "README.md"
DOCS = sorted((REPO_ROOT / "docs").glob("*.md"))
PERFORMANCE = REPO_ROOT / "docs" / "PERFORMANCE.md"
LLM_FOUNDRY = REPO_ROOT / "docs" / "LLM_FOUNDRY.md"

PERFORMANCE_MAX_LINES = 600
README_MAX_LINES = 250
# The harness's machine kinds (nvidia-h100-x4, nvidia-h200, ...) and its output placeholder; users read "2× H100 80GB".
HARNESS_WORDS = re.compile(r"nvidia-h[0-9]{3}(-x[0-9])?|\$OUT\b")
# README: "all 26 of LLM Foundry's train YAMLs: 25 run with their paths changed (3 of them after removing
# `packing_ratio`, ...) and 1 is refused at once".
README_YAML_COUNTS = re.compile(
    r"all (\d+) of LLM Foundry's train YAMLs: (\d+) runs? with their paths\s+changed \((\d+) of\s+them after"
    r".*?\) and (\d+) (?:is|are) refused at once",
    re.S,
)
# The README names these files in its layout map; a map that lost them was once shipped.
LAYOUT_MUST_NAME = ["moe.py", "experts.py", "expert_parallel.py", "split_attention.py", "remote_code/"]


def _section(text: str, heading: str) -> str:
    """The text under ``heading`` up to the next heading of the same level."""
    start = text.index(heading) + len(heading)
    level = heading.split(" ", 1)[0]
    following = re.search(rf"^{level} ", text[start:], re.M)
    return text[start : start + following.start()] if following else text[start:]


def _layout_map() -> str:
    """The fenced block of the README's "## Layout"."""
    block = re.search(r"```\n(.*?)```", _section(README.read_text(), "## Layout"), re.S)
    assert block is not None, "README.md's '## Layout' has no fenced map"
    return block.group(1)


def _llm_foundry_table_counts() -> tuple[int, int, int, int]:
    """(YAMLs, run, run after a change, refused) from docs/LLM_FOUNDRY.md's generated table."""
    table = re.search(r"<!-- table: .*? -->\n(.*?)<!-- end of table -->", LLM_FOUNDRY.read_text(), re.S)
    assert table is not None, "docs/LLM_FOUNDRY.md has no generated table"
    verdicts = [line.split("|")[2].strip() for line in table.group(1).splitlines()[2:] if line.startswith("|")]
    runs = [verdict for verdict in verdicts if verdict.startswith("yes")]
    changed = [verdict for verdict in runs if verdict != "yes"]
    refused = [verdict for verdict in verdicts if verdict.startswith("no")]
    assert len(runs) + len(refused) == len(verdicts), f"a verdict neither 'yes...' nor 'no...': {verdicts}"
    return len(verdicts), len(runs), len(changed), len(refused)


def test_readme_states_the_llm_foundry_yaml_counts_of_docs_llm_foundry_table() -> None:
    match = README_YAML_COUNTS.search(README.read_text())
    assert match is not None, "README.md no longer states how many of LLM Foundry's YAMLs run; keep it or drop this"
    stated = tuple(int(group) for group in match.groups())
    assert stated == _llm_foundry_table_counts(), (
        f"README.md says (YAMLs, run, run after a change, refused) = {stated}; docs/LLM_FOUNDRY.md's table (written "
        f"by `python benchmarks/llm_foundry_table.py`) says {_llm_foundry_table_counts()}"
    )


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda page: page.name)
def test_page_names_no_harness_machine_or_output_placeholder(page: Path) -> None:
    found = [
        f"{page.name}:{number}: {match.group(0)}"
        for number, line in enumerate(page.read_text().splitlines(), 1)
        for match in HARNESS_WORDS.finditer(line)
    ]
    assert not found, "name hardware as users do ('2× H100 80GB') and a real --out folder: " + "; ".join(found)


def test_performance_page_stays_within_its_length() -> None:
    lines = len(PERFORMANCE.read_text().splitlines())
    assert lines <= PERFORMANCE_MAX_LINES, (
        f"docs/PERFORMANCE.md has {lines} lines (at most {PERFORMANCE_MAX_LINES}): keep one current table per "
        "comparison and move superseded rounds to benchmarks/results/HISTORY.md"
    )


def test_readme_stays_within_its_length() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to the docs/ page it belongs to"
    )


def test_readme_headline_figures_are_performance_page_figures() -> None:
    performance = PERFORMANCE.read_text()
    headline = _section(README.read_text(), "## Headline figures")
    figures = re.findall(r"\d+(?:,\d{3})+|\d+\.\d+", headline)
    assert figures, "README.md's headline table has no figures"
    missing = sorted({figure for figure in figures if figure not in performance})
    assert not missing, f"README.md's headline figures not in docs/PERFORMANCE.md: {missing}"


def test_layout_map_names_every_package_and_top_level_module() -> None:
    layout = _layout_map()
    packages = sorted(path.parent.name for path in (REPO_ROOT / "foundry").glob("*/__init__.py"))
    modules = sorted(path.name for path in (REPO_ROOT / "foundry").glob("*.py") if not path.name.startswith("__"))
    missing = [f"foundry/{name}/" for name in packages if f"foundry/{name}/" not in layout]
    missing += [name for name in modules if not re.search(rf"(?<!\w){re.escape(name)}", layout)]
    missing += [name for name in LAYOUT_MUST_NAME if name not in layout]
    assert not missing, f"README.md's layout map does not name: {missing}"


def test_layout_map_names_only_files_that_exist() -> None:
    named = set(re.findall(r"\b\w+\.py\b", _layout_map()))
    folders = [REPO_ROOT / folder for folder in ("foundry", "tests", "benchmarks")]
    present = {path.name for folder in folders for path in folder.rglob("*.py")}
    assert named <= present, f"README.md's layout map names files that do not exist: {sorted(named - present)}"


def test_docs_pages_the_readme_names_exist() -> None:
    named = set(re.findall(r"docs/[A-Z_]+\.md", README.read_text()))
    assert named, "README.md names no docs/ page"
    missing = sorted(name for name in named if not (REPO_ROOT / name).is_file())
    assert not missing, f"README.md names docs/ pages that do not exist: {missing}"
