"""KV-cached vs uncached greedy decoding of MPT-1B on one CUDA device, then a profile of cached steps.

    python benchmarks/decode_profile.py --out OUT

Random weights (sdpa, amp_bf16), 32 prompts of 500-800 random tokens, 64 new tokens, a stop
string that never matches (so every row decodes all 64). Prints wall seconds per call, uncached, then
KV-cached with eager decode steps and with steps replayed from a CUDA graph, twice each (the first
calls include warm-up), and the host (CPU) and device time of a profile of 16 cached steps each way.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from bench_utils import REPO_ROOT, model_from_yaml, save_json
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from foundry.models.generation import greedy_generate


class NumberTokenizer:
    """Decodes ids as numbers: enough for the loop's eos and stop-string checks."""

    eos_token_id, pad_token_id = 0, 1

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(map(str, ids))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="folder for decode_profile.json")
    args = parser.parse_args()
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
    rows = []
    runs = [("uncached", False, False)] + [("cached, eager steps", True, False), ("cached, CUDA graph", True, True)] * 2
    for label, use_cache, cuda_graph in runs:
        model.config.use_cache = use_cache
        torch.cuda.synchronize()
        started = time.perf_counter()
        with torch.no_grad():
            greedy_generate(model, prompts, 64, tokenizer, ["\n\n"], "amp_bf16", "cuda", cuda_graph)
        torch.cuda.synchronize()
        rows.append({"run": label, "seconds": round(time.perf_counter() - started, 3)})
        print(f"{label}: {rows[-1]['seconds']:.3f} s for 64 tokens x 32 rows", flush=True)
    model.config.use_cache = True
    for label, cuda_graph in (("cached, eager steps", False), ("cached, CUDA graph", True)):
        with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
            greedy_generate(model, prompts, 16, tokenizer, ["\n\n"], "amp_bf16", "cuda", cuda_graph)
        events = profiler.key_averages()
        cpu_ms = sum(event.self_cpu_time_total for event in events) / 1e3
        gpu_ms = sum(event.self_device_time_total for event in events if event.device_type == DeviceType.CUDA) / 1e3
        rows.append({"run": f"profile of 16 steps, {label}", "cpu_ms": round(cpu_ms, 1), "gpu_ms": round(gpu_ms, 1)})
        print(rows[-1], flush=True)
        print(events.table(sort_by="cpu_time_total", row_limit=8, max_name_column_width=60))
    save_json(args.out, "decode_profile", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
