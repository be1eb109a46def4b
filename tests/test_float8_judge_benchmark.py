"""benchmarks/float8_judge.py's rule, resume and command plumbing, on synthetic curves (no training)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import float8_judge

from foundry.config import load_train_config

STEPS = 40


def curve(offset: float, wiggle: float = 0.0) -> dict[int, float]:
    return {step: 5.0 - 0.02 * step + offset + wiggle * (-1) ** step for step in range(1, STEPS + 1)}


BF16_SEEDS = [curve(-0.05), curve(0.0, wiggle=0.01), curve(0.05)]


def test_float8_between_the_bf16_seeds_passes() -> None:
    verdict = float8_judge.judge_variant(BF16_SEEDS, [curve(-0.02), curve(0.01), curve(0.03)], 10, 10)
    assert verdict["passes"] and verdict["judged_steps"] == STEPS - 10 and verdict["final_steps"] == 10


def test_float8_leaving_the_envelope_after_warm_up_fails() -> None:
    drifting = {step: loss + (0.2 if step > 30 else 0.0) for step, loss in curve(0.0).items()}
    verdict = float8_judge.judge_variant(BF16_SEEDS, [drifting] * 3, 10, 5)
    assert not verdict["inside_envelope"] and not verdict["passes"]
    assert verdict["worst_outside"]["step"] > 30


def test_float8_outside_during_warm_up_only_still_passes() -> None:
    early = {step: loss + (1.0 if step <= 10 else 0.0) for step, loss in curve(0.0).items()}
    assert float8_judge.judge_variant(BF16_SEEDS, [early] * 3, warmup_steps=10 + float8_judge.SMOOTHING_STEPS,
                                      final_steps=10)["passes"]  # fmt: skip


def test_a_final_mean_outside_the_bf16_range_fails_even_inside_the_envelope() -> None:
    # bf16 seeds that cross: a wide envelope at every step, but close final means
    crossing = [{s: 5.0 + 0.1 * (-1) ** (s // 5) * sign for s in range(1, STEPS + 1)} for sign in (1, -1, 0.5)]
    float8 = [{s: 5.09 * (s > 30) + 5.0 * (s <= 30) for s in range(1, STEPS + 1)}] * 3
    verdict = float8_judge.judge_variant(crossing, float8, 10, 5)
    assert not verdict["final_mean_inside"] and not verdict["passes"]


def test_smoothing_is_a_trailing_mean() -> None:
    smoothed = float8_judge.smoothed({1: 1.0, 2: 3.0, 3: 5.0, 4: 7.0}, window=2)
    assert smoothed == {1: 1.0, 2: 2.0, 3: 4.0, 4: 6.0}


def write_run(folder: Path, run: float8_judge.Run, losses: dict[int, float], returncode: int | None = 0) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    result = {"run": run.name, "model": run.model, "variant": run.variant, "seed": run.seed,
              "returncode": returncode, "losses": losses}  # fmt: skip
    (folder / f"{run.name}.json").write_text(json.dumps(result))


def test_verdicts_need_all_three_seeds_of_both_and_read_across_calls(tmp_path: Path) -> None:
    for run in float8_judge.planned_runs(["mpt-1b"], ["rowwise"]):
        folder = tmp_path / ("call1" if run.variant == "bf16" else "call2")
        write_run(folder, run, BF16_SEEDS[run.seed - 17])
    runs = float8_judge.load_runs([str(tmp_path / "call1"), str(tmp_path / "call2")])
    (row,) = float8_judge.judge(runs, 10, 10)
    assert row["model"] == "mpt-1b" and row["variant"] == "float8-rowwise" and row["passes"]
    write_run(tmp_path / "call2", float8_judge.Run("mpt-1b", "float8-rowwise", 19), {}, returncode=None)
    assert float8_judge.judge(float8_judge.load_runs([str(tmp_path / "call1"), str(tmp_path / "call2")]), 10, 10) == []


def test_a_run_is_finished_only_with_exit_0_and_every_step(tmp_path: Path) -> None:
    run = float8_judge.Run("mpt-1b", "bf16", 17)
    assert not float8_judge.finished(run, tmp_path, STEPS)
    write_run(tmp_path, run, dict(list(curve(0.0).items())[:20]), returncode=None)  # cut off by --deadline-s
    assert not float8_judge.finished(run, tmp_path, STEPS)
    write_run(tmp_path, run, curve(0.0))
    assert float8_judge.finished(run, tmp_path, STEPS)


def test_float8_runs_add_their_recipe_and_every_run_its_seed_and_batch() -> None:
    args = argparse.Namespace(steps=300, set=["fsdp_config.mixed_precision=DEFAULT"], smoke=False)
    bf16, float8 = (float8_judge.Run("llama-8b", variant, 18) for variant in ("bf16", "float8-tensorwise"))
    overrides = float8_judge.run_overrides(float8, Path("/data"), args)
    assert "algorithms.float8={recipe: tensorwise}" in overrides and "seed=18" in overrides
    assert "global_train_batch_size=4" in overrides and "device_train_microbatch_size=2" in overrides
    assert "fsdp_config.mixed_precision=DEFAULT" in overrides
    assert not any(o.startswith("algorithms.float8") for o in float8_judge.run_overrides(bf16, Path("/data"), args))


def test_the_control_arm_trains_the_bf16_seeds_again_and_is_judged_as_a_recipe_is(tmp_path: Path) -> None:
    args = argparse.Namespace(steps=300, set=[], smoke=False)
    planned = float8_judge.planned_runs(["mpt-1b"], ["rowwise"], control=True)
    assert [run.variant for run in planned[-3:]] == [float8_judge.CONTROL] * 3 and len(planned) == 9
    for run in planned[-3:]:
        overrides = float8_judge.run_overrides(run, Path("/data"), args)
        assert f"seed={run.seed}" in overrides and not any(o.startswith("algorithms.float8") for o in overrides)
    for run in planned:  # the control's seeds drift apart from the first three: judged, it fails
        drift = 0.2 if run.variant == float8_judge.CONTROL else 0.0
        write_run(tmp_path, run, {step: loss + drift for step, loss in BF16_SEEDS[run.seed - 17].items()})
    verdicts = {
        row["variant"]: row["passes"] for row in float8_judge.judge(float8_judge.load_runs([str(tmp_path)]), 10, 10)
    }
    assert verdicts == {"float8-rowwise": True, float8_judge.CONTROL: False}


@pytest.mark.parametrize("model", list(float8_judge.MODELS))
def test_smoke_models_have_a_middle_block_for_float8_to_convert(model) -> None:
    """--smoke trains tiny models; float8 keeps the first and last blocks in bf16 and refuses to convert nothing."""
    from foundry.algorithms.float8 import float8_module_names
    from foundry.models.build import build_model

    args = argparse.Namespace(steps=3, set=[], smoke=True)
    overrides = float8_judge.run_overrides(float8_judge.Run(model, "float8-rowwise", 17), Path("/data"), args)
    cfg, _ = load_train_config(float8_judge.REPO_ROOT / float8_judge.MODELS[model].yaml, overrides)
    assert float8_module_names(build_model({**cfg.model, "init_device": "meta"}), True, [])


def test_llama_8b_runs_checkpoint_every_block_as_its_bf16_seeds_ran() -> None:
    """llama-8b.yaml ships activation_checkpointing: auto; a judged run differs from the seeds in its variant only."""
    args = argparse.Namespace(steps=300, set=[], smoke=False)
    overrides = float8_judge.run_overrides(float8_judge.Run("llama-8b", "bf16", 17), Path("/data"), args)
    cfg, _ = load_train_config(float8_judge.REPO_ROOT / float8_judge.MODELS["llama-8b"].yaml, overrides)
    assert cfg.fsdp_config.activation_checkpointing is True and "activation_checkpointing_target" not in cfg.model


def test_the_plot_draws_the_envelope(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    runs = {("mpt-1b", "bf16"): dict(zip(float8_judge.SEEDS, BF16_SEEDS)),
            ("mpt-1b", "float8-rowwise"): dict(zip(float8_judge.SEEDS, BF16_SEEDS))}  # fmt: skip
    float8_judge.plot(runs, "mpt-1b", "float8-rowwise", 10, tmp_path / "judge.png")
    assert (tmp_path / "judge.png").stat().st_size > 1000


def test_data_a_run_would_read_twice_is_refused(tmp_path: Path) -> None:
    (tmp_path / "mds" / "train").mkdir(parents=True)
    shards = {"shards": [{"samples": 1000}, {"samples": 700}]}
    (tmp_path / "mds" / "train" / "index.json").write_text(json.dumps(shards))
    args = argparse.Namespace(steps=300, models=["mpt-1b"], smoke=False)  # 300 x 6 = 1,800 samples
    with pytest.raises(SystemExit, match="holds 1700 train samples and a run reads 1800"):
        float8_judge.check_samples(tmp_path, args)
    float8_judge.check_samples(tmp_path, argparse.Namespace(steps=300, models=["llama-8b"], smoke=False))  # 1,200


def test_a_float8_run_that_fell_back_to_bf16_is_a_failure_never_judged(tmp_path: Path, monkeypatch) -> None:
    def trained_in_bf16(yaml, run_folder: Path, overrides, nproc, timeout_s, env) -> int:
        run_folder.mkdir(parents=True)
        (run_folder.parent / f"{run_folder.name}.log").write_text(
            "algorithms.float8: float8 needs a GPU with float8 matrix units ...; this run trains in bf16.\n"
        )
        return 0

    monkeypatch.setattr(float8_judge, "foundry_train", trained_in_bf16)
    args = argparse.Namespace(steps=STEPS, set=[], smoke=False, work=str(tmp_path / "work"))
    run = float8_judge.Run("mpt-1b", "float8-rowwise", 17)
    result = float8_judge.train_one(run, ["0"], tmp_path, args, deadline=float("inf"))
    assert result["returncode"] == "float8 fell back to bf16"
    bf16 = float8_judge.train_one(float8_judge.Run("mpt-1b", "bf16", 17), ["0"], tmp_path, args, float("inf"))
    assert bf16["returncode"] == 0
