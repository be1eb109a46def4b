"""``fsdp_config.activation_checkpointing: auto``: the fewest whole blocks checkpointed that let the step fit."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import quickstart_corpus, repo_pythonpath
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from foundry import cli
from foundry.config import auto_checkpointing, load_train_config
from foundry.config.auto_checkpointing import MEMORY_SHARE, check_ranks_agree, choose_checkpointing, device_memory_gib
from foundry.config.dry_run import GIB, dry_run
from foundry.distributed import placement
from foundry.distributed.activation_checkpoint import apply_activation_checkpointing
from foundry.distributed.config import FSDPConfig
from foundry.distributed.placement import place_model
from foundry.errors import ConfigError
from foundry.models.build import build_model

REPO_ROOT = Path(__file__).resolve().parents[2]
# Six blocks and long sequences: activations are most of the step, so each block left whole costs memory.
TINY = [
    "model.d_model=64",
    "model.n_layers=6",
    "model.n_heads=4",
    "model.kv_n_heads=2",
    "model.vocab_size=512",
    "model.ffn_hidden_size=128",
    "precision=fp32",
    # resharded between microbatches on any card: the plan's fixed part does not move with the card tried
    "fsdp_config={sharding_strategy: FULL_SHARD, activation_checkpointing: auto, reshard_between_microbatches: true}",
    "global_train_batch_size=8",
    "device_train_microbatch_size=4",
    "variables.max_seq_len=256",
]


def tiny_config(*overrides: str):
    return load_train_config(REPO_ROOT / "yamls" / "quickstart-llama.yaml", [*TINY, *overrides])[0]


def planned_gib(blocks: int, *overrides: str, ranks: int = 2) -> float:
    """The dry run's total a GPU with the first ``blocks`` blocks checkpointed, set by hand."""
    cfg = tiny_config(*overrides)
    cfg.fsdp_config.activation_checkpointing = blocks > 0
    cfg.model["activation_checkpointing_target"] = {"mptblock": f"first-{blocks}"} if blocks else None
    return dry_run(cfg, ranks, ranks).total_bytes / GIB


def card_for(needed: int, *overrides: str, ranks: int = 2) -> float:
    """A card on which the first ``needed`` blocks checkpointed is the fewest whose plan fits (checked here)."""
    plans = [planned_gib(blocks, *overrides, ranks=ranks) for blocks in range(7)]
    budget = (plans[needed] + plans[needed - 1]) / 2
    assert min(k for k, plan in enumerate(plans) if plan <= budget) == needed
    return budget / MEMORY_SHARE


@pytest.mark.parametrize("needed", [2, 4, 6])
def test_auto_checkpoints_the_fewest_first_blocks_whose_plan_fits(needed):
    card_gib = card_for(needed)
    chosen, choice = choose_checkpointing(tiny_config(), 2, 2, card_gib)
    assert choice.checkpointed == needed and choice.blocks == 6
    assert chosen.fsdp_config.activation_checkpointing is True
    expected_target = None if needed == 6 else {"MPTBlock": f"first-{needed}"}  # all six: null, every block
    assert chosen.model.get("activation_checkpointing_target") == expected_target
    plan = dry_run(chosen, 2, 2)
    assert plan.checkpointed_blocks == needed and plan.total_bytes == choice.planned_bytes <= choice.budget_bytes


def test_the_dry_run_shows_the_choice_for_the_card_it_is_given(capsys):
    yaml = str(REPO_ROOT / "yamls" / "quickstart-llama.yaml")
    arguments = ["train", yaml, "--dry-run", "--world-size", "2", "--nproc", "2", *TINY]
    assert cli.main([*arguments, "--gpu-memory-gib", str(card_for(4))]) == 0
    out = capsys.readouterr().out
    assert "activation_checkpointing auto: 4 of 6 blocks checkpointed" in out and "; 4 of 6 blocks checkpointed" in out
    assert cli.main([*arguments, "--gpu-memory-gib", "80"]) == 0
    assert "auto: 0 of 6 blocks checkpointed" in capsys.readouterr().out


