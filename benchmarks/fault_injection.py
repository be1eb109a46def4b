"""Kill training runs with SIGKILL at random instants and inside every step of a save, resume them, check the end.

Each trial starts ``foundry train`` (the quickstart YAML at test size: 40 batches, a checkpoint every 4,
the newest 2 kept, ``autoresume: true``, ``save_overwrite: false``), kills it once, then relaunches the
same command until it exits 0. It passes when the run finished, its final checkpoint's tensors (model
and optimizer) are bit-identical to an uninterrupted run's, no ``.tmp-*`` or damaged folder is left, and
metrics.jsonl holds each batch's train loss exactly once. Kills land either at a named instant of a save
(``foundry.checkpoint.kill_points``, through ``FOUNDRY_KILL_AT``, on one rank) or at a random time in
the training part of the run (on a random rank). Runs use 1 and 2 ranks (gloo on CPU, through ``foundry
train --nproc 2``), with and without ``save_async``. The damaged-file matrix then flips a byte in,
truncates or deletes each file of the newest checkpoint and checks that autoresume falls back to the one
before (and finishes bit-identically), while ``foundry convert consolidate`` and ``to-hf`` stop with a
message naming the file::

    python benchmarks/fault_injection.py --random-trials 6 --out benchmarks/results
    python benchmarks/fault_injection.py --ranks 1 --random-trials 1 --no-matrix   # a quick look

``run_trial`` takes any command that trains with ``autoresume`` into a save folder; the test suite
runs a few trials of a small Trainer script through it (tests/checkpoint/test_fault_injection.py).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
KILL_POINTS = (
    "save.started",
    "save.metadata_written",
    "save.tensors_written",
    "save.hashed",
    "publish.manifest_written",
    "publish.renamed",
    "publish.latest_written",
    "prune.renamed",
)
RANK_ZERO_POINTS = ("publish.", "prune.")  # only rank 0 publishes and prunes
STARTED_MARKER = "foundry: run '"  # printed by rank 0 just before fit() starts
LAUNCH_TIMEOUT_S = 300
SLOW_LAUNCH_S = 120  # a launch this long (they take well under a minute) has its output kept
MISSED_KILL_RETRIES = 3  # redraws of a random instant that came after the run's end


@dataclass
class Kill:
    """Where a trial's one SIGKILL lands: at ``point``'s ``visit``-th visit, or ``after_s`` after the start marker."""

    rank: int = 0
    point: str | None = None
    visit: int = 1
    after_s: float | None = None

    def describe(self) -> str:
        where = f"{self.point}@{self.visit}" if self.point else f"random t+{self.after_s:.2f}s"
        return f"{where} on rank {self.rank}"


@dataclass
class Run:
    """A command that trains with autoresume into ``save_folder`` (run again, it resumes)."""

    command: list[str]
    save_folder: Path
    env: dict[str, str] = field(default_factory=dict)
    num_to_keep: int | None = None  # the run's save_num_checkpoints_to_keep, checked at its end
    metrics: Path | None = None  # its metrics.jsonl, checked at its end to hold each batch's train loss once
    num_batches: int = 0


@dataclass
class TrialResult:
    config: str
    kill: str
    killed: bool  # the first launch died (it did not finish on its own)
    launches: int
    finished: bool
    identical: bool
    leftovers: list[str]
    seconds: float
    metrics_problems: list[str] = field(default_factory=list)  # batches whose train-loss line is lost or repeated
    launch_seconds: list[float] = field(default_factory=list)  # each launch, start to exit
    slow_launch_output: str = ""  # the output of a launch that took over SLOW_LAUNCH_S, to see why
    error: str = ""

    @property
    def passed(self) -> bool:
        return self.killed and self.finished and self.identical and not self.leftovers and not self.metrics_problems


# --------------------------------------------------------------------------------------- launching
def launch(run: Run, kill: Kill | None = None, timeout_s: float = LAUNCH_TIMEOUT_S) -> tuple[int, str, float]:
    """Run ``run.command`` once (killed as ``kill`` says); (exit code, output tail, seconds after the start marker)."""
    # CPU ranks (gloo) on any machine: a GPU machine with fewer GPUs than ranks could not place them.
    # Unbuffered output: the start marker arrives when it is printed, and random kills are timed from it.
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONUNBUFFERED": "1",
        **run.env,
    }
    env.pop("FOUNDRY_KILL_AT", None)
    if kill is not None and kill.point:
        env["FOUNDRY_KILL_AT"] = f"{kill.point}@{kill.visit}:rank{kill.rank}"
    process = subprocess.Popen(
        run.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True, start_new_session=True
    )
    lines: list[str] = []
    started = threading.Event()
    started_at: list[float] = []

    def read_output() -> None:
        for line in process.stdout:
            lines.append(line)
            if STARTED_MARKER in line and not started.is_set():
                started_at.append(time.perf_counter())
                started.set()

    reader = threading.Thread(target=read_output, daemon=True)
    reader.start()
    if kill is not None and kill.after_s is not None and started.wait(timeout_s):
        time.sleep(kill.after_s)
        _kill_rank(process, kill.rank)
    try:
        exit_code = process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        exit_code = process.wait()
        lines.append(f"[fault_injection: no exit after {timeout_s} s; killed]\n")
    reader.join(timeout=10)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # ranks a dead launcher left behind
    after_start_s = time.perf_counter() - started_at[0] if started_at else 0.0
    return exit_code, "".join(lines[-40:]), after_start_s


def _kill_rank(process: subprocess.Popen, rank: int) -> None:
    """SIGKILL the process of ``rank``: the launched process itself, or the torchrun worker with that RANK."""
    import psutil

    target = process.pid
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(process.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if child.environ().get("RANK") == str(rank) and "foundry.cli" in " ".join(child.cmdline()):
                    target = child.pid
    with contextlib.suppress(ProcessLookupError):
        os.kill(target, signal.SIGKILL)


# ----------------------------------------------------------------------------------------- checking
def final_tensors(save_folder: Path) -> dict[str, Any]:
    """Model and optimizer tensors of the newest checkpoint (verified against its checksums first)."""
    from foundry.checkpoint.consolidate import read_checkpoint_tensors

    return read_checkpoint_tensors(save_folder)


def identical(got: Any, want: Any) -> bool:
    """Nested dicts with the same keys and bit-identical tensors."""
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(identical(got[k], want[k]) for k in want)
    if isinstance(want, torch.Tensor):
        return isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want)
    return got == want


def leftovers(save_folder: Path, num_to_keep: int | None = None) -> list[str]:
    """What an interrupted save or publish left behind: temporary or set-aside folders, a ``latest`` that
    names another checkpoint than the newest, more checkpoints than ``num_to_keep``."""
    from foundry.checkpoint.find import checkpoint_folders

    if not save_folder.is_dir():
        return []
    found = sorted(path.name for path in save_folder.iterdir() if path.name.startswith(".") or ".damaged" in path.name)
    published = checkpoint_folders(save_folder)
    pointer = save_folder / "latest"
    named = pointer.read_text().strip() if pointer.is_file() else "nothing"
    if published and named != published[-1].name:
        found.append(f"latest names {named}, not {published[-1].name}")
    if num_to_keep is not None and len(published) > num_to_keep:
        found.append(f"{len(published)} checkpoints kept, not {num_to_keep}")
    return found


def metrics_problems(run: Run) -> list[str]:
    """The batches of ``run`` whose train-loss line in metrics.jsonl is missing or appears more than once."""
    import json
    from collections import Counter

    if run.metrics is None:
        return []
    if not run.metrics.is_file():
        return [f"no {run.metrics}"]
    rows = [json.loads(line) for line in run.metrics.read_text().splitlines() if line.strip()]
    steps = Counter(row["step"] for row in rows if "loss/train/total" in row)
    lost = [f"batch {step} lost" for step in range(1, run.num_batches + 1) if steps[step] == 0]
    return lost + [f"batch {step} logged {count} times" for step, count in sorted(steps.items()) if count > 1]


def run_trial(config: str, run: Run, kill: Kill, reference: dict[str, Any], max_launches: int = 4) -> TrialResult:
    """Launch ``run`` killed as ``kill`` says, relaunch it until it finishes, and compare with ``reference``."""
    start = time.perf_counter()
    launch_seconds: list[float] = []
    outputs: list[str] = []

    def timed_launch(kill: Kill | None = None) -> tuple[int, float]:
        launch_start = time.perf_counter()
        exit_code, output, after_start_s = launch(run, kill)
        launch_seconds.append(round(time.perf_counter() - launch_start, 1))
        outputs.append(output)
        return exit_code, after_start_s

    exit_code, after_start_s = timed_launch(kill)
    for _ in range(MISSED_KILL_RETRIES):  # the run ended before the random instant (a busier machine): redraw it
        if exit_code != 0 or kill.after_s is None:
            break
        shutil.rmtree(run.save_folder, ignore_errors=True)
        kill = replace(kill, after_s=random.Random(kill.after_s).uniform(0.0, 0.9 * after_start_s))
        exit_code, after_start_s = timed_launch(kill)
    killed = exit_code != 0
    while exit_code != 0 and len(launch_seconds) < max_launches + MISSED_KILL_RETRIES:
        exit_code, _ = timed_launch()
    finished = exit_code == 0
    same, error = False, ""
    if finished:
        try:
            same = identical(final_tensors(run.save_folder), reference)
        except Exception as exc:  # a damaged final checkpoint is a failed trial, not a crash of the harness
            error = f"{type(exc).__name__}: {exc}"
    if not finished:
        error = outputs[-1]
    elif not same:
        error = error or "the final checkpoint differs from the uninterrupted run's"
    slow = [output for output, seconds in zip(outputs, launch_seconds) if seconds > SLOW_LAUNCH_S]
    return TrialResult(
        config=config,
        kill=kill.describe(),
        killed=killed,
        launches=len(launch_seconds),
        finished=finished,
        identical=same,
        leftovers=leftovers(run.save_folder, run.num_to_keep),
        metrics_problems=metrics_problems(run) if finished else [],
        seconds=round(time.perf_counter() - start, 1),
        launch_seconds=launch_seconds,
        slow_launch_output=slow[0][-3000:] if slow else "",
        error=error[-2000:],
    )


# ------------------------------------------------------------------------------- the quickstart runs
# The quickstart at test size: a 40-batch run that saves every 4 batches and keeps the newest 2.
RUN_SETTINGS = {
    "model.d_model": 64,
    "model.n_layers": 2,
    "model.max_seq_len": 32,
    "model.vocab_size": 512,
    "variables.max_seq_len": 32,
    "global_train_batch_size": 8,
    "device_train_microbatch_size": 4,
    "device_eval_batch_size": 16,
    "eval_first": "false",
    "eval_interval": "20ba",
    "callbacks": "{}",
    "console_log_interval": "10ba",
    "max_duration": "40ba",
    "save_interval": "4ba",
    "save_num_checkpoints_to_keep": 2,
    "save_overwrite": "false",
    "autoresume": "true",
    "python_log_level": "warning",
    "device": "cpu",
}
NUM_SAVES, NUM_PRUNES = 10, 8  # 40 batches, a save every 4, the newest 2 kept


def quickstart_run(folder: Path, data: Path, ranks: int, save_async: bool) -> Run:
    launcher = ["--nproc", str(ranks)] if ranks > 1 else []
    command = [sys.executable, "-m", "foundry.cli", "train", *launcher, str(REPO_ROOT / "yamls" / "quickstart.yaml")]
    command += [f"variables.data_local={data}", f"run_folder={folder / 'run'}", f"save_folder={folder / 'ckpt'}"]
    command += [f"{key}={value}" for key, value in {**RUN_SETTINGS, "save_async": str(save_async).lower()}.items()]
    return Run(
        command=command,
        save_folder=folder / "ckpt",
        num_to_keep=RUN_SETTINGS["save_num_checkpoints_to_keep"],
        metrics=folder / "run" / "metrics.jsonl",
        num_batches=40,
    )


def planned_kills(ranks: int, random_trials: int, training_s: float, rng: random.Random) -> list[Kill]:
    """One kill at each save step (a random save of the run) and ``random_trials`` at random instants."""
    kills = []
    for point in KILL_POINTS:
        rank = 0 if point.startswith(RANK_ZERO_POINTS) else rng.randrange(ranks)
        visits = NUM_PRUNES if point.startswith("prune.") else NUM_SAVES
        kills.append(Kill(rank=rank, point=point, visit=rng.randint(1, visits)))
    # Up to 90% of the uninterrupted run's time after the start marker, so that the kill lands before it ends.
    kills += [Kill(rank=rng.randrange(ranks), after_s=rng.uniform(0.0, 0.9 * training_s)) for _ in range(random_trials)]
    return kills


def damaged_file_matrix(source: Run, data: Path, work: Path, reference: dict[str, Any]) -> list[dict[str, Any]]:
    """Damage each file of the newest checkpoint of ``source`` three ways; what resume, consolidate and to-hf do."""
    from foundry.checkpoint import latest_checkpoint
    from foundry.cli import main

    newest = latest_checkpoint(source.save_folder)
    rows = []
    for file in sorted(path.name for path in newest.iterdir()):
        for damage in ("flip a byte", "truncate", "delete"):
            case = work / f"{file.strip('._')}-{damage.split()[0]}"
            shutil.copytree(source.save_folder.parent, case)
            run = quickstart_run(case, data, ranks=1, save_async=False)
            _damage(run.save_folder / newest.name / file, damage)
            readers = {}
            for name, command in (
                ("consolidate", ["convert", "consolidate", str(run.save_folder), str(case / "model.safetensors")]),
                ("to-hf", ["convert", "to-hf", str(run.save_folder / newest.name), str(case / "hf")]),
            ):
                stderr = io.StringIO()
                with contextlib.redirect_stderr(stderr):
                    exit_code = main(command)
                readers[name] = exit_code == 2 and file in stderr.getvalue()
            exit_code, output, _ = launch(run)
            resumed = exit_code == 0 and identical(final_tensors(run.save_folder), reference)
            rows.append(
                {
                    "file": file,
                    "damage": damage,
                    "autoresume falls back and finishes identically": resumed,
                    "warning names the file": file in output,
                    "consolidate: error naming the file": readers["consolidate"],
                    "to-hf: error naming the file": readers["to-hf"],
                }
            )
            shutil.rmtree(case)
    return rows


def _damage(path: Path, damage: str) -> None:
    if damage == "delete":
        path.unlink()
        return
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    else:
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))


# ------------------------------------------------------------------------------------------- main
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="world sizes to run (default: 1 2)")
    parser.add_argument("--random-trials", type=int, default=6, help="random-instant kills per configuration")
    parser.add_argument("--no-matrix", dest="matrix", action="store_false", help="skip the damaged-file matrix")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--out", type=Path, default=None, help="write <out>/<date>_cpu_fault_injection.json")
    args = parser.parse_args()
    work = args.work or Path(__import__("tempfile").mkdtemp(prefix="fault_injection-"))
    rng = random.Random(args.seed)
    data = _prepare_data(work / "data")
    trials: list[TrialResult] = []
    references = {}
    for ranks in args.ranks:
        reference_run = quickstart_run(work / f"reference-{ranks}", data, ranks, save_async=False)
        exit_code, output, training_s = launch(reference_run)
        if exit_code != 0:
            raise SystemExit(f"the uninterrupted {ranks}-rank run failed:\n{output}")
        references[ranks] = reference_run
        reference = final_tensors(reference_run.save_folder)
        for save_async in (False, True):
            mode = "async" if save_async else "sync"
            config = f"{ranks} rank{'s' * (ranks > 1)}, {mode}"
            for index, kill in enumerate(planned_kills(ranks, args.random_trials, training_s, rng)):
                run = quickstart_run(work / f"r{ranks}-{mode}-{index}", data, ranks, save_async)
                result = run_trial(config, run, kill, reference)
                trials.append(result)
                _print_trial(result)
                shutil.rmtree(run.save_folder.parent, ignore_errors=True)
    matrix = []
    if args.matrix and 1 in references:
        matrix = damaged_file_matrix(references[1], data, work / "matrix", final_tensors(references[1].save_folder))
    summary = _summary(trials, matrix)
    print(summary["text"])
    if args.out:
        _write(args.out, trials, matrix, summary)
    return 0 if summary["all_passed"] else 1


def _print_trial(result: TrialResult) -> None:
    verdict = "PASS" if result.passed else "FAIL"
    detail = "" if result.passed else f"killed={result.killed} identical={result.identical} {result.leftovers}"
    detail += f" {result.metrics_problems}" if result.metrics_problems else ""
    print(f"{verdict} {result.config:16s} {result.kill:42s} launches={result.launch_seconds} s {detail}")
    if not result.passed:
        print(result.error[-1500:])
    sys.stdout.flush()


def _prepare_data(out: Path) -> Path:
    from foundry.data import convert_to_mds

    if not (out / "train" / "index.json").is_file():
        convert_to_mds(None, out, max_seq_len=32, vocab_size=512, progress=False)
    return out


def _summary(trials: list[TrialResult], matrix: list[dict[str, Any]]) -> dict[str, Any]:
    def count(predicate: Callable[[TrialResult], bool]) -> int:
        return sum(map(predicate, trials))

    lines = [
        f"kill -9 trials: {len(trials)} (killed before finishing: {count(lambda t: t.killed)})",
        f"  finished:                  {count(lambda t: t.finished)}/{len(trials)}",
        f"  bit-identical final state: {count(lambda t: t.identical)}/{len(trials)}",
        f"  no leftover folders:       {count(lambda t: not t.leftovers)}/{len(trials)}",
        f"  metrics lines lost or repeated: {sum(len(t.metrics_problems) for t in trials)}",
        f"  relaunches needed:         {max((t.launches - 1 for t in trials), default=0)} at most",
    ]
    for config in dict.fromkeys(t.config for t in trials):
        mine = [t for t in trials if t.config == config]
        lines.append(f"  {config}: {sum(t.passed for t in mine)}/{len(mine)} passed")
    matrix_ok = all(all(value for key, value in row.items() if key not in ("file", "damage")) for row in matrix)
    if matrix:
        lines.append(f"damaged-file matrix: {len(matrix)} cases, {'all' if matrix_ok else 'NOT all'} as expected")
    return {"text": "\n".join(lines), "all_passed": all(t.passed for t in trials) and matrix_ok}


def _write(out_dir: Path, trials: list[TrialResult], matrix: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    import datetime
    import json

    out_dir.mkdir(parents=True, exist_ok=True)
    date = datetime.date.today().isoformat()
    path = out_dir / f"{date}_cpu_fault_injection.json"
    environment = {
        "date": date,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.platform()}",
        "torch": torch.__version__,
        "command": " ".join(["python", *sys.argv]),
    }
    body = {"environment": environment, "summary": summary["text"], "trials": [asdict(t) for t in trials]}
    path.write_text(json.dumps({**body, "matrix": matrix}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
