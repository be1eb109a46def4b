"""DPO on 2 gloo ranks equals 1 rank: the same pairs per step, the same losses, metrics and weights, with the
reference a frozen copy replicated (no fsdp_config) or sharded like the policy (FULL_SHARD), a sharded LoRA
model's base with its adapters off, or precomputed by the 2 ranks and read by the 1."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from distributed.jobs import assert_same_run, full_weights
from foundry.core import LoggerDestination
from foundry.data import builtin_corpus_documents, load_tokenizer, train_bpe_tokenizer
from foundry.data.preference import build_preference_dataloader
from foundry.distributed import get_rank
from foundry.models import MPTCausalLM
from foundry.models.build import build_model
from foundry.optim import DecoupledAdamW
from foundry.preference import PreferenceConfig, PreferenceObjective
from foundry.trainer import Trainer

GLOBAL_PAIRS = 4
STEPS = 4


class MetricRecorder(LoggerDestination):
    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if "loss/train/total" in metrics:
            # trainer/tokens counts padding, to each rank's longest pair: not compared
            self.steps.append(
                {name: float(v) for name, v in metrics.items() if name.startswith(("loss/", "rewards/", "logps/"))}
            )


LLAMA_LORA = {
    "name": "llama_causal_lm", "d_model": 32, "n_layers": 2, "n_heads": 4, "kv_n_heads": 2, "vocab_size": 320,
    "max_seq_len": 32, "ffn_hidden_size": 64,
    "peft_config": {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"},
}  # fmt: skip


def train_dpo(
    folder: str, fsdp_config: dict[str, Any] | None, lora: bool = False, reference: str = "auto"
) -> dict[str, Any] | None:
    """Rank 0's logged metrics per step and final weights of a DPO run on this job's ranks (with ``lora``, a tiny
    Llama whose base with adapters off is the reference)."""
    loader = build_preference_dataloader(
        tokenizer=load_tokenizer(f"{folder}/tokenizer"),
        device_batch_size=GLOBAL_PAIRS // torch.distributed.get_world_size(),
        dataset={"hf_name": f"{folder}/pairs.jsonl", "max_seq_len": 32, "shuffle": True, "shuffle_seed": 3},
    )
    torch.manual_seed(17)
    if lora:
        model = build_model(LLAMA_LORA)
    else:
        model = MPTCausalLM(d_model=32, n_heads=4, n_layers=2, vocab_size=320, max_seq_len=32, no_bias=True)
    recorder = MetricRecorder()
    trainer = Trainer(
        model, loader, f"{STEPS}ba", optimizers=lambda params: DecoupledAdamW(params, lr=3e-3),
        objective=PreferenceObjective(PreferenceConfig(beta=0.5, reference=reference)), fsdp_config=fsdp_config,
        device="cpu",
        run_folder=f"{folder}/run-{torch.distributed.get_world_size()}", log_to_console=False, loggers=[recorder],
    )  # fmt: skip
    trainer.fit()
    weights = full_weights(trainer.state.model)
    if get_rank() != 0:
        return None
    losses = {step: metrics["loss/train/total"] for step, metrics in enumerate(recorder.steps)}
    return {"losses": losses, "weights": weights, "steps": recorder.steps}


@pytest.mark.parametrize(
    ("fsdp_config", "lora", "reference"),
    [(None, False, "auto"), ({"sharding_strategy": "FULL_SHARD"}, False, "auto"),
     ({"sharding_strategy": "FULL_SHARD"}, True, "auto"), ({"sharding_strategy": "FULL_SHARD"}, False, "precomputed")],
    ids=["replicated", "sharded", "sharded-lora", "sharded-precomputed"],
)  # fmt: skip
def test_two_ranks_train_dpo_as_one_rank(
    ranks, tmp_path: Path, fsdp_config: dict[str, Any] | None, lora: bool, reference: str
) -> None:
    train_bpe_tokenizer(builtin_corpus_documents()[:2], vocab_size=300, out_dir=tmp_path / "tokenizer")
    rows = [{"prompt": f"Q{i}:", "chosen": " yes" * (1 + i % 3), "rejected": " no" * (1 + i % 4)} for i in range(16)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    two, _ = ranks.run(2, train_dpo, str(tmp_path), fsdp_config, lora, reference)
    (one,) = ranks.run(1, train_dpo, str(tmp_path), fsdp_config, lora, reference)  # precomputed: 2 ranks' table
    assert len(two["steps"]) == len(one["steps"]) == STEPS
    for two_step, one_step in zip(two["steps"], one["steps"]):
        assert set(two_step) == set(one_step)
        for name, value in one_step.items():
            assert two_step[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    assert_same_run(two, one)
