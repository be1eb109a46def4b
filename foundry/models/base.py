"""The small interface the Trainer needs from a model: forward, loss, how much the loss weighs, and FLOPs.

A plain ``nn.Module`` that returns a loss also works: the Trainer wraps it in ``ModuleModel``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from foundry import registry
from foundry.batches import batch_num_samples
from foundry.checkpoint.hooks import CheckpointHooks
from foundry.distributed.protocol import AttentionLayer, ExpertLayer, ParallelModel, no_split_blocks
from foundry.schema import config_to_dict
from foundry.targets import IGNORE_INDEX, shifted_targets


class FoundryModel(nn.Module):
    """Base class for models the Trainer drives.

    Gradient accumulation is exact because the Trainer scales each microbatch's mean loss by
    ``loss_weight(microbatch) / loss_weight(whole batch)``: uneven microbatches (or padding) weigh
    what they contain, not 1/number-of-microbatches.
    """

    def forward(self, batch: Mapping[str, Any]) -> Any:
        raise NotImplementedError

    def loss(self, outputs: Any, batch: Mapping[str, Any]) -> torch.Tensor:
        """Mean loss over this batch's loss units (tokens for a language model)."""
        raise NotImplementedError

    def loss_terms(self) -> dict[str, torch.Tensor]:
        """The named parts of the last ``loss`` when it sums several (an MoE's auxiliary losses), else {}.

        The Trainer logs each as ``loss/train/<name>``, weighted over microbatches and ranks as the loss is.
        """
        return {}

    def loss_weight(self, batch: Mapping[str, Any]) -> torch.Tensor | int:
        """How many units ``loss`` averaged over; a tensor on device is fine (no host sync)."""
        return batch_num_samples(batch)

    def flops_per_batch(self, batch: Mapping[str, Any]) -> int:
        """Model FLOPs of forward + backward for ``batch`` (0 if unknown: MFU is then not reported)."""
        del batch
        return 0

    def eval_metrics_from_loss(self, loss: float) -> dict[str, float]:
        """Eval metrics derived from the token-weighted eval loss."""
        return {"loss": loss}

    def correct_predictions(self, outputs: Any, batch: Mapping[str, Any]) -> torch.Tensor | None:
        """How many of the batch's loss units the outputs predict exactly (a tensor on device), or None when the
        model cannot tell (it then logs no ``TokenAccuracy``)."""
        del outputs, batch
        return None

    def llm_foundry_metrics(self, loss: torch.Tensor, correct: torch.Tensor | None, weight: torch.Tensor) -> dict:
        """The metrics LLM Foundry (Composer) logs for this model, by its names, from the mean ``loss`` over
        ``weight`` loss units of which ``correct`` were predicted; none for a model that is not a language model."""
        del loss, correct, weight
        return {}

    def model_section(self) -> dict[str, Any] | None:
        """``{"name": <registered name>, **config}``: what rebuilds this model, stored in its checkpoints.

        None unless the model's class is registered in ``foundry.registry.models`` (a subclass is
        not its parent: register it too) and ``constructor_config()`` is a dataclass.
        """
        name = registry.models.name_of(model_class(self))
        config = self.constructor_config()
        if name is None or not dataclasses.is_dataclass(config):
            return None
        return {"name": name, **config_to_dict(config)}

    def constructor_config(self) -> Any:
        """The config dataclass this model's class was built from (``self.config`` unless it converts it)."""
        return getattr(self, "config", None)

    # foundry.distributed.protocol.ParallelModel: what sharding, context and expert parallelism act on. A family
    # names its blocks, attention and expert layers; this default finds blocks by ``_no_split_modules`` only.
    def parallel_blocks(self) -> list[nn.Module]:
        return no_split_blocks(self)

    def attention_layers(self) -> list[AttentionLayer]:
        return []

    def expert_layers(self) -> list[ExpertLayer]:
        return []

    @property
    def checkpoint_hooks(self) -> CheckpointHooks:
        """How checkpoints save and load this model (``foundry.checkpoint.hooks``): all of its weights."""
        return CheckpointHooks()


def model_class(model: nn.Module) -> type:
    """The class ``model`` was built as: FSDP2's ``fully_shard`` swaps in ``FSDP<Class>(FSDPModule, Class)``."""
    cls = type(model)
    while cls.__module__.startswith("torch.distributed.fsdp") and len(cls.__bases__) > 1:
        cls = cls.__bases__[-1]
    return cls


