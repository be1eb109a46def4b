"""foundry compare: runs aligned by tokens, per-segment |Δ loss| against a band, a yes/no answer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import TINY_MPT, token_batches

from foundry.cli import main
from foundry.convergence import compare, loss_curves, noise_tolerance, report
from foundry.errors import DataError
from foundry.models import MPTCausalLM
from foundry.optim import DecoupledAdamW
from foundry.trainer import Trainer


def write_run(folder: Path, points: list[tuple[int, int, float]], eval_points=(), hyperparameters=None) -> Path:
    """A metrics.jsonl of (step, tokens, train loss) rows, and (step, eval loss) rows."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"hyperparameters": hyperparameters}] if hyperparameters else []
    rows += [{"step": step, "loss/train/total": loss, **({"trainer/tokens": tokens} if tokens is not None else {})}
             for step, tokens, loss in points]  # fmt: skip
    rows += [{"step": step, "metrics/eval/loss": loss} for step, loss in eval_points]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder


def curve(tokens: float) -> float:
    return 8.0 * 0.9 ** (tokens / 1000) + 2.0


def train_tiny(folder: Path, lr: float = 3e-3, batches: int = 12) -> Path:
    torch.manual_seed(0)
    trainer = Trainer(
        model=MPTCausalLM(**TINY_MPT),
        train_dataloader=token_batches(batches, batch_size=4, seq_len=16, vocab_size=TINY_MPT["vocab_size"]),
        max_duration=f"{batches}ba",
        optimizers=lambda params: DecoupledAdamW(params, lr=lr),
        device="cpu",
        run_folder=str(folder),
        log_to_console=False,
    )
    trainer.fit()
    return folder


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    return {"a": train_tiny(root / "a"), "again": train_tiny(root / "again"), "fast_lr": train_tiny(root / "lr", 3e-2)}


def test_two_identical_runs_pass(real_runs) -> None:
    comparison = compare(real_runs["a"], real_runs["again"])
    assert comparison.passed and all(segment.max_abs_diff < 1e-6 for segment in comparison.segments)
    assert "PASS" in report(comparison)


def test_a_run_with_another_learning_rate_fails_naming_where_it_left_the_band(real_runs) -> None:
    comparison = compare(real_runs["a"], real_runs["fast_lr"])
    failure = comparison.first_failure()
    assert failure is not None and failure.metric == "loss/train/total"
    text = report(comparison)
    assert f"FAIL: loss/train/total left the band between {failure.start_tokens:,.0f} and" in text


def test_runs_with_other_batch_sizes_align_by_tokens(tmp_path) -> None:
    small = write_run(tmp_path / "small", [(step, step * 100, curve(step * 100)) for step in range(1, 41)])
    large = write_run(tmp_path / "large", [(step, step * 400, curve(step * 400)) for step in range(1, 11)])
    comparison = compare(small, large)
    assert comparison.passed
    assert sum(segment.points for segment in comparison.segments) == 10  # every point of the large-batch run
    assert max(segment.max_abs_diff for segment in comparison.segments) < 0.01  # linear interpolation only


def test_a_step_offset_by_tokens_is_caught(tmp_path) -> None:
    reference = write_run(tmp_path / "ref", [(step, step * 100, curve(step * 100)) for step in range(1, 41)])
    shifted = write_run(tmp_path / "shifted", [(step, step * 100, curve(step * 100 - 1500)) for step in range(16, 41)])
    assert not compare(reference, shifted).passed


def test_eval_losses_are_compared_at_the_tokens_of_their_step(tmp_path) -> None:
    points = [(step, step * 100, curve(step * 100)) for step in range(1, 21)]
    reference = write_run(tmp_path / "ref", points, eval_points=[(10, 4.0), (20, 3.0)])
    worse = write_run(tmp_path / "worse", points, eval_points=[(10, 4.0), (20, 3.5)])
    comparison = compare(reference, worse, segments=1)
    assert [segment.metric for segment in comparison.segments] == ["loss/train/total", "metrics/eval/loss"]
    assert comparison.first_failure().metric == "metrics/eval/loss"


def test_tokens_come_from_the_hyperparameters_of_an_older_run(tmp_path) -> None:
    hyperparameters = {"global_train_batch_size": 4, "max_seq_len": 16}
    run = write_run(tmp_path / "old", [(step, None, 5.0) for step in (1, 2)], hyperparameters=hyperparameters)
    assert loss_curves(run)["loss/train/total"] == [(64.0, 5.0), (128.0, 5.0)]


def test_runs_that_share_no_tokens_are_an_error(tmp_path) -> None:
    early = write_run(tmp_path / "early", [(1, 100, 5.0), (2, 200, 4.0)])
    late = write_run(tmp_path / "late", [(1, 1000, 3.0), (2, 2000, 2.0)])
    with pytest.raises(DataError, match="share no tokens"):
        compare(early, late)


def test_noise_runs_give_twice_their_mean_difference(tmp_path) -> None:
    a = write_run(tmp_path / "a", [(step, step * 10, 5.0) for step in range(1, 5)])
    b = write_run(tmp_path / "b", [(step, step * 10, 5.0 + 0.01) for step in range(1, 5)])
    assert noise_tolerance(a, b) == pytest.approx(0.02)


def test_noise_from_two_identical_runs_is_refused(tmp_path) -> None:
    a = write_run(tmp_path / "a", [(step, step * 10, 5.0 - step / 10) for step in range(1, 5)])
    b = write_run(tmp_path / "b", [(step, step * 10, 5.0 - step / 10) for step in range(1, 5)])
    with pytest.raises(DataError, match="measure no noise"):
        noise_tolerance(a, b)
    assert main(["compare", str(a), str(b), "--noise", str(a), str(b)]) == 2


def test_the_command_exits_0_on_a_pass_and_1_on_a_failure_and_draws_the_band(real_runs, tmp_path) -> None:
    png = tmp_path / "band.png"
    assert main(["compare", str(real_runs["a"]), str(real_runs["again"]), "-o", str(png)]) == 0
    assert png.stat().st_size > 0
    assert main(["compare", str(real_runs["a"]), str(real_runs["again"]), str(real_runs["fast_lr"])]) == 1
