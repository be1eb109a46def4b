"""Tiny models and data shared by tests (importable as `helpers`: tests/ is on pytest's pythonpath)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from foundry.models.base import CausalLM

REPO_ROOT = Path(__file__).resolve().parents[1]
# The shared data folder (corpora, ICL files, tokenizers): $FOUNDRY_SHARED_DATA, else ../shared/data beside the repo.
SHARED_DATA = Path(os.environ.get("FOUNDRY_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))


def repo_pythonpath() -> str:
    """This checkout ahead of the caller's PYTHONPATH: a subprocess imports the foundry under test and still
    finds what the user's path adds (packages installed outside site-packages, as on some GPU images)."""
    return os.pathsep.join(path for path in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if path)


class TinyLM(CausalLM):
    """Embedding → linear head: the smallest causal LM the Trainer can drive (tests only)."""

    def __init__(self, vocab_size: int = 32, d_model: int = 8) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_size, d_model)
        self.head = torch.nn.Linear(d_model, vocab_size)

    def forward(self, batch: dict) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(batch["input_ids"])))  # (batch, seq, vocab)

    def flops_per_batch(self, batch: dict) -> int:
        return 6 * sum(p.numel() for p in self.parameters()) * batch["input_ids"].numel()


def token_batches(num_batches: int, batch_size: int, seq_len: int = 8, vocab_size: int = 32, seed: int = 0) -> list:
    """A fixed list of LM batches, usable as a dataloader with a length."""
    generator = torch.Generator().manual_seed(seed)
    return [
        {"input_ids": torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)}
        for _ in range(num_batches)
    ]


def tiny_trainer(folder: Path, *, batches: int = 4, batch_size: int = 4, seed: int | None = 0, **settings: Any):
    """A quiet CPU Trainer of a fresh TinyLM over ``batches`` fixed batches, its run folder under ``folder``.

    ``settings`` are the Trainer's keywords (``save_folder``, ``max_duration``, ...) and override the defaults
    here; ``seed`` seeds the model's initialisation (``None`` leaves the global generator as it is).
    """
    from foundry.trainer import Trainer

    if seed is not None:
        torch.manual_seed(seed)
    options = {
        "max_duration": f"{batches}ba", "run_folder": str(folder / "run"), "log_to_console": False, "device": "cpu",
        **settings,
    }  # fmt: skip
    return Trainer(model=TinyLM(), train_dataloader=token_batches(batches, batch_size), **options)


class FakeClock:
    """A clock that only moves when the test says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# Tiny model sections (fp32, CPU-fast) shared by the model, backend and conversion tests.
TINY_LLAMA: dict[str, Any] = {
    "d_model": 64, "n_layers": 2, "n_heads": 4, "kv_n_heads": 2, "vocab_size": 96, "max_seq_len": 32,
    "multiple_of": 32, "ffn_dim_multiplier": None, "rope_theta": 10000.0,
}  # fmt: skip
TINY_MPT: dict[str, Any] = {"d_model": 64, "n_heads": 4, "n_layers": 2, "vocab_size": 96, "max_seq_len": 32}

# One tiny decoder per way of encoding positions, plus GQA (Llama): what a KV cache must get right.
TINY_DECODERS: dict[str, tuple[str, dict[str, Any]]] = {
    "mpt_learned_pos_emb": ("mpt_causal_lm", TINY_MPT),
    "mpt_alibi": ("mpt_causal_lm", {**TINY_MPT, "learned_pos_emb": False, "attn_config": {"alibi": True}}),
    "mpt_rope_dail": ("mpt_causal_lm", {**TINY_MPT, "learned_pos_emb": False, "attn_config": {"rope": True}}),
    "mpt_rope_hf": (
        "mpt_causal_lm",
        {**TINY_MPT, "learned_pos_emb": False, "attn_config": {"rope": True, "rope_impl": "hf"}},
    ),
    "llama_gqa": ("llama_causal_lm", TINY_LLAMA),
}


def build_tiny_decoder(variant: str, attn_impl: str = "sdpa", seed: int = 0) -> Any:
    """The ``TINY_DECODERS[variant]`` model, with fixed-seed weights, in eval mode."""
    from foundry import registry

    name, keys = TINY_DECODERS[variant]
    if name == "llama_causal_lm":
        keys = {**keys, "attn_impl": attn_impl}
    else:
        keys = {**keys, "attn_config": {**keys.get("attn_config", {}), "attn_impl": attn_impl}}
    torch.manual_seed(seed)
    return registry.models.get(name)(**keys).eval()


BYTE_EOS = 256


class ByteTokenizer:
    """One token per UTF-8 byte plus eos (id 256): predictable ids for hand-checked tests."""

    eos_token_id = BYTE_EOS
    pad_token_id = BYTE_EOS
    eos_token = pad_token = "<eos>"

    def __call__(self, text: str | list[str], add_special_tokens: bool = True) -> dict[str, list]:
        """Like a transformers tokenizer: one text gives a list of ids, a list of texts a list of lists."""
        del add_special_tokens
        if isinstance(text, list):
            return {"input_ids": [list(item.encode()) for item in text]}
        return {"input_ids": list(text.encode())}

    def __len__(self) -> int:
        return BYTE_EOS + 1

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return bytes(i for i in ids if i < BYTE_EOS).decode(errors="replace")


class IdsTokenizer:
    """A generation tokenizer that decodes to the token ids themselves (eos kept): equal text, equal tokens."""

    pad_token_id = 0

    def __init__(self, eos_token_id: int) -> None:
        self.eos_token_id = eos_token_id

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return " ".join(str(token) for token in ids)


def assert_nested_close(got: Any, want: Any, where: str = "", atol: float = 0.0) -> None:
    """``got`` equals ``want``: nested dicts with the same keys, tensors within ``atol``, other values equal."""
    if isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            assert_nested_close(got[key], want[key], f"{where}.{key}", atol)
    elif isinstance(want, torch.Tensor):
        torch.testing.assert_close(got, want, atol=atol, rtol=0, msg=where)
    else:
        assert got == want, where


def flip_byte(path: Path, offset: int | None = None) -> None:
    """Invert one byte of a file (the middle one by default): the smallest damage a disk or a copy does."""
    data = bytearray(path.read_bytes())
    offset = len(data) // 2 if offset is None else offset
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


class RendezvousStore:
    """A TCPStore this process hosts on a port the OS picks, for the ranks a test starts to meet at.

    Ranks joining through ``env://`` with ``env`` added use it as torchrun's ranks use their agent's
    store, so tests that run at the same time never race for a port.
    """

    def __init__(self) -> None:
        import torch.distributed as dist

        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.env = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(self.store.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        }


def instruction_rows(row: dict) -> dict:
    """A ``preprocessing_fn`` (LLM Foundry's ``module:function`` form): Dolly-style columns to prompt/response."""
    return {"prompt": row["instruction"], "response": row["output"]}
