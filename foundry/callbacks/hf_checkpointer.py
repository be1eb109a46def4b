"""``hf_checkpointer``: a Hugging Face model folder written during training, with LLM Foundry's keys.

LLM Foundry's finetune YAMLs end with::

    callbacks:
      hf_checkpointer:
        save_folder: ./{run_name}/checkpoints     # the folder goes under <save_folder>/huggingface/ba{batch}
        save_interval: 1dur                       # and once more at the end of training
        precision: bfloat16

Each save writes what ``foundry convert to-hf`` writes (config, safetensors weights, tokenizer), so the
folder loads with ``transformers`` alone. An ``hf_causal_lm`` model is saved as the transformers model
it wraps; ``mpt_causal_lm`` and ``llama_causal_lm`` go out as the class ``foundry.convert`` picks for them
(a built-in transformers class where one computes the model exactly, else foundry's own code); a LoRA
run writes its adapters in PEFT's format (``foundry convert export-adapter``), as LLM Foundry does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from foundry import distributed, registry
from foundry.convert.checkpoint_io import write_atomically
from foundry.core.callback import Callback
from foundry.core.interval import Interval
from foundry.core.logger import Logger
from foundry.core.paths import is_object_store_url
from foundry.core.state import State
from foundry.core.time import Time
from foundry.distributed.host_memory import check_gather_fits
from foundry.distributed.tensor_parallel import gather_parts, has_parts
from foundry.errors import CheckpointError, ConfigError
from foundry.models.base import model_class
from foundry.models.hf import HFCausalLM
from foundry.models.lora_checkpoint import model_lora_config
from foundry.peft.export import write_peft_adapter

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@registry.callbacks.register("hf_checkpointer")
class HFCheckpointer(Callback):
    """Every ``save_interval`` and at the end of training, write the model as a Hugging Face folder.

    Args:
        save_folder: a local folder; ``{run_name}`` is filled in. The model goes to
            ``<save_folder>/huggingface/<huggingface_folder_name>``.
        save_interval: how often: ``1000ba``, ``1ep``, ``1dur`` (only at the end).
        huggingface_folder_name: the folder's name; ``{batch}``, ``{epoch}`` and ``{run_name}`` are filled in.
        precision: the dtype of the saved weights: ``float32``, ``bfloat16`` or ``float16``.
        overwrite: replace a folder of the same name (else it is an error).
        mlflow_registered_model_name, mlflow_logging_config, final_register_only, register_wait_seconds,
            flatten_imports: LLM Foundry's MLflow registration, which foundry does not do: the first is refused,
            the others have no effect.
    """

    def __init__(
        self,
        save_folder: str,
        save_interval: str | int | Time,
        huggingface_folder_name: str = "ba{batch}",
        precision: str = "float32",
        overwrite: bool = True,
        mlflow_registered_model_name: str | None = None,
        mlflow_logging_config: dict | None = None,
        flatten_imports: list[str] | tuple[str, ...] = ("llmfoundry",),
        final_register_only: bool = False,
        register_wait_seconds: int = 7200,
    ) -> None:
        if mlflow_registered_model_name is not None:
            raise ConfigError(
                "callbacks.hf_checkpointer.mlflow_registered_model_name: foundry does not register models in MLflow; "
                "remove the key (the Hugging Face folder is still written) and register the folder yourself."
            )
        if precision not in DTYPES:
            raise ConfigError(f"callbacks.hf_checkpointer.precision is {precision!r}; use one of {', '.join(DTYPES)}.")
        if is_object_store_url(save_folder):
            raise ConfigError(
                f"callbacks.hf_checkpointer.save_folder is {save_folder!r}: the Hugging Face folder is written to a "
                "local (or mounted) folder only; give one, and copy it to the store afterwards."
            )
        self.folder_pattern = str(Path(save_folder) / "huggingface" / huggingface_folder_name)
        self.interval = Interval(save_interval)
        self.dtype = DTYPES[precision]
        self.overwrite = overwrite
        self.saved_batch: int | None = None
        self.description = ""  # the Hugging Face class of the last save

    def fit_start(self, state: State, logger: Logger) -> None:
        # refused now rather than at the first save
        if state.parallel_dims.tp > 1 and model_lora_config(state.model) is not None:
            raise adapter_export_refusal(state.parallel_dims.tp)
        if state.world_size > 1 and state.is_main_process:
            check_gather_fits(state.model, self.dtype, "callbacks.hf_checkpointer")

    def batch_start(self, state: State, logger: Logger) -> None:
        self.interval.mark(state)

    def batch_end(self, state: State, logger: Logger) -> None:
        if self.interval.due(state):
            self.save(state, logger)

    def epoch_end(self, state: State, logger: Logger) -> None:
        if self.interval.due(state, epoch_end=True) and self.saved_batch != state.timestamp.batch:
            self.save(state, logger)

    def fit_end(self, state: State, logger: Logger) -> None:
        if self.saved_batch != state.timestamp.batch:  # LLM Foundry's checkpointer always saves the final model
            self.save(state, logger)

    def folder(self, state: State) -> Path:
        fields = {"run_name": state.run_name, "batch": state.timestamp.batch, "epoch": state.timestamp.epoch}
        try:
            return Path(self.folder_pattern.format(**fields))
        except (KeyError, IndexError, ValueError) as error:
            raise ConfigError(
                f"callbacks.hf_checkpointer: {self.folder_pattern!r} names {error}, which is not one of "
                "{run_name}, {batch}, {epoch}."
            ) from None

    def save(self, state: State, logger: Logger) -> None:
        """Write the model (gathered from every rank when sharded) as a Hugging Face folder, from rank 0."""
        folder = self.folder(state)
        if folder.exists() and not self.overwrite:
            raise CheckpointError(
                f"hf_checkpointer: {folder} exists and overwrite is false; remove it or set overwrite."
            )
        weights = full_state_dict(state.model, state.world_size)  # every rank takes part when sharded
        if state.is_main_process:
            weights = {name: tensor.detach().to("cpu", self.dtype, copy=True) for name, tensor in weights.items()}
            write_atomically(folder, lambda tmp_dir: self._write(state.model, weights, tmp_dir, state.tokenizer))
            written = f" as {self.description}" if self.description else ""
            logger.log_text(f"hf_checkpointer: wrote the model at batch {state.timestamp.batch}{written} to {folder}")
        distributed.barrier()
        self.saved_batch = state.timestamp.batch

    def _write(self, model: torch.nn.Module, weights: dict[str, torch.Tensor], out_dir: Path, tokenizer: Any) -> None:
        """The model (and the run's tokenizer, when it has one) as a Hugging Face folder in ``out_dir``."""
        if model_lora_config(model) is not None:  # LLM Foundry writes a PEFT model's adapters, in PEFT's format
            base = model.config.pretrained_model_name_or_path if isinstance(model, HFCausalLM) else ""
            write_peft_adapter(model, registered_name(model), out_dir, base)
        elif isinstance(model, HFCausalLM):  # saved as the transformers model it is, from copies of its weights
            prefix = "hf_model."
            hf_weights = {name.removeprefix(prefix): tensor for name, tensor in weights.items()}
            model.hf_model.save_pretrained(out_dir, state_dict=hf_weights)
        else:  # the class foundry.convert.choose_export picks: built into transformers, or foundry's own code
            from foundry.convert.commands import set_special_token_ids  # transformers: only when a run exports
            from foundry.convert.hf_export import export_hf_model, save_hf_folder

            export = export_hf_model(model, registered_name(model), weights)
            if tokenizer is not None:
                set_special_token_ids(export.hf_model, tokenizer)
            save_hf_folder(export.hf_model, out_dir)
            self.description = export.description
        if tokenizer is not None:
            tokenizer.save_pretrained(out_dir)


def adapter_export_refusal(tensor_parallel_degree: int) -> ConfigError:
    """LoRA adapters are written from rank 0's modules, which tensor parallelism leaves holding shares."""
    return ConfigError(
        f"'parallelism.tensor_parallel_degree' is {tensor_parallel_degree} with LoRA (model.peft_config) and "
        "callbacks.hf_checkpointer, which reads the adapters from rank 0's shares only. Remove the callback "
        "and export the checkpoint afterwards (`foundry convert export-adapter`), or set the degree to 1."
    )


def full_state_dict(model: torch.nn.Module, world_size: int) -> dict[str, torch.Tensor]:
    """The model's whole state dict: gathered to rank 0's CPU when sharded over several ranks (empty elsewhere).
    A tensor-parallel fused projection's parts are regrouped first (DTensor would gather them in its own order)."""
    if world_size == 1:
        return model.state_dict()
    if not has_parts(model):
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    whole = {}
    for name, value in gather_parts(get_model_state_dict(model)).items():
        value = value.full_tensor() if isinstance(value, DTensor) else value  # every rank takes part
        if distributed.get_rank() == 0:
            whole[name] = value.cpu()
    return whole


def registered_name(model: torch.nn.Module) -> str:
    """The ``model.name`` a foundry model is registered under (``mpt_causal_lm``, ...)."""
    name = registry.models.name_of(model_class(model))  # FSDP2 swaps in a subclass of its own
    if name is not None:
        return name
    raise ConfigError(
        f"hf_checkpointer cannot tell which registered model a {type(model).__name__} is, so it cannot export it."
    )
