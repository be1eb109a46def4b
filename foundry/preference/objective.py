"""Preference tuning as a training objective: DPO, IPO and SimPO over (prompt, chosen, rejected) pairs.

A step costs two forwards and one backward, as TRL's ``DPOTrainer``: chosen and rejected rows run through the
policy in one forward (``(2·pairs, seq)``, chosen first), and through the reference under ``no_grad``. The
reference is, by ``preference.reference``:

- ``adapters_off`` (the default for a LoRA model): the policy itself with its adapters switched off, so no
  second copy of the weights exists;
- ``copy`` (the default otherwise): a frozen copy of the policy, placed (sharded) as the policy is, holding the
  weights the run starts from (``load_path``'s, also when the run resumes from its own checkpoint later);
- ``precomputed``: the log-probabilities under the starting weights, computed once as the run starts and stored
  beside the data (``foundry.preference.reference_cache``): a step is then one forward and one backward;
- ``none``: no reference (SimPO is reference-free);
- or a model given as ``reference=`` (``preference.reference_model`` in a YAML), frozen, of the same vocabulary.

It logs TRL's metrics: ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``,
``logps/chosen`` and ``logps/rejected``, each a mean over the batch's pairs.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from foundry.batches import IGNORE_INDEX
from foundry.checkpoint.load import load_checkpoint
from foundry.errors import ConfigError
from foundry.models.base import FoundryModel
from foundry.models.build import build_model, vocab_size
from foundry.models.lora import adapters_disabled, lora_modules
from foundry.models.objective import Objective
from foundry.preference.config import AVERAGES_PER_TOKEN, REFERENCE_FREE, PreferenceConfig, Reference
from foundry.preference.logps import model_sequence_logps
from foundry.preference.losses import preference_loss
from foundry.preference.reference_cache import reference_table


class PreferenceObjective(Objective):
    """DPO and its variants through the Trainer: ``Trainer(model, loader, objective=PreferenceObjective(config))``.

    Batches come from the ``preference`` loader (``foundry.data.preference``): ``input_ids`` and ``labels``
    (pairs, 2, seq).
    """

    def __init__(
        self, config: PreferenceConfig | None = None, reference: nn.Module | None = None, tokenizer: Any = None
    ) -> None:
        """``reference``: a frozen model to compare with, else ``config.reference_model`` built (checked against
        ``tokenizer``), else what ``config.reference`` names."""
        self.config = config or PreferenceConfig()
        if reference is not None and self.config.reference_model is not None:
            raise ConfigError("'preference.reference_model' is set and a reference model is given too; keep one.")
        if self.config.reference_model is not None:
            reference = build_model(self.config.reference_model, tokenizer)
        self.reference = reference  # a separate frozen model, or None (adapters off, the policy's copy, none)
        self._copies_policy = reference is None  # a copy made at attach takes the policy's starting weights
        self.mode: Reference = "copy" if reference is not None else self.config.reference
        self._metrics: dict[str, torch.Tensor] = {}
        self._reference_table: torch.Tensor | None = None  # reference: precomputed, (pairs, 2) on the device

    def attach(self, model: FoundryModel) -> None:
        config = self.config
        if self.mode == "auto":
            has_adapters = next(lora_modules(model), None) is not None
            self.mode = "none" if config.loss_type in REFERENCE_FREE else "adapters_off" if has_adapters else "copy"
        if self.mode == "adapters_off" and next(lora_modules(model), None) is None:
            raise ConfigError(
                "'preference.reference' is adapters_off, but the model has no LoRA adapters (model.peft_config); "
                "use reference: copy."
            )
        if self.mode != "copy":
            return
        if self.reference is None:
            self.reference = copy.deepcopy(model)  # its weights follow the policy's starting ones (after_load)
        else:
            _check_same_vocabulary(model, self.reference)
        self.reference.requires_grad_(False).eval()

    def modules_to_place(self) -> list[nn.Module]:
        return [self.reference] if self.mode == "copy" and self.reference is not None else []

    def after_load(self, state: Any, load_path: str | None) -> None:
        if state.parallel_dims.cp > 1:  # each rank would score a piece of every sequence as if it were whole
            raise ConfigError(
                f"'parallelism.context_parallel_degree' is {state.parallel_dims.cp}, but preference tuning scores "
                "whole sequences on each rank; set the degree to 1 (shard the model with fsdp_config instead)."
            )
        model = state.model
        if self.mode == "precomputed" and state.eval_dataloaders:  # their pair_index would read the train table
            raise ConfigError(
                "'preference.reference' is precomputed, whose log-probabilities are the train pairs' only, but the "
                f"run has eval loaders ({', '.join(state.eval_dataloaders)}); remove them, or use reference: copy."
            )
        if self.mode == "precomputed":
            self._reference_table = reference_table(model, state, load_path).to(state.device)
        if self.mode != "copy" or not self._copies_policy:
            return
        if state.timestamp.batch > 0 and load_path:  # resumed later on: the run started from load_path's weights
            load_checkpoint(load_path, dataclasses.replace(state, model=self.reference), weights_only=True)
        elif state.timestamp.batch == 0:
            _copy_weights(model, self.reference)

    def forward(self, model: FoundryModel, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Summed log-probabilities of the policy and the reference and token counts, each (2·rows, sequences per
        row): every chosen row first, then every rejected row."""
        inputs = {key: _rows(batch[key]) for key in ("input_ids", "sequence_id", "position_ids") if key in batch}
        if "sequence_id" in inputs:
            _check_masks_packed_sequences(model)
        labels, sequence_id = _rows(batch["labels"]), inputs.get("sequence_id")
        # the batch's widest row's pairs, as the precomputed table's columns (a microbatch may hold fewer)
        sequences = batch["pair_index"].shape[1] if sequence_id is not None and "pair_index" in batch else None
        outputs = {}
        if self.mode == "precomputed":  # (pairs, 2) table → (2·rows, pairs per row), as the policy's
            table = self._reference_table[batch["pair_index"].clamp(min=0)]
            outputs["reference"] = torch.cat([table[..., 0], table[..., 1]])
        elif self.mode != "none":
            with torch.no_grad(), self._reference_model(model) as reference:
                outputs["reference"], _ = model_sequence_logps(reference, inputs, labels, sequence_id, sequences)
        outputs["policy"], outputs["tokens"] = model_sequence_logps(model, inputs, labels, sequence_id, sequences)
        return outputs

    @contextlib.contextmanager
    def _reference_model(self, model: FoundryModel) -> Iterator[nn.Module]:
        if self.mode == "adapters_off":
            with adapters_disabled(model):
                yield model
        else:
            yield self.reference

    def loss(self, model: FoundryModel, outputs: Any, batch: Mapping[str, Any]) -> torch.Tensor:
        config = self.config
        tokens = outputs["tokens"].clamp(min=1)
        per_token = config.loss_type in AVERAGES_PER_TOKEN
        policy = outputs["policy"] / tokens if per_token else outputs["policy"]
        reference = outputs.get("reference")
        if reference is not None and per_token:
            reference = reference / tokens
        chosen, rejected = (side.flatten() for side in policy.chunk(2))  # (pairs,): row by row, sequence by sequence
        reference_chosen, reference_rejected = (
            (side.flatten() for side in reference.chunk(2)) if reference is not None else (None, None)
        )
        losses, chosen_rewards, rejected_rewards = preference_loss(
            config.loss_type, chosen, rejected, reference_chosen, reference_rejected,
            config.beta, config.label_smoothing, config.gamma_beta_ratio,
        )  # fmt: skip
        real = outputs["tokens"].chunk(2)[0].flatten() > 0  # a padding pair (a short last step) weighs nothing
        pairs = real.sum().clamp(min=1)

        def mean(values: torch.Tensor) -> torch.Tensor:
            return torch.where(real, values.float(), 0.0).sum() / pairs

        self._metrics = {
            "rewards/chosen": mean(chosen_rewards),
            "rewards/rejected": mean(rejected_rewards),
            "rewards/accuracies": mean((chosen_rewards > rejected_rewards).float()),
            "rewards/margins": mean(chosen_rewards - rejected_rewards),
            "logps/chosen": mean(chosen.detach()),
            "logps/rejected": mean(rejected.detach()),
        }
        return mean(losses)

    def loss_weight(self, model: FoundryModel, batch: Mapping[str, Any]) -> torch.Tensor:
        """The pairs with a response token (padding pairs excluded)."""
        if "sequence_id" in batch:  # packed: each chosen sequence starts at position 0
            return ((batch["position_ids"][:, 0] == 0) & (batch["sequence_id"][:, 0] >= 0)).sum()
        return (batch["labels"][:, 0, 1:] != IGNORE_INDEX).any(-1).sum()

    def logged_terms(self, model: FoundryModel) -> dict[str, torch.Tensor]:
        return self._metrics

    def correct_predictions(self, model: FoundryModel, outputs: Any, batch: Mapping[str, Any]) -> None:
        return None

    def llm_foundry_metrics(
        self, model: FoundryModel, loss: torch.Tensor, correct: torch.Tensor | None, weight: torch.Tensor
    ) -> dict:
        return {}

    def eval_metrics_from_loss(self, model: FoundryModel, loss: float) -> dict[str, float]:
        return {"loss": loss}


