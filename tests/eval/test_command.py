"""``foundry eval`` end to end on tiny checkpoints: tables, files, comparisons, the shared light suite."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from foundry.cli import main
from foundry.eval.metrics import MC_ACCURACY
from foundry.eval_command import display_name

MC_ROWS = [{"query": f"Question {i}: pick", "choices": ["yes", "no"], "gold": i % 2} for i in range(6)]


@pytest.fixture
def tasks_yaml(tmp_path: Path, write_jsonl) -> Path:
    path = write_jsonl("mc.jsonl", MC_ROWS)
    tasks = tmp_path / "tasks.yaml"
    tasks.write_text(
        f"icl_tasks:\n- {{label: mc, dataset_uri: '{path}', icl_task_type: multiple_choice, num_fewshot: [0, 1]}}\n"
    )
    return tasks


def test_eval_of_a_save_folder_prints_a_table_and_writes_files(tiny_checkpoint, tasks_yaml, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    code = main(
        ["eval", "--model", str(tiny_checkpoint), "--tasks", str(tasks_yaml), "--out", str(out), "--precision", "fp32"]
    )
    printed = capsys.readouterr().out
    assert code == 0
    assert f"| mc/1-shot | {MC_ACCURACY} |" in printed
    saved = json.loads((out / "results.json").read_text())
    assert set(saved[0]["results"]) == {"mc/0-shot", "mc/1-shot"}
    assert (out / "results.csv").read_text().startswith("task,metric,")


def test_eval_of_a_checkpoint_without_a_tokenizer_suggests_tokenizer_and_takes_it(
    bpe_tokenizer_dir, tasks_yaml, tmp_path, capsys
) -> None:
    from foundry.convert.checkpoint_io import save_weights_checkpoint
    from foundry.models.build import build_model

    section = {"name": "mpt_causal_lm", "d_model": 32, "n_heads": 2, "n_layers": 2, "vocab_size": 320}
    save_weights_checkpoint(build_model(section), tmp_path / "ckpt", {"model": section}, overwrite=True)  # no tokenizer
    argv = ["eval", "--model", str(tmp_path / "ckpt"), "--tasks", str(tasks_yaml), "--precision", "fp32"]
    assert main(argv) == 2
    assert (
        "has no tokenizer" in (err := capsys.readouterr().err) and "`foundry eval --tokenizer DIR_OR_NAME ...`" in err
    )
    assert main([*argv, "--tokenizer", str(bpe_tokenizer_dir)]) == 0
    assert f"| mc/1-shot | {MC_ACCURACY} |" in capsys.readouterr().out


def test_compare_shows_deltas_and_draws_a_chart(tiny_checkpoint, tasks_yaml, tmp_path, capsys) -> None:
    out = tmp_path / "cmp"
    checkpoint = next(tiny_checkpoint.glob("ep*-ba*"))
    args = ["eval", "--compare", str(tiny_checkpoint), str(checkpoint), "--tasks", str(tasks_yaml), "--out", str(out)]
    assert main([*args, "--precision", "fp32"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert f"| {checkpoint} - {tiny_checkpoint} |" in header
    assert (out / "compare.png").stat().st_size > 0


def test_eval_of_our_hf_export_reads_its_context_length(tiny_hf_dir, tmp_path, write_jsonl, capsys) -> None:
    long_context = " ".join(f"word{i}" for i in range(100))  # longer than the model's 64 positions
    path = write_jsonl("lm.jsonl", [{"context": long_context, "continuation": "end"}] * 2)
    tasks = tmp_path / "long.yaml"
    tasks.write_text(f"icl_tasks:\n- {{label: lm, dataset_uri: '{path}', icl_task_type: language_modeling}}\n")
    assert main(["eval", "--model", str(tiny_hf_dir), "--tasks", str(tasks), "--precision", "fp32"]) == 0
    assert "| lm/0-shot |" in capsys.readouterr().out


def test_eval_without_tasks_says_how_to_give_them(tiny_checkpoint, capsys) -> None:
    assert main(["eval", "--model", str(tiny_checkpoint)]) == 2
    assert "pass --tasks" in capsys.readouterr().err


def test_light_suite_runs_end_to_end_on_cpu(icl_copy, tiny_checkpoint, repo_root, monkeypatch, capsys) -> None:
    monkeypatch.delenv("FOUNDRY_ICL_DATA", raising=False)
    tasks, gauntlet = repo_root / "yamls/eval/tasks_light.yaml", repo_root / "yamls/eval/eval_gauntlet_light.yaml"
    args = ["eval", "--model", str(tiny_checkpoint), "--tasks", str(tasks), "--gauntlet", str(gauntlet)]
    args += ["--icl-data", str(icl_copy)]  # an offline copy of LLM Foundry's scripts/eval folder
    assert main([*args, "--limit", "4", "--batch-size", "16", "--seq-len", "256", "--precision", "fp32"]) == 0
    printed = capsys.readouterr().out
    for row in ("arc_challenge/10-shot", "winograd/0-shot", "triviaqa_small/3-shot", "gauntlet/average"):
        assert f"| {row} |" in printed


def test_task_files_are_downloaded_on_first_use(icl_server, tiny_checkpoint, repo_root, monkeypatch, capsys) -> None:
    monkeypatch.chdir(repo_root.parent)  # no eval/local_data here: the files come from the server
    tasks = repo_root / "yamls/eval/tasks_zero_shot.yaml"
    args = ["eval", "--model", str(tiny_checkpoint), "--tasks", str(tasks), "--limit", "2", "--precision", "fp32"]
    assert main(args) == 0
    assert "| copa/0-shot |" in capsys.readouterr().out
    assert "/local_data/commonsense_reasoning/copa.jsonl" in icl_server.requests


def test_a_model_on_an_object_store_keeps_its_url_as_its_name() -> None:
    assert display_name("s3://bucket/run/checkpoints") == "s3://bucket/run/checkpoints"
    assert display_name("runs/x/") == "runs/x"


def test_importing_the_evaluator_does_not_import_streaming() -> None:
    modules = "foundry.eval.evaluator, foundry.eval.during_training, foundry.eval.report"
    code = f"import sys, {modules}; print('streaming' in sys.modules)"
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert output.strip() == "False"


@pytest.mark.parametrize("given", ["gpt2", "EleutherAI/pythia-14m"])
def test_a_hub_id_is_named_as_one_with_the_way_to_get_it_on_disk(given, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no folder of that name here
    code = main(["eval", "--model", given, "--tasks", "light", "--precision", "fp32"])  # before the list is fetched
    err = capsys.readouterr().err
    assert code == 2
    assert f"No model at '{given}'" in err and "reads as a Hugging Face Hub id" in err and "never downloaded" in err
    assert f"hf download {given} --local-dir models/{given}" in err and f"pass models/{given}" in err
    assert "load_path" not in err


def test_a_missing_local_model_path_says_to_check_it(tasks_yaml, tmp_path, capsys) -> None:
    code = main(["eval", "--model", str(tmp_path / "absent"), "--tasks", str(tasks_yaml), "--precision", "fp32"])
    err = capsys.readouterr().err
    assert code == 2 and "no such file or folder" in err and "Check the path" in err and "Hub id" not in err
