"""fsdp_config.activation_checkpointing_keep_attention: backward recomputes every block but its attention kernel."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from helpers import builds_graphs
from torch.utils._python_dispatch import TorchDispatchMode

from distributed.jobs import build_trainer, summary
from foundry.algorithms import ActivationCheckpointing
from foundry.algorithms.torch_compile import TorchCompile
from foundry.core.event import Event
from foundry.core.parallel_dims import ParallelDims
from foundry.distributed.activation_checkpoint import attention_kernel_ops
from foundry.distributed.config import FSDPConfig
from foundry.distributed.placement import parallelize
from foundry.errors import ConfigError
from foundry.models.build import build_model
from foundry.schema import parse_dataclass

N_LAYERS = 2
LLAMA = {
    "name": "llama_causal_lm", "d_model": 32, "n_heads": 4, "kv_n_heads": 2, "n_layers": N_LAYERS,
    "vocab_size": 64, "max_seq_len": 16, "ffn_hidden_size": 64, "rope_theta": 100.0,
}  # fmt: skip
NO_CHECKPOINTING: dict = {}
CHECKPOINTING = {"activation_checkpointing": True}
KEEP_ATTENTION = {"activation_checkpointing": True, "activation_checkpointing_keep_attention": True}


class AttentionKernelCounter(TorchDispatchMode):
    """Counts the attention kernels that run (a kernel whose output selective checkpointing kept does not)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = set(attention_kernel_ops())
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func in self.ops
        return func(*args, **(kwargs or {}))


def placed_model(
    fsdp_config: dict,
    compile_backend: str | None = None,
    device: str = "cpu",
    model_keys: dict = LLAMA,
    compile_scope: str = "blocks",
) -> tuple[torch.nn.Module, TorchCompile | None]:
    """The tiny Llama (same seed each time), compiled at INIT as the Trainer does, then placed on one rank."""
    torch.manual_seed(0)
    model = build_model(model_keys)
    compiler = None
    if compile_backend is not None:
        compiler = TorchCompile(backend=compile_backend, scope=compile_scope)
        compiler.apply(Event.INIT, SimpleNamespace(model=model, parallel_dims=ParallelDims()), logger=None)
    precision = "amp_bf16" if device == "cuda" else "fp32"
    parallelize(model, FSDPConfig(mixed_precision="PURE", **fsdp_config), torch.device(device), precision)
    return model, compiler


class ProfiledAttentionKernels(torch.profiler.profile):
    """Counts the attention kernels compiled code calls. A dispatch mode cannot: under one, dynamo runs a
    compiled block eagerly, and plain checkpointing's recompute then differs from its compiled forward.
    (The profiler also records the calls selective checkpointing answers from its cache: eager runs use
    ``AttentionKernelCounter``.)"""

    @property
    def calls(self) -> int:
        names = {f"aten::{op.__name__.split('.')[0]}" for op in attention_kernel_ops() if hasattr(op, "_schema")}
        names |= {"foundry::flash_attention4_forward"}
        return sum(event.count for event in self.key_averages() if event.key in names)


