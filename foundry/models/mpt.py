"""MPT, LLM Foundry's decoder-only transformer: ``model.name: mpt_causal_lm``.

Pre-norm blocks, ``x + attn(norm_1(x))`` then ``x + ffn(norm_2(x))``, a final norm and (by default)
an output projection tied to the token embedding. Config keys, defaults and parameter names match
LLM Foundry's ``MPTConfig`` / ``MPTForCausalLM`` (``transformer.wte``, ``transformer.blocks.0.attn.Wqkv``,
...), so YAMLs carry over unchanged and checkpoints map one to one.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from foundry import registry
from foundry.checkpoint.hooks import CheckpointHooks
from foundry.distributed.env import get_local_rank
from foundry.distributed.protocol import InitStep
from foundry.errors import ConfigError, FoundryError
from foundry.kernels.device import kernels_run_on
from foundry.kernels.linear_cross_entropy import linear_cross_entropy
from foundry.models import flops
from foundry.models.attention import Attention, AttentionInputs, AttnConfig, AttnImpl, build_attention_inputs
from foundry.models.base import CausalLM, LossOutput, TokenLogps, shifted_targets
from foundry.models.experts import GroupedExperts
from foundry.models.init import InitConfig, InitName, init_module_, init_weights_
from foundry.models.kv_cache import KVCache, LayerKVCache
from foundry.models.layers import FFNConfig, NormType, build_ffn, build_norm, ffn_hidden_size
from foundry.models.lora import LoraConfig, inject_lora, lora_modules, reset_lora_parameters
from foundry.models.lora import init_steps as lora_init_steps
from foundry.models.lora_checkpoint import lora_checkpoint_hooks
from foundry.models.moe import MoE, moe_config_from_ffn, moe_layers, moe_loss_terms
from foundry.models.nf4 import dense_weights
from foundry.models.tp_plan import check_tensor_parallel, mpt_tensor_parallel_plan
from foundry.schema import parse_dataclass

_KEY = "model"
LossFn = Literal["auto", "torch_crossentropy", "fused_crossentropy"]
FUSES_LOSS: dict[str, bool | None] = {"auto": None, "torch_crossentropy": False, "fused_crossentropy": True}


@torch.compiler.assume_constant_result
def fused_loss_runs_on(device: torch.device) -> bool:
    """``loss_fn: auto``: the fused loss on a GPU where its Triton kernel runs (not the CPU interpreter)."""
    return device.type == "cuda" and kernels_run_on(device)


@dataclasses.dataclass
class MPTConfig:
    """The ``model`` section of an LLM Foundry MPT YAML, with LLM Foundry's defaults.

    Three defaults differ on purpose: ``attn_config.attn_impl`` is ``sdpa`` (LLM Foundry: ``flash``,
    from the flash-attn package), ``loss_fn`` is ``auto`` (LLM Foundry: ``fused_crossentropy``) and
    ``use_cache`` is true. ``fused_crossentropy`` here is the chunked output projection +
    cross-entropy of ``foundry.kernels.linear_cross_entropy``: training never materialises the
    (tokens, vocab) logits, and on an H100 it is faster than the compiled unfused loss at both MPT's
    and Llama 3's vocabularies (docs/PERFORMANCE.md). ``auto`` uses it wherever its Triton kernel
    runs (a GPU) and ``torch_crossentropy`` elsewhere. ``attn_impl`` beside ``attn_config`` is
    accepted as Llama's spelling of ``attn_config.attn_impl``. ``use_cache`` makes greedy generation (ICL eval) decode
    with a KV cache (``foundry/models/kv_cache.py``): the prompts run once, then one token per row per
    step; false re-runs the whole prefix for every new token. As in LLM Foundry, ``alibi`` or ``rope``
    turns ``learned_pos_emb`` off.
    """

    d_model: int = 2048
    n_heads: int = 16
    n_layers: int = 24
    expansion_ratio: float = 4
    max_seq_len: int = 2048
    vocab_size: int = 50368
    resid_pdrop: float = 0.0
    emb_pdrop: float = 0.0
    embedding_fraction: float = 1.0  # < 1 scales the embedding's gradient (GLM-130B)
    learned_pos_emb: bool = True
    attn_config: AttnConfig = dataclasses.field(default_factory=AttnConfig)
    ffn_config: FFNConfig = dataclasses.field(default_factory=FFNConfig)
    init_config: InitConfig = dataclasses.field(default_factory=InitConfig)
    param_init_fn: InitName | None = None  # LLM Foundry's alias of init_config.name
    init_device: str = "cpu"  # 'cpu', 'meta', 'mixed' (cpu on local rank 0, meta elsewhere), 'cuda', ...
    logit_scale: float | Literal["inv_sqrt_d_model"] | None = None
    no_bias: bool = False
    norm_type: NormType = "low_precision_layernorm"
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    use_cache: bool = True  # greedy generation decodes with a KV cache; training ignores it
    loss_fn: LossFn = "auto"
    attn_impl: AttnImpl | None = None  # Llama's spelling of attn_config.attn_impl
    fc_type: str | dict[str, Any] = "torch"
    use_pad_tok_in_ffn: bool = True
    peft_config: LoraConfig | None = None  # LoRA adapters on the linear layers it names (docs/LORA.md)
    # With fsdp_config.activation_checkpointing: which modules recompute their activations (null: every
    # block; a class name, a list, or {name: blocks}); foundry.distributed.activation_checkpoint reads it.
    activation_checkpointing_target: str | list[Any] | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.attn_impl is not None:
            self.attn_config = with_attn_impl(self.attn_config, self.attn_impl, f"{_KEY}.attn_config.attn_impl")
        self._check_shapes()
        self._check_not_yet_supported()
        for key in ("resid_pdrop", "emb_pdrop"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ConfigError(f"'{_KEY}.{key}' is {getattr(self, key)}; it is a probability in [0, 1].")
        if not 0.0 < self.embedding_fraction <= 1.0:
            raise ConfigError(f"'{_KEY}.embedding_fraction' is {self.embedding_fraction}; it must be in (0, 1].")
        if self.param_init_fn is not None and self.param_init_fn != self.init_config.name:
            if self.init_config.name != InitConfig.name:
                raise ConfigError(
                    f"'{_KEY}.param_init_fn' ({self.param_init_fn}) and '{_KEY}.init_config.name' "
                    f"({self.init_config.name}) disagree; keep only init_config.name."
                )
            self.init_config = dataclasses.replace(self.init_config, name=self.param_init_fn)
        if self.learned_pos_emb and (self.attn_config.alibi or self.attn_config.rope):
            message = "alibi or rope is on, so 'model.learned_pos_emb' is turned off; set it to false to say so."
            warnings.warn(message, stacklevel=3)
            self.learned_pos_emb = False
        init_device(self.init_device)  # fails early on a bad device name

    def _check_shapes(self) -> None:
        for key in ("d_model", "n_heads", "n_layers", "max_seq_len", "vocab_size"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"'{_KEY}.{key}' is {getattr(self, key)}; it must be positive.")
        head_dim = self.head_dim  # refuses a d_model that n_heads does not divide, unless attn_config.head_dim is set
        if self.attn_config.rope and head_dim % 2:
            raise ConfigError(
                f"rope needs an even head dim (d_model / n_heads, or attn_config.head_dim), got {head_dim}."
            )
        self.attn_config.resolve_kv_n_heads(self.n_heads)
        ffn_hidden_size(self.d_model, self.expansion_ratio, self.ffn_config)

    def _check_not_yet_supported(self) -> None:
        fc_name = self.fc_type.get("name") if isinstance(self.fc_type, Mapping) else self.fc_type
        if fc_name != "torch":
            raise ConfigError(f"'{_KEY}.fc_type' is {fc_name!r}; only 'torch' (nn.Linear) is supported.")
        if not self.use_pad_tok_in_ffn:
            raise ConfigError(f"'{_KEY}.use_pad_tok_in_ffn: false' (unpadding) is not supported; remove it.")

    @property
    def head_dim(self) -> int:
        return self.attn_config.resolve_head_dim(self.d_model, self.n_heads)

    @property
    def q_dim(self) -> int:
        """The width of q and of the attention output, heads × head_dim: d_model unless ``attn_config.head_dim``."""
        return self.n_heads * self.head_dim

    @property
    def head_dim_decoupled(self) -> bool:
        """Whether heads are wider or narrower than d_model / n_heads (``attn_config.head_dim``): what a class that
        derives head_dim from hidden_size alone (MPT, GPT-2, OLMoE, DBRX) cannot compute."""
        return self.q_dim != self.d_model

    @property
    def num_experts(self) -> int | None:
        """Experts per MoE layer; None for a dense model."""
        return self.ffn_config.moe_num_experts if self.ffn_config.is_moe else None

    @property
    def resolved_logit_scale(self) -> float | None:
        """PaLM's 1/sqrt(d_model) for 'inv_sqrt_d_model', else the number (or None)."""
        if self.logit_scale == "inv_sqrt_d_model":
            return 1 / math.sqrt(self.d_model)
        return self.logit_scale


