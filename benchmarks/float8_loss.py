"""Does float8 train a 7B model like bf16? Per-batch losses of ``foundry train --nproc 2`` on real text.

Here, once (real text of the shared data folder, tokenized with gpt-neox-20b into 2048-token MDS samples):

    python benchmarks/float8_loss.py prepare --shared-data SHARED_DATA --out data/float8_loss

On two GPUs (data/float8_loss copied there); each variant's JSON is written to OUT_DIR as soon as it ends, so a call
that runs out of time keeps the variants before it, and a variant stopped by ``--variant-timeout`` keeps
the batches it logged:

    python benchmarks/float8_loss.py run --data data/float8_loss --out OUT_DIR --variants bf16 float8

Every variant is ``foundry train yamls/pretrain/mpt-7b.yaml --nproc 2`` (the YAML as shipped: FSDP2,
activation checkpointing, its optimizer and schedule over ``--batches``) on the same data, seed and order,
with a global batch of ``--global-batch`` sequences: ``bf16`` (the YAML), ``bf16_again`` (the same run
repeated: the run-to-run spread that GPU nondeterminism alone gives), ``bf16_seed`` (another seed for the
weights, the data order kept: the spread between two equally good bf16 runs, which stays above zero where
the GPU path is deterministic), ``float8`` (``algorithms.float8={}``, tensorwise scaling and float8
all-gathers) and ``float8_again``. Then, here:

    python benchmarks/float8_loss.py compare OUT1 OUT2 --plot docs/images/float8_loss_mpt7b.png

prints max and mean |loss - bf16| of every variant, whether each float8 run is within each spread (its max
and mean gaps no larger than that bf16 run's), and draws the curves.
``run --smoke`` checks the plumbing on the CPU: a tiny MPT on two gloo ranks, a few batches.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench_utils import (
    REPO_ROOT,
    SHARED_DATA,
    environment,
    foundry_train,
    loss_gaps,
    markdown_table,
    prepare_and_run_parsers,
    train_losses,
)
from peers_rows import SMOKE_FOUNDRY, SMOKE_SETTINGS

REFERENCE = "bf16"
VARIANTS: dict[str, list[str]] = {
    "bf16": [],
    "bf16_again": [],
    "bf16_seed": ["seed=18"],  # the YAML's data shuffle_seed stays variables.global_seed (17)
    "float8": ["algorithms.float8={}"],
    "float8_again": ["algorithms.float8={}"],
}
SPREAD_VARIANTS = ("bf16_again", "bf16_seed")  # bf16 runs as good as the reference: how far they drift from it
SEQ_LEN = 2048
LOG_TAIL_LINES = 30
# ICL files whose rows repeat the same few-shot prefix: text a 300-batch run would see many times over.
REPEATED_TEXT_MARKERS = ("prepended", "8shot", "human_eval-0.")


def corpus_texts(shared_data: Path) -> list[str]:
    """The shared folder's real text, each distinct passage once: the corpora, then every ICL file's strings."""
    texts = [path.read_text(encoding="utf-8") for path in sorted((shared_data / "corpus").rglob("*.txt"))]
    seen: set[str] = set()
    for path in sorted((shared_data / "icl").rglob("*.jsonl")):
        if any(marker in path.name for marker in REPEATED_TEXT_MARKERS):
            continue
        rows = path.read_text(encoding="utf-8").split("\n")  # not splitlines: passages hold U+2028
        for line in filter(str.strip, rows):
            for value in json.loads(line).values():
                strings = value if isinstance(value, list) else [value]
                for text in strings:
                    if isinstance(text, str) and len(text) >= 40 and text not in seen:
                        seen.add(text)
                        texts.append(text)
    return texts


def prepare(out: Path, samples: int, shared_data: Path = SHARED_DATA) -> dict:
    """MDS shards of ``samples`` 2048-token samples of distinct real text, and the tokenizer, under ``out``."""
    from default_path import build_data

    # About 4 characters a token: 5 a token leaves spare samples and keeps the conversion to what is needed.
    text = "\n\n".join(corpus_texts(shared_data))[: samples * SEQ_LEN * 5]
    if not text:
        raise SystemExit(f"no text under {shared_data}/corpus or {shared_data}/icl: pass --shared-data")
    out.mkdir(parents=True, exist_ok=True)
    corpus = out / "corpus.txt"
    corpus.write_text(text, encoding="utf-8")
    tokenizer = shared_data / "tokenizers" / "gpt-neox-20b"
    build_data([str(corpus)], str(tokenizer), samples, out / "mds")
    corpus.unlink()
    import shutil

    shutil.copytree(tokenizer, out / "tokenizer", dirs_exist_ok=True)
    index = json.loads((out / "mds" / "train" / "index.json").read_text())
    manifest = {"train_samples": sum(shard["samples"] for shard in index["shards"]), "characters": len(text)}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


def variant_overrides(name: str, args: argparse.Namespace) -> list[str]:
    """The ``foundry train`` overrides of a variant: data, length, batch, and the variant's own keys."""
    data = Path(args.data).resolve()
    overrides = [
        f"variables.data_local={data / 'mds'}", f"tokenizer.name={data / 'tokenizer'}", "eval_loader=null",
        f"max_duration={args.batches}ba", f"global_train_batch_size={args.global_batch}",
        f"device_train_microbatch_size={args.global_batch // args.nproc}", "console_log_interval=10ba",
        f"run_name={name}", *VARIANTS[name],
    ]  # fmt: skip
    if args.smoke:
        overrides += [*SMOKE_FOUNDRY["mpt"], *SMOKE_SETTINGS, "compile_config=false"]
    return overrides


