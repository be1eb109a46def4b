"""Any Hugging Face causal LM as a foundry model: ``model.name: hf_causal_lm``.

Wraps ``transformers.AutoModelForCausalLM`` so a local checkpoint directory (or a hub name, when the
machine can reach the hub) trains, evaluates and checkpoints like a native family. Remote code
never runs unless the YAML sets ``trust_remote_code: true``. The loss is foundry's (shifted
targets, token-weighted), so it is exactly the native families' loss; the HF model never sees labels.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from foundry import registry
from foundry.checkpoint.hf_weights import layers_of_folder
from foundry.checkpoint.hooks import CheckpointHooks
from foundry.errors import ConfigError, did_you_mean
from foundry.models import flops
from foundry.models.base import CausalLM
from foundry.models.hf_families import NATIVE_MOE
from foundry.models.lora import LoraConfig, inject_lora, is_adapter_key, reset_lora_parameters
from foundry.models.lora_checkpoint import lora_checkpoint_hooks
from foundry.models.mpt import init_device
from foundry.models.nf4 import dense_weights
from foundry.schema import parse_dataclass

_KEY = "model"


@dataclasses.dataclass
class HFCausalLMConfig:
    """The ``model`` section for ``hf_causal_lm`` (LLM Foundry's keys where they exist)."""

    pretrained_model_name_or_path: str
    pretrained: bool = True  # False: the architecture of the config, randomly initialised
    config_overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    trust_remote_code: bool = False
    # transformers' name: sdpa, eager, flash_attention_2, ...; None: sdpa where the model's class implements it,
    # else eager (LLM Foundry always defaults to eager, which refuses no model but is the slowest).
    attn_implementation: str | None = None
    init_device: str = "cpu"  # 'cpu', 'meta', 'mixed' (cpu on each node's rank 0, meta elsewhere), ...
    use_flash_attention_2: bool = False  # LLM Foundry's spelling of attn_implementation: flash_attention_2
    # A Hub token (or true: the logged-in one) for gated models; with a local directory it does nothing.
    use_auth_token: bool | str | None = None
    token: bool | str | None = None  # transformers' newer name for use_auth_token
    peft_config: LoraConfig | None = None  # LoRA on the HF model's own linear layers (docs/LORA.md)
    pretrained_lora_id_or_path: str | None = None

    def __post_init__(self) -> None:
        self.config_overrides = dict(self.config_overrides)
        attn_config = self.config_overrides.get("attn_config")
        if isinstance(attn_config, Mapping) and "attn_impl" in attn_config:
            # LLM Foundry's MPT key, which its YAMLs set on other models too (Llama's); no transformers model
            # reads it (their attention is attn_implementation), so 'flash' asks for flash attention as below.
            attn_config = dict(attn_config)
            wants_flash = attn_config.pop("attn_impl") == "flash"
            if attn_config.get("attn_uses_sequence_id") is False:  # what every HF model does
                attn_config.pop("attn_uses_sequence_id")
            self.config_overrides.pop("attn_config")
            if attn_config:
                self.config_overrides["attn_config"] = attn_config
            self.use_flash_attention_2 |= wants_flash and self.attn_implementation is None
        if self.use_flash_attention_2:
            if self.attn_implementation not in (None, "flash_attention_2"):
                raise ConfigError(
                    f"'{_KEY}.use_flash_attention_2' is true but '{_KEY}.attn_implementation' is "
                    f"{self.attn_implementation!r}; keep one of them."
                )
            if importlib.util.find_spec("flash_attn") is not None:
                self.attn_implementation = "flash_attention_2"
            else:  # LLM Foundry's YAMLs ask for it on every machine; the default (sdpa) is the fast path here
                warnings.warn(
                    f"'{_KEY}.use_flash_attention_2' is true but the flash_attn package is not installed, so "
                    "transformers' flash_attention_2 cannot run; using the default attention (sdpa where the model "
                    "has it). Set attn_implementation: flash_attention_2 to require it.",
                    stacklevel=2,
                )
        if self.pretrained_lora_id_or_path is not None:
            raise ConfigError(
                f"'{_KEY}.pretrained_lora_id_or_path': starting from a trained PEFT adapter is not supported; remove "
                f"it, and train new adapters with '{_KEY}.peft_config' (or continue a foundry LoRA run with load_path)."
            )


@registry.models.register("hf_causal_lm")
class HFCausalLM(CausalLM):
    """A ``transformers`` causal LM; ``forward(batch)`` returns its logits (batch, seq, vocab).

    ``hf_model`` is the wrapped ``PreTrainedModel`` (``save_pretrained`` works on it directly).
    """

    def __init__(self, config: HFCausalLMConfig | Mapping[str, Any] | None = None, **config_keys: Any) -> None:
        super().__init__()
        if config is not None and config_keys:
            raise ConfigError("Pass HFCausalLM either an HFCausalLMConfig or its keys as keyword arguments, not both.")
        self.config = parse_dataclass(HFCausalLMConfig, config if config is not None else config_keys, _KEY)
        hf_config = load_hf_config(self.config)
        warn_if_native_moe(hf_config, self.config.pretrained_model_name_or_path)
        self.hf_model = _build_hf_model(self.config, hf_config)
        keep_expert_sums_in_the_input_dtype(self.hf_model)
        # False once the weights are gone (init_device: meta, to_empty): then load_pretrained_weights() reads them.
        self.holds_pretrained_weights = self.config.pretrained and init_device(self.config.init_device).type != "meta"
        if self.config.peft_config is not None:
            inject_lora(self.hf_model, self.config.peft_config)

    def to_empty(self, *, device: torch.device | str | None, recurse: bool = True) -> HFCausalLM:
        """``nn.Module.to_empty``, then the buffers no state dict holds (RoPE frequencies) are computed again."""
        super().to_empty(device=device, recurse=recurse)
        refill_computed_buffers(self.hf_model, device)
        self.holds_pretrained_weights = False
        reset_lora_parameters(self)  # the adapters start as PEFT's init until a checkpoint fills them
        return self

    @property
    def checkpoint_hooks(self) -> CheckpointHooks:
        """With a ``peft_config``: LoRA's checkpoints (maybe adapters only, their base loaded first)."""
        return lora_checkpoint_hooks(self)

    def init_weights(self) -> None:
        """Weights for a model built on the meta device (``init_device: meta``, as LLM Foundry's 8B YAMLs build):
        the pretrained ones read again, else transformers' own random init of the architecture."""
        if self.config.pretrained:
            self.load_pretrained_weights()
            return
        with dense_weights(self):  # QLoRA: the init writes bf16 values, quantized again after
            for module in self.hf_model.modules():
                self.hf_model._init_weights(module)
            self.hf_model.tie_weights()
        reset_lora_parameters(self)

    def load_pretrained_weights(self) -> None:
        """Read ``pretrained_model_name_or_path``'s weights again (the base of an adapters-only LoRA checkpoint)."""
        if not self.config.pretrained:
            raise ConfigError(
                f"'{_KEY}.pretrained' is false, so {self.config.pretrained_model_name_or_path} holds no base weights "
                "for this model; load a checkpoint that has them (load_path)."
            )
        pretrained = _build_hf_model(dataclasses.replace(self.config, init_device="cpu"), self.hf_config)
        device = next(self.hf_model.parameters()).device
        result = self.hf_model.load_state_dict(pretrained.to(device).state_dict(), strict=False)
        if result.unexpected_keys or any(not is_adapter_key(key) for key in result.missing_keys):
            raise ConfigError(
                f"{self.config.pretrained_model_name_or_path} does not fit this model: missing "
                f"{result.missing_keys[:3]}, unexpected {result.unexpected_keys[:3]}."
            )
        self.holds_pretrained_weights = True

    def weight_layers(self) -> Iterator[dict[str, torch.Tensor]] | None:
        """The pretrained weights a layer at a time by parameter name (``foundry.distributed.protocol.
        StreamedWeights``: each rank reads the files and keeps its slices); None where they cannot be streamed
        (random init, a Hub id rather than a folder, LoRA adapters, which are drawn after the base is read)."""
        folder = Path(self.config.pretrained_model_name_or_path).expanduser()
        if not self.config.pretrained or self.config.peft_config is not None or not folder.is_dir():
            return None
        return ({f"hf_model.{name}": tensor for name, tensor in layer.items()} for layer in layers_of_folder(folder))

    @property
    def hf_config(self) -> Any:
        return self.hf_model.config

    @property
    def vocab_size(self) -> int:
        return self.hf_model.get_input_embeddings().weight.shape[0]

    def forward(self, batch: Mapping[str, Any]) -> torch.Tensor:
        refuse_packed_examples(batch)
        outputs = self.hf_model(
            input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"), use_cache=False
        )
        return outputs.logits

    @property
    def num_params(self) -> int:
        return flops.num_params(self)

    @functools.cached_property
    def n_active_params(self) -> int:
        embedding = self.hf_model.get_input_embeddings()
        output = self.hf_model.get_output_embeddings()
        tied = output is not None and output.weight is embedding.weight
        return flops.active_params(self, embedding, tied)

    def flops_per_batch(self, batch: Mapping[str, Any]) -> int:
        batch_size, seq_len = flops.rows_and_length(batch["input_ids"])
        n_layers, q_dim = hf_depth_and_attention_width(self.hf_config)
        return flops.flops_per_batch(self.n_active_params, n_layers, q_dim, batch_size, seq_len)


def refuse_packed_examples(batch: Mapping[str, Any]) -> None:
    """Hugging Face models take no per-example attention mask here, so packed rows would attend across examples."""
    sequence_id = batch.get("sequence_id")
    if sequence_id is not None and bool((sequence_id > 0).any()):
        raise ConfigError(
            "This batch packs several examples per row (the finetuning loader's packing_ratio), but hf_causal_lm "
            "cannot mask attention between them. Remove 'train_loader.dataset.packing_ratio' (and the eval "
            "loaders'), or use mpt_causal_lm / llama_causal_lm with attn_config.attn_uses_sequence_id: true."
        )


def refill_computed_buffers(hf_model: nn.Module, device: torch.device | str | None) -> None:
    """Recompute the non-persistent buffers of ``hf_model`` (RoPE inverse frequencies) on ``device``.

    No state dict holds them, so a model built on the meta device or emptied by ``to_empty`` would
    keep garbage there. transformers computes them from the config in the module's constructor.
    """
    for module in hf_model.modules():
        names = module._non_persistent_buffers_set
        if not names:
            continue
        try:
            with torch.device(device or "cpu"):
                fresh = _fresh_module(module, hf_model.config)
        except TypeError as error:
            raise ConfigError(
                f"{type(module).__name__} holds buffers no checkpoint saves ({', '.join(sorted(names))}) and foundry "
                f"cannot recompute them from the config ({error}); build this model on the CPU (model.init_device: "
                "cpu) rather than on the meta device."
            ) from None
        for name in names:
            module._buffers[name] = fresh._buffers[name]
        for key, value in vars(fresh).items():  # tensors kept beside them (e.g. RoPE's original_inv_freq)
            if isinstance(value, torch.Tensor) and not key.startswith("_"):
                setattr(module, key, value)


def warn_if_native_moe(hf_config: Any, path: str) -> None:
    """transformers runs an MoE's experts one after another; foundry's MoE runs them in grouped GEMMs."""
    native = NATIVE_MOE.get(getattr(hf_config, "model_type", ""))
    if native is not None:
        warnings.warn(
            f"{path} is a {hf_config.model_type} mixture of experts, whose experts transformers computes one after "
            f"another. foundry's own MoE computes them in grouped GEMMs and is faster: convert it with `foundry "
            f"convert from-hf {path} OUT_CKPT` and train model.name: {native} with load_path: OUT_CKPT "
            "(docs/MODELS.md, Mixture of experts).",
            stacklevel=3,
        )


def keep_expert_sums_in_the_input_dtype(hf_model: nn.Module) -> None:
    """DBRX's experts (transformers 4.57 and 5.x) sum each expert's output into a buffer of the input's dtype
    with ``index_add_``; under CUDA autocast the router weights arrive in fp32 (softmax and norm run in fp32),
    which makes the source fp32 and ``index_add_`` refuse the bf16 buffer. The weights are cast to the input's
    dtype before the experts run, as they would be on one dtype throughout."""
    for module in hf_model.modules():
        if type(module).__name__ == "DbrxExperts":
            module.register_forward_pre_hook(_cast_floating_arguments_to_the_first)


def _cast_floating_arguments_to_the_first(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    dtype = args[0].dtype
    return tuple(arg.to(dtype) if isinstance(arg, torch.Tensor) and arg.is_floating_point() else arg for arg in args)


def _fresh_module(module: nn.Module, config: Any) -> nn.Module:
    """``module`` built anew: from the config, or (a RoPE that predates config arguments, as DBRX's in
    transformers 4) from its own ``dim``, ``max_position_embeddings`` and ``base``."""
    if all(hasattr(module, key) for key in ("dim", "max_position_embeddings", "base")):
        return type(module)(module.dim, module.max_position_embeddings, module.base)
    return type(module)(config=config)


def load_hf_config(config: HFCausalLMConfig) -> Any:
    """The checkpoint's ``PretrainedConfig`` with ``config_overrides`` applied (each key must exist)."""
    # transformers' Auto* registries take 0.4 to 2 s to import; every training run imports this module.
    from transformers import AutoConfig

    path = config.pretrained_model_name_or_path
    if _looks_like_path(path) and not Path(path).expanduser().is_dir():
        raise ConfigError(
            f"'{_KEY}.pretrained_model_name_or_path' is {path!r}, which is not a directory. Give the path of a "
            "Hugging Face model directory (one holding config.json), or a Hub name such as 'gpt2'."
        )
    local_config = Path(path).expanduser() / "config.json"
    if local_config.is_file():  # before transformers reads it: version 5's strict config classes may refuse it first
        raw = json.loads(local_config.read_text())
        _refuse_unrun_custom_code(config, raw.get("auto_map"), raw.get("model_type"))
    try:
        hf_config = AutoConfig.from_pretrained(path, **_hub_kwargs(config))
    except ValueError as error:
        if "trust_remote_code" in str(error):
            raise ConfigError(
                f"'{_KEY}.pretrained_model_name_or_path' ({path}) needs its own Python code to build the model, "
                f"which foundry does not run unless you set '{_KEY}.trust_remote_code: true'. Do so only if you "
                "trust that code."
            ) from None
        raise ConfigError(f"'{_KEY}.pretrained_model_name_or_path' ({path}): {error}") from None
    except OSError as error:
        raise ConfigError(
            f"'{_KEY}.pretrained_model_name_or_path' is {path!r}, which is neither a directory with a config.json "
            f"nor a model this machine can download ({error}). Give the path of a Hugging Face model directory."
        ) from None
    overrides = dict(config.config_overrides)
    if "max_seq_len" in overrides and not hasattr(hf_config, "max_seq_len"):  # MPT's name, in LLM Foundry's YAMLs
        context_key = next((key for key in CONTEXT_LENGTH_KEYS if hasattr(hf_config, key)), None)
        if context_key is not None:
            overrides[context_key] = overrides.pop("max_seq_len")
    _refuse_unrun_custom_code(config, getattr(hf_config, "auto_map", None), hf_config.model_type)
    _apply_overrides(hf_config, overrides, f"{_KEY}.config_overrides")
    return hf_config


# The names transformers' configs give the context length: MPT's, most models', GPT-2's and GPT-Neo's,
# ChatGLM's, older GPTs'.
CONTEXT_LENGTH_KEYS = ("max_seq_len", "max_position_embeddings", "n_positions", "seq_length", "n_ctx")


def hf_context_length(hf_config: Any) -> int | None:
    """The longest sequence a Hugging Face config says its model reads, or None if it says nothing."""
    for key in CONTEXT_LENGTH_KEYS:
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _refuse_unrun_custom_code(config: HFCausalLMConfig, auto_map: dict[str, str] | None, model_type: Any) -> None:
    """A checkpoint with its own modeling code (``auto_map``) whose model_type transformers also knows (an LLM
    Foundry MPT is model_type mpt) would load silently as transformers' class, which computes something else."""
    if not auto_map or config.trust_remote_code:
        return
    code = auto_map.get("AutoModelForCausalLM") or next(iter(auto_map.values()))
    raise ConfigError(
        f"'{_KEY}.pretrained_model_name_or_path' ({config.pretrained_model_name_or_path}) ships its own modeling "
        f"code (config.json auto_map: {code}), which a built-in transformers class for model_type '{model_type}' "
        f"would replace, computing other logits from the same weights. Set '{_KEY}.trust_remote_code: true' "
        "(`foundry eval --trust-remote-code`, `foundry.load_model(..., trust_remote_code=True)`) to run that code, "
        "only if you trust it. An LLM Foundry MPT export needs none: `foundry eval --model DIR` loads it as "
        "foundry's mpt_causal_lm, and `foundry convert from-hf DIR OUT` converts it."
    )


def _apply_overrides(target: Any, overrides: Mapping[str, Any], key_path: str) -> None:
    """Set each override on ``target``; a mapping updates a nested config or dict key by key (LLM Foundry's rule)."""
    is_dict = isinstance(target, dict)
    known = target if is_dict else target.to_dict()
    for key, value in overrides.items():
        if key not in known and (is_dict or not hasattr(target, key)):
            raise ConfigError(
                f"'{key_path}.{key}' is not a key of {type(target).__name__}.{did_you_mean(key, known)} "
                f"Valid keys include: {', '.join(sorted(known)[:30])}."
            )
        current = target.get(key) if is_dict else getattr(target, key, None)
        if isinstance(value, Mapping) and (isinstance(current, dict) or hasattr(current, "to_dict")):
            _apply_overrides(current, value, f"{key_path}.{key}")
        elif is_dict:
            target[key] = value
        else:
            setattr(target, key, value)


def _build_hf_model(config: HFCausalLMConfig, hf_config: Any) -> nn.Module:
    from transformers import AutoModelForCausalLM  # 2 s to import: see load_hf_config

    path = config.pretrained_model_name_or_path
    _check_is_causal_lm(config, hf_config)
    attn_implementation = config.attn_implementation or default_attn_implementation(hf_config)
    try:
        if config.pretrained and init_device(config.init_device).type != "meta":  # on meta: read at placement
            model = AutoModelForCausalLM.from_pretrained(
                path,
                config=hf_config,
                dtype=torch.float32,
                attn_implementation=attn_implementation,
                **_hub_kwargs(config),
            )
            return model.to(init_device(config.init_device))
        with init_device(config.init_device):  # from_config reads no files: the Hub token has no use here
            return AutoModelForCausalLM.from_config(
                hf_config,
                dtype=torch.float32,
                attn_implementation=attn_implementation,
                trust_remote_code=config.trust_remote_code,
            )
    except (ValueError, ImportError) as error:
        raise ConfigError(
            f"transformers cannot build '{_KEY}.pretrained_model_name_or_path' ({path}) with "
            f"'{_KEY}.attn_implementation: {attn_implementation}' ({error}). Set "
            f"'{_KEY}.attn_implementation' to one this model supports ('eager' always works)."
        ) from None
    except OSError as error:
        raise ConfigError(
            f"'{_KEY}.pretrained_model_name_or_path' ({path}) has a config but no weights transformers can read "
            f"({error}). Set '{_KEY}.pretrained: false' to start from random weights."
        ) from None


def _check_is_causal_lm(config: HFCausalLMConfig, hf_config: Any) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING  # 1.5 s: see load_hf_config

    remote = "AutoModelForCausalLM" in (getattr(hf_config, "auto_map", None) or {}) and config.trust_remote_code
    if not remote and type(hf_config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ConfigError(
            f"'{_KEY}.pretrained_model_name_or_path' ({config.pretrained_model_name_or_path}) is a "
            f"{type(hf_config).__name__} (model_type '{hf_config.model_type}'), which has no causal language "
            "model class in transformers (AutoModelForCausalLM); hf_causal_lm trains decoder language models only."
        )


def default_attn_implementation(hf_config: Any) -> str:
    """``sdpa`` when transformers' class for ``hf_config`` implements it, else ``eager``.

    Some built-in classes (GPT-Neo; ``MptForCausalLM``, which ``foundry convert to-hf`` writes for MPT)
    have no SDPA path, and transformers refuses to build them with it; remote code is built with eager.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING  # see load_hf_config

    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(hf_config), None)
    if getattr(hf_config, "auto_map", None):
        return "eager"  # its own code runs, whose attention choices are unknown; eager always works
    return "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"


def _hub_kwargs(config: HFCausalLMConfig) -> dict[str, Any]:
    """Keywords for transformers' ``from_pretrained``: the Hub token only where a download may need it."""
    kwargs: dict[str, Any] = {"trust_remote_code": config.trust_remote_code}
    token = config.token if config.token is not None else config.use_auth_token
    if token is not None and not Path(config.pretrained_model_name_or_path).expanduser().is_dir():
        kwargs["token"] = token
    return kwargs


def hf_depth_and_attention_width(hf_config: Any) -> tuple[int, int]:
    """(layers, width of q) under the names different architectures use: heads × ``head_dim`` where the config
    sets both (Qwen3's q is twice its hidden size), else the hidden size."""
    n_layers = _first_attribute(hf_config, ("num_hidden_layers", "n_layers", "n_layer", "num_layers"))
    heads, head_dim = getattr(hf_config, "num_attention_heads", None), getattr(hf_config, "head_dim", None)
    if isinstance(heads, int) and isinstance(head_dim, int):
        return n_layers, heads * head_dim
    return n_layers, _first_attribute(hf_config, ("hidden_size", "d_model", "n_embd"))


def _first_attribute(hf_config: Any, names: tuple[str, ...]) -> int:
    for name in names:
        value = getattr(hf_config, name, None)
        if isinstance(value, int):
            return value
    raise ConfigError(f"{type(hf_config).__name__} has none of {names}; foundry cannot count its FLOPs.")


def _looks_like_path(name: str) -> bool:
    """Hub names are 'name' or 'org/name'; anything absolute, dotted, home-based or deeper is a local path."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or Path(name).expanduser().exists()
