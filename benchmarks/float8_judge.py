"""The float8 judge: does float8 train like bf16 does with other seeds? Three seeds each, through ``foundry train``.

The rule, fixed before the runs (docs/PERFORMANCE.md "Float8 judge"): for each model, three bf16 runs with
seeds 17, 18 and 19 and three float8 runs with the same seeds, ``--steps`` (300) steps each, the shipped YAML on
the same MDS data in the same order (only the weights' seed differs; the data's ``shuffle_seed`` stays the
YAML's). Every curve is smoothed alike, a trailing mean over ``SMOOTHING_STEPS`` steps. After the warm-up
(``--warmup-steps``, the YAMLs' 100 learning-rate warm-up batches) float8's seed-mean must lie inside the bf16
seeds' envelope (their smoothed min and max) at every step, and float8's final ``--final-steps`` (50) mean
(of the raw losses, over its seeds) inside the range of the bf16 seeds' own final means. Both hold: float8
passes for that model.

    # here, once: 2,031 samples of 2048 tokens of distinct real text (gpt-neox-20b), with its tokenizer
    python benchmarks/float8_loss.py prepare --shared-data SHARED_DATA --out data/float8_loss --samples 2100
    # on the GPU host (mosaicml-streaming and torchao installed), as many calls as it takes: a finished run is
    # skipped, one cut off by --deadline-s is run again from its start next call
    python benchmarks/float8_judge.py run --models mpt-1b --data data/float8_loss --out OUT --deadline-s 540
    python benchmarks/float8_judge.py run --models llama-8b --data data/float8_loss --out OUT --deadline-s 540
    # here: the verdict (OUT/float8_judge.json, a table) and one plot per model
    python benchmarks/float8_judge.py judge OUT --plot-dir docs/images

``MODELS`` sets each model's YAML, GPUs a run and batch: MPT-1B on one GPU at 6 x 2048 tokens a step (300 steps:
1,800 of the 2,031 samples, none seen twice; about 80 s of steps on an H100-class GPU, plus compile), the
Llama-8B shape on two GPUs at 4 x 2048, every block checkpointed (as its bf16 seeds ran; the YAML ships ``auto``).
Runs go out over ``--gpus`` (default: every visible GPU), one run per free GPU set through ``CUDA_VISIBLE_DEVICES``,
so a 2-GPU host trains two MPT-1B seeds at once; each concurrent slot reads its own copy of the MDS folder
(mosaicml-streaming refuses two live runs on one local directory).
``--recipes`` judges several float8 recipes (each gets its three seeds); ``--control`` adds the rule's control arm,
``bf16-again``: the three bf16 seeds trained once more and judged as a recipe is (bf16 against itself: run to run, the
same seed differs by nondeterministic kernels; an arm that fails shows how tight the rule is). ``--set KEY=VALUE``
adds an override to every run, bf16 and float8 alike (e.g. ``fsdp_config.mixed_precision=DEFAULT`` for fp32
gradient reduction).
A run writes its losses to its run folder's metrics.jsonl as it trains, and ``OUT/<run>.json`` when it ends.
A float8 run that fell back to bf16 (its log's one line: no float8 matrix units or no torchao) counts as failed.
``run --smoke`` checks all of it on the CPU: tiny models, a few steps, float8 falling back to bf16 with its line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import mean
from typing import Any

from bench_utils import EVERY_BLOCK_CHECKPOINTED, REPO_ROOT, environment, foundry_train, markdown_table, train_losses
from peers_rows import SMOKE_FOUNDRY, SMOKE_SETTINGS

SEEDS = (17, 18, 19)  # 17: the YAMLs' global_seed
BF16 = "bf16"
CONTROL = "bf16-again"  # the bf16 seeds trained again, judged as a float8 recipe is
SMOOTHING_STEPS = 10
LOG_TAIL_LINES = 30
# Float8Training's line where float8 cannot run (no float8 matrix units, no torchao): the run trained in bf16.
FELL_BACK = "this run trains in bf16"


@dataclasses.dataclass(frozen=True)
class Model:
    yaml: str
    family: str  # SMOKE_FOUNDRY's key: the tiny widths --smoke trains
    gpus: int
    global_batch: int  # sequences of 2048 tokens a step
    overrides: tuple[str, ...] = ()


MODELS = {
    "mpt-1b": Model("yamls/pretrain/mpt-1b.yaml", "mpt", gpus=1, global_batch=6),
    # weights drawn on each GPU (the same seed on both ranks), not module by module on rank 0's CPU: a minute less;
    # every block checkpointed, as the bf16 seeds ran (runs of one model must differ only in their variant)
    "llama-8b": Model(
        "yamls/pretrain/llama-8b.yaml", "llama", 2, 4, overrides=("model.init_device=cuda", EVERY_BLOCK_CHECKPOINTED)
    ),
}


@dataclasses.dataclass(frozen=True)
class Run:
    model: str
    variant: str  # "bf16" or "float8-<recipe>"
    seed: int

    @property
    def name(self) -> str:
        return f"{self.model}-{self.variant}-seed{self.seed}"


def planned_runs(models: list[str], recipes: list[str], control: bool = False) -> list[Run]:
    """Every run of the judge, the bf16 seeds of a model before its float8 ones (and the control arm's last)."""
    variants = [BF16, *(f"float8-{recipe}" for recipe in recipes), *([CONTROL] if control else [])]
    return [Run(model, variant, seed) for model in models for variant in variants for seed in SEEDS]


def run_overrides(run: Run, data: Path, args: argparse.Namespace) -> list[str]:
    """The ``foundry train`` overrides of a run: the data, its length and batch, its seed and precision."""
    model = MODELS[run.model]
    overrides = [
        f"variables.data_local={data / 'mds'}", f"tokenizer.name={data / 'tokenizer'}", "eval_loader=null",
        f"max_duration={args.steps}ba", f"global_train_batch_size={model.global_batch}",
        f"device_train_microbatch_size={model.global_batch // model.gpus}", "console_log_interval=10ba",
        f"run_name={run.name}", f"seed={run.seed}", *model.overrides, *args.set,
    ]  # fmt: skip
    if is_float8(run.variant):
        overrides.append(f"algorithms.float8={{recipe: {run.variant.removeprefix('float8-')}}}")
    if args.smoke:
        overrides += [*SMOKE_FOUNDRY[model.family], *SMOKE_SETTINGS, "compile_config=false"]
    return overrides


def is_float8(variant: str) -> bool:
    return variant.startswith("float8-")


def gpus_per_run(run: Run, smoke: bool) -> int:
    return 1 if smoke else MODELS[run.model].gpus  # --smoke: one CPU process a run, two runs at once


def finished(run: Run, out: Path, steps: int) -> bool:
    """Whether ``run`` already ended with all its steps logged (a later call skips it)."""
    path = out / f"{run.name}.json"
    if not path.is_file():
        return False
    result = json.loads(path.read_text())
    return result["returncode"] == 0 and len(result["losses"]) >= steps


def slot_data(data: Path, slot: str, work: Path, copies: bool) -> Path:
    """The MDS folder a run on GPU ``slot`` reads: ``data`` itself, or the slot's own copy when runs overlap."""
    if not copies:
        return data
    copy = work / f"data-gpu{slot}"
    if not (copy / "mds" / "train" / "index.json").is_file():
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(data, copy)
    return copy


def train_one(run: Run, gpus: list[str], data: Path, args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    """Train ``run`` on ``gpus`` (a fresh run folder); its losses, exit code and wall time."""
    run_folder = Path(args.work) / run.name
    shutil.rmtree(run_folder, ignore_errors=True)
    (run_folder.parent / f"{run.name}.log").unlink(missing_ok=True)
    overrides = run_overrides(run, data, args)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "" if args.smoke else ",".join(gpus)}
    started_s = time.perf_counter()
    timeout_s = max(1.0, deadline - time.monotonic())
    returncode = foundry_train(REPO_ROOT / MODELS[run.model].yaml, run_folder, overrides, len(gpus), timeout_s, env)
    log = (run_folder.parent / f"{run.name}.log").read_text(errors="replace").splitlines()
    if is_float8(run.variant) and not args.smoke and any(FELL_BACK in line for line in log):
        returncode = "float8 fell back to bf16"  # not 0: never finished, never judged (bf16 against bf16 passes)
    return {
        "run": run.name, "model": run.model, "variant": run.variant, "seed": run.seed, "gpus": gpus,
        "overrides": overrides, "returncode": returncode, "wall_s": round(time.perf_counter() - started_s, 1),
        "losses": train_losses(run_folder), "log_tail": log[-LOG_TAIL_LINES:],
    }  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Train every planned run not yet finished, one per free GPU set, until ``--deadline-s``."""
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    data = Path(args.data).resolve() if args.data else smoke_data(work)
    check_samples(data, args)
    planned = planned_runs(args.models, args.recipes, args.control)
    pending = [run for run in planned if not finished(run, out, args.steps)]
    slots = args.gpus or (["cpu0", "cpu1"] if args.smoke else visible_gpus())
    for run_ in pending:
        if gpus_per_run(run_, args.smoke) > len(slots):
            raise SystemExit(f"{run_.model} takes {MODELS[run_.model].gpus} GPUs a run; --gpus gives {slots}")
    deadline = time.monotonic() + args.deadline_s
    free: queue.Queue[str] = queue.Queue()
    for slot in slots:
        free.put(slot)
    taking = threading.Lock()  # one run takes its GPUs at a time: two 2-GPU runs never hold one GPU each
    overlapping = len(slots) > 1 and any(gpus_per_run(run_, args.smoke) < len(slots) for run_ in pending)
    failed = []

    def launch(run_: Run) -> None:
        with taking:
            gpus = [free.get() for _ in range(gpus_per_run(run_, args.smoke))]
        try:
            if deadline - time.monotonic() < args.min_start_s:
                print(
                    f"{run_.name}: not started, {args.min_start_s:.0f} s or less left before --deadline-s", flush=True
                )
                return
            result = {
                "environment": environment(),
                **train_one(run_, gpus, slot_data(data, gpus[0], work, overlapping), args, deadline),
            }
            (out / f"{run_.name}.json").write_text(json.dumps(result, indent=2))
            print({key: result[key] for key in ("run", "gpus", "returncode", "wall_s")}
                  | {"steps_logged": len(result["losses"])}, flush=True)  # fmt: skip
            if result["returncode"] != 0:
                failed.append(run_.name)
        finally:
            for gpu in gpus:
                free.put(gpu)

    with ThreadPoolExecutor(max_workers=len(slots)) as pool:
        list(pool.map(launch, pending))
    left = [run_.name for run_ in planned if not finished(run_, out, args.steps)]
    print(f"finished: {len(planned) - len(left)}; still to run: {left}", flush=True)
    return 1 if failed else 0


def check_samples(data: Path, args: argparse.Namespace) -> None:
    """Refuse data too short for every run to see each sample at most once (a second epoch would lower the loss)."""
    index = json.loads((data / "mds" / "train" / "index.json").read_text())
    held = sum(shard["samples"] for shard in index["shards"])
    needed = max(args.steps * MODELS[model].global_batch for model in args.models)
    if held < needed and not args.smoke:
        raise SystemExit(f"{data}/mds holds {held} train samples and a run reads {needed}: prepare more (--samples)")


def visible_gpus() -> list[str]:
    import torch

    count = torch.cuda.device_count()
    if not count:
        raise SystemExit("no GPU visible: run on the GPU host, or pass --smoke")
    return [str(index) for index in range(count)]


def smoke_data(work: Path) -> Path:
    """A few MDS samples of the shared real text, for ``--smoke`` (``float8_loss.py prepare``'s data, smaller)."""
    from float8_loss import prepare

    data = work / "smoke-data"
    if not (data / "mds" / "train" / "index.json").is_file():
        prepare(data, samples=80)
    return data


def smoothed(curve: dict[int, float], window: int = SMOOTHING_STEPS) -> dict[int, float]:
    """Each step's trailing mean over the last ``window`` logged steps (fewer at the start)."""
    steps = sorted(curve)
    return {step: mean(curve[earlier] for earlier in steps[max(0, at - window + 1) : at + 1]) for at, step in
            enumerate(steps)}  # fmt: skip


def judge_variant(
    bf16: list[dict[int, float]], float8: list[dict[int, float]], warmup_steps: int, final_steps: int
) -> dict[str, Any]:
    """The rule for one float8 variant against the bf16 seeds (see the module docstring)."""
    smooth_bf16 = [smoothed(curve) for curve in bf16]
    smooth_float8 = [smoothed(curve) for curve in float8]
    common = set.intersection(*(set(curve) for curve in bf16 + float8))
    steps = sorted(step for step in common if step > warmup_steps)
    outside = []
    for step in steps:
        low, high = min(c[step] for c in smooth_bf16), max(c[step] for c in smooth_bf16)
        value = mean(c[step] for c in smooth_float8)
        if not low <= value <= high:
            outside.append({"step": step, "float8": value, "bf16_min": low, "bf16_max": high})
    final = steps[-final_steps:]
    bf16_finals = [mean(curve[step] for step in final) for curve in bf16] if final else []
    float8_final = mean(mean(curve[step] for step in final) for curve in float8) if final else None
    final_inside = bool(final) and min(bf16_finals) <= float8_final <= max(bf16_finals)
    return {
        "judged_steps": len(steps), "steps_outside_envelope": len(outside),
        "worst_outside": max(outside, key=lambda row: max(row["bf16_min"] - row["float8"],
                                                          row["float8"] - row["bf16_max"]), default=None),
        "final_steps": len(final), "bf16_final_means": bf16_finals, "float8_final_mean": float8_final,
        "inside_envelope": bool(steps) and not outside, "final_mean_inside": final_inside,
        "passes": bool(steps) and not outside and final_inside,
    }  # fmt: skip


def load_runs(folders: list[str]) -> dict[tuple[str, str], dict[int, dict[int, float]]]:
    """Every finished run's losses under the folders, by (model, variant), then seed (steps back to ints)."""
    runs: dict[tuple[str, str], dict[int, dict[int, float]]] = {}
    for folder in folders:
        for path in sorted(Path(folder).glob("*-seed*.json")):
            result = json.loads(path.read_text())
            if result["returncode"] == 0:
                losses = {int(step): loss for step, loss in result["losses"].items()}
                runs.setdefault((result["model"], result["variant"]), {})[result["seed"]] = losses
    return runs


def judge(runs: dict[tuple[str, str], dict[int, dict[int, float]]], warmup_steps: int, final_steps: int) -> list:
    """One verdict row per (model, float8 variant) whose three seeds and the bf16 three have all finished."""
    rows = []
    for (model, variant), seeds in sorted(runs.items()):
        bf16 = runs.get((model, BF16), {})
        if variant == BF16 or set(seeds) != set(SEEDS) or set(bf16) != set(SEEDS):
            continue
        verdict = judge_variant([bf16[s] for s in SEEDS], [seeds[s] for s in SEEDS], warmup_steps, final_steps)
        rows.append({"model": model, "variant": variant, **verdict})
    return rows


def plot(runs: dict, model: str, variant: str, warmup_steps: int, path: Path) -> None:
    """The bf16 seeds' smoothed envelope, their mean and float8's (top); each mean minus bf16's mean (bottom)."""
    from foundry.plotting import figure_class

    curves = {name: [smoothed(runs[(model, name)][seed]) for seed in SEEDS] for name in (BF16, variant)}
    steps = sorted(set.intersection(*(set(curve) for group in curves.values() for curve in group)))
    means = {name: [mean(c[step] for c in group) for step in steps] for name, group in curves.items()}
    low = [min(c[step] for c in curves[BF16]) for step in steps]
    high = [max(c[step] for c in curves[BF16]) for step in steps]
    figure = figure_class()(figsize=(8, 6), layout="constrained")
    top, bottom = figure.subplots(2, 1, sharex=True)
    top.fill_between(steps, low, high, alpha=0.3, label=f"bf16 seeds {SEEDS}: min-max")
    bottom.fill_between(steps, [a - b for a, b in zip(low, means[BF16])], [a - b for a, b in zip(high, means[BF16])],
                        alpha=0.3, label="bf16 envelope")  # fmt: skip
    for name, values in means.items():
        top.plot(steps, values, label=f"{name}: mean of 3 seeds", linewidth=1)
        bottom.plot(steps, [a - b for a, b in zip(values, means[BF16])], label=f"{name} - bf16 mean", linewidth=1)
    for axes in (top, bottom):
        axes.axvline(warmup_steps, color="grey", linestyle=":", linewidth=1)
        axes.grid(alpha=0.3)
        axes.legend()
    top.set_title(f"{model}: train loss, trailing mean of {SMOOTHING_STEPS} steps")
    bottom.set_title("difference from the bf16 seeds' mean (judged right of the dotted line)")
    bottom.set_xlabel("step")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="action", required=True)
    run_parser = commands.add_parser("run", help="train the runs not yet finished (on the GPU host)")
    run_parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    run_parser.add_argument("--recipes", nargs="+", default=["rowwise"], help="algorithms.float8.recipe values")
    run_parser.add_argument("--control", action="store_true", help=f"the {CONTROL} arm too: bf16 judged as float8 is")
    run_parser.add_argument("--data", default=None, help="the folder `float8_loss.py prepare` wrote")
    run_parser.add_argument("--steps", type=int, default=300)
    run_parser.add_argument("--set", nargs="*", default=[], help="KEY=VALUE overrides added to every run")
    run_parser.add_argument("--gpus", nargs="+", default=None, help="GPU indices to spread runs over (default: all)")
    run_parser.add_argument("--deadline-s", type=float, default=540.0, help="runs still going then are stopped")
    run_parser.add_argument("--min-start-s", type=float, default=150.0, help="no run starts with less time left")
    run_parser.add_argument("--work", default="/tmp/foundry-float8-judge")
    run_parser.add_argument("--smoke", action="store_true", help="tiny models on the CPU: checks the plumbing")
    run_parser.add_argument("--out", required=True)
    judge_parser = commands.add_parser("judge", help="the verdict and plots from the runs' JSON")
    judge_parser.add_argument("folders", nargs="+", help="the --out folders of the run calls")
    judge_parser.add_argument("--warmup-steps", type=int, default=100, help="steps before the envelope applies")
    judge_parser.add_argument("--final-steps", type=int, default=50)
    judge_parser.add_argument("--plot-dir", default=None, help="float8_judge_<model>_<variant>.png go here")
    judge_parser.add_argument("--out", default=None, help="where to write float8_judge.json")
    args = parser.parse_args()
    if args.action == "run":
        return run(args)
    runs = load_runs(args.folders)
    rows = judge(runs, args.warmup_steps, args.final_steps)
    print(markdown_table([{k: v for k, v in row.items() if k != "worst_outside"} for row in rows]))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "float8_judge.json").write_text(json.dumps({"rule": __doc__.split("\n\n")[1],
                                                                      "verdicts": rows}, indent=2))  # fmt: skip
    for row in rows if args.plot_dir else []:
        name = f"float8_judge_{row['model']}_{row['variant']}.png"
        plot(runs, row["model"], row["variant"], args.warmup_steps, Path(args.plot_dir) / name)
    return 0 if rows and all(row["passes"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
