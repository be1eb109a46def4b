"""A trained model from Python: ``foundry.load_model`` and ``foundry.generate``.

    import foundry

    model, tokenizer = foundry.load_model("runs/quickstart/checkpoints")   # or a checkpoint folder, or an HF dir
    print(foundry.generate(model, tokenizer, "The meaning of", max_new_tokens=20))

``load_model`` reads what ``foundry eval --model`` reads: a checkpoint folder (its config rebuilds the
model and names the tokenizer), a save_folder (its latest checkpoint) or a Hugging Face directory.
An adapters-only LoRA checkpoint loads its base first, from where its run loaded it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from foundry.errors import ConfigError
from foundry.eval.loading import load_model as load_source
from foundry.models.generation import greedy_generate


def load_model(
    path: str | Path,
    device: str | torch.device = "cpu",
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    tokenizer: Any = None,
) -> tuple[nn.Module, Any]:
    """``(model, tokenizer)`` stored at ``path``, the model in eval mode on ``device``.

    The tokenizer is None for a checkpoint whose run named none (a Trainer fed pre-tokenized batches);
    ``generate`` then asks for one.

    Args:
        path: a foundry checkpoint folder, a save_folder (its latest checkpoint) or a Hugging Face
            model directory (``config.json``; loaded as ``hf_causal_lm``, its tokenizer from beside it).
        device: where the model's weights go.
        attn_implementation: for Hugging Face directories, transformers' attention name; None picks
            ``sdpa`` where the model implements it, else ``eager``.
        trust_remote_code: let a Hugging Face directory that ships its own modeling code (``auto_map``)
            run it; without it such a directory is refused. An LLM Foundry MPT export needs none: it
            loads as foundry's ``mpt_causal_lm``.
        tokenizer: a tokenizer, or its directory or Hub name, used instead of the stored one.
    """
    loaded = load_source(
        path, attn_implementation=attn_implementation, trust_remote_code=trust_remote_code, tokenizer=tokenizer
    )
    return loaded.model.to(device).eval(), loaded.tokenizer


@torch.no_grad()
def generate(
    model: nn.Module,
    tokenizer: Any,
    prompts: str | Sequence[str],
    max_new_tokens: int = 64,
    stop: Sequence[str] = (),
    precision: str = "fp32",
) -> str | list[str]:
    """Greedy continuations of ``prompts`` (one string, or a list of them), as text.

    Each prompt is tokenized with the tokenizer's special tokens (BOS where it adds one), all prompts
    run as one batch, and each stops at EOS, after ``max_new_tokens``, or at the first of the ``stop``
    strings, which is cut off with whatever followed it. Decoding is greedy (the most likely token
    each step): the same text every time. ``precision``: ``fp32``, ``amp_bf16`` or ``amp_fp16``.
    """
    if tokenizer is None:
        raise ConfigError(
            "foundry.generate needs the model's tokenizer, and none was given (a checkpoint from pre-tokenized "
            "batches stores none): load it with foundry.load_model(path, tokenizer=DIR_OR_NAME)."
        )
    texts = [prompts] if isinstance(prompts, str) else list(prompts)
    token_ids = [list(tokenizer(text)["input_ids"]) for text in texts]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        outputs = greedy_generate(model, token_ids, max_new_tokens, tokenizer, stop, precision, device)
    finally:
        model.train(was_training)
    outputs = [_cut_at_stop(text, stop) for text in outputs]
    return outputs[0] if isinstance(prompts, str) else outputs


def _cut_at_stop(text: str, stop: Sequence[str]) -> str:
    positions = [text.find(string) for string in stop if string and string in text]
    return text[: min(positions)] if positions else text