def loss_grads_and_backward_kernels(
    model: torch.nn.Module, counter: type = AttentionKernelCounter
) -> tuple[torch.Tensor, dict, int]:
    """One step's loss, each parameter's gradient (by its unwrapped name), and the attention kernels backward ran."""
    device = next(model.parameters()).device
    tokens = torch.randint(0, LLAMA["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": tokens.to(device)}
    with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
        loss = model.loss(model(batch), batch)
    with counter() as backward:
        loss.backward()
    grads = {name.replace("_checkpoint_wrapped_module.", ""): p.grad for name, p in model.named_parameters()}
    return loss.detach(), grads, backward.calls


def assert_same_step(step: tuple, reference: tuple, rtol: float = 1e-5, atol: float = 1e-7) -> None:
    torch.testing.assert_close(step[0], reference[0], rtol=rtol, atol=0)
    assert step[1].keys() == reference[1].keys()
    for name, grad in reference[1].items():
        torch.testing.assert_close(
            step[1][name], grad, rtol=rtol, atol=atol, msg=lambda text, name=name: f"{name}: {text}"
        )


def test_keeping_attention_gives_the_loss_and_gradients_of_plain_and_of_no_checkpointing():
    reference = loss_grads_and_backward_kernels(placed_model(NO_CHECKPOINTING)[0])
    assert_same_step(loss_grads_and_backward_kernels(placed_model(CHECKPOINTING)[0]), reference)
    assert_same_step(loss_grads_and_backward_kernels(placed_model(KEEP_ATTENTION)[0]), reference)


def test_plain_checkpointing_reruns_attention_in_backward_and_keep_attention_does_not():
    model, _ = placed_model(KEEP_ATTENTION)
    batch = {"input_ids": torch.zeros(1, 16, dtype=torch.long)}
    with AttentionKernelCounter() as forward:  # the counter sees the kernel this CPU runs
        model(batch)
    assert forward.calls == N_LAYERS
    assert loss_grads_and_backward_kernels(placed_model(CHECKPOINTING)[0])[2] == N_LAYERS
    assert loss_grads_and_backward_kernels(placed_model(KEEP_ATTENTION)[0])[2] == 0


@pytest.mark.parametrize(
    ("backend", "scope"),
    [("aot_eager", "blocks"), ("aot_eager", "model"), pytest.param("inductor", "blocks", marks=pytest.mark.slow)],
)
def test_compiled_blocks_keep_attention_inside_the_compiled_graph(backend, scope):
    """Regional compile runs at INIT, before checkpointing wraps the blocks; the wrapper is what gets compiled.
    A whole-model graph (scope: model) traces the wrappers as they are."""
    reference = loss_grads_and_backward_kernels(placed_model(NO_CHECKPOINTING)[0])
    with builds_graphs():
        plain, compiler = placed_model(CHECKPOINTING, backend, compile_scope=scope)
        assert loss_grads_and_backward_kernels(plain, ProfiledAttentionKernels)[2] == N_LAYERS
    with builds_graphs():
        model, compiler = placed_model(KEEP_ATTENTION, backend, compile_scope=scope)
        step = loss_grads_and_backward_kernels(model, ProfiledAttentionKernels)
    assert step[2] == 0
    assert_same_step(step, reference)
    assert compiler.compiled.error is None  # compiled, not fallen back to eager


def test_keep_attention_without_checkpointing_names_both_keys():
    with pytest.raises(
        ConfigError, match="activation_checkpointing_keep_attention is true but .*activation_checkpointing is false"
    ):
        parse_dataclass(FSDPConfig, {"activation_checkpointing_keep_attention": True}, "fsdp_config")


def test_keep_attention_with_reentrant_checkpointing_names_both_keys():
    section = {**KEEP_ATTENTION, "activation_checkpointing_reentrant": True}
    with pytest.raises(
        ConfigError, match="keep_attention needs .*non-reentrant.*activation_checkpointing_reentrant is true"
    ):
        parse_dataclass(FSDPConfig, section, "fsdp_config")
    deprecated = pytest.warns(FutureWarning, match="algorithms.activation_checkpointing is deprecated")
    with deprecated, pytest.raises(ConfigError, match="keep_attention: true and reentrant: true"):
        ActivationCheckpointing(reentrant=True, keep_attention=True)


def train_counting_attention_kernels(folder: str, fsdp_config: dict, attention: str) -> dict | None:
    """Two CP2 steps of the tiny Llama; rank 0 returns the summary and the attention kernels this rank ran."""
    parallelism = {"context_parallel_degree": 2, "context_parallel_attention": attention}
    trainer = build_trainer(2, folder, {"sharding_strategy": "FULL_SHARD", **fsdp_config}, model_keys=LLAMA,
                            parallelism=parallelism)  # fmt: skip
    with AttentionKernelCounter() as counter:
        trainer.fit()
    result = summary(trainer)
    return None if result is None else {**result, "kernels": counter.calls}


def train_plain_and_keeping_attention(folder: str, attention: str) -> tuple[dict, dict] | None:
    plain = train_counting_attention_kernels(f"{folder}/plain", CHECKPOINTING, attention)
    kept = train_counting_attention_kernels(f"{folder}/kept", KEEP_ATTENTION, attention)
    return None if plain is None else (plain, kept)


@pytest.mark.parametrize(("attention", "kernels_per_layer"), [("end_aligned", 2), ("split", 2)])
def test_context_parallel_keeps_attention_with_the_same_losses_and_weights(
    ranks, tmp_path, attention, kernels_per_layer
):
    """Under CP rank 0 runs each layer's head chunk as one kernel call and its tail as one: SDPA's (end_aligned)
    or the split op (its block before the chunk and causal square in one call, whose merged output is what
    selective checkpointing keeps); keep_attention runs them once, not again in backward."""
    plain, kept = ranks.run(2, train_plain_and_keeping_attention, str(tmp_path), attention)[0]
    forward_kernels = kernels_per_layer * N_LAYERS * 2  # two steps
    assert (plain["kernels"], kept["kernels"]) == (2 * forward_kernels, forward_kernels)
    assert kept["losses"] == pytest.approx(plain["losses"], rel=1e-6)
    for name, weight in plain["weights"].items():
        torch.testing.assert_close(kept["weights"][name], weight, rtol=1e-5, atol=1e-7, msg=name)


# 64-wide heads in bf16: SDPA's fused kernels (or FlashAttention-4 where installed) take them
GPU_LLAMA = {**LLAMA, "d_model": 256, "n_heads": 4, "kv_n_heads": 2, "ffn_hidden_size": 512, "attn_impl": "flash"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", [None, "inductor"])
def test_on_a_gpu_backward_runs_no_fused_attention_kernel_and_matches_plain_checkpointing(backend):
    counter = AttentionKernelCounter if backend is None else ProfiledAttentionKernels
    with builds_graphs() if backend else contextlib.nullcontext():
        plain = loss_grads_and_backward_kernels(placed_model(CHECKPOINTING, backend, "cuda", GPU_LLAMA)[0], counter)
    with builds_graphs() if backend else contextlib.nullcontext():
        model, compiler = placed_model(KEEP_ATTENTION, backend, "cuda", GPU_LLAMA)
        kept = loss_grads_and_backward_kernels(model, counter)
    assert (plain[2], kept[2]) == (N_LAYERS, 0)
    assert_same_step(kept, plain, rtol=2e-2, atol=1e-3)  # bf16: compiled graphs may fuse differently
    assert compiler is None or compiler.compiled.error is None


def train_sharded_compiled(folder: str) -> tuple[dict, dict] | None:
    """FSDP2 over 2 ranks with regional compile (aot_eager): plain checkpointing, then keep_attention."""
    runs = []
    for name, fsdp_config in (("plain", CHECKPOINTING), ("kept", KEEP_ATTENTION)):
        trainer = build_trainer(2, f"{folder}/{name}", {"sharding_strategy": "FULL_SHARD", **fsdp_config},
                                model_keys=LLAMA, compile_config={"backend": "aot_eager"})  # fmt: skip
        with builds_graphs():
            trainer.fit()
        runs.append(summary(trainer))
    return None if runs[0] is None else tuple(runs)


@pytest.mark.slow
def test_sharded_compiled_blocks_keep_attention_and_train_like_plain_checkpointing(ranks, tmp_path):
    """FSDP2 shards the compiled checkpoint wrappers (the kernel counts are the one-rank tests')."""
    plain, kept = ranks.run(2, train_sharded_compiled, str(tmp_path))[0]
    assert kept["losses"] == pytest.approx(plain["losses"], rel=1e-6)
    for name, weight in plain["weights"].items():
        torch.testing.assert_close(kept["weights"][name], weight, rtol=1e-5, atol=1e-7, msg=name)
