"""What the distributed tests run on each rank: a tiny MPT trained on fixed batches, through the Trainer.

Every run of ``train`` sees the same global batches; rank r of W trains on its 1/W slice of each,
so any world size trains on the same data and should reach the same losses and weights.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import pytest
import torch
from helpers import builds_graphs, token_batches
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor

from foundry.core import LoggerDestination
from foundry.distributed import get_rank, get_world_size
from foundry.distributed.tensor_parallel import gather_parts
from foundry.models import MPTCausalLM
from foundry.models.build import build_model
from foundry.optim import DecoupledAdamW
from foundry.trainer import Trainer

# no_bias: the attention's key bias has a zero gradient in exact arithmetic, so Adam would scale
# rank-count-dependent rounding noise up to full-size updates there.
MODEL = {"d_model": 32, "n_heads": 4, "n_layers": 2, "vocab_size": 64, "max_seq_len": 16, "no_bias": True}
GLOBAL_BATCH_SIZE = 4
SEED = 17


class LossRecorder(LoggerDestination):
    """Keeps every logged ``loss/train/total`` (the global batch's loss, the same on every rank)."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if "loss/train/total" in metrics:
            self.losses[step] = metrics["loss/train/total"]


def rank_batches(num_batches: int, tensor_parallel_degree: int = 1) -> list[dict[str, torch.Tensor]]:
    """This rank's slice of each of ``num_batches`` fixed global batches (tensor-parallel ranks share one)."""
    rank, world_size = get_rank() // tensor_parallel_degree, get_world_size() // tensor_parallel_degree
    per_rank = GLOBAL_BATCH_SIZE // world_size
    batches = token_batches(num_batches, GLOBAL_BATCH_SIZE, seq_len=16, vocab_size=MODEL["vocab_size"], seed=0)
    return [{key: value[rank * per_rank : (rank + 1) * per_rank] for key, value in b.items()} for b in batches]


def build_trainer(
    max_batches: int,
    folder: str,
    fsdp_config: dict[str, Any] | None = None,
    model_keys: dict[str, Any] | None = None,  # with a 'name': a whole model section instead of the tiny MPT
    precision: str = "fp32",  # ranks' losses are compared to one rank's within fp32 round-off
    optimizer_keys: dict[str, Any] | None = None,  # DecoupledAdamW's, over lr=3e-3
    **trainer_kwargs: Any,
) -> Trainer:
    torch.manual_seed(SEED)  # as builders.build_trainer seeds before building the model
    return Trainer(
        model=build_model(model_keys) if "name" in (model_keys or {}) else MPTCausalLM(**MODEL, **(model_keys or {})),
        train_dataloader=rank_batches(
            max_batches, (trainer_kwargs.get("parallelism") or {}).get("tensor_parallel_degree", 1)
        ),
        max_duration=f"{max_batches}ba",
        optimizers=lambda params: DecoupledAdamW(params, **{"lr": 3e-3, **(optimizer_keys or {})}),
        fsdp_config=fsdp_config,
        precision=precision,
        device="cpu",
        seed=SEED,
        run_folder=f"{folder}/run",
        log_to_console=False,
        loggers=[LossRecorder()],
        **trainer_kwargs,
    )


def train(max_batches: int, folder: str, fsdp_config: dict[str, Any] | None = None, **kwargs: Any) -> dict | None:
    """Train (resuming when ``autoresume`` is passed); rank 0 returns losses, final weights and stop reason."""
    trainer = build_trainer(max_batches, folder, fsdp_config, **kwargs)
    trainer.fit()
    return summary(trainer)


def train_compiled(
    max_batches: int, folder: str, fsdp_config: dict[str, Any] | None = None, **kwargs: Any
) -> dict | None:
    """``train`` with a compile setting in ``kwargs`` (``compile_config`` or a ``TorchCompile`` algorithm), failing
    unless dynamo built graphs and nothing fell back to eager: a compiled run that ran eagerly proves nothing."""
    with warnings.catch_warnings(), builds_graphs():
        warnings.filterwarnings("error", message="torch.compile failed")
        return train(max_batches, folder, fsdp_config, **kwargs)


def summary(trainer: Trainer) -> dict[str, Any] | None:
    """Losses by batch, full weights (gathered from the shards) and the stop reason, on rank 0 only."""
    weights = full_weights(trainer.state.model)
    if get_rank() != 0:
        return None
    recorder = next(d for d in trainer.logger.destinations if isinstance(d, LossRecorder))
    return {
        "losses": recorder.losses,
        "weights": {name: tensor.detach().clone() for name, tensor in weights.items()},
        "stop_reason": trainer.state.stop_reason,
        "batch": trainer.state.timestamp.batch,
    }


def full_weights(model: Any) -> dict[str, torch.Tensor]:
    """Every rank's shards gathered into whole tensors (tensor-parallel parts regrouped by hand, which torch
    2.11's DTensor cannot do)."""
    state = gather_parts(get_model_state_dict(model))
    return {name: value.full_tensor() if isinstance(value, DTensor) else value for name, value in state.items()}


def initial_weights(folder: str, fsdp_config: dict[str, Any] | None = None, **kwargs: Any) -> dict | None:
    """The full weights right after the Trainer placed (and sharded) the model, on rank 0."""
    result = summary(build_trainer(1, folder, fsdp_config, **kwargs))
    return None if result is None else result["weights"]


def collective_counts(folder: str, fsdp_config: dict[str, Any], microbatch_size: int) -> dict[str, int] | None:
    """How many all-gathers and reduce-scatters FSDP2 issued in one trained batch, on rank 0."""
    import torch.distributed as dist

    counts = {"all_gather": 0, "reduce_scatter": 0}
    originals = {}
    for name in ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor"):
        if hasattr(dist, name):  # FSDP2 calls one or the other, depending on the torch release
            originals[name] = original = getattr(dist, name)
            kind = "all_gather" if name.startswith("all_gather") else "reduce_scatter"

            def counting(*args: Any, _original: Any = original, _kind: str = kind, **kwargs: Any) -> Any:
                counts[_kind] += 1
                return _original(*args, **kwargs)

            setattr(dist, name, counting)
    try:
        trainer = build_trainer(1, folder, fsdp_config, device_train_microbatch_size=microbatch_size)
        counts.update(all_gather=0, reduce_scatter=0)  # what placing the model sent is not the batch's
        trainer.fit()
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return counts if get_rank() == 0 else None


# float8's GEMM takes sizes in multiples of 16: under TP2 each rank's share of the query/key/value output (96) is one
FLOAT8_LLAMA = {
    "name": "llama_causal_lm", "d_model": 64, "n_heads": 4, "kv_n_heads": None, "n_layers": 3, "vocab_size": 64,
    "max_seq_len": 16, "ffn_hidden_size": 128, "rope_theta": 100.0,
}  # fmt: skip


def skip_without_cpu_float8() -> None:
    """Skip unless torchao is installed and this torch multiplies float8 on the CPU (``torch._scaled_mm``)."""
    pytest.importorskip("torchao")
    ones, scale = torch.ones(16, 16).to(torch.float8_e4m3fn), torch.tensor(1.0)
    try:
        torch._scaled_mm(ones, ones.t(), scale_a=scale, scale_b=scale, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError):
        pytest.skip("this torch has no CPU float8 GEMM")


def train_float8(folder: str, float8: bool, compiled: bool = False, **kwargs: Any) -> dict | None:
    """Two fp32 steps of ``FLOAT8_LLAMA``, its blocks' linears in tensorwise float8 (through torch's CPU float8
    GEMM, where foundry itself would train in bf16) unless not ``float8``; rank 0 returns ``summary`` and which
    layers were float8. ``kwargs`` go to ``build_trainer``."""
    from foundry.algorithms import float8 as float8_module

    algorithms = [float8_module.Float8Training(keep_first_and_last_blocks=False)] if float8 else []
    compiling = {"compile_config": {"backend": "aot_eager"}} if compiled else {}
    unavailable = float8_module.float8_unavailable
    float8_module.float8_unavailable = lambda device, recipe: None
    try:
        trainer = build_trainer(2, folder, model_keys=FLOAT8_LLAMA, algorithms=algorithms, **compiling, **kwargs)
        with builds_graphs() if compiled else contextlib.nullcontext():
            trainer.fit()
    finally:
        float8_module.float8_unavailable = unavailable
    result = summary(trainer)
    if result is not None:
        modules = trainer.state.model.named_modules()
        result["float8"] = sorted(name for name, module in modules if type(module).__name__ == "Float8Linear")
    return result


def assert_same_run(result: dict, reference: dict, tolerance: float = 1e-5) -> None:
    """``result`` (a ``summary``) trained as ``reference`` did: each step's loss and each final weight within
    ``tolerance``, and no step missing."""
    assert sorted(result["losses"]) == sorted(reference["losses"])
    for step, loss in reference["losses"].items():
        assert result["losses"][step] == pytest.approx(loss, abs=tolerance), step
    assert result["weights"].keys() == reference["weights"].keys()
    for name, weight in reference["weights"].items():
        torch.testing.assert_close(result["weights"][name], weight, atol=tolerance, rtol=0, msg=name)
