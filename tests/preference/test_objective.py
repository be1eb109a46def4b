"""The preference objective through the Trainer: its reference, its TRL-named metrics and its refusals."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from foundry.core import LoggerDestination, State
from foundry.core.parallel_dims import ParallelDims
from foundry.errors import ConfigError
from foundry.models.lora import LoraConfig, inject_lora
from foundry.models.mpt import MPTCausalLM
from foundry.preference import PreferenceConfig, PreferenceObjective
from foundry.trainer import Trainer

TRL_METRICS = {
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
}
VOCAB = 64


class Recorder(LoggerDestination):
    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if "loss/train/total" in metrics:
            self.steps.append(metrics)


def tiny_model(vocab_size: int = VOCAB) -> MPTCausalLM:
    torch.manual_seed(0)
    return MPTCausalLM(
        d_model=16,
        n_heads=2,
        n_layers=2,
        max_seq_len=16,
        vocab_size=vocab_size,
        no_bias=True,
        learned_pos_emb=False,
        attn_config={"alibi": True},
    )


def pair_batches(count: int) -> list[dict[str, torch.Tensor]]:
    """Pairs of a 4-token prompt and 4-token responses: chosen counts up, rejected down."""
    batches = []
    for index in range(count):
        prompt = torch.arange(4) + index
        chosen, rejected = torch.arange(10, 14), torch.arange(40, 36, -1)
        input_ids = torch.stack([torch.cat([prompt, chosen]), torch.cat([prompt, rejected])])[None].repeat(2, 1, 1)
        labels = input_ids.clone()
        labels[..., :4] = -100
        batches.append({"input_ids": input_ids, "labels": labels})
    return batches


def train(model: MPTCausalLM, tmp_path: Path, config: PreferenceConfig, batches: int = 6) -> list[dict[str, float]]:
    """fp32 and eager on any device: the policy and its frozen copy then compute alike, to the last bit (a GPU's
    default, bf16 with the policy compiled and the reference eager, rounds them apart by a few thousandths)."""
    recorder = Recorder()
    trainer = Trainer(
        model, pair_batches(batches), f"{batches}ba", objective=PreferenceObjective(config), loggers=[recorder],
        run_folder=str(tmp_path / "run"), progress_bar=False, log_to_console=False, precision="fp32",
        compile_config=False,
    )  # fmt: skip
    trainer.fit()
    return recorder.steps


def test_dpo_starts_at_log_two_against_a_copy_of_the_policy_and_logs_trls_metrics(tmp_path: Path) -> None:
    steps = train(tiny_model(), tmp_path, PreferenceConfig(beta=0.1))
    assert steps[0]["loss/train/total"] == pytest.approx(math.log(2), abs=1e-6)
    assert steps[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert set(steps[0]) >= TRL_METRICS
    assert steps[-1]["loss/train/total"] < steps[0]["loss/train/total"]
    assert steps[-1]["rewards/accuracies"] == 1.0


def test_a_dpo_step_is_one_policy_forward_of_both_sides_one_reference_forward_and_one_backward(
    tmp_path: Path,
) -> None:
    model = tiny_model()
    objective = PreferenceObjective(PreferenceConfig())
    trainer = Trainer(
        model, pair_batches(3), "3ba", objective=objective, run_folder=str(tmp_path / "run"), progress_bar=False,
        log_to_console=False,
    )  # fmt: skip
    forwards: dict[str, list[tuple[int, bool]]] = {"policy": [], "reference": []}

    def record(name: str) -> Any:
        """Each forward's rows, and whether it ran the chunked output projection (no logits)."""
        return lambda module, args, kwargs: forwards[name].append((len(args[0]["input_ids"]), kwargs["token_logps"]))

    model.register_forward_pre_hook(record("policy"), with_kwargs=True)
    objective.reference.register_forward_pre_hook(record("reference"), with_kwargs=True)
    backwards = []
    model.transformer.norm_f.weight.register_hook(lambda grad: backwards.append(1))
    trainer.fit()
    one_forward_a_batch = [(4, True)] * 3  # 2 pairs a batch: their chosen and rejected rows together
    assert forwards == {"policy": one_forward_a_batch, "reference": one_forward_a_batch}
    assert len(backwards) == 3