def with_attn_impl(config: AttnConfig, attn_impl: str, nested_key: str) -> AttnConfig:
    """``config`` with ``attn_impl`` given in the other spelling (``model.attn_impl``); both set must agree."""
    if config.attn_impl not in (AttnConfig.attn_impl, attn_impl):
        raise ConfigError(
            f"'{_KEY}.attn_impl' is {attn_impl!r} but '{nested_key}' is {config.attn_impl!r}: they are two "
            "spellings of one key. Keep one."
        )
    return dataclasses.replace(config, attn_impl=attn_impl)


def init_device(name: str) -> torch.device:
    """The device parameters are created on; 'mixed' is cpu on each node's rank 0 and meta elsewhere."""
    if name == "mixed":
        return torch.device("cpu" if get_local_rank() == 0 else "meta")
    try:
        return torch.device(name)
    except RuntimeError:
        raise ConfigError(f"'{_KEY}.init_device' is {name!r}; use 'cpu', 'meta', 'mixed' or a torch device.") from None


def build_block_ffn(config: MPTConfig, bias: bool) -> nn.Module:
    """A block's feed-forward: dense (``mptmlp``, ``mptglu``) or a mixture of experts (``mb_moe``, ``mb_dmoe``)."""
    if config.ffn_config.is_moe:
        hidden = ffn_hidden_size(config.d_model, config.expansion_ratio, config.ffn_config)
        return MoE(config.d_model, moe_config_from_ffn(config.ffn_config, hidden, bias))
    return build_ffn(config.ffn_config, config.d_model, config.expansion_ratio, bias)


