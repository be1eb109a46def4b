"""ICL eval throughput: examples/s per task of the light suite for a train YAML's model (random init), bf16.

    python benchmarks/icl_throughput.py --config yamls/pretrain/mpt-1b.yaml \
        --tokenizer ../shared/data/tokenizers/gpt-neox-20b --limit 200 --out results/

Throughput only: a randomly initialised model's accuracies are noise (printed to show every task ran).
The first task's time includes no warm-up cost: one batch runs before timing starts.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from bench_utils import REPO_ROOT, model_from_yaml, write_results

from foundry.eval.evaluator import ICLEvaluator
from foundry.eval.gauntlet import primary_accuracy
from foundry.eval.task_config import parse_icl_tasks
from foundry.icl_data import ICL_DATA_ENV


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO_ROOT / "yamls/pretrain/mpt-1b.yaml"))
    parser.add_argument("--tasks", default=str(REPO_ROOT / "yamls/eval/tasks_light.yaml"))
    parser.add_argument(
        "--data", help="a copy of LLM Foundry's scripts/eval (or local_data) folder; default: download the files"
    )
    parser.add_argument("--tokenizer", default=str(REPO_ROOT.parent / "shared/data/tokenizers/gpt-neox-20b"))
    parser.add_argument("--limit", type=int, default=200, help="examples per task")
    parser.add_argument("--batch-size", type=int, default=32, help="rows per forward")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--precision", default="amp_bf16")
    parser.add_argument("--out", help="folder for icl_throughput.json")
    args = parser.parse_args()

    from transformers import AutoTokenizer  # directly: foundry.data would import mosaicml-streaming

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    if args.data:
        os.environ[ICL_DATA_ENV] = args.data
    tasks = parse_icl_tasks(args.tasks)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, _ = model_from_yaml(args.config, ["model.init_device=meta"])
    model.to_empty(device=device)
    model.init_weights()
    prepare_s = time.perf_counter()
    evaluator = ICLEvaluator(tasks, tokenizer, args.seq_len, args.batch_size, limit=args.limit)
    prepare_s = time.perf_counter() - prepare_s
    warmup = ICLEvaluator(tasks[:1], tokenizer, args.seq_len, args.batch_size, limit=2)
    warmup.evaluate(model, args.precision, device)
    results = evaluator.evaluate(model, args.precision, device)
    rows = []
    for name, metrics in results.items():
        count, seconds = evaluator.num_examples(name), evaluator.seconds[name]
        subtask = next(s for s in evaluator.subtasks if s.name == name)
        rows.append(
            {
                "task": name,
                "type": subtask.task.icl_task_type,
                "examples": count,
                "rows": sum(len(example.requests) for example in subtask.examples),
                "seconds": round(seconds, 3),
                "examples_per_s": round(count / seconds, 1),
                "accuracy (random init)": round(primary_accuracy(metrics) or 0.0, 3),
            }
        )
    total_examples, total_s = sum(r["examples"] for r in rows), sum(r["seconds"] for r in rows)
    rows.append({"task": "all", "examples": total_examples, "seconds": round(total_s, 2),
                 "examples_per_s": round(total_examples / total_s, 1)})  # fmt: skip
    print(f"prompt building and tokenization: {prepare_s:.1f} s for {total_examples} examples")
    write_results(args.out, "icl_throughput", rows)


if __name__ == "__main__":
    main()