@dataclasses.dataclass
class LossOutput:
    """What a forward returns when it computed the loss itself (the fused linear + cross-entropy): no logits."""

    loss: torch.Tensor


# FSDP2 hooks the root module's pre-backward all-gather onto the forward's output tensors, found
# with pytree on torch < 2.14: unregistered, the loss inside would be missed and backward would
# run on freed parameters.
pytree.register_pytree_node(
    LossOutput, lambda output: ([output.loss], None), lambda children, _: LossOutput(children[0])
)


@dataclasses.dataclass
class TokenLogps:
    """What ``forward(batch, token_logps=True)`` returns (``CausalLM.computes_token_logps``): each position's
    log-probability of its target, fp32 (batch, seq), 0 where the target is ignored; no logits."""

    logps: torch.Tensor


pytree.register_pytree_node(
    TokenLogps, lambda output: ([output.logps], None), lambda children, _: TokenLogps(children[0])
)


class CausalLM(FoundryModel):
    """A next-token predictor: ``forward`` returns logits (batch, seq, vocab); labels shift inside.

    A model may instead return ``LossOutput`` from a training forward that fused the output
    projection into the loss; ``loss`` then passes it through. A model whose ``computes_token_logps`` is true
    takes ``forward(batch, token_logps=True)`` and returns ``TokenLogps`` (preference tuning's log-probabilities,
    without the (batch, seq, vocab) logits).
    """

    computes_token_logps: bool = False

    def loss(self, outputs: Any, batch: Mapping[str, Any]) -> torch.Tensor:
        if isinstance(outputs, LossOutput):
            return outputs.loss
        logits = outputs.logits if hasattr(outputs, "logits") else outputs
        targets = shifted_targets(batch)
        return nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="mean"
        )

    def loss_weight(self, batch: Mapping[str, Any]) -> torch.Tensor:
        return (shifted_targets(batch) != IGNORE_INDEX).sum()

    def eval_metrics_from_loss(self, loss: float) -> dict[str, float]:
        return {"loss": loss, "perplexity": math.exp(min(loss, 80.0))}

    def correct_predictions(self, outputs: Any, batch: Mapping[str, Any]) -> torch.Tensor | None:
        """Target tokens the logits' argmax predicts; None for a fused loss's outputs, which hold no logits."""
        if isinstance(outputs, LossOutput):
            return None
        logits = outputs.logits if hasattr(outputs, "logits") else outputs
        targets = shifted_targets(batch)
        return ((logits.argmax(dim=-1) == targets) & (targets != IGNORE_INDEX)).sum()

    def llm_foundry_metrics(self, loss: torch.Tensor, correct: torch.Tensor | None, weight: torch.Tensor) -> dict:
        """Composer's ``LanguageCrossEntropy``, ``LanguagePerplexity`` and ``TokenAccuracy`` (without logits, none)."""
        metrics = {"LanguageCrossEntropy": loss, "LanguagePerplexity": torch.exp(loss.clamp(max=80.0))}
        if correct is not None:
            metrics["TokenAccuracy"] = correct / weight.clamp(min=1)
        return metrics


class ModuleModel(FoundryModel):
    """Adapts any ``nn.Module`` whose forward returns a loss (or an object with ``.loss``, like HF outputs)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, batch: Mapping[str, Any]) -> Any:
        if isinstance(batch, Mapping):
            return self.module(**batch)
        return self.module(*batch) if isinstance(batch, list | tuple) else self.module(batch)

    def loss(self, outputs: Any, batch: Mapping[str, Any]) -> torch.Tensor:
        del batch
        loss = outputs.loss if hasattr(outputs, "loss") else outputs
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise TypeError(
                "A plain nn.Module passed to Trainer must return a scalar loss (or an object with .loss); "
                "subclass foundry.models.FoundryModel to return outputs and compute the loss separately."
            )
        return loss

    def parallel_blocks(self) -> list[nn.Module]:
        return self._declared("parallel_blocks", no_split_blocks(self.module))

    def attention_layers(self) -> list[AttentionLayer]:
        return self._declared("attention_layers", [])

    def expert_layers(self) -> list[ExpertLayer]:
        return self._declared("expert_layers", [])

    def _declared(self, name: str, otherwise: list[Any]) -> list[Any]:
        """The wrapped module's own list when it implements ``ParallelModel``."""
        return list(getattr(self.module, name)()) if isinstance(self.module, ParallelModel) else otherwise
