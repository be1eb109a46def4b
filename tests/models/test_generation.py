"""Greedy generation: the KV cache and CUDA-graph decoding write the tokens of the uncached loop."""

from __future__ import annotations

import contextlib
import warnings
from collections import Counter
from collections.abc import Sequence

import pytest
import torch
from helpers import TINY_DECODERS, IdsTokenizer, build_tiny_decoder, builds_graphs
from torch.utils._python_dispatch import TorchDispatchMode

from foundry.algorithms.torch_compile import compile_forward
from foundry.models.generation import greedy_generate

PROMPTS = [[5, 17, 3, 9, 40, 2, 11], [8, 1], [60, 61, 62, 63], [33]]  # different lengths: the batch is padded
MAX_NEW_TOKENS = 6


def generate(model: torch.nn.Module, use_cache: bool, tokenizer: IdsTokenizer, stops: Sequence[str] = ()) -> list:
    model.config.use_cache = use_cache
    return greedy_generate(model, PROMPTS, MAX_NEW_TOKENS, tokenizer, stops)


@pytest.mark.parametrize("variant", list(TINY_DECODERS))
def test_cached_generation_writes_the_tokens_of_the_uncached_loop(variant) -> None:
    model = build_tiny_decoder(variant)
    tokenizer = IdsTokenizer(eos_token_id=-1)  # no eos: every row runs MAX_NEW_TOKENS steps
    assert generate(model, True, tokenizer) == generate(model, False, tokenizer)


def test_cached_generation_stops_each_row_at_eos_as_the_uncached_loop_does() -> None:
    model = build_tiny_decoder("llama_gqa")
    rows = [text.split() for text in generate(model, False, IdsTokenizer(eos_token_id=-1))]
    eos = next(int(row[2]) for row in rows if row[2] not in row[:2])  # some row's third token is its first eos
    tokenizer = IdsTokenizer(eos_token_id=eos)
    expected = generate(model, False, tokenizer)
    assert len({len(text.split()) for text in expected}) > 1  # rows stop at different steps
    assert generate(model, True, tokenizer) == expected


def test_cached_generation_stops_at_a_stop_string_as_the_uncached_loop_does() -> None:
    model = build_tiny_decoder("mpt_alibi")
    tokenizer = IdsTokenizer(eos_token_id=-1)
    stop = " " + generate(model, False, tokenizer)[1].split()[1]  # row 1's second token ends it
    expected = generate(model, False, tokenizer, [stop])
    assert expected[1].endswith(stop) and len(expected[1].split()) < MAX_NEW_TOKENS
    assert generate(model, True, tokenizer, [stop]) == expected


class _WeightCasts(TorchDispatchMode):
    """Counts the casts of each parameter (by storage) that reach the dispatcher, autocast's included."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.parameters = {parameter.data_ptr() for parameter in model.parameters()}
        self.counts: Counter[int] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in self.parameters:
            self.counts[args[0].data_ptr()] += 1
        return func(*args, **(kwargs or {}))


def _generate_counting_casts(model: torch.nn.Module) -> tuple[list[str], Counter[int]]:
    with _WeightCasts(model) as casts:
        texts = greedy_generate(model, PROMPTS, MAX_NEW_TOKENS, IdsTokenizer(eos_token_id=-1), precision="amp_bf16")
    return texts, casts.counts


@pytest.mark.parametrize("use_cache", [True, False])
def test_autocast_casts_each_weight_once_per_generation_not_per_step(
    use_cache: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = build_tiny_decoder("llama_gqa")
    model.config.use_cache = use_cache
    texts, counts = _generate_counting_casts(model)
    assert counts and max(counts.values()) == 1
    # Without the one autocast around the loop every step re-casts: the same text, MAX_NEW_TOKENS casts.
    monkeypatch.setattr("foundry.models.generation._weights_cast_once", lambda *args: contextlib.nullcontext())
    per_step_texts, per_step_counts = _generate_counting_casts(model)
    assert per_step_texts == texts
    assert max(per_step_counts.values()) == MAX_NEW_TOKENS


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _generate_on_gpu(model: torch.nn.Module, cuda_graph: bool, precision: str = "amp_bf16") -> list[str]:
    tokenizer = IdsTokenizer(eos_token_id=-1)
    return greedy_generate(model, PROMPTS, MAX_NEW_TOKENS, tokenizer, precision=precision, device="cuda",
                           cuda_graph=cuda_graph)  # fmt: skip


@needs_gpu
@pytest.mark.filterwarnings("error:Decoding stays eager")  # the graph must really be used
@pytest.mark.parametrize("variant", list(TINY_DECODERS))
def test_decode_steps_replayed_from_a_cuda_graph_write_the_eager_tokens(variant) -> None:
    model = build_tiny_decoder(variant).cuda()
    for precision in ("fp32", "amp_bf16"):
        assert _generate_on_gpu(model, True, precision) == _generate_on_gpu(model, False, precision)


@needs_gpu
def test_a_decode_step_that_syncs_with_the_host_warns_and_decodes_eagerly() -> None:
    """Found before any capture: afterwards graphs (and compiles) in the same process still work."""
    model = build_tiny_decoder("llama_gqa").cuda()
    expected = _generate_on_gpu(model, False)

    def read_on_host(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        output.sum().item()  # a host read: not allowed while a graph captures

    model.register_forward_hook(read_on_host)
    with pytest.warns(UserWarning, match="Decoding stays eager"):
        assert _generate_on_gpu(model, True) == expected
    compiled = build_tiny_decoder("mpt_rope_hf").cuda()
    for block in compiled.transformer.blocks:
        compile_forward(block, {})
    with warnings.catch_warnings(), builds_graphs():
        warnings.filterwarnings("error", "Decoding stays eager")
        assert _generate_on_gpu(compiled, True) == _generate_on_gpu(build_tiny_decoder("mpt_rope_hf").cuda(), False)


@needs_gpu
@pytest.mark.filterwarnings("error:Decoding stays eager")
def test_regionally_compiled_blocks_decode_the_same_tokens_from_a_cuda_graph() -> None:
    """As during training with the torch_compile algorithm: each block's forward compiled."""
    model = build_tiny_decoder("mpt_rope_hf").cuda()
    expected = _generate_on_gpu(model, False)
    for block in model.transformer.blocks:
        compile_forward(block, {})
    with builds_graphs():
        assert _generate_on_gpu(model, True) == expected
