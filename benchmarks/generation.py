"""Greedy generation with and without the KV cache: generated tokens/s of a small random MPT.

    python benchmarks/generation.py --d-model 256 --n-layers 4 --rows 16 --prompt-lens 64 256 --new-tokens 32

Every row runs all ``--new-tokens`` steps (no eos), so both loops do the same number of steps; the
uncached loop re-runs the whole prefix each step, the cached one runs each prompt once and then one
token per row. Prompts in a batch differ in length (a quarter of the rows are half as long), as ICL
batches do. Runs on whatever device torch finds; a micro-benchmark, not an eval-throughput figure.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import torch
from bench_utils import environment, write_results

from foundry.models import MPTCausalLM
from foundry.models.generation import greedy_generate


class _NoEosTokenizer:
    """What greedy_generate asks of a tokenizer, with an eos no model emits (every row runs to the end)."""

    pad_token_id = 0
    eos_token_id = -1

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return " ".join(str(token) for token in ids)


def time_generation(
    model: MPTCausalLM, prompts: list[list[int]], new_tokens: int, use_cache: bool, precision: str, device: torch.device
) -> float:
    """Seconds for one greedy_generate call, after one untimed warm-up call."""
    model.config.use_cache = use_cache
    tokenizer = _NoEosTokenizer()
    greedy_generate(model, prompts, new_tokens, tokenizer, precision=precision, device=device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start_s = time.perf_counter()
    greedy_generate(model, prompts, new_tokens, tokenizer, precision=precision, device=device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-heads", type=int, default=4)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--rows", type=int, default=16, help="prompts per batch")
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[64, 256], help="longest prompt of a batch")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--out", help="folder for generation.json")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    max_seq_len = max(args.prompt_lens) + args.new_tokens
    keys = {"d_model": args.d_model, "n_heads": args.n_heads, "n_layers": args.n_layers}
    model = MPTCausalLM(**keys, vocab_size=args.vocab_size, max_seq_len=max_seq_len, init_device=device.type).eval()
    rows = []
    for prompt_len in args.prompt_lens:
        lengths = [prompt_len if row % 4 else prompt_len // 2 for row in range(args.rows)]
        prompts = [torch.randint(1, args.vocab_size, (length,)).tolist() for length in lengths]
        generated = args.rows * args.new_tokens
        seconds = {
            use_cache: time_generation(model, prompts, args.new_tokens, use_cache, args.precision, device)
            for use_cache in (False, True)
        }
        rows.append({
            "prompt_len": prompt_len,
            "rows": args.rows,
            "new_tokens": args.new_tokens,
            "uncached_tokens_per_s": generated / seconds[False],
            "cached_tokens_per_s": generated / seconds[True],
            "speedup": seconds[False] / seconds[True],
        })  # fmt: skip
    print(f"{environment()}; MPT d_model={args.d_model} n_layers={args.n_layers}, {args.precision}")
    write_results(args.out, "generation", rows)


if __name__ == "__main__":
    main()
