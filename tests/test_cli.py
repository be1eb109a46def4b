"""The `foundry` command, run in-process: help text, error reporting, --print-config, subcommand routing."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from helpers import TinyLM, token_batches

from foundry import cli, registry
from foundry.config import build as builders

CONFIG = """\
variables:
  seq: 16
run_name: cli-test
model: {name: tiny_test_model, max_seq_len: "${variables.seq}"}
tokenizer: {name: gpt2}
train_loader: {name: text, dataset: {local: ./data}}
optimizer: {name: decoupled_adamw, lr: 1.0e-3}
max_duration: 2ba
global_train_batch_size: 4
"""


def write_config(folder: Path) -> Path:
    path = folder / "cfg.yaml"
    path.write_text(textwrap.dedent(CONFIG))
    return path


@pytest.fixture
def config_path(tmp_path: Path) -> Path:
    return write_config(tmp_path)


def test_train_help_explains_overrides_and_lists_keys_with_defaults(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert "optimizer.lr=3e-4" in out
    assert "global_train_batch_size: int (required)" in out
    assert "save_interval: Time = 1000ba" in out
    assert "fsdp_config (FSDPConfig):\n    sharding_strategy" in out  # one key a line, with what it does
    assert "limit_all_gathers: bool = True\n        no effect" in out


def test_bad_key_prints_one_paragraph_error_and_exits_2(config_path: Path, capsys: pytest.CaptureFixture) -> None:
    code = cli.main(["train", str(config_path), "max_durration=5ba"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ") and "Traceback" not in err
    assert "'max_durration'" in err and "Did you mean 'max_duration'" in err
    assert len(err.strip().splitlines()) == 1


def test_debug_flag_shows_the_exception(config_path: Path) -> None:
    from foundry.errors import ConfigError

    with pytest.raises(ConfigError):
        cli.main(["train", str(config_path), "max_durration=5ba", "--debug"])


def test_missing_config_file_is_a_clean_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code = cli.main(["train", str(tmp_path / "absent.yaml")])
    assert code == 2 and "absent.yaml' does not exist" in capsys.readouterr().err


def test_print_config_prints_resolved_yaml_with_overrides(config_path: Path, capsys: pytest.CaptureFixture) -> None:
    code = cli.main(["train", str(config_path), "--print-config", "variables.seq=32", "optimizer.lr=3e-4"])
    printed = yaml.safe_load(capsys.readouterr().out)
    assert code == 0
    assert printed["model"]["max_seq_len"] == 32 and printed["optimizer"]["lr"] == 3e-4
    assert printed["max_duration"] == "2ba" and printed["seed"] == 17 and "variables" not in printed


def test_print_config_runs_the_checks_of_a_run(config_path: Path, tmp_path: Path, capsys) -> None:
    typo = ["--print-config", "callbacks={speed_monitor: {windw_size: 5}}"]
    assert cli.main(["train", str(config_path), *typo]) == 2
    assert "callbacks.speed_monitor" in capsys.readouterr().err
    (tmp_path / "a-file").write_text("")
    unwritable = ["--print-config", f"save_folder={tmp_path / 'a-file' / 'checkpoints'}"]
    assert cli.main(["train", str(config_path), *unwritable]) == 2
    assert "save_folder" in capsys.readouterr().err


def test_override_that_looks_like_an_option_is_rejected(config_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", str(config_path), "--bogus"])
    assert exit_info.value.code == 2


def test_only_the_chosen_command_builds_its_arguments() -> None:
    assert cli.selected_command(["--debug", "data", "convert", "--out", "x"]) == "data convert"
    parser = cli.build_parser("train")
    assert parser.parse_args(["data", "convert"]).run is cli.run_convert  # convert's arguments were never added


def test_top_level_help_does_not_import_the_trainer_or_data_tools() -> None:
    code = "import sys; from foundry import cli; cli.build_parser(None).format_help(); print(*sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    modules = set(result.stdout.split())
    assert not modules & {
        "foundry.trainer",
        "foundry.config.build",
        "foundry.data.convert",
        "transformers",
        "streaming",
    }


def tiny_loader(tokenizer: object, device_batch_size: int, **settings: object) -> list:
    return token_batches(2, device_batch_size)


def tiny_model(max_seq_len: int) -> TinyLM:
    return TinyLM()


registry.models.register("test_cli_lm", tiny_model)
registry.dataloaders.register("test_cli_loader", tiny_loader)


def test_train_runs_fit_and_says_where_the_run_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setattr(builders, "load_tokenizer", lambda name, **kwargs: None)
    overrides = ["model.name=test_cli_lm", "train_loader.name=test_cli_loader", f"run_folder={tmp_path}/{{run_name}}"]
    overrides += ["precision=fp32", "device=cpu", "log_to_console=false", "expandable_segments=false"]
    code = cli.main(["train", str(write_config(tmp_path)), *overrides])
    assert code == 0
    assert (tmp_path / "cli-test" / "metrics.jsonl").is_file()
    assert f"metrics in {tmp_path / 'cli-test'}" in capsys.readouterr().out


def test_train_stopped_by_reference_curve_exits_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import json

    reference = tmp_path / "reference"
    reference.mkdir()
    rows = [{"step": step, "loss/train/total": 0.01, "trainer/tokens": step * 64} for step in range(1, 5)]
    (reference / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))  # far below any loss
    monkeypatch.setattr(builders, "load_tokenizer", lambda name, **kwargs: None)
    overrides = ["model.name=test_cli_lm", "train_loader.name=test_cli_loader", f"run_folder={tmp_path}/{{run_name}}"]
    overrides += ["precision=fp32", "device=cpu", "log_to_console=false", "expandable_segments=false"]
    overrides += [f"callbacks={{reference_curve: {{reference: {reference}, action: stop}}}}"]
    assert cli.main(["train", str(write_config(tmp_path)), *overrides]) == 1
    assert "FAILED its reference check: reference_curve: at batch" in capsys.readouterr().out


def test_plot_command_draws_runs_side_by_side(tmp_path) -> None:
    import json

    for name, losses in (("a", [3.0, 2.0]), ("b", [3.5, 2.5])):
        rows = [{"step": step + 1, "loss/train/total": loss} for step, loss in enumerate(losses)]
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "both.png"
    assert cli.main(["plot", str(tmp_path / "a"), str(tmp_path / "b"), "-o", str(out)]) == 0
    assert out.read_bytes().startswith(b"\x89PNG") and out.stat().st_size > 1000


@pytest.mark.parametrize(
    ("argv", "exit_code"),
    [(["train", "--help"], 0), (["eval", "--help"], 0), (["train", "CONFIG", "save_intervl=1ba"], 2)],
    ids=["train-help", "eval-help", "config-error"],
)
def test_help_and_config_errors_answer_without_importing_torch(
    argv: list[str], exit_code: int, config_path: Path
) -> None:
    # torch, transformers and torchmetrics cost seconds to import; a typo or --help must not wait for them.
    argv = [str(config_path) if arg == "CONFIG" else arg for arg in argv]
    code = (
        "import sys; from foundry import cli\n"
        f"try:\n    code = cli.main({argv!r})\nexcept SystemExit as exit:\n    code = exit.code\n"
        "print('EXIT', code, 'torch' in sys.modules, 'transformers' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip().splitlines()[-1] == f"EXIT {exit_code} False False", result.stdout


QUICKSTART = Path(__file__).resolve().parents[1] / "yamls" / "quickstart.yaml"


def test_a_wrong_data_folder_is_named_as_the_data_not_the_tokenizer(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    code = cli.main(["train", str(QUICKSTART), f"variables.data_local={tmp_path / 'nowhere'}"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"No dataset at '{tmp_path / 'nowhere'}' ('train_loader.dataset.local'" in err
    assert "variables.data_local" in err and "foundry data convert" in err
    assert "tokenizer" not in err and "../shared" not in err


def test_a_missing_tokenizer_folder_names_ways_every_user_has() -> None:
    from foundry.data import load_tokenizer
    from foundry.errors import DataError

    with pytest.raises(DataError) as failed:
        load_tokenizer("./nowhere/tokenizer")
    message = str(failed.value)
    assert "does not exist" in message and "foundry data convert" in message and "save_pretrained" in message
    assert "shared" not in message


@pytest.mark.parametrize(
    ("gpus", "device", "expected"),
    [(0, None, "which has 2 core(s)"), (2, None, "which has 2 GPU(s)"), (2, "cpu", "which has 2 core(s)")],
)
def test_nproc_beyond_the_gpus_or_cores_is_refused_with_the_count(
    config_path: Path, capsys, monkeypatch, gpus: int, device: str | None, expected: str
) -> None:
    import os

    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0, 1}, raising=False)
    overrides = [f"device={device}"] if device else []
    code = cli.main(["train", str(config_path), "--nproc", "8", *overrides])
    err = capsys.readouterr().err
    assert code == 2
    assert "--nproc 8 starts 8 ranks" in err and expected in err and "Use --nproc 2 or fewer" in err


@pytest.mark.parametrize(
    "typo",
    [
        "max_durration=5ba",  # top level
        "train_loader.num_workerz=1",  # a typed section
        "model.n_layrs=2",  # a model's config dataclass, read from its source
        "callbacks.speed_monitor.windw_size=3",  # a component's constructor, read from its source
    ],
)
def test_a_config_typo_is_reported_without_importing_torch(typo: str) -> None:
    code = (
        "import sys; from foundry import cli; "
        f"code = cli.main(['train', {str(QUICKSTART)!r}, {typo!r}]); "
        "print(code, 'torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["2", "False"]
    assert "Did you mean" in result.stderr


QUICKSTART_MOE = QUICKSTART.with_name("quickstart-moe.yaml")
MPT_MOE = "model.ffn_config={ffn_type: mb_dmoe, moe_num_experts: 4, moe_top_k: 5}"


@pytest.mark.parametrize(
    ("yaml_path", "override", "named"),
    [
        (QUICKSTART_MOE, "model.moe_top_k=9", "'model.moe_top_k' is 9"),
        (QUICKSTART_MOE, "model.moe_top_k=0", "'model.moe_top_k' is 0"),
        (QUICKSTART_MOE, "model.moe_num_experts=0", "'model.moe_num_experts' is 0"),
        (QUICKSTART, MPT_MOE, "'model.ffn_config.moe_top_k' is 5"),  # MPT's experts are written nested
    ],
    ids=["llama-top-k-9", "llama-top-k-0", "llama-experts-0", "mpt-nested-top-k"],
)
def test_moe_values_are_refused_by_the_key_written_before_the_process_group_data_or_model(
    yaml_path: Path, override: str, named: str, tmp_path: Path, capsys, monkeypatch
) -> None:
    from foundry import distributed

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the config's own check comes first")

    monkeypatch.setattr(builders, "build_model", never)
    monkeypatch.setattr(distributed, "init_process_group", never)
    code = cli.main(["train", str(yaml_path), f"variables.data_local={tmp_path / 'absent'}", override])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: {named}") and "'model.ffn_config'" not in err  # a key never written


def test_an_expert_parallel_degree_that_does_not_divide_the_experts_names_the_key_and_the_count(capsys) -> None:
    code = cli.main(
        ["train", str(QUICKSTART_MOE), "--print-config", "--nproc", "3", "parallelism.expert_parallel_degree=3"]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert "'parallelism.expert_parallel_degree' is 3" in err and "8 experts" in err and "(2, 4, 8)" in err


def test_expert_parallelism_on_one_rank_says_how_to_launch_ranks(tmp_path: Path, capsys) -> None:
    overrides = [f"variables.data_local={tmp_path / 'absent'}", "parallelism.expert_parallel_degree=2"]
    assert cli.main(["train", str(QUICKSTART_MOE), *overrides]) == 2
    err = capsys.readouterr().err
    assert "has 1 rank;" in err and "launch 2 ranks (`foundry train --nproc 2`), or set it to 1" in err
    assert "or to 1, or" not in err and "set it to 1, or to 1" not in err


def test_context_parallelism_of_an_alibi_model_is_refused_at_config_time_suggesting_rope(capsys) -> None:
    overrides = ["--print-config", "--nproc", "2", "parallelism.context_parallel_degree=2"]
    assert cli.main(["train", str(QUICKSTART), *overrides]) == 2
    err = capsys.readouterr().err
    assert "model.attn_config.alibi is set" in err
    assert "{alibi: false, rope: true}" in err and "yamls/quickstart-llama.yaml" in err


def test_a_world_size_the_global_batch_does_not_divide_is_refused_before_the_nodes_meet(config_path: Path, capsys):
    launch = ["--nproc", "1", "--nnodes", "3", "--rdzv-endpoint", "127.0.0.1:29500"]
    assert cli.main(["train", str(config_path), *launch, "global_train_batch_size=4"]) == 2
    assert "global_train_batch_size (4) is not divisible by the number of processes (3)" in capsys.readouterr().err
