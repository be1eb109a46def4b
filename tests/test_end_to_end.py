"""The real path, scaled down: convert → `foundry train` YAML → eval → checkpoint → kill → resume."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers import builds_graphs, quickstart_corpus, repo_pythonpath

from foundry.checkpoint import latest_checkpoint
from foundry.cli import main
from foundry.data import convert_to_mds

REPO_ROOT = Path(__file__).resolve().parents[1]
QUICKSTART_OVERRIDES = [
    "model.d_model=64",
    "model.n_layers=2",
    "model.max_seq_len=32",
    "model.vocab_size=512",
    "variables.max_seq_len=32",
    "global_train_batch_size=8",
    "device_train_microbatch_size=4",
    "device_eval_batch_size=16",
    "eval_first=true",
    "callbacks={}",
    "console_log_interval=5ba",
]


@pytest.fixture(scope="module")
def quickstart_data(tmp_path_factory) -> Path:
    """The quickstart's corpus, as `make quickstart` converts it, at test size."""
    return quickstart_corpus(tmp_path_factory)


def _train(tmp_path: Path, data: Path, *overrides: str) -> int:
    return main(
        [
            "train",
            str(REPO_ROOT / "yamls" / "quickstart.yaml"),
            f"variables.data_local={data}",
            f"run_folder={tmp_path / 'run'}",
            f"save_folder={tmp_path / 'ckpt'}",
            *QUICKSTART_OVERRIDES,
            *overrides,
        ]
    )


def _metrics(run_folder: Path, name: str) -> list[float]:
    rows = [json.loads(line) for line in (run_folder / "metrics.jsonl").read_text().splitlines()]
    return [row[name] for row in rows if name in row]


def test_quickstart_yaml_trains_and_eval_loss_drops(tmp_path, quickstart_data):
    assert _train(tmp_path, quickstart_data, "max_duration=40ba", "eval_interval=20ba", "save_interval=20ba") == 0
    eval_losses = _metrics(tmp_path / "run", "metrics/eval/loss")
    assert len(eval_losses) == 3
    assert eval_losses[-1] < eval_losses[0] - 1.0, eval_losses
    assert latest_checkpoint(tmp_path / "ckpt").name == "ep0-ba40"