def test_a_card_with_room_checkpoints_nothing_and_one_without_checkpoints_every_block():
    keep_attention = tiny_config("fsdp_config.activation_checkpointing_keep_attention=true")
    roomy, choice = choose_checkpointing(keep_attention, 2, 2, 80)
    assert choice.checkpointed == 0 and roomy.fsdp_config.activation_checkpointing is False
    assert roomy.fsdp_config.activation_checkpointing_keep_attention is False  # a choice within checkpointing
    assert "activation_checkpointing_target" not in roomy.model
    assert dry_run(roomy, 2, 2).checkpointed_blocks == 0
    tight, choice = choose_checkpointing(tiny_config(), 2, 2, 1e-4)
    assert choice.checkpointed == 6 and tight.fsdp_config.activation_checkpointing is True
    assert "activation_checkpointing_target" not in tight.model  # null: every block
    assert not choice.fits and not choice.fits_card and "above the card's" in choice.line()
    assert "device_train_microbatch_size" in choice.line()  # the fix, where the run may run out of memory


@pytest.mark.parametrize(("card_share", "level"), [(1.1, logging.INFO), (0.9, logging.WARNING)])
def test_a_rank_warns_only_when_even_every_block_checkpointed_plans_above_the_card(
    monkeypatch, caplog, card_share, level
):
    """Between auto's 75% and the whole card the run is tight but fits: a line, not a warning, on every run."""
    _, every_block = choose_checkpointing(tiny_config(), 1, 1, 1e-4)
    card_gib = card_share * every_block.planned_bytes / GIB  # the plan: 1/1.1 or 1/0.9 of it
    monkeypatch.setattr(auto_checkpointing, "device_memory_gib", lambda device, ranks_per_node: card_gib)
    with caplog.at_level(logging.INFO, logger="foundry.config.auto_checkpointing"):
        resolved = auto_checkpointing.resolve_for_this_rank(tiny_config())
    assert resolved.fsdp_config.activation_checkpointing is True
    assert [record.levelno for record in caplog.records] == [level]
    assert "6 of 6 blocks checkpointed" in caplog.text
    assert ("within the card's" in caplog.text) == (level == logging.INFO)


def test_the_choice_leaves_the_callers_config_as_it_was():
    cfg = tiny_config()
    choose_checkpointing(cfg, 2, 2, 1e-4)
    assert cfg.fsdp_config.activation_checkpointing == "auto" and "activation_checkpointing_target" not in cfg.model


def test_auto_beside_a_target_or_an_auto_microbatch_is_refused_naming_both_keys():
    with pytest.raises(ConfigError, match=r"model.activation_checkpointing_target is \['mlp'\].*Drop the target"):
        choose_checkpointing(tiny_config("model.activation_checkpointing_target=[mlp]"), 2, 2, 80)
    with pytest.raises(ConfigError, match="device_train_microbatch_size are both 'auto'.*Give device_train_micro"):
        choose_checkpointing(tiny_config("device_train_microbatch_size=auto"), 2, 2, 80)


def test_foundry_train_refuses_auto_beside_a_target_before_any_rank_starts(capsys):
    yaml = str(REPO_ROOT / "yamls" / "quickstart-llama.yaml")
    overrides = [*TINY, "model.activation_checkpointing_target=[mlp]"]
    assert cli.main(["train", yaml, "--print-config", "--nproc", "2", *overrides]) != 0
    assert "model.activation_checkpointing_target is ['mlp']" in capsys.readouterr().err


def test_the_dry_run_alone_refuses_auto_rather_than_plan_every_block():
    with pytest.raises(ConfigError, match="'auto', a choice the dry run does not plan itself.*choose_checkpointing"):
        dry_run(tiny_config("global_train_batch_size=4"), 1, 1)


def test_a_layout_the_dry_run_cannot_plan_is_refused_naming_auto_and_the_way_out():
    with pytest.raises(ConfigError, match="'auto', which chooses by the dry run.*tensor parallel.*true or false"):
        choose_checkpointing(tiny_config("parallelism.tensor_parallel_degree=2"), 2, 2, 80)


def test_a_python_trainer_given_auto_is_told_how_to_choose():
    section = {"name": "llama_causal_lm", "d_model": 32, "n_layers": 2, "n_heads": 2, "kv_n_heads": 2, "vocab_size": 64}
    model = build_model(section)
    with pytest.raises(ConfigError, match="foundry train` resolves.*choose_checkpointing"):
        place_model(model, torch.device("cpu"), FSDPConfig(activation_checkpointing="auto"), "fp32")


