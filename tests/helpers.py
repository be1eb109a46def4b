"""Tiny models and data shared by tests (importable as `helpers`: tests/ is on pytest's pythonpath)."""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import signal
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch._dynamo
import torch._functorch.config
import torch._inductor.config
import torch.distributed as dist

from foundry.models.base import CausalLM

REPO_ROOT = Path(__file__).resolve().parents[1]
# The shared data folder (corpora, ICL files, tokenizers): $FOUNDRY_SHARED_DATA, else ../shared/data beside the repo.
SHARED_DATA = Path(os.environ.get("FOUNDRY_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))


def repo_pythonpath() -> str:
    """This checkout ahead of the caller's PYTHONPATH: a subprocess imports the foundry under test and still
    finds what the user's path adds (packages installed outside site-packages, as on some GPU images)."""
    return os.pathsep.join(path for path in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if path)


def quickstart_corpus(tmp_path_factory: Any, max_seq_len: int = 32) -> Path:
    """The quickstart's embedded corpus as MDS, as `make quickstart` converts it, at test size (512-token BPE)."""
    from foundry.data import convert_to_mds

    out = tmp_path_factory.mktemp("data") / "quickstart"
    convert_to_mds(None, out, max_seq_len=max_seq_len, vocab_size=512, progress=False)
    return out


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


# ------------------------------------------------------------------------------ process state between tests
# torch's process-wide switches a test may flip: (read, write).
_TORCH_SWITCHES: dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]] = {
    "default dtype": (torch.get_default_dtype, torch.set_default_dtype),
    "default device": (
        torch.get_default_device,
        lambda device: torch.set_default_device(None if device == torch.device("cpu") else device),
    ),
    "grad mode": (torch.is_grad_enabled, torch.set_grad_enabled),
    "deterministic algorithms": (
        lambda: (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
        lambda flags: torch.use_deterministic_algorithms(flags[0], warn_only=flags[1]),
    ),
    "float32 matmul precision": (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    "anomaly detection": (torch.is_anomaly_enabled, torch.set_anomaly_enabled),
    "threads": (torch.get_num_threads, torch.set_num_threads),
}
_CONFIGS = {
    "torch._dynamo.config": torch._dynamo.config,
    "torch._inductor.config": torch._inductor.config,
    "torch._functorch.config": torch._functorch.config,
}
_HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # what fit() handles (foundry.checkpoint.preemption)
_PYTEST_OWN = "PYTEST_CURRENT_TEST"  # the environment variable pytest itself sets and clears around each test


class ProcessState:
    """What one test (or one job of a reused rank) may change in its process, to be put back before the next.

    Made before the test; ``restore()`` after it gives back the environment, torch's switches, the compiler
    configs and the preemption signal handlers as they were, and resets dynamo: a graph it cached, a recompile
    limit a test used up, would otherwise reach the next test (which could then run eagerly and pass unnoticed).
    It returns what could only be undone by force, each as a sentence: a saved-tensors hook, a torch function or
    dispatch mode left active, or a process group left joined, which break every later backward or collective.
    """

    def __init__(self) -> None:
        self.environment = {name: value for name, value in os.environ.items() if name != _PYTEST_OWN}
        self.switches = {name: read() for name, (read, _) in _TORCH_SWITCHES.items()}
        self.configs = {name: config.save_config() for name, config in _CONFIGS.items()}
        self.handlers = {number: signal.getsignal(number) for number in _HANDLED_SIGNALS}
        self.function_modes = torch._C._len_torch_function_stack()
        self.dispatch_modes = torch._C._len_torch_dispatch_stack()
        self.joined = dist.is_available() and dist.is_initialized()

    def restore(self) -> list[str]:
        from foundry import deprecation
        from foundry.checkpoint import kill_points

        for name in os.environ.keys() - self.environment.keys() - {_PYTEST_OWN}:
            del os.environ[name]
        os.environ.update(self.environment)
        for name, (read, write) in _TORCH_SWITCHES.items():
            if read() != self.switches[name]:
                write(self.switches[name])
        for name, config in _CONFIGS.items():
            if config.save_config() != self.configs[name]:  # the keys changed only: setting others may warn
                before, now = pickle.loads(self.configs[name]), pickle.loads(config.save_config())
                config.load_config({key: value for key, value in before.items() if now.get(key) != value})
        for number, handler in self.handlers.items():
            if signal.getsignal(number) is not handler:
                signal.signal(number, handler)
        torch._dynamo.reset()
        kill_points.reset()  # foundry's once-per-process state: each test starts from none
        deprecation.reset()
        return self._undo_by_force()

    def _undo_by_force(self) -> list[str]:
        left = []
        if _top_saved_tensors_hooks() is not None:
            # torch 2.11 (not 2.14) leaves non-reentrant checkpointing's hook pushed when the checkpointed function
            # raises, until the exception's reference cycle is collected (closing checkpoint's generator pops it);
            # meanwhile every forward saves into that dead checkpoint and backward recomputes the wrong function.
            gc.collect()
        while (hooks := _top_saved_tensors_hooks()) is not None:
            left.append(f"a saved-tensors hook ({getattr(hooks[0], '__qualname__', hooks[0])}) still pushed")
            torch._C._autograd._pop_saved_tensors_default_hooks()
        while torch._C._len_torch_function_stack() > self.function_modes:
            left.append(f"a torch function mode ({type(torch._C._pop_torch_function_stack()).__name__}) still active")
        while torch._C._len_torch_dispatch_stack() > self.dispatch_modes:
            left.append(f"a dispatch mode ({type(torch._C._pop_torch_dispatch_stack()).__name__}) still active")
        if not self.joined and dist.is_available() and dist.is_initialized():
            left.append("a process group still joined")
            dist.destroy_process_group()
        return left


def _top_saved_tensors_hooks() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    return torch._C._autograd._top_saved_tensors_default_hooks(True)


@contextlib.contextmanager
def builds_graphs() -> Iterator[None]:
    """Fail unless torch.compile builds a graph inside the block, starting from a fresh dynamo.

    For compiled-vs-eager comparisons: a compiled side that silently ran eagerly (a used-up recompile limit, a
    fallback after a compiler error, a graph break around everything) would compare eager with eager and pass.
    """
    torch._dynamo.reset()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    yield
    built = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
    assert built > 0, "torch.compile built 0 graphs here: the compiled code ran eagerly"
