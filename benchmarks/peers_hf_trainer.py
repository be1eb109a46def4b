"""The Hugging Face Trainer row of benchmarks/peers.py: transformers' own ``Trainer`` on the Llama-3.2-1B shape.

    python benchmarks/peers_hf_trainer.py --tokens data/peers/tokens.bin --steps 35 --batch 4 --accumulation 4

Settings are the ones Hugging Face recommends for speed on one GPU: bf16 mixed precision, SDPA attention,
``torch_compile=True``, the fused AdamW (``optim="adamw_torch_fused"``), no checkpointing or evaluation, and
no logging beyond one line per optimizer step (``peers-step N``, after a CUDA sync) that the caller times.
The data is ``tokens.bin`` (the token stream every row reads), a sample per 2048 tokens, labels = inputs.
``--tiny`` swaps in a two-layer model on the CPU in fp32, uncompiled: the CPU smoke test of the script.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from peers_data import read_token_file
from torch.utils.data import Dataset

# Llama-3.2-1B: the shape yamls/pretrain/llama-1b.yaml trains. Its RoPE frequencies (theta, llama3 scaling) are
# left at the config's defaults: they change no FLOP, and transformers 4.x and 5.x spell them differently.
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True)  # fmt: skip
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=50304, tie_word_embeddings=True)  # fmt: skip


class TokenSamples(Dataset):
    """Samples of ``tokens.bin`` as causal-LM examples."""

    def __init__(self, path: Path, seq_len: int) -> None:
        self.samples = read_token_file(path, seq_len)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        input_ids = torch.from_numpy(self.samples[index].astype("int64"))
        return {"input_ids": input_ids, "labels": input_ids}


def step_printer():
    from transformers import TrainerCallback

    class PrintSteps(TrainerCallback):
        """One line per optimizer step once the GPU has finished it; the peak memory at the end."""

        def on_step_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            print(f"peers-step {state.global_step} {time.time():.3f}", flush=True)

        def on_train_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                print(f"peers-peak-allocated-gib {torch.cuda.max_memory_allocated() / 2**30:.2f}", flush=True)

    return PrintSteps()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=Path, required=True, help="tokens.bin from `peers.py prepare`")
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps")
    parser.add_argument("--batch", type=int, required=True, help="per_device_train_batch_size")
    parser.add_argument("--accumulation", type=int, default=1, help="gradient_accumulation_steps")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--output-dir", default="/tmp/peers-hf-trainer")
    parser.add_argument("--tiny", action="store_true", help="two-layer model on the CPU (smoke test)")
    args = parser.parse_args()

    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    config = LlamaConfig(**(TINY if args.tiny else LLAMA_1B), attn_implementation="sdpa")
    torch.manual_seed(17)
    model = LlamaForCausalLM(config)
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.accumulation,
        learning_rate=2e-4,
        adam_beta2=0.95,
        weight_decay=0.0,
        max_grad_norm=1.0,
        lr_scheduler_type="cosine",
        warmup_steps=min(2, args.steps - 1),
        bf16=not args.tiny,
        torch_compile=not args.tiny,
        optim="adamw_torch_fused" if not args.tiny else "adamw_torch",
        use_cpu=args.tiny,
        dataloader_num_workers=2,
        dataloader_pin_memory=not args.tiny,
        save_strategy="no",
        eval_strategy="no",
        logging_strategy="no",
        report_to="none",
        seed=17,
        disable_tqdm=True,
    )
    print(f"peers-versions transformers={transformers.__version__} torch={torch.__version__}", flush=True)
    dataset = TokenSamples(args.tokens, args.seq_len)
    Trainer(model=model, args=training_args, train_dataset=dataset, callbacks=[step_printer()]).train()
    return 0


if __name__ == "__main__":
    sys.exit(main())
