"""LoRA vs full finetuning of one model on one GPU: tokens/s, peak memory and optimizer-state bytes.

    python benchmarks/lora_vs_full.py yamls/pretrain/mpt-1b.yaml --microbatch 4 --out results/

Each variant builds the YAML's model on the GPU, then runs forward, backward and a DecoupledAdamW
step on random tokens (amp_bf16, the same microbatch for all): full finetuning (every weight
trains), LoRA r=8 / alpha 16 on every block linear layer (``all-linear``), and LoRA on the
attention projections only (``Wqkv``, ``out_proj``). The optimizer gets the trainable parameters
only, as the Trainer does, so a frozen base has no optimizer state.
"""

from __future__ import annotations

import argparse
import gc

import torch
from bench_utils import cuda_time_ms, environment, model_from_yaml, random_batch, write_results

from foundry.models.lora import trainable_parameters
from foundry.optim import DecoupledAdamW

VARIANTS = {
    "full finetune": None,
    "LoRA r=8, all linear": "{r: 8, lora_alpha: 16, target_modules: all-linear}",
    "LoRA r=8, attention only": "{r: 8, lora_alpha: 16, target_modules: [Wqkv, out_proj]}",
}


def measure(config_path: str, peft_config: str | None, microbatch: int, warmup: int, iters: int) -> dict:
    overrides = ["model.init_device=cuda", *([f"model.peft_config={peft_config}"] if peft_config else [])]
    model, seq_len = model_from_yaml(config_path, overrides)
    model.train()
    params = trainable_parameters(model)
    optimizer = DecoupledAdamW(params, lr=1e-4)
    batch = random_batch(microbatch, seq_len, model.config.vocab_size, torch.device("cuda"))

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model.loss(model(batch), batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    torch.cuda.reset_peak_memory_stats()
    times_ms = sorted(cuda_time_ms(step, warmup, iters))
    frozen_with_grad = [p for p in model.parameters() if not p.requires_grad and p.grad is not None]
    assert not frozen_with_grad, "a frozen weight received a gradient"
    optimizer_bytes = sum(
        t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)
    )
    median_ms = times_ms[len(times_ms) // 2]
    row = {
        "trainable params": sum(p.numel() for p in params),
        "total params": sum(p.numel() for p in model.parameters()),
        "tokens/s": round(microbatch * seq_len / (median_ms / 1000)),
        "step ms (median)": round(median_ms, 1),
        "peak memory GiB": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "optimizer state MiB": round(optimizer_bytes / 2**20, 1),
    }
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config", help="a train YAML whose model is measured")
    parser.add_argument("--microbatch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", help="folder for lora_vs_full.json")
    args = parser.parse_args()
    env = environment()
    rows = []
    for name, peft_config in VARIANTS.items():
        row = measure(args.config, peft_config, args.microbatch, args.warmup, args.iters)
        gc.collect()  # the previous variant's model and optimizer state go before the next is built
        torch.cuda.empty_cache()
        rows.append({"variant": name, "microbatch": args.microbatch, **row, **env})
        print(rows[-1], flush=True)
    write_results(args.out, "lora_vs_full", rows)


if __name__ == "__main__":
    main()
