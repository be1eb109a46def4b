"""The Python API against ``foundry train``: MPT-1B built in Python as the README shows, no YAML.

    python benchmarks/python_api.py --corpus a.txt b.txt --tokenizer DIR --out OUT

Both rows read the same MDS data through StreamingDataset (``default_path.build_data``), in fresh
processes, at the YAML's microbatch (16) and global batch (512 x 2048 tokens), each timed after one
warm-up batch (compile included) by the speed monitor (``throughput/run/*``):

- ``foundry-train``: ``foundry train yamls/pretrain/mpt-1b.yaml`` with only paths and length changed
  (``default_path.run_foundry_row``).
- ``python-api``: ``MPTCausalLM(...)``, ``build_text_dataloader(...)``, ``Trainer(...)`` with the
  YAML's values spelled as Python arguments, and nothing else: whatever ``foundry train`` applies by
  default (compile, the fused loss, weight-gradient summing, the allocator setting) the Trainer
  must apply by itself.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from bench_utils import REPO_ROOT, markdown_table, save_json
from default_path import build_data, run_foundry_row

BATCHES, WARMUP_BATCHES, MICROBATCH, GLOBAL_BATCH, SEQ_LEN = 3, 1, 16, 512, 2048


def python_api_run(data: str, tokenizer_dir: str, run_folder: str) -> None:
    """MPT-1B as a user writes it in Python (the README's example at MPT-1B's widths)."""
    from foundry import Trainer
    from foundry.algorithms import GradientClipping
    from foundry.callbacks import LRMonitor, MemoryMonitor, RuntimeEstimator, SpeedMonitor
    from foundry.data import build_text_dataloader, load_tokenizer
    from foundry.models import MPTCausalLM
    from foundry.optim import CosineWithWarmupScheduler, DecoupledAdamW

    tokenizer = load_tokenizer(tokenizer_dir, model_max_length=SEQ_LEN)
    model = MPTCausalLM(
        d_model=2048, n_heads=16, n_layers=24, expansion_ratio=4, max_seq_len=SEQ_LEN, vocab_size=50368,
        init_device="meta", attn_config={"attn_impl": "flash"},
    )  # fmt: skip
    dataset = {"local": data, "split": "train", "shuffle": True, "max_seq_len": SEQ_LEN, "shuffle_seed": 17}
    train_loader = build_text_dataloader(
        device_batch_size=GLOBAL_BATCH, dataset=dataset, tokenizer=tokenizer, drop_last=True, num_workers=8
    )
    trainer = Trainer(
        model=model,
        train_dataloader=train_loader,
        tokenizer=tokenizer,
        max_duration=f"{BATCHES}ba",
        optimizers=lambda params: DecoupledAdamW(params, lr=2e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0),
        schedulers=CosineWithWarmupScheduler(t_warmup="100ba", alpha_f=0.1),
        algorithms=[GradientClipping(clipping_type="norm", clipping_threshold=1.0)],
        callbacks=[
            SpeedMonitor(window_size=10, warmup_batches=WARMUP_BATCHES),
            LRMonitor(),
            MemoryMonitor(),
            RuntimeEstimator(),
        ],
        fsdp_config={"sharding_strategy": "FULL_SHARD", "mixed_precision": "PURE"},
        device_train_microbatch_size=MICROBATCH,
        run_folder=run_folder,
        seed=17,
    )
    trainer.fit()
    train_loader.dataset.close()


def run_python_row(args: argparse.Namespace) -> dict:
    run_folder = Path(args.work) / "runs" / "python-api"
    command = [sys.executable, __file__, "--python-api-run", "--data", str(args.data), "--tokenizer", args.tokenizer]
    process = subprocess.run([*command, "--work", str(run_folder)], cwd=REPO_ROOT, capture_output=True, text=True)
    log = process.stdout + process.stderr
    if args.out:
        (Path(args.out) / "python-api.log").write_text(log)
    if process.returncode != 0:
        return {"row": "python-api", "error": f"exit {process.returncode}: {log.strip().splitlines()[-1][:300]}"}
    rows = [json.loads(line) for line in (run_folder / "metrics.jsonl").read_text().splitlines()]
    latest = {key: value for row in rows for key, value in row.items()}
    return {
        "row": "python-api",
        "mfu": latest.get("throughput/run/device/mfu"),
        "tokens_per_s": latest.get("throughput/run/tokens_per_sec"),
        "compile_s": latest.get("time/compile_s"),
        "peak_gib": latest.get("memory/peak_allocated_mem"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", nargs="+", help="text files for the MDS data (unless --data is given)")
    parser.add_argument("--data", default=None, help="MDS data already converted (2048-token samples)")
    parser.add_argument("--tokenizer", required=True, help="tokenizer directory (gpt-neox-20b)")
    parser.add_argument("--samples", type=int, default=2000, help="2048-token samples in the train split")
    parser.add_argument("--work", default="/tmp/foundry-python-api")
    parser.add_argument("--out", default=None)
    parser.add_argument("--python-api-run", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.python_api_run:
        python_api_run(args.data, args.tokenizer, args.work)
        return 0
    if args.data is None:
        args.data = build_data(args.corpus, args.tokenizer, args.samples, Path(args.work) / "data")
    Path(args.out).mkdir(parents=True, exist_ok=True) if args.out else None
    yaml_args = argparse.Namespace(data=args.data, tokenizer=args.tokenizer, work=args.work, out=args.out)
    yaml_row = run_foundry_row(
        "foundry-train", REPO_ROOT / "yamls/pretrain/mpt-1b.yaml", (BATCHES, WARMUP_BATCHES), [], yaml_args
    )
    yaml_row.pop("summary", None)
    print(yaml_row, flush=True)
    python_row = run_python_row(args)
    print(python_row, flush=True)
    if yaml_row.get("mfu") and python_row.get("mfu"):
        python_row["vs_foundry_train"] = python_row["mfu"] / yaml_row["mfu"]
    rows = [yaml_row, python_row]
    save_json(args.out, "python_api", rows)
    print(markdown_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