def test_a_gpu_named_without_an_index_is_the_local_ranks(monkeypatch):
    """``device: cuda`` reads, and makes current, the GPU the process group gives this rank (LOCAL_RANK)."""
    made_current = []
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)

    def card(index: int) -> SimpleNamespace:
        return SimpleNamespace(total_memory=(80 + index) * GIB)

    monkeypatch.setattr(torch.cuda, "get_device_properties", card)
    assert device_memory_gib(torch.device("cuda"), 2) == 81 and made_current == [1]
    assert device_memory_gib(torch.device("cuda:0"), 2) == 80 and made_current == [1, 0]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return quickstart_corpus(tmp_path_factory, 256)


def train_args(folder: Path, data: Path, *overrides: str) -> list[str]:
    return [
        "train", str(REPO_ROOT / "yamls" / "quickstart-llama.yaml"), f"variables.data_local={data}",
        f"run_folder={folder}", "save_folder=null", "eval_loader=null", "callbacks={}", "console_log_interval=1ba",
        "max_duration=3ba", "device=cpu", *TINY, *overrides,
    ]  # fmt: skip


def losses(folder: Path) -> list[float]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [row["loss/train/total"] for row in rows if "loss/train/total" in row]


def test_foundry_train_checkpoints_what_auto_chose_and_trains_to_the_same_losses(tmp_path, data, monkeypatch, caplog):
    card_gib = card_for(3, "global_train_batch_size=4", ranks=1)  # in this process: one rank
    monkeypatch.setattr(auto_checkpointing, "device_memory_gib", lambda device, ranks_per_node: card_gib)
    wrapped = []

    def recorded(model, blocks, *args, **kwargs):
        blocks = apply_activation_checkpointing(model, blocks, *args, **kwargs)
        wrapped.append(sum(isinstance(block, CheckpointWrapper) for block in blocks))
        return blocks

    monkeypatch.setattr(placement, "apply_activation_checkpointing", recorded)
    with caplog.at_level(logging.INFO, logger="foundry.config.auto_checkpointing"):
        assert cli.main(train_args(tmp_path / "auto", data, "global_train_batch_size=4")) == 0
    assert "activation_checkpointing auto: 3 of 6 blocks checkpointed" in caplog.text
    assert wrapped == [3]  # the model trained with the blocks auto chose
    off = "fsdp_config.activation_checkpointing=false"
    plain = train_args(tmp_path / "plain", data, "global_train_batch_size=4", off)
    assert cli.main(plain) == 0
    assert losses(tmp_path / "auto") == pytest.approx(losses(tmp_path / "plain"), abs=1e-6)
    assert len(losses(tmp_path / "auto")) == 3


@pytest.mark.slow  # two torchrun ranks: 20-40 s on the shared 2 cores
def test_two_launched_ranks_plan_on_a_fake_group_then_train_on_gloo(tmp_path, data):
    command = [sys.executable, "-m", "foundry.cli", *train_args(tmp_path, data)[:1], "--nproc", "2"]
    command += train_args(tmp_path, data)[1:]
    cpu_ranks = {**os.environ, "PYTHONPATH": repo_pythonpath(), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=cpu_ranks)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "activation_checkpointing auto: 0 of 6 blocks checkpointed" in done.stdout + done.stderr  # host memory
    assert len(losses(tmp_path)) == 3


def choose_by_rank(blocks_by_rank: list[int]) -> str:
    """One rank's agreement check after it chose ``blocks_by_rank[rank]`` blocks (its error, or "agreed")."""
    cfg = tiny_config()
    rank = torch.distributed.get_rank()
    cfg.fsdp_config.activation_checkpointing = blocks_by_rank[rank] > 0
    cfg.model["activation_checkpointing_target"] = {"MPTBlock": f"first-{blocks_by_rank[rank]}"}
    try:
        check_ranks_agree(cfg)
    except ConfigError as error:
        return str(error)
    return "agreed"


def test_ranks_that_chose_differently_are_refused_rather_than_left_to_hang(ranks):
    assert ranks.run(2, choose_by_rank, [3, 3]) == ["agreed", "agreed"]
    errors = ranks.run(2, choose_by_rank, [0, 3])
    assert errors[0] == errors[1]  # every rank stops, with the same message
    assert "ranks chose differently" in errors[0] and "rank 0: False" in errors[0] and "first-3" in errors[0]
    assert "--dry-run --gpu-memory-gib G" in errors[0]
