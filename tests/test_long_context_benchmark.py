"""benchmarks/long_context.py's loss comparison across calls, on synthetic curves (no training)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import long_context


def curve(offset: float, steps: int = 10) -> dict[str, float]:
    """A falling loss, ``offset`` above or below it on alternate steps; keys as strings, as JSON stores them."""
    return {str(step): 10.0 - 0.5 * step + offset * (-1) ** step for step in range(1, steps + 1)}


def row(name: str, losses: dict[str, float], digest: str = "abc", **extra) -> dict:
    cp = 2 if name.endswith("-cp2") else 1
    return {"row": name, "seq_len": 8192, "context_parallel_degree": cp, "world_size": 2, "tokens_digest": digest,
            "losses": losses, **extra}  # fmt: skip


def write_call(folder: Path, rows: list[dict]) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "long_context.json"
    path.write_text(json.dumps({"environment": {}, "rows": rows}))
    return str(path)


def compare(tmp_path: Path, call1: list[dict], call2: list[dict]) -> dict:
    paths = [write_call(tmp_path / "call1", call1), write_call(tmp_path / "call2", call2)]
    rows = long_context.merge_rows([json.loads(Path(path).read_text())["rows"] for path in paths])
    (group,) = long_context.compare_losses(rows)
    return group


def test_cp2_within_the_spread_of_a_repeat_from_another_call_passes(tmp_path: Path) -> None:
    group = compare(tmp_path, [row("llama8b-8k", curve(0.0)), row("llama8b-8k-repeat", curve(0.02))],
                    [row("llama8b-8k-cp2", curve(0.015))])  # fmt: skip
    assert group["reference"] == "llama8b-8k" and group["same_batches"]
    assert group["spread_max_abs"] == pytest.approx(0.02) and group["tolerance"] == pytest.approx(0.02)
    cp2 = group["rows"]["llama8b-8k-cp2"]
    assert cp2["common_batches"] == 10 and cp2["max_abs_gap"] == pytest.approx(0.015)
    assert cp2["mean_abs_gap"] == pytest.approx(0.015)
    assert group["cp2_within_tolerance"] is True


def test_cp2_beyond_both_the_spread_and_the_tolerance_fails(tmp_path: Path) -> None:
    group = compare(tmp_path, [row("llama8b-8k", curve(0.0)), row("llama8b-8k-repeat", curve(0.0))],
                    [row("llama8b-8k-cp2", curve(0.012))])  # fmt: skip
    assert group["spread_max_abs"] == 0.0 and group["tolerance"] == long_context.LOSS_TOLERANCE
    assert group["cp2_within_tolerance"] is False


def test_cp2_within_the_tolerance_passes_without_a_repeat(tmp_path: Path) -> None:
    group = compare(tmp_path, [row("llama8b-8k", curve(0.0))], [row("llama8b-8k-cp2", curve(0.009))])
    assert group["spread_max_abs"] is None and group["cp2_within_tolerance"] is True


def test_calls_on_different_token_streams_never_pass(tmp_path: Path) -> None:
    group = compare(tmp_path, [row("llama8b-8k", curve(0.0), digest="abc")],
                    [row("llama8b-8k-cp2", curve(0.0), digest="def")])  # fmt: skip
    assert group["same_batches"] is False and group["cp2_within_tolerance"] is False


def test_a_finished_row_replaces_its_partial_save_and_steps_line_up(tmp_path: Path) -> None:
    partial = row("llama8b-8k", curve(0.0, steps=4), partial=True)
    group = compare(tmp_path, [partial, row("llama8b-8k", curve(0.0)), partial],
                    [row("llama8b-8k-cp2", curve(0.001, steps=7))])  # fmt: skip
    assert group["rows"]["llama8b-8k-cp2"]["common_batches"] == 7


def test_rows_of_other_lengths_are_compared_with_their_own_reference() -> None:
    rows = [row("llama8b-8k", curve(0.0)), row("llama8b-16k", curve(1.0)), row("llama8b-16k-cp2", curve(1.0))]
    groups = long_context.compare_losses(rows)
    assert [group["reference"] for group in groups] == ["llama8b-16k", "llama8b-8k"]
    assert groups[0]["rows"]["llama8b-16k-cp2"]["max_abs_gap"] == 0.0 and groups[1]["rows"] == {}


def test_half_the_length_halves_the_linear_part_and_quarters_attention() -> None:
    assert long_context.half_length_step_s(2.0, attention_share=0.0) == pytest.approx(1.0)
    assert long_context.half_length_step_s(2.0, attention_share=1.0) == pytest.approx(0.5)
    assert long_context.LOSS_ROWS["llama8b-8k"] < long_context.LOSS_ROWS["llama8b-8k-cp2"]