def run_variant(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Train one variant; its losses (as far as it got), exit code and wall time."""
    run_folder = Path(args.work) / name
    overrides = variant_overrides(name, args)
    started_s = time.perf_counter()
    if not args.shares_machine:
        clear_stale_shared_memory()
    returncode = foundry_train(args.yaml, run_folder, overrides, args.nproc, args.variant_timeout)
    log = (run_folder.parent / f"{name}.log").read_text(errors="replace").splitlines()
    losses = train_losses(run_folder)
    return {
        "variant": name, "yaml": args.yaml, "overrides": overrides, "nproc": args.nproc,
        "returncode": returncode, "timed_out": returncode is None, "wall_s": round(time.perf_counter() - started_s, 1),
        "batches_logged": len(losses), "losses": losses, "log_tail": log[-LOG_TAIL_LINES:],
    }  # fmt: skip


def clear_stale_shared_memory() -> None:
    """Free the shared-memory blocks a variant killed at its timeout left behind, before the next one loads data."""
    try:
        from streaming.base.util import clean_stale_shared_memory
    except ImportError:  # no streaming here: the run itself says how to install it
        return
    clean_stale_shared_memory()


def run(args: argparse.Namespace) -> int:
    if args.smoke and any(name.startswith("float8") for name in args.variants):
        print("float8 needs a GPU with float8 matrix units: --smoke runs the bf16 variants only", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name in args.variants:
        result = {"environment": environment(), **run_variant(name, args)}
        (out / f"float8_loss_{name}.json").write_text(json.dumps(result, indent=2))
        shown = {key: value for key, value in result.items() if key not in ("losses", "log_tail", "overrides")}
        print(shown, flush=True)
        failed += result["returncode"] != 0
    return 1 if failed else 0


def load_variants(folders: list[str]) -> dict[str, dict]:
    """Every ``float8_loss_<variant>.json`` under the folders, by variant (steps back to ints)."""
    variants = {}
    for folder in folders:
        for path in sorted(Path(folder).glob("float8_loss_*.json")):
            result = json.loads(path.read_text())
            result["losses"] = {int(step): loss for step, loss in result["losses"].items()}
            variants[result["variant"]] = result
    return variants


def compare(variants: dict[str, dict]) -> dict[str, Any]:
    """Each variant's gaps to bf16, and for each float8 run whether it is within each bf16 spread run's gaps."""
    if REFERENCE not in variants:
        raise SystemExit(f"no {REFERENCE} variant among {sorted(variants)}: run it first")
    reference = variants[REFERENCE]["losses"]
    rows = []
    for name, result in variants.items():
        curve = result["losses"]
        last = max(curve, default=None)
        rows.append({"variant": name, "batches": len(curve), "first_loss": curve.get(1),
                     "last_loss": curve.get(last), "device": result["environment"]["device"],
                     **(loss_gaps(curve, reference) if name != REFERENCE else {})})  # fmt: skip
    spreads = {row["variant"]: row for row in rows if row["variant"] in SPREAD_VARIANTS and row["common_batches"]}
    verdict: dict[str, Any] = {}
    for row in rows:
        if row["variant"].startswith("float8") and row.get("common_batches"):
            verdict[row["variant"]] = {
                spread: all(row[key] <= gaps[key] for key in ("max_abs_gap", "mean_abs_gap"))
                for spread, gaps in spreads.items()
            }
    return {"rows": rows, "within_bf16_spread": verdict}


def plot(variants: dict[str, dict], path: str, title: str) -> None:
    """Loss curves (top) and each variant's loss minus bf16's (bottom)."""
    from foundry.plotting import figure_class

    reference = variants[REFERENCE]["losses"]
    figure = figure_class()(figsize=(8, 6), layout="constrained")
    top, bottom = figure.subplots(2, 1, sharex=True)
    for name, result in variants.items():
        curve = result["losses"]
        top.plot(list(curve), list(curve.values()), label=name, linewidth=1)
        if name != REFERENCE:
            steps = sorted(set(curve) & set(reference))
            bottom.plot(steps, [curve[step] - reference[step] for step in steps], label=f"{name} - {REFERENCE}")
    for axes in (top, bottom):
        axes.grid(alpha=0.3)
        axes.legend()
    top.set_title(title)
    bottom.set_title(f"difference from {REFERENCE}")
    bottom.set_xlabel("batch")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)


def main() -> int:
    parser, commands, run_parser = prepare_and_run_parsers(
        __doc__, prepared="the MDS data", samples=1300, sample_tokens="2048-token",
        run_help="train the variants (on the GPU machine)",
    )  # fmt: skip
    run_parser.add_argument("--variants", nargs="+", default=["bf16", "float8"], choices=list(VARIANTS))
    run_parser.add_argument("--data", default="data/float8_loss", help="the folder `prepare` wrote")
    run_parser.add_argument("--yaml", default=str(REPO_ROOT / "yamls" / "pretrain" / "mpt-7b.yaml"))
    run_parser.add_argument("--batches", type=int, default=300)
    run_parser.add_argument("--global-batch", type=int, default=2, help="sequences per optimizer step")
    run_parser.add_argument("--nproc", type=int, default=2)
    run_parser.add_argument("--variant-timeout", type=float, default=250.0, help="seconds before a variant stops")
    run_parser.add_argument("--work", default="/tmp/foundry-float8-loss")
    run_parser.add_argument(
        "--shares-machine", action="store_true",
        help="another run streams data on this machine now: leave streaming's shared memory alone (give each run "
        "its own --data copy and --work)",
    )  # fmt: skip
    run_parser.add_argument("--smoke", action="store_true", help="a tiny MPT on the CPU: checks the plumbing")
    run_parser.add_argument("--out", required=True)
    compare_parser = commands.add_parser("compare", help="merge the runs' JSON, print the gaps, draw the curves")
    compare_parser.add_argument("folders", nargs="+", help="the --out folders of the GPU runs")
    compare_parser.add_argument("--plot", default=None, help="PNG of the curves and their differences")
    compare_parser.add_argument("--title", default="MPT-7B on two GPUs: train loss per batch")
    compare_parser.add_argument("--out", default=None, help="where to write the merged float8_loss.json")
    args = parser.parse_args()
    if args.action == "prepare":
        print(prepare(Path(args.out), args.samples, Path(args.shared_data)))
        return 0
    if args.action == "run":
        return run(args)
    variants = load_variants(args.folders)
    result = compare(variants)
    print(markdown_table(result["rows"]))
    print("within the bf16 spread:", result["within_bf16_spread"])
    if args.out:
        merged = {**result, "losses": {name: variant["losses"] for name, variant in variants.items()}}
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "float8_loss.json").write_text(json.dumps(merged, indent=2))
    if args.plot:
        plot(variants, args.plot, args.title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
