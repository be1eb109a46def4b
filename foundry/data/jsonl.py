"""Reading .jsonl files line by line, with errors that name the file and line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from foundry.errors import DataError


def read_jsonl(path: Path, expected_row: str) -> Iterator[tuple[str, Any]]:
    """``("path:line", row)`` for each non-blank line; invalid JSON fails naming the line and ``expected_row``."""
    with path.open(encoding="utf-8") as lines:
        for line_number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(
                    f"{path}:{line_number}: not valid JSON ({error.msg} at column {error.colno}). Each line of a "
                    f".jsonl file must be one JSON object {expected_row}."
                ) from None
            yield f"{path}:{line_number}", row
