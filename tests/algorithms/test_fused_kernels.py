from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers import TINY_LLAMA, TINY_MPT, token_batches

from foundry.algorithms.fused_kernels import FusedKernels, FusedNorm
from foundry.core.callback import Callback
from foundry.errors import ConfigError
from foundry.models import LlamaCausalLM, MPTCausalLM
from foundry.models.base import LossOutput
from foundry.trainer import Trainer

pytest.importorskip("triton")

# MPT with RoPE and a GeGLU feed-forward, so every kernel has a layer to replace.
MPT_ALL_KERNELS = {
    **TINY_MPT, "max_seq_len": 16, "no_bias": True, "learned_pos_emb": False, "attn_config": {"rope": True},
    "ffn_config": {"ffn_type": "mptglu", "ffn_act_fn": {"name": "gelu", "approximate": "tanh"}},
}  # fmt: skip
MODELS = {"mpt": (MPTCausalLM, MPT_ALL_KERNELS), "llama": (LlamaCausalLM, {**TINY_LLAMA, "max_seq_len": 16})}


@pytest.fixture(scope="module")
def triton_interpreter() -> Iterator[None]:
    """Kernels compiled where there is a GPU (the Trainer then trains there); Triton's interpreter on a CPU."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        if torch.cuda.is_available():
            monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        else:
            monkeypatch.setenv("TRITON_INTERPRET", "1")
        yield


class _RecordLoss(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def batch_end(self, state, logger) -> None:
        self.losses.append(state.loss.item())


@dataclass
class Run:
    losses: list[float]
    model: torch.nn.Module
    checkpoint: Path  # the save_folder holding its checkpoint after the last batch


def _train(folder: Path, family: str, fused: bool) -> Run:
    """Two batches (the second after an optimizer step through the kernels' backward), saved at the end."""
    model_class, keys = MODELS[family]
    torch.manual_seed(0)
    model = model_class(keys)
    recorder = _RecordLoss()
    Trainer(
        model=model,
        train_dataloader=token_batches(2, batch_size=2, seq_len=16, vocab_size=96),
        max_duration="2ba",
        algorithms=[FusedKernels()] if fused else [],
        callbacks=[recorder],
        run_folder=str(folder / "run"),
        save_folder=str(folder / "checkpoints"),
        save_interval="2ba",
        log_to_console=False,
        precision="fp32",  # the kernels' losses are compared with PyTorch's within fp32 round-off
    ).fit()
    return Run(recorder.losses, model, folder / "checkpoints")


@pytest.fixture(scope="module")
def runs(triton_interpreter, tmp_path_factory) -> Callable[[str, bool], Run]:
    """``runs(family, fused)``: each family's run with and without the kernels, trained once for the module."""
    cache: dict[tuple[str, bool], Run] = {}

    def get(family: str, fused: bool) -> Run:
        if (family, fused) not in cache:
            cache[family, fused] = _train(tmp_path_factory.mktemp(f"{family}-{fused}"), family, fused)
        return cache[family, fused]

    return get


@pytest.mark.parametrize("family", ["mpt", "llama"])
def test_fused_kernels_train_to_the_same_losses(runs, family: str) -> None:
    plain, fused = runs(family, fused=False), runs(family, fused=True)
    assert sum(isinstance(m, FusedNorm) for m in fused.model.modules()) == 2 * 2 + 1  # two per block + final
    torch.testing.assert_close(torch.tensor(fused.losses), torch.tensor(plain.losses), rtol=1e-5, atol=0)


@pytest.mark.parametrize("saved_fused", [True, False])
def test_checkpoints_load_with_or_without_the_algorithm(runs, tmp_path: Path, saved_fused: bool) -> None:
    saved = runs("llama", fused=saved_fused)
    model_class, keys = MODELS["llama"]
    loaded = model_class(keys)
    Trainer(model=loaded, algorithms=[FusedKernels()] if not saved_fused else [], load_path=str(saved.checkpoint),
            run_folder=str(tmp_path / "load"), log_to_console=False)  # fmt: skip
    for (name, want), (_, got) in zip(saved.model.state_dict().items(), loaded.state_dict().items(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)


def test_fusing_keeps_parameter_names_and_objects() -> None:
    model = MPTCausalLM(MPT_ALL_KERNELS)
    before = dict(model.named_parameters())
    swapped = FusedKernels().fuse(model)
    assert swapped == {"norms": 5, "rope": 2, "glu": 2}  # the loss is model.loss_fn's to choose
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    assert all(after[name] is before[name] for name in before)


def test_cpu_without_the_interpreter_falls_back_with_one_warning(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = MPTCausalLM(MPT_ALL_KERNELS)
    with pytest.warns(UserWarning, match="fused_kernels: Triton kernels cannot run on cpu") as warned:
        Trainer(model=model, algorithms=[FusedKernels()], run_folder=str(tmp_path), log_to_console=False, device="cpu")
    assert len([w for w in warned if "fused_kernels" in str(w.message)]) == 1
    assert not any(isinstance(m, FusedNorm) for m in model.modules())


def test_strict_refuses_to_fall_back(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="strict: true"):
        Trainer(model=MPTCausalLM(MPT_ALL_KERNELS), algorithms=[FusedKernels(strict=True)], run_folder=str(tmp_path),
                log_to_console=False, device="cpu")  # fmt: skip


@pytest.mark.parametrize("family", ["mpt", "llama"])
def test_fused_crossentropy_key_returns_the_loss_in_training_and_logits_in_eval(family: str) -> None:
    model_class, keys = MODELS[family]
    torch.manual_seed(0)
    model = model_class({**keys, "loss_fn": "fused_crossentropy"})
    batch = token_batches(1, batch_size=2, seq_len=16, vocab_size=96)[0]
    outputs = model(batch)
    assert isinstance(outputs, LossOutput)
    model.eval()
    logits = model(batch)
    assert logits.shape == (2, 16, 96)
    torch.testing.assert_close(model.loss(outputs, batch), model.loss(logits, batch), rtol=1e-5, atol=0)


def test_fsdp2_sees_the_fused_loss_as_a_forward_output() -> None:
    """FSDP2 hooks its pre-backward all-gather onto output tensors found by pytree (torch < 2.14)."""
    loss = torch.ones((), requires_grad=True)
    leaves, spec = torch.utils._pytree.tree_flatten(LossOutput(loss))
    assert leaves == [loss]
    assert torch.utils._pytree.tree_unflatten(leaves, spec).loss is loss


def test_the_old_cross_entropy_switch_still_fuses_and_warns_once() -> None:
    model = MPTCausalLM(MPT_ALL_KERNELS)
    with pytest.warns(FutureWarning, match="fused_kernels.cross_entropy is deprecated.*model.loss_fn"):
        algorithm = FusedKernels(cross_entropy=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        FusedKernels(cross_entropy=True)  # once per process
    assert algorithm.fuse(model)["cross_entropy"] == 1 and model.fused_cross_entropy is True
