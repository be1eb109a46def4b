"""What every benchmark script shares: a model from a train YAML, random batches, CUDA timing."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from foundry.config import load_train_config
from foundry.models.build import build_model

REPO_ROOT = Path(__file__).resolve().parent.parent
# The shared data folder (docs: shared/data/README.md): inside the checkout on a GPU machine, beside it here.
SHARED_DATA = next(
    (path for path in (REPO_ROOT / "shared" / "data", REPO_ROOT.parent / "shared" / "data") if path.exists()),
    REPO_ROOT / "shared" / "data",
)
# llama-8b.yaml ships activation_checkpointing: auto (blocks by the card's memory): rows measured with every block
# recomputed, or set against a peer that recomputes every block, pin it.
EVERY_BLOCK_CHECKPOINTED = "fsdp_config.activation_checkpointing=true"


def model_from_yaml(config_path: str | Path, overrides: Sequence[str] = ()) -> tuple[nn.Module, int]:
    """The YAML's model (its ``model:`` section with ``overrides``) and its ``max_seq_len``."""
    cfg, _ = load_train_config(config_path, overrides)
    return build_model(cfg.model), cfg.max_seq_len


def yaml_trainer(
    cfg: Any, batches: list[dict], microbatch: int, callbacks: Sequence[Any] = (), **overrides: Any
) -> Any:
    """A Trainer as ``foundry train`` builds it from ``cfg`` (its optimizer, schedule, algorithms with the
    compile_config default, fsdp_config, parallelism and precision), on in-memory ``batches`` on the GPU; ``overrides``
    replace Trainer arguments (e.g. ``precision``)."""
    import tempfile

    from foundry import registry
    from foundry.registry import build_components, component_factory
    from foundry.trainer import Trainer

    scheduler = component_factory(registry.schedulers, cfg.scheduler, "scheduler")() if cfg.scheduler else None
    arguments = dict(
        model=build_model(cfg.model),
        train_dataloader=batches,
        max_duration=f"{len(batches)}ba",
        optimizers=component_factory(registry.optimizers, cfg.optimizer, "optimizer", supplied=("params",)),
        schedulers=scheduler,
        algorithms=build_components(registry.algorithms, cfg.algorithms, "algorithms"),
        compile_config=cfg.compile_config,
        fsdp_config=cfg.fsdp_config,
        parallelism=cfg.parallelism,
        callbacks=list(callbacks),
        precision=cfg.precision,
        device="cuda",
        device_train_microbatch_size=microbatch,
        fuse_weight_grad_accumulation=cfg.fuse_weight_grad_accumulation,
        seed=cfg.seed,
        log_to_console=False,
        console_log_interval=f"{len(batches) + 1}ba",
        run_folder=tempfile.mkdtemp(prefix="foundry-bench-"),
    )
    return Trainer(**{**arguments, **overrides})


def random_batch(batch_size: int, seq_len: int, vocab_size: int, device: torch.device) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, vocab_size, (batch_size, seq_len), device=device)}


def cuda_time_ms(step: Callable[[], Any], warmup: int, iters: int) -> list[float]:
    """Milliseconds of each of ``iters`` calls of ``step`` (after ``warmup`` calls), from CUDA events."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends):
        start.record()
        step()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in zip(starts, ends)]


def environment() -> dict[str, str]:
    """Device, software and date, recorded next to every result."""
    return {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
    }


def run_on_ranks(script: str, nproc: int, worker_args: list[str], **extra_env: str) -> int:
    """``script --worker worker_args`` as a torchrun of ``nproc`` ranks on this host, with the repository and
    benchmarks/ importable; its exit code."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    command += [script, "--worker", *worker_args]
    here = Path(__file__).resolve().parent
    pythonpath = os.pathsep.join([str(here.parent), str(here), os.environ.get("PYTHONPATH", "")])
    return subprocess.run(command, env={**os.environ, "PYTHONPATH": pythonpath, **extra_env}).returncode


def print_report(out_dir: str | Path | None, name: str) -> None:
    """The markdown table a worker wrote to ``out_dir/name.md`` (if any), then the environment, for the log."""
    if out_dir and Path(out_dir, f"{name}.md").exists():
        print(Path(out_dir, f"{name}.md").read_text())
    print(json.dumps(environment()))


def write_results(out_dir: str | Path | None, name: str, rows: list[dict[str, Any]]) -> None:
    """Print rows as a markdown table and, with ``out_dir``, save them as JSON."""
    print(markdown_table(rows))
    save_json(out_dir, name, rows)


def save_json(out_dir: str | Path | None, name: str, rows: list[dict[str, Any]]) -> None:
    """With ``out_dir``, save rows and the environment as ``<out_dir>/<name>.json``."""
    if out_dir:
        path = Path(out_dir) / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"environment": environment(), "rows": rows}, indent=2))