def _rows(pairs: torch.Tensor) -> torch.Tensor:
    """(pairs, 2, seq) → (2·pairs, seq): every chosen row, then every rejected row (TRL's concatenated batch)."""
    return torch.cat([pairs[:, 0], pairs[:, 1]])


@torch.no_grad()
def _copy_weights(source: nn.Module, target: nn.Module) -> None:
    """``target``'s parameters and buffers set to ``source``'s (same structure, same placement)."""
    for (_, value), (_, into) in zip(
        [*source.named_parameters(), *source.named_buffers()], [*target.named_parameters(), *target.named_buffers()]
    ):
        into.copy_(value)


def _check_masks_packed_sequences(model: nn.Module) -> None:
    """Packed pairs are exact only where attention stays within each sequence."""
    attn_config = getattr(getattr(model, "config", None), "attn_config", None)
    if not getattr(attn_config, "attn_uses_sequence_id", False):
        raise ConfigError(
            "The preference loader packs several pairs per row (packing_ratio), but the model lets packed sequences "
            "attend to each other, so their log-probabilities would not be the pairs' own. Set "
            "model.attn_config.attn_uses_sequence_id: true (mpt_causal_lm, llama_causal_lm), or remove packing_ratio."
        )


def _check_same_vocabulary(model: nn.Module, reference: nn.Module) -> None:
    policy_vocab, reference_vocab = vocab_size(model), vocab_size(reference)
    if policy_vocab is not None and reference_vocab is not None and policy_vocab != reference_vocab:
        raise ConfigError(
            f"'preference.reference_model' has a vocabulary of {reference_vocab} tokens and the model one of "
            f"{policy_vocab}: their log-probabilities of the same token ids would not compare. Use a reference with "
            "the model's tokenizer and vocab_size (or leave reference_model out: a frozen copy of the model)."
        )
