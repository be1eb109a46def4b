"""FlexAttention (``attn_impl: flex``, and ``flash`` with a mask on a GPU) against the explicit reference.

FlexAttention has no backward on a CPU, so the CPU tests run its forward (eagerly, uncompiled) through
the same block mask and score modifier a GPU forward builds; the GPU tests add the gradients.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from helpers import builds_graphs
from torch.nn.attention.flex_attention import flex_attention

from foundry.core import LoggerDestination
from foundry.errors import ConfigError
from foundry.models import attention as attention_module
from foundry.models import flex_attention as flex_module
from foundry.models.attention import Attention, AttnConfig, build_attention_inputs

D_MODEL, N_HEADS, SEQ = 64, 4, 24  # FlexAttention needs heads of 16 or more
HEAD_DIM = D_MODEL // N_HEADS
CASES: dict[str, dict[str, Any]] = {
    "causal": {},
    "alibi": {"alibi": True},
    "window": {"sliding_window_size": 5},
    "gqa_alibi_window": {
        "attn_type": "grouped_query_attention", "kv_n_heads": 2, "alibi": True, "sliding_window_size": 7
    },
}  # fmt: skip
# Three packed examples in row 0, two in row 1 and right padding (-1) at its end.
SEQUENCE_ID = torch.tensor([[0] * 10 + [1] * 6 + [2] * 8, [0] * 12 + [1] * 9 + [-1] * 3])


@pytest.fixture
def flex_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU's FlexAttention path on the CPU, forward only: the eager (uncompiled) kernel, whose unfused
    implementation warns that it is unfused (as it should on a GPU, where foundry always compiles it)."""
    import warnings

    warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
    monkeypatch.setattr(attention_module, "flex_runs_on", lambda device, head_dim: True)
    monkeypatch.setattr(flex_module, "_compiled_flex_attention", lambda: flex_attention)


def make(attn_impl: str, device: str = "cpu", **keys: Any) -> Attention:
    torch.manual_seed(0)
    config = AttnConfig(attn_impl=attn_impl, attn_uses_sequence_id=True, **keys)
    return Attention(D_MODEL, N_HEADS, config, norm_type="layernorm").to(device)


def forward(attention: Attention, x: torch.Tensor, sequence_id: torch.Tensor | None = None, padding=None):
    positions = torch.arange(x.shape[1], device=x.device)[None]
    inputs = build_attention_inputs(
        attention.config, N_HEADS, HEAD_DIM, x.shape[1], positions, padding, sequence_id=sequence_id
    )
    return attention(x, inputs), inputs


def inputs_x(device: str = "cpu") -> torch.Tensor:
    return torch.randn(2, SEQ, D_MODEL, generator=torch.Generator().manual_seed(3)).to(device)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("documents", [False, True], ids=["one_document", "packed"])
def test_flex_forward_equals_the_reference(flex_on_cpu, case: str, documents: bool) -> None:
    x, sequence_id = inputs_x(), SEQUENCE_ID if documents else None
    reference, flex = make("torch", **CASES[case]), make("flex", **CASES[case])
    with torch.no_grad():
        expected, _ = forward(reference, x, sequence_id)
        got, inputs = forward(flex, x, sequence_id)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert inputs.block_mask is not None
    assert inputs.allowed is None and inputs.bias is None  # nothing of size seq² is built


def test_flex_masks_padding_as_the_reference_does(flex_on_cpu) -> None:
    padding = torch.ones(2, SEQ, dtype=torch.bool)
    padding[1, -5:] = False
    with torch.no_grad():
        expected, _ = forward(make("torch", alibi=True), inputs_x(), padding=padding)
        got, _ = forward(make("flex", alibi=True), inputs_x(), padding=padding)
    torch.testing.assert_close(got[0], expected[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1, :-5], expected[1, :-5], atol=1e-5, rtol=1e-5)  # padding rows are unused


def test_flash_takes_flexattention_only_when_a_mask_is_needed(flex_on_cpu) -> None:
    with torch.no_grad():
        _, plain = forward(make("flash"), inputs_x())
        _, packed = forward(make("flash"), inputs_x(), SEQUENCE_ID)
    assert plain.block_mask is None  # plain causal: SDPA's fused kernels (cuDNN's on an H100)
    assert packed.block_mask is not None


def test_flash_with_attention_dropout_stays_on_sdpa(flex_on_cpu) -> None:
    with torch.no_grad():
        _, inputs = forward(make("flash", attn_pdrop=0.1).eval(), inputs_x(), SEQUENCE_ID)
    assert inputs.block_mask is None and inputs.allowed is not None