KILL_AT_BATCH_SCRIPT = """
import os, signal, sys
from foundry import Callback, registry

@registry.callbacks.register("kill_after_checkpoint")
class KillAfterCheckpoint(Callback):
    def batch_checkpoint(self, state, logger):
        os.kill(os.getpid(), signal.SIGKILL)  # like a preempted node: no cleanup at all

from foundry.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_weights_as_an_uninterrupted_one(tmp_path, quickstart_data):
    # On the CPU: resuming is exact there; some GPU kernels (the embedding's backward) are not bit-deterministic.
    common = ["max_duration=8ba", "eval_interval=100ba", "precision=fp32", "scheduler.t_warmup=2ba", "device=cpu"]
    assert _train(tmp_path / "a", quickstart_data, *common, "save_interval=8ba") == 0

    killed_dir = tmp_path / "b"
    args = [
        "train",
        str(REPO_ROOT / "yamls" / "quickstart.yaml"),
        f"variables.data_local={quickstart_data}",
        f"run_folder={killed_dir / 'run'}",
        f"save_folder={killed_dir / 'ckpt'}",
        *QUICKSTART_OVERRIDES,
        *common,
        "save_interval=3ba",
        "callbacks={kill_after_checkpoint: {}}",
    ]
    process = subprocess.run(
        [sys.executable, "-c", KILL_AT_BATCH_SCRIPT, *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": repo_pythonpath()},
        timeout=300,
    )
    assert process.returncode == -signal.SIGKILL, process.stderr[-2000:]
    assert latest_checkpoint(killed_dir / "ckpt").name == "ep0-ba3"

    assert _train(killed_dir, quickstart_data, *common, "save_interval=8ba", "autoresume=true") == 0
    uninterrupted = _model_weights(latest_checkpoint(tmp_path / "a" / "ckpt"))
    resumed = _model_weights(latest_checkpoint(killed_dir / "ckpt"))
    assert uninterrupted.keys() == resumed.keys()
    for name in uninterrupted:
        assert torch.equal(uninterrupted[name], resumed[name]), name
    train_losses = _metrics(tmp_path / "a" / "run", "loss/train/total")
    resumed_losses = _metrics(killed_dir / "run", "loss/train/total")
    assert resumed_losses[-1] == train_losses[-1]


def _model_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    from foundry.checkpoint import load_checkpoint
    from foundry.core import State, Time
    from foundry.models import MPTCausalLM

    config = json.loads((checkpoint / "meta.json").read_text())["config"]["model"]
    model = MPTCausalLM(**{k: v for k, v in config.items() if k != "name"})
    load_checkpoint(checkpoint, State(model=model, max_duration=Time.parse("1ba")), weights_only=True)
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


@pytest.mark.slow
def test_mpt_small_cpu_yaml_runs_with_only_data_and_tokenizer_changed(tmp_path, shared_data, monkeypatch):
    """LLM Foundry's CPU example, unchanged apart from `data_local` and `tokenizer.name`; it trains 2 of its 10
    batches (`max_duration`), each at its full size (256 samples, a 50k vocabulary), and evaluates at the end."""
    source = shared_data / "reference" / "llm-foundry-yamls" / "pretrain" / "mpt-small-cpu.yaml"
    tokenizer = shared_data / "tokenizers" / "gpt-neox-20b"
    corpus = shared_data / "corpus" / "tinyshakespeare" / "input.txt"
    data = tmp_path / "c4-like"
    convert_to_mds([corpus], data, tokenizer=str(tokenizer), max_seq_len=128, eval_fraction=0.1, progress=False)
    config = yaml.safe_load(source.read_text())
    config["variables"]["data_local"] = str(data)
    config["tokenizer"]["name"] = str(tokenizer)
    config["max_duration"] = "2ba"
    cfg_path = tmp_path / "mpt-small-cpu.yaml"
    cfg_path.write_text(yaml.safe_dump(config))
    monkeypatch.chdir(tmp_path)  # the YAML writes its run folder relative to the working directory
    assert main(["train", str(cfg_path)]) == 0
    rows = (tmp_path / "runs" / "mpt_causal_lm_cpu" / "metrics.jsonl").read_text().splitlines()
    losses = [json.loads(r)["loss/train/total"] for r in rows if "loss/train/total" in r]
    assert len(losses) == 2 and all(loss == loss for loss in losses)
    assert any("metrics/eval/loss" in row for row in rows)


FEW_BATCHES = ["max_duration=6ba", "console_log_interval=1ba", "eval_first=false", "eval_interval=100ba"]
# What `foundry train` picks by itself on one GPU, forced here on the CPU: the whole model compiled (dynamo's
# aot_eager backend: inductor's code generation would take minutes on a CPU runner), the fused loss, and the
# YAML's fsdp_config applied without FSDP on one rank (its PURE precision: a bf16 residual stream).
FAST_PATH = [
    "compile_config={backend: aot_eager}",
    "model.loss_fn=fused_crossentropy",
    "fsdp_config={mixed_precision: PURE}",
]
EAGER_PATH = ["compile_config=false", "model.loss_fn=torch_crossentropy"]


@pytest.mark.parametrize(("precision", "tolerance"), [("fp32", 1e-5), ("amp_bf16", 2e-3)])
def test_the_fast_path_trains_to_the_eager_losses(tmp_path, quickstart_data, precision, tolerance):
    losses = {}
    for name, settings in (("eager", EAGER_PATH), ("fast", FAST_PATH)):
        run = tmp_path / name
        with builds_graphs() if settings is FAST_PATH else contextlib.nullcontext():
            assert _train(run, quickstart_data, *FEW_BATCHES, f"precision={precision}", *settings) == 0
        losses[name] = _metrics(run / "run", "loss/train/total")
    assert len(losses["fast"]) == 6
    assert losses["fast"] == pytest.approx(losses["eager"], rel=tolerance)
