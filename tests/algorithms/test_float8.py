"""The float8 algorithm: which linear layers it converts, its config checks, and its hardware requirement."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import math
import re
from types import SimpleNamespace

import pytest
import torch
from helpers import TINY_LLAMA, TINY_MPT

from foundry import registry
from foundry.algorithms import Float8Training, TorchCompile, float8
from foundry.algorithms.float8 import (
    BlockwiseFloat8Linear,
    convert_to_float8,
    float8_module_names,
    float8_unavailable,
)
from foundry.core.event import Event
from foundry.core.logger import Logger
from foundry.core.parallel_dims import ParallelDims
from foundry.errors import ConfigError
from foundry.models import LlamaCausalLM, MPTCausalLM
from foundry.registry import build_components
from foundry.trainer import Trainer

FOUR_BLOCKS = {**TINY_MPT, "d_model": 64, "n_heads": 4, "n_layers": 4}  # every linear a multiple of 16
WIDE_BLOCKS = {**FOUR_BLOCKS, "d_model": 128}  # every linear whole 128 x 128 tiles (blockwise)
BLOCK_LINEARS = ["attn.Wqkv", "attn.out_proj", "ffn.up_proj", "ffn.down_proj"]


def names_in(blocks: range) -> list[str]:
    return [f"transformer.blocks.{block}.{linear}" for block in blocks for linear in BLOCK_LINEARS]


def test_the_middle_blocks_linears_are_chosen_by_default() -> None:
    assert float8_module_names(MPTCausalLM(**FOUR_BLOCKS), True, []) == names_in(range(1, 3))


def test_first_and_last_blocks_can_be_converted_too() -> None:
    assert float8_module_names(MPTCausalLM(**FOUR_BLOCKS), False, []) == names_in(range(4))


def test_exclude_patterns_keep_modules_in_bf16() -> None:
    names = float8_module_names(MPTCausalLM(**FOUR_BLOCKS), False, ["*.ffn.down_proj", "transformer.blocks.0.*"])
    assert names == [name for name in names_in(range(1, 4)) if not name.endswith("down_proj")]


def test_the_output_head_the_embeddings_and_moe_routers_stay_in_bf16() -> None:
    moe = {"moe_num_experts": 16, "moe_top_k": 2, "ffn_hidden_size": 32}
    model = LlamaCausalLM(**{**TINY_LLAMA, "n_layers": 3, "tie_word_embeddings": False, **moe})
    assert isinstance(model.lm_head, torch.nn.Linear) and model.lm_head.in_features % 16 == 0
    names = float8_module_names(model, False, [])
    attention = ("Wqkv", "out_proj")  # the experts are grouped weights, not nn.Linear: the grouped GEMM keeps them
    assert names == [f"transformer.blocks.{block}.attn.{linear}" for block in range(3) for linear in attention]


def test_layers_whose_sizes_float8_cannot_multiply_are_skipped() -> None:
    model = MPTCausalLM(**{**FOUR_BLOCKS, "d_model": 40, "n_heads": 4})  # 40 is not a multiple of 16
    assert float8_module_names(model, False, []) == []


def test_blockwise_takes_only_layers_whose_sizes_are_whole_tiles() -> None:
    """128 x 128 tiles: at d_model 64 nothing fits; at 128 every linear does, biased or not."""
    assert float8_module_names(MPTCausalLM(**FOUR_BLOCKS), False, [], "blockwise") == []
    for no_bias in (True, False):
        model = MPTCausalLM(**{**WIDE_BLOCKS, "no_bias": no_bias})
        assert float8_module_names(model, True, [], "blockwise") == names_in(range(1, 3))


def test_blockwise_finding_nothing_is_a_config_error_naming_its_tile(train) -> None:
    with pytest.raises(ConfigError, match=r"no linear layer to convert.*with sizes divisible by 128"):
        train([Float8Training(recipe="blockwise")], model_keys=FOUR_BLOCKS, num_batches=1)


def test_lora_layers_and_their_base_stay_in_bf16() -> None:
    lora = {"peft_type": "LORA", "r": 16, "target_modules": ["Wqkv"]}
    names = float8_module_names(MPTCausalLM(**FOUR_BLOCKS, peft_config=lora), False, [])
    assert names and not any("Wqkv" in name or "lora" in name for name in names)


def test_float8_where_it_cannot_run_trains_in_bf16_saying_so_once(train, recorder) -> None:
    trainer, losses = train([Float8Training()], model_keys=FOUR_BLOCKS, num_batches=2, loggers=[recorder])
    said = [text for text in recorder.texts if text.startswith("algorithms.float8")]
    assert len(said) == 1 and "on a cpu device; this run trains in bf16" in said[0]
    assert not any(type(module).__name__ == "Float8Linear" for module in trainer.state.model.modules())
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)


def test_nothing_to_convert_is_a_config_error_even_where_float8_cannot_run(train) -> None:
    with pytest.raises(ConfigError, match=r"algorithms\.float8 found no linear layer to convert.*'exclude'"):
        train([Float8Training(exclude=["*"])], model_keys=FOUR_BLOCKS, num_batches=1)


@pytest.mark.parametrize(
    ("capability", "torchao_installed", "recipe", "reason"),
    [
        ((9, 0), True, "tensorwise", None),
        ((8, 9), True, "rowwise", None),
        ((8, 0), True, "tensorwise", r"float8 matrix units.*a NVIDIA A100 \(compute capability 8\.0\)"),
        ((9, 0), False, "tensorwise", r"float8 needs torchao, which is not installed.*foundry\[float8\]"),
        ((9, 0), True, "blockwise", None),
        ((8, 9), True, "blockwise", r"blockwise recipe needs .*capability 9\.0.*on a NVIDIA A100; 'rowwise' runs"),
    ],
    ids=["hopper", "ada", "ampere", "hopper-without-torchao", "hopper-blockwise", "ada-blockwise"],
)
def test_float8_runs_on_compute_capability_8_9_and_up_with_torchao(
    monkeypatch, capability, torchao_installed, recipe, reason
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    find_spec = importlib.util.find_spec
    torchao_spec = importlib.machinery.ModuleSpec("torchao", None) if torchao_installed else None
    # whether this machine has torchao must not decide the case
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *args: torchao_spec if name == "torchao" else find_spec(name, *args)
    )
    monkeypatch.setattr(float8, "_blockwise_gemm_unavailable", lambda device: None)  # one GEMM on the GPU
    unavailable = float8_unavailable(torch.device("cuda", 0), recipe)
    assert unavailable is None if reason is None else re.search(reason, unavailable)


def test_blockwise_where_cublas_cannot_multiply_it_trains_in_bf16_naming_why(monkeypatch) -> None:
    pytest.importorskip("torchao")
    # this CPU stands for a torch whose cuBLAS takes no blockwise scales: the probe's one GEMM fails here too
    unavailable = float8._blockwise_gemm_unavailable(torch.device("cpu"))
    assert re.search(r"blockwise recipe needs cuBLAS's blockwise-scaled float8 GEMM .*failed here \(\w+", unavailable)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100")
    monkeypatch.setattr(float8, "_blockwise_gemm_unavailable", lambda device: f"probed {device}")
    assert float8_unavailable(torch.device("cuda", 0), "blockwise") == "probed cuda:0"
    assert float8_unavailable(torch.device("cuda", 0), "rowwise") is None


@pytest.mark.parametrize("build", ["yaml", "python"])
def test_unknown_recipe_is_a_config_error_naming_the_choices(build) -> None:
    choices = r"'tensorwise', 'rowwise', 'rowwise_with_gw_hp', 'blockwise'"
    with pytest.raises(ConfigError, match=rf"'algorithms\.float8\.recipe' is 'mxfp8'; it must be one of {choices}"):
        if build == "yaml":
            build_components(registry.algorithms, {"float8": {"recipe": "mxfp8"}}, "algorithms")
        else:
            Float8Training(recipe="mxfp8")


@pytest.mark.parametrize("compiled", [None, "blocks", "model", "torch.compile"])
def test_a_run_without_compile_is_warned_that_float8_is_slow_eagerly(compiled, caplog) -> None:
    state = SimpleNamespace(model=MPTCausalLM(**FOUR_BLOCKS), parallel_dims=ParallelDims())
    if compiled == "torch.compile":  # a model the user compiled before handing it over
        state.model = torch.compile(state.model, backend="eager")
    elif compiled is not None:
        TorchCompile(backend="eager", scope=compiled).apply(Event.INIT, state, Logger(state))
    algorithm = Float8Training()
    algorithm.converted = names_in(range(1, 3))  # as INIT leaves it on a float8 GPU
    assert algorithm.match(Event.FIT_START, state)
    with caplog.at_level(logging.WARNING, logger="foundry.algorithms.float8"):
        algorithm.apply(Event.FIT_START, state, Logger(state))
    warned = [record.getMessage() for record in caplog.records]
    assert warned == [] if compiled else "runs without torch.compile" in warned[0] and "compile_config" in warned[0]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_conversion_swaps_exactly_the_chosen_layers(recipe) -> None:
    pytest.importorskip("torchao")
    model = MPTCausalLM(**FOUR_BLOCKS)
    chosen = float8_module_names(model, True, [])
    assert convert_to_float8(model, chosen, recipe, fsdp_float8_all_gather=False) == chosen
    assert type(model.transformer.blocks[0].attn.Wqkv) is torch.nn.Linear


def test_blockwise_conversion_keeps_each_layers_weight_and_changes_only_its_forward() -> None:
    pytest.importorskip("torchao")
    model = MPTCausalLM(**WIDE_BLOCKS)
    chosen = float8_module_names(model, True, [], "blockwise")
    weights = {name: model.get_submodule(name).weight for name in chosen}
    assert convert_to_float8(model, chosen, "blockwise", fsdp_float8_all_gather=False) == chosen
    for name in chosen:
        layer = model.get_submodule(name)
        assert type(layer) is BlockwiseFloat8Linear and layer.weight is weights[name]
    assert type(model.transformer.blocks[0].attn.Wqkv) is torch.nn.Linear
    plain = MPTCausalLM(**WIDE_BLOCKS)
    assert model.state_dict().keys() == plain.state_dict().keys()  # checkpoints are unchanged


class TileCheckingMatmul(torch.autograd.Function):
    """``fp8_blockwise_mm``'s contract without its GPU kernels: ``x @ weight.T`` of 2-D rows, refusing a token
    count that is no multiple of 128 (torchao's backward asserts it when it tiles the weight gradient's GEMM)."""

    @staticmethod
    def forward(ctx, x, weight, block_size, out_dtype, use_triton):  # type: ignore[no-untyped-def]
        assert x.dim() == 2 and x.shape[0] % block_size == 0, tuple(x.shape)
        ctx.save_for_backward(x, weight)
        return x @ weight.T

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[no-untyped-def]
        x, weight = ctx.saved_tensors
        return grad_output @ weight, grad_output.T @ x, None, None, None


@pytest.mark.parametrize("tokens", [100, 256])
def test_blockwise_pads_a_microbatch_to_whole_128_token_tiles(monkeypatch, tokens) -> None:
    pytest.importorskip("torchao")
    layer = torch.nn.Linear(128, 256)
    plain = torch.nn.Linear(128, 256)
    plain.load_state_dict(layer.state_dict())
    BlockwiseFloat8Linear.convert(layer)
    monkeypatch.setattr(BlockwiseFloat8Linear, "blockwise_mm", TileCheckingMatmul)
    x = torch.randn(2, tokens // 2, 128, requires_grad=True)
    outputs = [module(x) for module in (layer, plain)]
    grads = [
        torch.autograd.grad(out.square().sum(), (x, module.weight)) for out, module in zip(outputs, (layer, plain))
    ]
    torch.testing.assert_close(outputs[0], outputs[1])
    for padded, exact in zip(*grads):
        torch.testing.assert_close(padded, exact)


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_converted_layers_initialise_as_the_plain_model_does(recipe) -> None:
    """A meta-device model is converted before init_weights: the init hints of its layers must survive."""
    pytest.importorskip("torchao")
    weights = {}
    for converted in (False, True):
        torch.manual_seed(0)
        model = MPTCausalLM(**WIDE_BLOCKS)
        if converted:
            chosen = float8_module_names(model, False, [], recipe)
            assert convert_to_float8(model, chosen, recipe, fsdp_float8_all_gather=False) == chosen
            assert model.transformer.blocks[0].attn.out_proj.is_residual_output
        torch.manual_seed(1)
        model.init_weights()
        weights[converted] = model.state_dict()
    assert weights[True].keys() == weights[False].keys()
    for name, tensor in weights[False].items():
        torch.testing.assert_close(weights[True][name], tensor, rtol=0, atol=0, msg=name)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs float8 matrix units"
)
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise"])
def test_a_float8_step_trains_close_to_bf16(tmp_path, recipe) -> None:
    pytest.importorskip("torchao")  # an optional extra: a GPU image without it skips, as the CPU tests do
    if recipe == "blockwise" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torchao's blockwise kernels need compute capability 9.0")
    from helpers import token_batches

    losses = {}
    for name, algorithms in (
        ("bf16", []),
        ("float8", [Float8Training(recipe=recipe, keep_first_and_last_blocks=False)]),
    ):
        torch.manual_seed(0)
        trainer = Trainer(
            model=MPTCausalLM(**{**WIDE_BLOCKS, "max_seq_len": 64, "init_device": "meta"}),
            train_dataloader=token_batches(3, batch_size=8, seq_len=64, vocab_size=TINY_MPT["vocab_size"]),
            max_duration="3ba", algorithms=algorithms, precision="amp_bf16", device="cuda",
            run_folder=str(tmp_path / name), log_to_console=False,
        )  # fmt: skip
        trainer.fit()
        losses[name] = trainer.state.loss.item()
        float8_layers = [module for module in trainer.state.model.modules() if "Float8" in type(module).__name__]
        assert bool(float8_layers) == (name == "float8")  # converted, not fallen back to bf16
    assert torch.isfinite(torch.tensor(losses["float8"]))
    assert losses["float8"] == pytest.approx(losses["bf16"], rel=5e-2)