class MPTBlock(nn.Module):
    def __init__(self, config: MPTConfig) -> None:
        super().__init__()
        bias = not config.no_bias
        self.norm_1 = build_norm(config.norm_type, config.d_model, config.norm_eps, bias)
        self.attn = Attention(
            config.d_model, config.n_heads, config.attn_config, config.norm_type, config.norm_eps, bias
        )
        self.norm_2 = build_norm(config.norm_type, config.d_model, config.norm_eps, bias)
        self.ffn = build_block_ffn(config, bias)
        self.resid_attn_dropout = nn.Dropout(config.resid_pdrop)
        self.resid_ffn_dropout = nn.Dropout(config.resid_pdrop)

    def forward(self, x: torch.Tensor, attn_inputs: AttentionInputs, cache: LayerKVCache | None = None) -> torch.Tensor:
        x = x + self.resid_attn_dropout(self.attn(self.norm_1(x), attn_inputs, cache))
        return x + self.resid_ffn_dropout(self.ffn(self.norm_2(x)))


class MPTTransformer(nn.Module):
    """Embeddings, blocks and the final norm: token ids -> hidden states (batch, seq, d_model)."""

    def __init__(self, config: MPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.wpe = nn.Embedding(config.max_seq_len, config.d_model) if config.learned_pos_emb else None
        self.emb_drop = nn.Dropout(config.emb_pdrop)
        self.blocks = nn.ModuleList(MPTBlock(config) for _ in range(config.n_layers))
        self.norm_f = build_norm(config.norm_type, config.d_model, config.norm_eps, not config.no_bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        sequence_id: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """``sequence_id`` (batch, seq) masks attention to each packed example (needs
        ``attn_uses_sequence_id``); ``position_ids`` (batch, seq), e.g. restarting at 0 per packed
        example, replace the positions derived from ``attention_mask``. With ``cache``, input_ids
        continue the tokens already in it (see ``forward_with_cache``).
        """
        if cache is not None:
            if sequence_id is not None or position_ids is not None:
                raise FoundryError(
                    "A forward with a KV cache takes input_ids and attention_mask only (positions continue "
                    "the cached tokens); drop sequence_id and position_ids when decoding."
                )
            return self.forward_with_cache(input_ids, attention_mask, cache)
        config = self.config
        seq_len = input_ids.shape[1]
        self._check_seq_len(seq_len)
        padding = _key_padding_mask(attention_mask)
        if position_ids is not None:
            positions = shifted = position_ids
        else:
            positions = torch.arange(seq_len, device=input_ids.device)[None]  # (1, seq)
            shifted = _positions_after_left_padding(positions, padding)
        x = self._embed(input_ids, shifted)
        attn = config.attn_config
        rope_positions = shifted if attn.rope_impl == "hf" else positions  # DAIL rope ignores padding
        if sequence_id is not None and not attn.attn_uses_sequence_id:
            sequence_id = None  # as LLM Foundry: packed examples attend to each other unless asked not to
        attn_inputs = build_attention_inputs(
            attn, config.n_heads, config.head_dim, seq_len, rope_positions, padding, sequence_id
        )
        for block in self.blocks:
            x = block(x, attn_inputs)
        return self.norm_f(x)

    def forward_with_cache(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, cache: KVCache
    ) -> torch.Tensor:
        """Hidden states of input_ids (batch, new) placed after the ``cache.length`` tokens in ``cache``.

        They equal the full forward's over the cached tokens followed by these (same positions, same
        masks); the tokens' keys and values are added to the cache. ``attention_mask`` (batch, new)
        marks left padding of the prompts; None means every token is real.
        """
        config, attn = self.config, self.config.attn_config
        past_len, seq_len = cache.length, input_ids.shape[1]  # past_len: an int, or on the device (kv_cache.py)
        if isinstance(past_len, int):
            self._check_seq_len(past_len + seq_len)
        padding = cache.add_tokens(input_ids, attention_mask)  # (batch, max_len)
        columns = (past_len + torch.arange(seq_len, device=input_ids.device))[None]  # (1, new)
        shifted = _positions_after_left_padding(columns, padding)
        x = self._embed(input_ids, shifted)
        rope_positions = shifted if attn.rope_impl == "hf" else columns
        attn_inputs = build_attention_inputs(
            attn, config.n_heads, config.head_dim, seq_len, rope_positions, padding, past_len=past_len
        )
        for block, layer_cache in zip(self.blocks, cache.layers, strict=True):
            x = block(x, attn_inputs, layer_cache)
        cache.advance(seq_len)
        return self.norm_f(x)

    def _check_seq_len(self, seq_len: int) -> None:
        if seq_len > self.config.max_seq_len:
            raise ConfigError(
                f"A batch has sequences of {seq_len} tokens but 'model.max_seq_len' is {self.config.max_seq_len}; "
                f"raise max_seq_len or shorten the dataset's max_seq_len."
            )

    def _embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token (+ learned position) embeddings, (batch, seq, d_model); positions are each row's own."""
        config = self.config
        x = self.wte(input_ids)  # (batch, seq, d_model)
        if self.wpe is not None:
            x = x + self.wpe(positions)
        if config.embedding_fraction < 1:
            x = x * config.embedding_fraction + x.detach() * (1 - config.embedding_fraction)
        return self.emb_drop(x)


def _positions_after_left_padding(columns: torch.Tensor, padding: torch.Tensor | None) -> torch.Tensor:
    """Each token's position in its row: its column less the padding before it (LLM Foundry's rule).

    Left padding thus starts every row's first real token at 0. ``columns`` (1, seq) are the tokens'
    columns in ``padding`` (batch, columns), True for real tokens; None when there is no padding. The
    padding count is gathered at ``columns`` rather than sliced, so the columns may come from a
    device-side cache length (a decode step with no host values, for CUDA graphs).
    """
    if padding is None:
        return columns
    padding_so_far = (~padding).cumsum(dim=1).gather(1, columns.expand(padding.shape[0], -1))
    return (columns - padding_so_far).clamp(min=0)


def _key_padding_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """(batch, seq) bool, True = real token; None when nothing is padded.

    Checking for padding costs one host sync, but an unpadded batch then runs plain causal
    attention (SDPA's flash path) instead of a masked one. Omit attention_mask to skip the check.
    """
    if attention_mask is None:
        return None
    mask = attention_mask.bool()
    return None if bool(mask.all()) else mask


@registry.models.register("mpt_causal_lm")
class MPTCausalLM(CausalLM):
    """MPT as a next-token predictor: ``forward(batch)`` returns logits (batch, seq, vocab).

    Build from an ``MPTConfig`` or from the YAML keys directly::

        MPTCausalLM(d_model=768, n_heads=12, n_layers=12, attn_config={"alibi": True})

    Parameters are created on the meta device and then materialised on ``init_device`` and
    initialised by ``init_weights()``; with ``init_device: meta`` that is left to the caller
    (``model.to_empty(device=...)`` then ``model.init_weights()``), e.g. after FSDP sharding.
    """

    def __init__(self, config: MPTConfig | Mapping[str, Any] | None = None, **config_keys: Any) -> None:
        super().__init__()
        if config is not None and config_keys:
            raise ConfigError("Pass MPTCausalLM either an MPTConfig or its keys as keyword arguments, not both.")
        self.config = parse_dataclass(MPTConfig, config if config is not None else config_keys, _KEY)
        self.logit_scale = self.config.resolved_logit_scale
        # Training forwards return the loss of the chunked output projection + cross-entropy (no logits):
        # always (True), never (False), or (None, loss_fn: auto) where its Triton kernel runs on a GPU.
        self.fused_cross_entropy: bool | None = FUSES_LOSS[self.config.loss_fn]
        self._loss_terms: dict[str, torch.Tensor] = {}
        with torch.device("meta"):
            self.transformer = MPTTransformer(self.config)
            tied = self.config.tie_word_embeddings
            self.lm_head = None if tied else nn.Linear(self.config.d_model, self.config.vocab_size, bias=False)
        if self.config.peft_config is not None:
            inject_lora(self, self.config.peft_config)
        device = init_device(self.config.init_device)
        if device.type != "meta":
            self.to_empty(device=device)
            self.init_weights()

    @classmethod
    def checked_config(cls, keys: Mapping[str, Any]) -> MPTConfig:
        """The ``MPTConfig`` of ``keys`` (a YAML's model section without ``name``), checked without building the
        model: ``foundry train`` refuses a wrong value before any rank starts (``foundry.models.build``)."""
        return parse_dataclass(MPTConfig, keys, _KEY)

    def init_weights(self) -> None:
        """(Re)initialise every parameter in place with ``config.init_config``'s scheme."""
        with dense_weights(self):  # QLoRA: the init writes bf16 values, quantized again after
            init_weights_(self, self.config.init_config, self.config.n_layers, self.config.d_model)
        reset_lora_parameters(self)

    def init_steps(self) -> list[InitStep] | None:
        """``init_weights`` one module at a time (``foundry.distributed.protocol.ModuleByModuleInit``); None for
        LoRA under ``init_config.name: default_``, whose LoRA layers' own reset also draws their adapters."""
        config = self.config
        has_lora = any(True for _ in lora_modules(self))
        if has_lora and config.init_config.name == "default_":
            return None
        init_module = functools.partial(
            init_module_, config=config.init_config, n_layers=config.n_layers, d_model=config.d_model
        )
        return lora_init_steps(self, init_module)

    @property
    def checkpoint_hooks(self) -> CheckpointHooks:
        """With a ``peft_config``: LoRA's checkpoints (maybe adapters only, their base loaded first)."""
        return lora_checkpoint_hooks(self)

    # foundry.distributed.protocol.ParallelModel
    def parallel_blocks(self) -> list[nn.Module]:
        return list(self.transformer.blocks)

    def attention_layers(self) -> list[Attention]:
        return [module for module in self.modules() if isinstance(module, Attention)]

    def expert_layers(self) -> list[GroupedExperts]:
        return [module.experts for module in self.modules() if isinstance(module, MoE)]

    # foundry.distributed.protocol.TensorParallelModel
    def tensor_parallel_plan(self, degree: int, sequence_parallel: bool = True) -> dict[str, ParallelStyle]:
        check_tensor_parallel(self.config, degree)
        return mpt_tensor_parallel_plan(list(self.transformer.blocks), sequence_parallel)

    @property
    def output_weight(self) -> torch.Tensor:
        """The (vocab, d_model) output projection: the token embedding itself when tied."""
        return self.transformer.wte.weight if self.lm_head is None else self.lm_head.weight

    computes_token_logps = True

    def forward(
        self, batch: Mapping[str, Any], cache: KVCache | None = None, token_logps: bool = False
    ) -> torch.Tensor | LossOutput | TokenLogps:
        """Logits (batch, seq, vocab); with ``fused_cross_entropy`` in training, the loss itself.

        With ``cache`` (from ``new_kv_cache``), the batch's tokens follow those already cached. With
        ``token_logps``, each position's log-probability of its target from the chunked output projection.
        """
        hidden = self.transformer(
            batch["input_ids"], batch.get("attention_mask"), batch.get("sequence_id"), batch.get("position_ids"),
            cache,
        )  # fmt: skip
        if token_logps:  # log-probability = -cross-entropy
            targets = shifted_targets(batch)
            losses = linear_cross_entropy(hidden, self.output_weight, targets, self.logit_scale, reduction="none")
            return TokenLogps(-losses)
        if self.training and self._fuses_loss(hidden.device):
            targets = shifted_targets(batch)
            return LossOutput(linear_cross_entropy(hidden, self.output_weight, targets, self.logit_scale))
        logits = F.linear(hidden, self.output_weight)  # (batch, seq, vocab)
        return logits if self.logit_scale is None else logits * self.logit_scale

    def loss(self, outputs: Any, batch: Mapping[str, Any]) -> torch.Tensor:
        """Cross-entropy, plus in training the MoE load-balancing and router z-loss terms (``loss_terms``)."""
        cross_entropy = super().loss(outputs, batch)
        moe_terms = moe_loss_terms(self._moe_layers) if self.training and self._moe_layers else {}
        self._loss_terms = {"cross_entropy": cross_entropy, **moe_terms} if moe_terms else {}
        return cross_entropy + sum(moe_terms.values()) if moe_terms else cross_entropy

    def loss_terms(self) -> dict[str, torch.Tensor]:
        """The last training loss's parts when it has several: cross_entropy, load_balancing, router_z."""
        return {name: value.detach() for name, value in self._loss_terms.items()}

    @functools.cached_property
    def _moe_layers(self) -> list[MoE]:
        return moe_layers(self)

    def _fuses_loss(self, device: torch.device) -> bool:
        if self.fused_cross_entropy is None:
            return fused_loss_runs_on(device)
        return self.fused_cross_entropy

    @property
    def generates_with_kv_cache(self) -> bool:
        """Whether greedy generation should use ``new_kv_cache`` (``model.use_cache``)."""
        return self.config.use_cache

    def new_kv_cache(self, max_len: int) -> KVCache:
        """An empty KV cache for one batch of up to ``max_len`` tokens per row (prompt + generated)."""
        return KVCache(self.config.n_layers, max_len)

    @property
    def num_params(self) -> int:
        return flops.num_params(self)

    @functools.cached_property
    def n_active_params(self) -> int:
        """Parameters that cost FLOPs per token: an MoE layer counts only top_k of its experts."""
        params = flops.active_params(self, self.transformer.wte, self.config.tie_word_embeddings)
        return params - sum(layer.inactive_params for layer in self._moe_layers)

    def flops_per_batch(self, batch: Mapping[str, Any]) -> int:
        batch_size, seq_len = flops.rows_and_length(batch["input_ids"])
        config = self.config
        return flops.flops_per_batch(self.n_active_params, config.n_layers, config.q_dim, batch_size, seq_len)

    def flops_per_token(self, seq_len: int) -> int:
        return flops.flops_per_token(self.n_active_params, self.config.n_layers, self.config.q_dim, seq_len)
