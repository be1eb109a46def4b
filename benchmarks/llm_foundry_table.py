"""Rewrite the table of docs/LLM_FOUNDRY.md from tests/llm_foundry_compat.py, the list the tests run.

    python benchmarks/llm_foundry_table.py

tests/test_llm_foundry_yamls.py runs every YAML of the list and fails when the docs' table differs from it.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "tests"))

from llm_foundry_compat import markdown_table  # noqa: E402  (tests/ is not a package)

DOCS = REPO_ROOT / "docs" / "LLM_FOUNDRY.md"
TABLE = re.compile(r"(<!-- table: .*? -->\n)(.*?)(<!-- end of table -->)", re.S)


def main() -> None:
    text = DOCS.read_text()
    if not TABLE.search(text):
        raise SystemExit(f"{DOCS} has no '<!-- table: ... -->' ... '<!-- end of table -->' block to fill")
    DOCS.write_text(TABLE.sub(lambda match: match.group(1) + markdown_table() + match.group(3), text))
    print(f"wrote the table of {DOCS}")


if __name__ == "__main__":
    main()
