"""Greedy generation from a model: left-padded prompts, a KV cache, decode steps replayed from a CUDA graph.

Used by ICL generation tasks and by ``foundry.generate``. Under FSDP every rank must run the same
number of forwards, so ``greedy_generate`` stops only when every row on every rank has stopped.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from foundry import distributed
from foundry.core.precision import autocast

# (tokens, positions) -> the next token's logits for each row
NextLogits = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def logits_of(model: nn.Module, input_ids: torch.Tensor, precision: str) -> torch.Tensor:
    """(rows, seq, vocab) logits of a right-padded batch (no mask needed: attention is causal)."""
    with autocast(precision, input_ids.device):
        outputs = model({"input_ids": input_ids})
    return outputs.logits if hasattr(outputs, "logits") else outputs


@torch.no_grad()
def greedy_generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    tokenizer: Any,
    stop_strings: Sequence[str] = (),
    precision: str = "fp32",
    device: torch.device | str = "cpu",
    cuda_graph: bool | None = None,
) -> list[str]:
    """Greedy continuations of ``prompts`` (decoded text), each stopped at eos or a stop string.

    Uses the model's own ``generate`` when it wraps a transformers model; a KV cache when the model
    offers one (MPT and Llama with ``use_cache``); otherwise a batched loop that re-runs the forward
    over the growing sequences (fine for small models). With a KV cache, ``cuda_graph`` replays each
    decode step from a CUDA graph (None: on CUDA devices, for models not sharded by FSDP).
    """
    hf_model = getattr(model, "hf_model", None)
    if hf_model is not None and hasattr(hf_model, "generate"):
        return _hf_generate(hf_model, prompts, max_new_tokens, tokenizer, stop_strings, precision, device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    if getattr(model, "generates_with_kv_cache", False):
        tokens, attention_mask = _left_padded(prompts, pad, max_new_tokens, device)
        start = torch.full((len(prompts),), attention_mask.shape[1], device=device)
        use_graph = _decodes_in_cuda_graph(model, torch.device(device)) if cuda_graph is None else cuda_graph
        next_logits = _CachedDecoder(model, attention_mask, tokens.shape[1], precision, use_graph)
    else:
        tokens, start = _right_padded(prompts, pad, max_new_tokens, device)
        next_logits = _uncached_next_logits(model, precision)
    with _weights_cast_once(model, precision, torch.device(device)):
        generated = _greedy_loop(tokens, start, next_logits, max_new_tokens, tokenizer, stop_strings)
    return [_decode(token_ids, tokenizer) for token_ids in generated]


def _is_sharded(model: nn.Module) -> bool:
    return any(isinstance(parameter, DTensor) for parameter in model.parameters())


def _decodes_in_cuda_graph(model: nn.Module, device: torch.device) -> bool:
    """CUDA graphs for decode steps on CUDA, except for FSDP-sharded models (their steps all-gather)."""
    return device.type == "cuda" and not _is_sharded(model)


@contextlib.contextmanager
def _weights_cast_once(model: nn.Module, precision: str, device: torch.device) -> Iterator[None]:
    """One autocast around every decoding step, so each fp32 weight is cast to bf16/fp16 once.

    Autocast caches its casts of parameters until the outermost autocast exits; with a fresh one per
    step, every step re-cast the whole model, which bounded decoding by host work
    (docs/PERFORMANCE.md). The cache costs one low-precision copy of the weights while decoding. Not
    for FSDP-sharded models: it would hold an unsharded copy of every layer at once.
    """
    if _is_sharded(model):
        yield
        return
    with autocast(precision, device):
        yield


def _greedy_loop(
    tokens: torch.Tensor,
    start: torch.Tensor,
    next_logits: NextLogits,
    max_new_tokens: int,
    tokenizer: Any,
    stop_strings: Sequence[str],
) -> list[list[int]]:
    """Append each row's argmax token at its end until it stops; returns each row's new token ids.

    ``tokens`` (rows, columns) holds each row's prompt in ``[.., start)``; ``next_logits(tokens, lengths)``
    gives (rows, vocab) logits of every row's next token. Every rank runs the same number of steps.
    """
    rows = torch.arange(len(tokens), device=tokens.device)
    lengths = start.clone()
    done = torch.zeros(len(tokens), dtype=torch.bool, device=tokens.device)
    # Stopping is decided on the host from one copy of each step's tokens: indexing the device
    # tensors row by row would sync with the GPU for every row of every step.
    generated: list[list[int]] = [[] for _ in range(len(tokens))]
    done_rows = [False] * len(tokens)
    for _ in range(max_new_tokens):
        next_token = next_logits(tokens, lengths).argmax(dim=-1)
        current = tokens[rows, lengths]
        tokens[rows, lengths] = torch.where(done, current, next_token)
        lengths = lengths + (~done).long()
        for row, token in enumerate(next_token.tolist()):
            if done_rows[row]:
                continue
            generated[row].append(token)
            stops = token == tokenizer.eos_token_id or _has_stop_string(generated[row], tokenizer, stop_strings)
            done_rows[row] = stops
        done = torch.tensor(done_rows, device=tokens.device)
        if _all_ranks_done(done_rows, tokens.device):
            break
    return generated


def _uncached_next_logits(model: nn.Module, precision: str) -> NextLogits:
    """Next-token logits from a forward over every row's whole prefix (right-padded rows; no mask needed)."""

    def next_logits(tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        logits = logits_of(model, tokens[:, : int(lengths.max())], precision)
        return logits[torch.arange(len(tokens), device=tokens.device), lengths - 1]

    return next_logits


class _CachedDecoder:
    """Next-token logits from a KV cache: the left-padded prompts once, then the last column per step.

    Left padding ends every prompt in the same column, so all rows still going append in one column;
    a finished row's later tokens are computed and ignored.

    With ``cuda_graph``, the cache's length moves to the device after the prompts, the first two
    decode steps run eagerly on a side stream (lazy initialisation, compiles, library workspaces;
    the second one checks that the step never syncs with the host), the third is captured in a CUDA
    graph, and every later step copies its tokens into the graph's input and replays it: one launch
    per step instead of a few hundred, which is what bounded decoding by the host
    (docs/PERFORMANCE.md). A step that syncs makes decoding warn once and stay eager.
    """

    def __init__(
        self, model: nn.Module, attention_mask: torch.Tensor, max_len: int, precision: str, cuda_graph: bool
    ) -> None:
        self.model, self.prompt_mask, self.precision = model, attention_mask, precision
        self.cache = model.new_kv_cache(max_len)
        self.filled = 0  # columns in the cache, counted on the host
        self.cuda_graph = cuda_graph
        self.graph: torch.cuda.CUDAGraph | None = None
        self.graph_ids: torch.Tensor | None = None
        self.graph_logits: torch.Tensor | None = None
        self.warmed_up = False

    def __call__(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        del lengths  # the cache knows how far the rows got
        if self.filled == 0:
            width = self.prompt_mask.shape[1]
            logits = self._forward({"input_ids": tokens[:, :width], "attention_mask": self.prompt_mask})
            self.filled = width
            if self.cuda_graph:
                self.cache.keep_length_on_device(tokens.device)
            return logits[:, -1]
        step_ids = tokens[:, self.filled : self.filled + 1]
        self.filled += 1
        logits = self._graphed_step(step_ids) if self.cuda_graph else self._forward({"input_ids": step_ids})
        return logits[:, -1]

    def _forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with autocast(self.precision, batch["input_ids"].device):
            return self.model(batch, cache=self.cache)

    def _graphed_step(self, step_ids: torch.Tensor) -> torch.Tensor:
        if self.graph is not None:
            self.graph_ids.copy_(step_ids)
            self.graph.replay()
            return self.graph_logits
        if self.graph_ids is None:
            # The first step runs eagerly on the graph's own input tensor: a compiled block compiles
            # here, for exactly what capture will see.
            self.graph_ids = step_ids.clone()
            return self._side_stream_forward()
        self.graph_ids.copy_(step_ids)
        if not self.warmed_up:
            # The second step runs eagerly with host syncs made errors: a step that syncs cannot be
            # captured, and a failed capture can leave torch's CUDA state unusable, so it is found
            # here instead. Such a step is re-run plainly and decoding stays eager.
            self.warmed_up = True
            length_before = self.cache.length.clone()
            try:
                with _host_syncs_raise():
                    return self._side_stream_forward()
            except RuntimeError as error:
                self.cache.length.copy_(length_before)  # the rerun writes the same columns again
                self.cuda_graph = False
                warnings.warn(
                    f"Decoding stays eager: a decode step synchronizes with the host, so it cannot be "
                    f"captured in a CUDA graph ({error}).",
                    stacklevel=3,
                )
                return self._forward({"input_ids": self.graph_ids})
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.graph_logits = self._forward({"input_ids": self.graph_ids})
        self.graph = graph
        graph.replay()
        return self.graph_logits

    def _side_stream_forward(self) -> torch.Tensor:
        """An eager step on a side stream, as CUDA graph capture wants its warm-up steps."""
        current = torch.cuda.current_stream(self.graph_ids.device)
        side = torch.cuda.Stream(self.graph_ids.device)
        side.wait_stream(current)
        try:
            with torch.cuda.stream(side):
                return self._forward({"input_ids": self.graph_ids})
        finally:  # also when the step raised: what it queued runs before anything after it
            current.wait_stream(side)


@contextlib.contextmanager
def _host_syncs_raise() -> Iterator[None]:
    """CUDA operations that synchronize with the host raise instead of running (torch's sync debug mode)."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _left_padded(
    prompts: Sequence[Sequence[int]], pad: int, extra_columns: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, width + extra_columns) token ids with every prompt ending at column ``width``, and the
    (rows, width) attention mask of the prompts (0 = left padding)."""
    width = max(len(prompt) for prompt in prompts)
    tokens = torch.full((len(prompts), width + extra_columns), pad, dtype=torch.long, device=device)
    attention_mask = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        tokens[row, width - len(prompt) : width] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, width - len(prompt) :] = 1
    return tokens, attention_mask


def _right_padded(
    prompts: Sequence[Sequence[int]], pad: int, extra_columns: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, width + extra_columns) token ids with every prompt starting at column 0, and their lengths."""
    lengths = torch.tensor([len(prompt) for prompt in prompts], device=device)
    tokens = torch.full((len(prompts), int(lengths.max()) + extra_columns), pad, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
    return tokens, lengths


def _has_stop_string(token_ids: list[int], tokenizer: Any, stop_strings: Sequence[str]) -> bool:
    if not stop_strings:
        return False
    text = tokenizer.decode(token_ids)
    return any(stop in text for stop in stop_strings)


def _all_ranks_done(done_rows: list[bool], device: torch.device) -> bool:
    """Whether every row on every rank has stopped (FSDP ranks must keep running forwards together)."""
    remaining = float(done_rows.count(False))
    if distributed.get_world_size() == 1:
        return remaining == 0
    return distributed.all_reduce_sum(torch.tensor(remaining, device=device)).item() == 0


def _decode(token_ids: Sequence[int], tokenizer: Any) -> str:
    return tokenizer.decode(list(token_ids), skip_special_tokens=True)


def _hf_generate(
    hf_model: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    tokenizer: Any,
    stop_strings: Sequence[str],
    precision: str,
    device: torch.device | str,
) -> list[str]:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    input_ids, attention_mask = _left_padded(prompts, pad, 0, device)  # every prompt ends where generation starts
    width = input_ids.shape[1]
    with autocast(precision, input_ids.device):
        output = hf_model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=tokenizer.eos_token_id,
            stop_strings=list(stop_strings) or None,
            tokenizer=tokenizer if stop_strings else None,
            synced_gpus=distributed.get_world_size() > 1,
        )
    return [_decode(row[width:].tolist(), tokenizer) for row in output]