def test_a_lora_policy_uses_its_base_with_adapters_off_as_the_reference(tmp_path: Path) -> None:
    base = tiny_model()
    model = tiny_model()
    inject_lora(model, LoraConfig(r=4, target_modules="all-linear"))
    objective = PreferenceObjective(PreferenceConfig())
    objective.attach(model)
    assert objective.mode == "adapters_off" and objective.reference is None
    for _, module in model.named_modules():
        if hasattr(module, "lora_B"):
            torch.nn.init.normal_(module.lora_B.weight)  # the adapted model now differs from its base
    reference_free = PreferenceObjective(PreferenceConfig(loss_type="simpo"))
    reference_free.attach(base)
    batch = pair_batches(1)[0]
    with torch.no_grad():
        outputs = objective.forward(model, batch)
        base_outputs = reference_free.forward(base, batch)
    assert torch.equal(outputs["reference"], base_outputs["policy"])
    assert not torch.allclose(outputs["policy"], outputs["reference"])


@pytest.mark.parametrize("beta", [0.0, -0.1])
def test_a_beta_that_is_not_positive_is_refused_naming_the_key(beta: float) -> None:
    with pytest.raises(ConfigError, match=r"'preference.beta' is .*must be positive"):
        PreferenceConfig(beta=beta)


def test_a_reference_of_another_vocabulary_is_refused_naming_both_sizes() -> None:
    objective = PreferenceObjective(PreferenceConfig(), reference=tiny_model(vocab_size=128))
    with pytest.raises(ConfigError, match=r"reference_model' has a vocabulary of 128 tokens and the model one of 64"):
        objective.attach(tiny_model())


def test_a_reference_model_section_is_built_as_the_reference_from_python() -> None:
    section = {"name": "mpt_causal_lm", "d_model": 16, "n_heads": 2, "n_layers": 1, "max_seq_len": 16}
    objective = PreferenceObjective(PreferenceConfig(reference_model={**section, "vocab_size": 128}))
    assert objective.mode == "copy" and isinstance(objective.reference, MPTCausalLM)
    with pytest.raises(ConfigError, match=r"reference_model' has a vocabulary of 128 tokens and the model one of 64"):
        objective.attach(tiny_model())


def test_context_parallelism_is_refused_from_python(state: State) -> None:
    objective = PreferenceObjective(PreferenceConfig())
    with pytest.raises(ConfigError, match=r"'parallelism.context_parallel_degree' is 2"):
        objective.after_load(dataclasses.replace(state, parallel_dims=ParallelDims(dp_shard=1, cp=2)), None)


def test_a_resumed_run_takes_its_reference_from_load_path_not_from_its_own_checkpoint(tmp_path: Path) -> None:
    def trainer(folder: str, batches: int, **checkpointing: object) -> Trainer:
        return Trainer(
            tiny_model(), pair_batches(4), f"{batches}ba", objective=PreferenceObjective(PreferenceConfig()),
            run_folder=str(tmp_path / folder), save_folder=str(tmp_path / folder / "checkpoints"),
            progress_bar=False, log_to_console=False, **checkpointing,
        )  # fmt: skip

    base = trainer("base", 2)
    base.fit()
    base_weights = {name: tensor.clone() for name, tensor in base.state.model.state_dict().items()}
    dpo = trainer("dpo", 2, load_path=str(tmp_path / "base" / "checkpoints"), load_weights_only=True, autoresume=True)
    dpo.fit()
    resumed = trainer(
        "dpo", 4, load_path=str(tmp_path / "base" / "checkpoints"), load_weights_only=True, autoresume=True
    )
    assert resumed.state.timestamp.batch == 2  # from its own checkpoint, whose policy has moved
    moved = resumed.state.model.state_dict()
    assert any(not torch.equal(moved[name], tensor) for name, tensor in base_weights.items())
    for name, tensor in resumed.objective.reference.state_dict().items():
        assert torch.equal(tensor, base_weights[name]), name