def test_flex_on_a_cpu_trains_on_sdpa_with_one_warning() -> None:
    attention_module._warn_once.cache_clear()
    x = inputs_x().requires_grad_()
    with pytest.warns(UserWarning, match="'flex', but FlexAttention has no backward on cpu; attention runs on SDPA"):
        got, inputs = forward(make("flex", alibi=True), x, SEQUENCE_ID)
    expected, _ = forward(make("torch", alibi=True), x, SEQUENCE_ID)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    got.sum().backward()
    assert inputs.block_mask is None and x.grad is not None


def test_flex_with_attention_dropout_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"attn_pdrop' is 0\.1, but FlexAttention.*attn_pdrop: 0"):
        AttnConfig(attn_impl="flex", attn_pdrop=0.1)


def test_unknown_attn_impl_lists_the_kernels_and_the_closest() -> None:
    with pytest.raises(ConfigError, match=r"'flx'; it must be one of 'sdpa', 'flash'.*'flex'.*Did you mean 'flex'"):
        AttnConfig(attn_impl="flx")


class LossRecorder(LoggerDestination):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if "loss/train/total" in metrics:
            self.losses.append(metrics["loss/train/total"])


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's backward runs on GPUs only")
GPU_CASES = [(case, "flex") for case in CASES] + [("gqa_alibi_window", "flash")]


@needs_gpu
@pytest.mark.parametrize(("case", "attn_impl"), GPU_CASES)
def test_flex_forward_and_gradients_equal_the_reference_on_a_gpu(case: str, attn_impl: str) -> None:
    x = inputs_x("cuda")
    results = []
    for impl in ("torch", attn_impl):
        attention = make(impl, "cuda", **CASES[case])
        out, inputs = forward(attention, x, SEQUENCE_ID.cuda())
        out.square().sum().backward()
        results.append((out, attention.Wqkv.weight.grad, inputs))
    (expected, expected_grad, _), (got, grad, inputs) = results
    assert inputs.block_mask is not None
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(grad, expected_grad, atol=2e-3, rtol=2e-3)


@needs_gpu
def test_a_compiled_packed_alibi_model_trains_on_flex_to_the_reference_losses(tmp_path) -> None:
    """Whole-model compile around FlexAttention, with document masking and ALiBi, in bf16."""
    from helpers import TINY_MPT

    from foundry.algorithms import TorchCompile
    from foundry.models import MPTCausalLM
    from foundry.trainer import Trainer

    lengths = torch.tensor([[0] * 40 + [1] * 24, [0] * 16 + [1] * 48] * 2)
    batches = [{"input_ids": torch.randint(0, 96, (4, 64), generator=torch.Generator().manual_seed(i)),
                "sequence_id": lengths} for i in range(3)]  # fmt: skip
    losses = {}
    for impl in ("torch", "flex"):
        torch.manual_seed(0)
        attn = {"attn_impl": impl, "alibi": True, "attn_uses_sequence_id": True}
        model = MPTCausalLM(**{**TINY_MPT, "max_seq_len": 64, "learned_pos_emb": False, "attn_config": attn})
        algorithms = [TorchCompile(scope="model")] if impl == "flex" else []
        recorder = LossRecorder()
        trainer = Trainer(model=model, train_dataloader=batches, max_duration="3ba", algorithms=algorithms,
                          precision="amp_bf16", device="cuda", run_folder=str(tmp_path / impl), log_to_console=False,
                          console_log_interval="1ba", loggers=[recorder])  # fmt: skip
        with builds_graphs() if algorithms else contextlib.nullcontext():
            trainer.fit()
        losses[impl] = recorder.losses
    assert len(losses["flex"]) == 3
    assert losses["flex"] == pytest.approx(losses["torch"], rel=2e-2)


@needs_gpu
def test_heads_narrower_than_the_flex_kernel_takes_stay_on_sdpa() -> None:
    torch.manual_seed(0)
    narrow = Attention(32, 4, AttnConfig(attn_impl="flash", alibi=True), norm_type="layernorm").cuda()
    positions = torch.arange(SEQ, device="cuda")[None]
    inputs = build_attention_inputs(narrow.config, 4, 8, SEQ, positions, None)
    assert inputs.block_mask is None and inputs.bias is not None
    assert narrow(torch.randn(2, SEQ, 32, device="cuda"), inputs).isfinite().all()
