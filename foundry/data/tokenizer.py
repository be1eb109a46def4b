"""Tokenizers: load a local transformers tokenizer directory, or train a small byte-level BPE one."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from foundry.errors import ConfigError, DataError

END_OF_TEXT = "<|endoftext|>"
BYTE_ALPHABET_SIZE = 256  # byte-level BPE starts from one token per byte


def load_tokenizer(name: str, **kwargs: Any) -> PreTrainedTokenizerBase:
    """Load a transformers tokenizer from a local directory (or, if no such path exists, the Hub).

    Args:
        name: a tokenizer directory (``tokenizer.json`` + ``tokenizer_config.json``) or a Hub id.
        **kwargs: passed to ``AutoTokenizer.from_pretrained`` (e.g. ``model_max_length``).

    Returns:
        A ``PreTrainedTokenizerBase`` with a pad token (the eos token when it had none).

    Raises:
        DataError: naming ``name`` and the fix when it cannot be loaded.
    """
    from transformers import AutoTokenizer  # 1.5 s (every tokenizer class's registry): only when one is loaded

    path = Path(name).expanduser()
    if not path.exists() and _looks_like_path(name):
        raise DataError(_load_failure(name, f"the directory {path} does not exist"))
    source = str(path) if path.exists() else name
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    except Exception as error:  # transformers raises OSError, ValueError, HTTP errors, ...
        raise DataError(_load_failure(name, f"{type(error).__name__}: {error}")) from error
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise DataError(
                f"Tokenizer '{name}' has neither a pad token nor an eos token, so padded batches cannot be built. "
                f"Pass tokenizer kwargs such as {{pad_token: '<pad>'}} or use a tokenizer that defines eos."
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


MODEL_INPUT_NAMES = ("input_ids", "attention_mask")  # what a causal LM's tokenizer should return


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: Path) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer and save it as a transformers tokenizer directory.

    ``<|endoftext|>`` serves as eos, bos, pad and unk (GPT-2's convention). The same texts and
    vocab_size give the same tokenizer.

    Returns:
        The trained ``PreTrainedTokenizerFast``; ``load_tokenizer(out_dir)`` loads the same one.
    """
    if vocab_size <= BYTE_ALPHABET_SIZE:
        raise ConfigError(
            f"vocab_size is {vocab_size}; a byte-level BPE tokenizer needs more than {BYTE_ALPHABET_SIZE} "
            f"(one token per byte plus {END_OF_TEXT} and merges). Use e.g. --vocab-size 8192."
        )
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=END_OF_TEXT,
        eos_token=END_OF_TEXT,
        unk_token=END_OF_TEXT,
        pad_token=END_OF_TEXT,
        clean_up_tokenization_spaces=False,  # decode(encode(text)) == text
        # No token_type_ids: causal LMs take none, and transformers' generate() rejects them.
        model_input_names=list(MODEL_INPUT_NAMES),
    )
    out_dir = Path(out_dir)
    tokenizer.save_pretrained(str(out_dir))
    _write_special_tokens_map(out_dir)
    return tokenizer


def _write_special_tokens_map(out_dir: Path) -> None:
    """transformers 5 no longer writes special_tokens_map.json; older readers (and LLM Foundry) look for it."""
    path = out_dir / "special_tokens_map.json"
    if not path.exists():
        names = ("bos_token", "eos_token", "unk_token", "pad_token")
        path.write_text(json.dumps(dict.fromkeys(names, END_OF_TEXT), indent=2) + "\n")


def _looks_like_path(name: str) -> bool:
    """Hub ids are 'org/name'; anything absolute, relative-dotted or home-based is meant as a local path."""
    return name.startswith(("/", "./", "../", "~", ".\\")) or name.count("/") > 1


def _load_failure(name: str, reason: str) -> str:
    return (
        f"Cannot load tokenizer '{name}' ({reason}). Point tokenizer.name at a local tokenizer directory "
        "(one holding tokenizer.json and tokenizer_config.json: the <out>/tokenizer that 'foundry data convert "
        "--concat-tokens N' trains, or a Hub tokenizer saved once with AutoTokenizer.from_pretrained(NAME)"
        ".save_pretrained(DIR) on a machine with internet), or name a Hub id (downloaded on first use; offline, "
        "only one already in the Hugging Face cache loads)."
    )
