"""KV-cached vs uncached greedy decoding of MPT-1B on one CUDA device, then a profile of cached steps.

    python benchmarks/decode_profile.py

Random weights (sdpa, amp_bf16), 32 prompts of 500-800 random tokens, 64 new tokens, a stop
string that never matches (so every row decodes all 64). Prints wall seconds per call (the first
cached call includes warm-up) and the top ops of a profile of 16 cached steps.
"""

from __future__ import annotations

import sys
import time

import torch
from bench_utils import REPO_ROOT, model_from_yaml
from torch.profiler import ProfilerActivity, profile

from foundry.eval.scoring import greedy_generate


class NumberTokenizer:
    """Decodes ids as numbers: enough for the loop's eos and stop-string checks."""

    eos_token_id, pad_token_id = 0, 1

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(map(str, ids))


def main() -> int:
    if not torch.cuda.is_available():
        print("decode_profile.py needs a CUDA device.", file=sys.stderr)
        return 2
    overrides = ["model.attn_config.attn_impl=sdpa", "model.init_device=cuda"]
    model, _ = model_from_yaml(REPO_ROOT / "yamls/pretrain/mpt-1b.yaml", overrides)
    model.eval()
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(500, 800, (32,), generator=generator).tolist()
    prompts = [torch.randint(2, 50000, (n,), generator=generator).tolist() for n in lengths]
    tokenizer = NumberTokenizer()
    for use_cache in (True, False, True):
        model.config.use_cache = use_cache
        torch.cuda.synchronize()
        started = time.perf_counter()
        with torch.no_grad():
            greedy_generate(model, prompts, 64, tokenizer, ["\n\n"], "amp_bf16", "cuda")
        torch.cuda.synchronize()
        label = "cached" if use_cache else "uncached"
        print(f"{label}: {time.perf_counter() - started:.3f} s for 64 tokens x 32 rows", flush=True)
    model.config.use_cache = True
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        greedy_generate(model, prompts, 16, tokenizer, ["\n\n"], "amp_bf16", "cuda")
    print(profiler.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    sys.exit(main())
