"""The LR schedules: their values, and each batch's LR in a run against what Composer's Trainer gave it
(tests/fixtures/llmfoundry/schedules.json, written by Composer 0.32.1 through LLM Foundry 0.22's scheduler builder)."""

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import token_batches

from foundry import registry
from foundry.core import Callback, State, Time, Timestamp
from foundry.errors import ConfigError
from foundry.models.build import build_model
from foundry.optim import (
    ConstantWithWarmupScheduler,
    CosineWithWarmupScheduler,
    DecoupledAdamW,
    LinearWithWarmupScheduler,
)
from foundry.trainer import Trainer


def _state_at(batch: int, max_duration: str = "100ba", loader_len: int | None = None) -> State:
    state = State(model=torch.nn.Linear(1, 1), max_duration=Time.parse(max_duration), train_dataloader_len=loader_len)
    state.timestamp = Timestamp(batch=batch, batch_in_epoch=batch % (loader_len or 10**9))
    return state


@pytest.mark.parametrize(("batch", "expected"), [(0, 0.0), (5, 0.5), (10, 1.0), (55, 0.1 + 0.9 * 0.5), (100, 0.1)])
def test_cosine_with_warmup_values(batch, expected):
    scheduler = CosineWithWarmupScheduler(t_warmup="10ba", alpha_f=0.1)
    assert scheduler.multiplier(_state_at(batch)) == pytest.approx(expected)


def test_cosine_quarter_point():
    scheduler = CosineWithWarmupScheduler(t_warmup="0ba", alpha_f=0.0)
    assert scheduler.multiplier(_state_at(25)) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.25)))


@pytest.mark.parametrize(("batch", "expected"), [(2, 0.2), (10, 1.0), (55, 0.5), (100, 0.0)])
def test_linear_decay_with_warmup_values(batch, expected):
    scheduler = LinearWithWarmupScheduler(t_warmup="0.1dur", alpha_f=0.0)
    assert scheduler.multiplier(_state_at(batch)) == pytest.approx(expected)


def test_constant_with_warmup_in_epochs_against_batches():
    scheduler = ConstantWithWarmupScheduler(t_warmup="1ep")
    assert scheduler.multiplier(_state_at(5, max_duration="40ba", loader_len=10)) == pytest.approx(0.5)
    assert scheduler.multiplier(_state_at(30, max_duration="40ba", loader_len=10)) == 1.0


def test_incompatible_units_name_both():
    scheduler = CosineWithWarmupScheduler(t_warmup="100tok")
    with pytest.raises(ConfigError, match="100tok.*100ba"):
        scheduler.multiplier(_state_at(3))


def test_torch_wrapper_sets_learning_rate_from_state():
    state = _state_at(0)
    optimizer = torch.optim.SGD(state.model.parameters(), lr=0.4)
    torch_scheduler = CosineWithWarmupScheduler(t_warmup="10ba").to_torch(optimizer, state)
    assert optimizer.param_groups[0]["lr"] == 0.0
    state.timestamp = Timestamp(batch=5)
    optimizer.step()
    torch_scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.2)


def test_schedulers_and_optimizers_are_registered():
    assert {"constant", "constant_with_warmup", "cosine_with_warmup", "linear_decay_with_warmup"} <= set(
        registry.schedulers
    )
    assert {"decoupled_adamw", "adamw"} <= set(registry.optimizers)


def test_decoupled_weight_decay_is_independent_of_peak_lr():
    shrunk = []
    for lr in (1e-3, 1e-1):
        param = torch.nn.Parameter(torch.ones(3))
        optimizer = DecoupledAdamW([param], lr=lr, weight_decay=0.1)
        param.grad = torch.zeros(3)
        optimizer.step()
        shrunk.append(param.detach().clone())
    torch.testing.assert_close(shrunk[0], torch.full((3,), 0.9))
    torch.testing.assert_close(shrunk[1], torch.full((3,), 0.9))


def test_decoupled_weight_decay_follows_schedule():
    param = torch.nn.Parameter(torch.ones(2))
    optimizer = DecoupledAdamW([param], lr=1.0, weight_decay=0.1)
    optimizer.param_groups[0]["lr"] = 0.5  # as a scheduler would set it
    param.grad = torch.zeros(2)
    optimizer.step()
    torch.testing.assert_close(param.detach(), torch.full((2,), 0.95))


# ------------------------------------------------------------------ the LRs Composer's Trainer gave each batch
COMPOSER_SCHEDULES = json.loads((Path(__file__).parents[1] / "fixtures" / "llmfoundry" / "schedules.json").read_text())


class _LoggedLR(Callback):
    """What lr_monitor logs at each BATCH_END: the LR the next batch trains at."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def batch_end(self, state: State, logger: Any) -> None:
        self.values.append(state.optimizers[0].param_groups[0]["lr"])


def _fit_logging_lr(case: dict[str, Any], run_folder: Path, load_path: str | None = None) -> list[float]:
    rows, width = COMPOSER_SCHEDULES["batch_shape"]
    options = dict(case["scheduler"])
    scheduler = registry.schedulers.get(options.pop("name"))(**options)
    logged = _LoggedLR()
    Trainer(
        build_model({"name": "mpt_causal_lm", "d_model": 16, "n_heads": 2, "n_layers": 1, "vocab_size": 32}),
        token_batches(COMPOSER_SCHEDULES["batches_per_epoch"], rows, seq_len=width),
        max_duration=case["max_duration"], schedulers=scheduler, callbacks=[logged],
        optimizers=lambda params: DecoupledAdamW(params, lr=COMPOSER_SCHEDULES["lr"]), save_folder=str(run_folder),
        save_interval="4ba", load_path=load_path, run_folder=str(run_folder), log_to_console=False, device="cpu",
    ).fit()  # fmt: skip
    return logged.values


@pytest.mark.parametrize("label", sorted(COMPOSER_SCHEDULES["cases"]))
def test_each_batch_trains_at_the_lr_composer_gives_it_from_scratch_and_after_resume(label, tmp_path):
    case = COMPOSER_SCHEDULES["cases"][label]
    assert _fit_logging_lr(case, tmp_path / "run") == case["lr_monitor"]
    resumed = _fit_logging_lr(case, tmp_path / "resumed", load_path=str(tmp_path / "run" / "ep0-ba4"))
    assert resumed == case["lr_monitor_resumed_from_batch_4"]
