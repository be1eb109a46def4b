"""Does QLoRA train like bf16 LoRA? Per-batch losses of two ``foundry train`` runs on the same data and seed.

    python benchmarks/qlora_vs_lora.py --out OUT_DIR [--data data/qlora_vs_lora] [--batches 200]

Both runs are ``foundry train yamls/pretrain/llama-1b.yaml`` (Llama-3.2-1B's widths, random weights: the
machine has no network) with rank-16 adapters on every block linear layer (``all-linear``), amp_bf16, the
same seed (the same initial weights and adapters) and the same batches in the same order:

- ``lora``: the frozen base stored in bf16 (``peft_config.base_dtype: bfloat16``);
- ``qlora``: the frozen linear weights stored in 4-bit NF4 (``peft_config.quantize_base: true``), the
  embeddings and norms as ``lora`` keeps them.

The data: the shared folder's corpora (``SHARED_DATA/corpus``), tokenized with gpt-neox-20b into 2048-token
MDS samples under ``--data`` (built on the first call, repeated as often as the batches need). Written to
OUT_DIR: ``qlora_vs_lora.json`` (both curves, exit codes, wall times, the gaps) and ``qlora_vs_lora.png``
(the curves and QLoRA minus LoRA). The gaps: the largest |QLoRA - LoRA| over the batches, raw and after a
centred moving average of ``--smooth`` batches (each batch's loss averaged with its neighbours, which takes
out the batch-to-batch noise both runs share only in part), and the two runs' mean losses over the last 50
batches. ``--smoke`` runs a tiny Llama (256 wide, NF4 blocks whole) for 10 batches on a CPU.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from bench_utils import REPO_ROOT, SHARED_DATA, environment, foundry_train, markdown_table, train_losses

YAML = REPO_ROOT / "yamls" / "pretrain" / "llama-1b.yaml"
ADAPTERS = "{r: 16, lora_alpha: 32, lora_dropout: 0.0, target_modules: all-linear"
VARIANTS: dict[str, list[str]] = {
    "lora": [f"model.peft_config={ADAPTERS}, base_dtype: bfloat16}}"],
    "qlora": [f"model.peft_config={ADAPTERS}, quantize_base: true}}"],
}
REFERENCE = "lora"
SMOKE = [
    "model.d_model=256", "model.n_layers=2", "model.n_heads=4", "model.kv_n_heads=2", "model.ffn_hidden_size=512",
    "variables.max_seq_len=128", "train_loader.num_workers=0",
]  # fmt: skip
LAST_BATCHES = 50


def prepare(data: Path, samples: int, smoke: bool) -> Path:
    """2048-token MDS samples of the shared corpora (smoke: tinyshakespeare alone) and the gpt-neox-20b tokenizer
    under ``data``, kept for the next call (the GPU machine reads them from the checkout)."""
    from default_path import build_data

    if (data / "mds" / "train" / "index.json").exists() and (data / "tokenizer").is_dir():
        return data
    corpus = [str(path) for path in sorted((SHARED_DATA / "corpus").rglob("*.txt"))]
    corpus = [path for path in corpus if not smoke or "shakespeare" in path]
    tokenizer = SHARED_DATA / "tokenizers" / "gpt-neox-20b"
    if not corpus or not tokenizer.is_dir():
        raise SystemExit(f"no corpus or gpt-neox-20b tokenizer under {SHARED_DATA}: the shared data folder")
    build_data(corpus, str(tokenizer), samples, data / "mds")
    shutil.copytree(tokenizer, data / "tokenizer", dirs_exist_ok=True)
    return data


def run_overrides(name: str, args: argparse.Namespace) -> list[str]:
    """The ``foundry train`` overrides of a variant: the same data, batch, schedule and seed for both."""
    overrides = [
        f"variables.data_local={Path(args.data).resolve() / 'mds'}",
        f"tokenizer.name={Path(args.data).resolve() / 'tokenizer'}", "model.vocab_size=50304",
        "eval_loader=null", f"max_duration={args.batches}ba", f"global_train_batch_size={args.global_batch}",
        f"device_train_microbatch_size={args.global_batch}", "scheduler.t_warmup=20ba", "precision=amp_bf16",
        "console_log_interval=10ba", f"run_name={name}", "save_folder=null", *VARIANTS[name],
    ]  # fmt: skip
    return overrides + (SMOKE if args.smoke else [])


def run_variant(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Train one variant; its losses by batch (as far as it got), exit code and wall time."""
    run_folder = Path(args.work) / name
    overrides = run_overrides(name, args)
    started_s = time.perf_counter()
    returncode = foundry_train(YAML, run_folder, overrides, timeout_s=args.variant_timeout)
    log = (run_folder.parent / f"{name}.log").read_text(errors="replace").splitlines()
    return {
        "variant": name, "overrides": overrides, "returncode": returncode,
        "wall_s": round(time.perf_counter() - started_s, 1), "losses": train_losses(run_folder), "log_tail": log[-20:],
    }  # fmt: skip