def markdown_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(no rows)"
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(column, "")) for column in columns) + " |")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


TRAIN_LOSS = "loss/train/total"


def foundry_train(
    yaml: str | Path,
    run_folder: Path,
    overrides: Sequence[str],
    nproc: int = 1,
    timeout_s: float | None = None,
    env: dict[str, str] | None = None,
) -> int | None:
    """``foundry train yaml overrides [--nproc N]`` as a user runs it, its output appended to ``<run_folder>.log``.

    ``env``: the process's environment (default: this one's), e.g. with ``CUDA_VISIBLE_DEVICES`` naming its GPUs.

    Returns the exit code, or None when ``timeout_s`` passed: then the launcher and its ranks (one process
    group) are killed, so no rank keeps holding its GPU for the next run.
    """
    import os
    import signal
    import subprocess
    import sys

    command = [sys.executable, "-m", "foundry.cli", "train", str(yaml), f"run_folder={run_folder}", *overrides]
    command += ["--nproc", str(nproc)] if nproc > 1 else []
    run_folder.parent.mkdir(parents=True, exist_ok=True)
    with (run_folder.parent / f"{run_folder.name}.log").open("a") as log:
        process = subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            return None


def train_losses(run_folder: Path) -> dict[int, float]:
    """The run's train loss by batch, from its metrics.jsonl (what a killed run wrote so far; empty if none)."""
    from foundry.plotting import metrics_path, read_run

    return dict(read_run(run_folder).get(TRAIN_LOSS, [])) if metrics_path(run_folder).is_file() else {}


def latest_metrics(run_folder: Path) -> dict[str, Any]:
    """Each metric's latest value in the run's metrics.jsonl (a killed run's: what it wrote so far)."""
    lines = (run_folder / "metrics.jsonl").read_text(errors="replace").splitlines()
    if lines and not lines[-1].rstrip().endswith("}"):  # a run killed mid-write leaves its last line cut short
        lines.pop()
    return {key: value for line in lines for key, value in json.loads(line).items()}


def loss_gaps(curve: dict[int, float], reference: dict[int, float]) -> dict[str, float | int | None]:
    """max and mean |curve - reference| over the batches both have, and over the last 50 of them."""
    steps = sorted(set(curve) & set(reference))
    gaps = [abs(curve[step] - reference[step]) for step in steps]
    last = gaps[-50:]
    return {
        "common_batches": len(steps),
        "max_abs_gap": max(gaps, default=None),
        "mean_abs_gap": sum(gaps) / len(gaps) if gaps else None,
        "mean_abs_gap_last_50": sum(last) / len(last) if last else None,
    }


def plot_against_reference(
    curves: dict[str, dict[int, float]],
    reference: str,
    path: str | Path,
    titles: tuple[str, str],
    marks: Sequence[int] = (),
) -> None:
    """Loss curves by step (top) and each one minus ``reference``'s (bottom), one colour a run; dotted
    vertical lines at the steps in ``marks``. Needs matplotlib (``foundry.plotting.figure_class``)."""
    from foundry.plotting import figure_class

    figure = figure_class()(figsize=(8, 6), layout="constrained")
    top, bottom = figure.subplots(2, 1, sharex=True)
    for name, curve in curves.items():
        (line,) = top.plot(list(curve), list(curve.values()), label=name)
        if name != reference:
            steps = [step for step in curve if step in curves[reference]]
            differences = [curve[step] - curves[reference][step] for step in steps]
            bottom.plot(steps, differences, color=line.get_color(), label=f"{name} - {reference}")
    for ax in (top, bottom):
        for step in marks:
            ax.axvline(step, color="grey", linestyle=":", linewidth=1)
        ax.grid(alpha=0.3)
        ax.legend()
    top.set_title(titles[0])
    bottom.set_title(titles[1])
    bottom.set_xlabel("step")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)


def prepare_and_run_parsers(
    description: str, *, prepared: str, samples: int, sample_tokens: str, run_help: str
) -> tuple[argparse.ArgumentParser, Any, argparse.ArgumentParser]:
    """(parser, its subcommands, ``run``'s parser) of a benchmark whose ``prepare --out --samples --shared-data``
    writes ``prepared`` here before the GPU call and whose ``run`` (``run_help``) trains on the GPU machine."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="action", required=True)
    prepare_parser = commands.add_parser("prepare", help=f"{prepared} (here, before the GPU call)")
    prepare_parser.add_argument("--out", required=True)
    prepare_parser.add_argument(
        "--samples", type=int, default=samples, help=f"{sample_tokens} train samples (at least)"
    )
    prepare_parser.add_argument("--shared-data", default=str(SHARED_DATA), help="the shared data folder")
    return parser, commands, commands.add_parser("run", help=run_help)
