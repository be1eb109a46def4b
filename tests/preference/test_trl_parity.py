"""foundry's DPO equals TRL 1.16's ``DPOTrainer`` on the fixture in tests/fixtures/dpo (its README is the contract).

Both fixture models (a tiny Llama, and a tiny MPT that is a Llama in MPT's keys) are imported with
``foundry convert from-hf``'s ``from_hf_model`` and trained through the Trainer with the preference loader on
the fixture's pairs: the pairs' token ids, the per-pair policy and reference log-probabilities and losses at
the initial weights (within 1e-5) and the first 10 optimizer steps' losses (within 1e-4) are TRL's.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from foundry.convert.commands import from_hf_model
from foundry.core import LoggerDestination
from foundry.data import load_tokenizer
from foundry.data.preference import build_preference_dataloader
from foundry.preference import PreferenceConfig, PreferenceObjective, preference_loss
from foundry.trainer import Trainer

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "dpo"
MODELS = ("llama", "mpt_as_llama")
pytestmark = pytest.mark.skipif(
    not (FIXTURE / "trl_outputs.json").is_file(), reason="the TRL fixture (tests/fixtures/dpo) is not in this tree"
)


@functools.cache
def trl() -> dict[str, Any]:
    return json.loads((FIXTURE / "trl_outputs.json").read_text())


def fixture_loader() -> Any:
    """The fixture's pairs in their order, two per batch, as TRL batched them."""
    return build_preference_dataloader(
        tokenizer=load_tokenizer(str(FIXTURE / "tokenizer")),
        device_batch_size=trl()["settings"]["batch_size"],
        dataset={"hf_name": str(FIXTURE / "pairs.jsonl"), "max_seq_len": trl()["settings"]["max_length"]},
    )


def objective() -> PreferenceObjective:
    settings = trl()["settings"]
    return PreferenceObjective(PreferenceConfig(loss_type=settings["loss_type"], beta=settings["beta"]))


class StepLosses(LoggerDestination):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if "loss/train/total" in metrics:
            self.losses.append(float(metrics["loss/train/total"]))


def test_the_preference_loader_tokenizes_each_pair_as_trl() -> None:
    loader = fixture_loader()
    ours = [
        {"prompt_ids": pair.prompt.tolist(), "chosen_ids": pair.chosen.tolist(), "rejected_ids": pair.rejected.tolist()}
        for pair in loader.pairs
    ]
    assert ours == trl()["tokenization"]


@pytest.mark.parametrize("name", MODELS)
def test_initial_log_probabilities_and_losses_equal_trls_within_1e_5(name: str) -> None:
    model, _ = from_hf_model(FIXTURE / name)
    dpo = objective()
    dpo.attach(model)  # the reference: a frozen copy of the imported weights
    columns: dict[str, list[float]] = {key: [] for key in trl()["models"][name]["initial"] if "token" not in key}
    with torch.no_grad():
        for batch in fixture_loader():
            outputs = dpo.forward(model, batch)
            policy_chosen, policy_rejected = outputs["policy"].flatten().chunk(2)
            reference_chosen, reference_rejected = outputs["reference"].flatten().chunk(2)
            columns["policy_chosen_logps"] += policy_chosen.tolist()
            columns["policy_rejected_logps"] += policy_rejected.tolist()
            columns["reference_chosen_logps"] += reference_chosen.tolist()
            columns["reference_rejected_logps"] += reference_rejected.tolist()
            losses, _, _ = preference_loss(
                "sigmoid", policy_chosen, policy_rejected, reference_chosen, reference_rejected, dpo.config.beta
            )
            columns["losses"] += losses.tolist()
    for key, values in columns.items():
        assert values == pytest.approx(trl()["models"][name]["initial"][key], abs=1e-5), key


@pytest.mark.parametrize("name", MODELS)
def test_the_first_ten_step_losses_equal_trls_within_1e_4(name: str, tmp_path: Path) -> None:
    settings, optimizer = trl()["settings"], trl()["settings"]["optimizer"]
    model, _ = from_hf_model(FIXTURE / name)
    recorder = StepLosses()
    trainer = Trainer(
        model, fixture_loader(), f"{settings['steps']}ba",
        optimizers=lambda params: torch.optim.AdamW(
            params, lr=optimizer["lr"], betas=tuple(optimizer["betas"]), eps=optimizer["eps"],
            weight_decay=optimizer["weight_decay"],
        ),
        objective=objective(), loggers=[recorder], run_folder=str(tmp_path), progress_bar=False, log_to_console=False,
        precision="fp32", compile_config=False,  # TRL's run was fp32 and eager (a GPU's default is bf16, compiled)
    )  # fmt: skip
    trainer.fit()
    assert recorder.losses == pytest.approx(trl()["models"][name]["losses"], abs=1e-4)