def centred_mean(curve: dict[int, float], window: int) -> dict[int, float]:
    """Each batch's loss averaged with its neighbours, ``window`` batches in all (fewer at the ends)."""
    steps = sorted(curve)
    half = window // 2
    smoothed = {}
    for index, step in enumerate(steps):
        around = steps[max(0, index - half) : index + window - half]
        smoothed[step] = sum(curve[neighbour] for neighbour in around) / len(around)
    return smoothed


def gaps(curve: dict[int, float], reference: dict[int, float], window: int) -> dict[str, Any]:
    """|curve - reference| (raw and smoothed) over the batches both logged, and both means over the last 50."""
    steps = sorted(set(curve) & set(reference))
    if not steps:
        return {"common_batches": 0}
    common = {step: curve[step] for step in steps}, {step: reference[step] for step in steps}
    smooth = centred_mean(common[0], window), centred_mean(common[1], window)
    last = steps[-LAST_BATCHES:]
    return {
        "common_batches": len(steps),
        "max_abs_gap": max(abs(curve[step] - reference[step]) for step in steps),
        f"max_abs_gap_smoothed_{window}": max(abs(smooth[0][step] - smooth[1][step]) for step in steps),
        "mean_last_50": sum(curve[step] for step in last) / len(last),
        "reference_mean_last_50": sum(reference[step] for step in last) / len(last),
    }


def plot(curves: dict[str, dict[int, float]], path: Path, title: str) -> None:
    """The loss curves (top) and QLoRA minus LoRA (bottom)."""
    from bench_utils import plot_against_reference

    plot_against_reference(curves, REFERENCE, path, (title, f"difference from {REFERENCE}"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for qlora_vs_lora.json and .png")
    parser.add_argument("--data", default="data/qlora_vs_lora", help="the MDS data folder (built when missing)")
    parser.add_argument("--batches", type=int, default=None, help="optimizer steps (default 200; smoke: 10)")
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per optimizer step (smoke: 2)")
    parser.add_argument("--smooth", type=int, default=10, help="batches in the centred moving average")
    parser.add_argument("--variant-timeout", type=float, default=260.0, help="seconds before a run is stopped")
    parser.add_argument("--work", default="/tmp/foundry-qlora-vs-lora", help="the runs' folders and logs")
    parser.add_argument("--smoke", action="store_true", help="a tiny Llama on this CPU: checks the plumbing")
    args = parser.parse_args()
    args.batches = args.batches or (10 if args.smoke else 200)
    args.global_batch = 2 if args.smoke else args.global_batch
    prepare(Path(args.data), args.batches * args.global_batch, args.smoke)
    results = {name: run_variant(name, args) for name in VARIANTS}
    curves = {name: result["losses"] for name, result in results.items()}
    summary = gaps(curves["qlora"], curves[REFERENCE], args.smooth)
    rows = [
        {"variant": name, "exit": result["returncode"], "wall_s": result["wall_s"], "batches": len(result["losses"]),
         "first_loss": result["losses"].get(1), "last_loss": result["losses"].get(max(result["losses"], default=0))}
        for name, result in results.items()
    ]  # fmt: skip
    print(markdown_table(rows))
    print(json.dumps(summary, indent=1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"environment": environment(), "smoothing": f"centred moving average of {args.smooth} batches"}
    (out / "qlora_vs_lora.json").write_text(json.dumps({**payload, "gaps": summary, "runs": results}, indent=1))
    if all(curves.values()):
        shape = "tiny Llama (smoke, CPU)" if args.smoke else "Llama-3.2-1B shape, random weights"
        plot(curves, out / "qlora_vs_lora.png", f"{shape}: train loss per batch, rank-16 adapters")
    return 0 if all(result["returncode"] == 0 for result in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
