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
    python benchmarks/fault_injection.py --cases store-outage garbage-pointer other-run   # the other faults

``--cases`` also runs faults other than kills, each once on a 1-rank run: the object store's server
killed mid-run (the run must exit 4 naming the checkpoints the store lacks; the relaunch on an empty bucket
uploads them and finishes bit-identically without retraining), a ``latest`` pointer of garbage bytes, and
another run (another ``run_name``) launched on a finished run's save_folder (refused, exit 2). And the
scheduler's view: SIGTERM at a random instant to a 1-rank run and to the launcher of a 2-rank run
(``sigterm``: exit 5, a checkpoint at the batch reached, no traceback, the relaunch bit-identical), the same
command launched again while the first still trains (``concurrent-folder``: refused at once, exit 2, naming
the first; the first unharmed), and a relaunch with another global batch (``changed-config``: refused
naming the key and both values; accepted with ``autoresume_accept_changes: true``)::

    python benchmarks/fault_injection.py --cases sigterm concurrent-folder changed-config --out benchmarks/results

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
import re
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
CASES = (  # what --cases selects
    "kills",
    "matrix",
    "store-outage",
    "garbage-pointer",
    "other-run",
    "sigterm",
    "concurrent-folder",
    "changed-config",
)
EXIT_PREEMPTED, EXIT_CONFIG_ERROR = 5, 2  # foundry.errors


@dataclass
class Kill:
    """Where a trial's one SIGKILL lands: at ``point``'s ``visit``-th visit, or ``after_s`` after the start marker.

    ``signal`` other than SIGKILL goes to the launched process itself (a run's launcher), as a scheduler sends it.
    With ``after_file``, ``after_s`` counts from the moment that file exists (a first checkpoint published).
    """

    rank: int = 0
    point: str | None = None
    visit: int = 1
    after_s: float | None = None
    signal: str = "SIGKILL"
    after_file: Path | None = None

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
def launch(run: Run, kill: Kill | None = None, timeout_s: float | None = None) -> tuple[int, str, float]:
    """Run ``run.command`` once (killed as ``kill`` says); (exit code, output tail, seconds after the start marker)."""
    timeout_s = timeout_s or LAUNCH_TIMEOUT_S
    env = launch_env(run)
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
        while kill.after_file is not None and not kill.after_file.exists() and process.poll() is None:
            time.sleep(0.05)
        time.sleep(kill.after_s)
        if kill.signal == "SIGKILL":
            _kill_rank(process, kill.rank)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.Signals[kill.signal])
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


def launch_env(run: Run) -> dict[str, str]:
    """The environment of a launch of ``run``."""
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
    return env


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


# ------------------------------------------------------------------------- what else breaks: three cases
def garbage_pointer_case(source: Run, data: Path, work: Path, reference: dict[str, Any]) -> dict[str, Any]:
    """``latest`` holding garbage bytes and the newest checkpoint gone: autoresume must resume from the one
    before, warn about the pointer, finish identically and rewrite it."""
    case = work / "garbage-pointer"
    shutil.copytree(source.save_folder.parent, case)
    run = quickstart_run(case, data, ranks=1, save_async=False)
    from foundry.checkpoint import latest_checkpoint

    shutil.rmtree(latest_checkpoint(run.save_folder))
    (run.save_folder / "latest").write_bytes(b"\xff\xfe\x00\x9c not a checkpoint name")
    exit_code, output, _ = launch(run)
    finished = exit_code == 0
    row = {
        "case": "garbage latest pointer",
        "finished": finished,
        "identical": finished and identical(final_tensors(run.save_folder), reference),
        "warning names the pointer": "Ignoring" in output and "latest" in output,
        "metrics problems": metrics_problems(run) if finished else ["did not finish"],
        "leftovers": leftovers(run.save_folder, run.num_to_keep),
    }
    shutil.rmtree(case)
    return {**row, "passed": row["identical"] and row["warning names the pointer"] and not row["metrics problems"]}


def other_run_case(source: Run, data: Path, work: Path) -> dict[str, Any]:
    """Another run (another run_name) launched on a finished run's save_folder: refused, naming both, untouched."""
    case = work / "other-run"
    shutil.copytree(source.save_folder.parent, case)
    run = quickstart_run(case, data, ranks=1, save_async=False)
    before = sorted(path.name for path in run.save_folder.iterdir())
    run.command.append("run_name=someone-else")
    exit_code, output, _ = launch(run)
    row = {
        "case": "another run's save_folder",
        "exit code": exit_code,
        "names both runs": "'quickstart'" in output and "'someone-else'" in output,
        "folder untouched": sorted(path.name for path in run.save_folder.iterdir()) == before,
    }
    shutil.rmtree(case)
    return {**row, "passed": exit_code == 2 and row["names both runs"] and row["folder untouched"]}


def sigterm_case(data: Path, work: Path, reference: dict[str, Any], ranks: int, after_s: float) -> dict[str, Any]:
    """SIGTERM ``after_s`` after the run's first checkpoint, to the run itself (1 rank) or to its launcher (2 ranks):
    it must exit 5 with a checkpoint at the batch it names and no traceback; the relaunch must finish
    bit-identically."""
    from foundry.checkpoint import latest_checkpoint

    run = quickstart_run(work / f"sigterm-{ranks}", data, ranks, save_async=False)
    exit_code, output, _ = launch(run, Kill(after_s=after_s, signal="SIGTERM", after_file=run.save_folder / "latest"))
    stopped = re.search(r"preempted by SIGTERM at batch (\d+); checkpoint (\S+)", output)
    newest = latest_checkpoint(run.save_folder) if run.save_folder.is_dir() else None
    at_batch = stopped is not None and newest is not None and newest.name.endswith(f"-ba{stopped.group(1)}")
    relaunch_exit, relaunch_output, _ = launch(run)
    finished = relaunch_exit == 0
    row = {
        "case": f"SIGTERM mid-run to {'the launcher of 2 ranks' if ranks > 1 else 'a 1-rank run'}",
        "signal after s": round(after_s, 2),
        "exit code": exit_code,
        "stopped at batch": int(stopped.group(1)) if stopped else None,
        "checkpoint at that batch": at_batch,
        "no traceback": "Traceback" not in output + relaunch_output,
        "relaunch exit code": relaunch_exit,
        "identical": finished and identical(final_tensors(run.save_folder), reference),
        "metrics problems": metrics_problems(run) if finished else ["did not finish"],
        "leftovers": leftovers(run.save_folder, run.num_to_keep),
    }
    shutil.rmtree(run.save_folder.parent, ignore_errors=True)
    passed = exit_code == EXIT_PREEMPTED and at_batch and row["no traceback"] and row["identical"]
    return {**row, "passed": passed and not row["metrics problems"] and not row["leftovers"]}


def concurrent_folder_case(data: Path, work: Path) -> dict[str, Any]:
    """The same command launched again while the first launch trains: refused at its start (exit 2) naming the
    first, which goes on unharmed (each batch's metrics line once) until SIGTERM stops it."""
    first = quickstart_run(work / "concurrent-folder", data, ranks=1, save_async=False)
    first.command += ["max_duration=100000ba", "save_interval=200ba", "eval_interval=100000ba"]
    process = subprocess.Popen(
        first.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=launch_env(first), text=True
    )
    lock = first.save_folder / ".lock"
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while not lock.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    second_exit, second_output, _ = launch(first)
    first_was_training = process.poll() is None
    process.send_signal(signal.SIGTERM)
    first_output, _ = process.communicate(timeout=LAUNCH_TIMEOUT_S)
    stopped = re.search(r"preempted by SIGTERM at batch (\d+)", first_output)
    first.num_batches = int(stopped.group(1)) if stopped else 0
    row = {
        "case": "the same command launched twice at once",
        "second exit code": second_exit,
        "second names the first": "in use by run 'quickstart' (pid" in second_output,
        "second trained no batch": "loss/train" not in second_output,
        "first was training meanwhile": first_was_training,
        "first exit code (SIGTERM after)": process.returncode,
        "first's metrics problems": metrics_problems(first) if stopped else ["did not stop at a batch"],
    }
    shutil.rmtree(first.save_folder.parent, ignore_errors=True)
    passed = second_exit == EXIT_CONFIG_ERROR and row["second names the first"] and first_was_training
    return {**row, "passed": passed and process.returncode == EXIT_PREEMPTED and not row["first's metrics problems"]}


def changed_config_case(source: Run, data: Path, work: Path) -> dict[str, Any]:
    """Relaunches of a finished run: logging and eval changes pass; another global batch is refused naming the key
    and both values, the folder untouched; ``autoresume_accept_changes: true`` accepts it."""
    from foundry.checkpoint import latest_checkpoint

    case = work / "changed-config"
    shutil.copytree(source.save_folder.parent, case)
    run = quickstart_run(case, data, ranks=1, save_async=False)
    quiet_exit, _, _ = launch(replace(run, command=[*run.command, "console_log_interval=5ba", "eval_interval=8ba"]))
    before = sorted(path.name for path in run.save_folder.iterdir())
    changed = [*run.command, "global_train_batch_size=16", "max_duration=44ba"]
    refused_exit, refused_output, _ = launch(replace(run, command=changed))
    untouched = sorted(path.name for path in run.save_folder.iterdir()) == before
    accepted_exit, _, _ = launch(replace(run, command=[*changed, "autoresume_accept_changes=true"]))
    row = {
        "case": "a relaunch with another global batch",
        "logging/eval changes: exit code": quiet_exit,
        "refused: exit code": refused_exit,
        "names the key and both values": "global_train_batch_size: 8 in the checkpoint, 16 now" in refused_output,
        "folder untouched": untouched,
        "with autoresume_accept_changes: exit code": accepted_exit,
        "trained on to batch 44": latest_checkpoint(run.save_folder).name.endswith("-ba44"),
    }
    shutil.rmtree(case)
    passed = quiet_exit == 0 and refused_exit == EXIT_CONFIG_ERROR and row["names the key and both values"]
    return {**row, "passed": passed and untouched and accepted_exit == 0 and row["trained on to batch 44"]}


class MotoServer:
    """moto's S3 server in a process of its own, which the harness kills (SIGKILL) and starts again, empty."""

    def __init__(self) -> None:
        import socket

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def env(self, cache_dir: Path) -> dict[str, str]:
        """The environment of a run that saves to this server: dummy credentials, its URL, the local copy."""
        return {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "S3_ENDPOINT_URL": self.url,
            "AWS_ENDPOINT_URL": self.url,
            "AWS_MAX_ATTEMPTS": "1",  # botocore's retries only slow a failing upload; foundry retries it
            "FOUNDRY_CACHE_DIR": str(cache_dir),
        }

    def client(self) -> Any:
        import boto3

        credentials = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}  # moto takes any
        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1", **credentials)

    def start(self, bucket: str) -> None:
        command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = self.client()
        for _ in range(600):  # up to a minute for the server to listen (moto imports slowly on a busy machine)
            with contextlib.suppress(Exception):
                client.create_bucket(Bucket=bucket)
                return
            time.sleep(0.1)
        raise RuntimeError(f"moto's server did not start on {self.url}")

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def kill_once_published(self, bucket: str, stop: threading.Event) -> None:
        """Kill the server once the run has published its first checkpoint on the store."""
        client = self.client()
        while not stop.is_set():
            with contextlib.suppress(Exception):
                listed = client.list_objects_v2(Bucket=bucket).get("Contents", [])
                if any(item["Key"].endswith("/manifest.json") for item in listed):
                    self.kill()
                    return
            time.sleep(0.2)


def store_outage_case(data: Path, work: Path, reference: dict[str, Any]) -> dict[str, Any]:
    """The S3 server killed once the first checkpoint is published: the run must fail (exit 4) naming the
    checkpoints; the relaunch on an empty bucket uploads the local copies and finishes without retraining."""
    server, bucket = MotoServer(), "fault-injection"
    env = server.env(work / "store-outage" / "cache")
    os.environ.update(env)  # final_tensors reads the store from this process
    run = quickstart_run(work / "store-outage", data, ranks=1, save_async=False)
    url = f"s3://{bucket}/run"
    run.command[run.command.index(f"save_folder={run.save_folder}")] = f"save_folder={url}"
    run.command += ["save_upload_retries=1", "save_upload_backoff_s=0.5"]
    run.env = env
    server.start(bucket)
    stop = threading.Event()
    watcher = threading.Thread(target=server.kill_once_published, args=(bucket, stop), daemon=True)
    watcher.start()
    first_exit, first_output, _ = launch(run)
    stop.set()
    server.kill()
    server.start(bucket)  # back, empty
    try:
        second_exit, second_output, _ = launch(run)
        same = second_exit == 0 and identical(final_tensors(url), reference)
    finally:
        server.kill()
    run.save_folder = Path(env["FOUNDRY_CACHE_DIR"]) / "object_stores" / "s3" / bucket / "run"
    row = {
        "case": "object store killed mid-run",
        "first exit code": first_exit,
        "names the local copies": "They are kept in" in first_output,
        "relaunch exit code": second_exit,
        "uploaded the local copies": "Uploaded checkpoint" in second_output,
        "identical": same,
        "metrics problems": metrics_problems(run) if second_exit == 0 else ["did not finish"],
    }
    shutil.rmtree(work / "store-outage", ignore_errors=True)
    passed = first_exit == 4 and row["names the local copies"] and row["uploaded the local copies"] and same
    return {**row, "passed": passed and not row["metrics problems"]}


# ------------------------------------------------------------------------------------------- main
def main() -> int:
    global LAUNCH_TIMEOUT_S
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="world sizes to run (default: 1 2)")
    parser.add_argument("--random-trials", type=int, default=6, help="random-instant kills per configuration")
    parser.add_argument("--no-matrix", dest="matrix", action="store_false", help="skip the damaged-file matrix")
    parser.add_argument(
        "--cases",
        nargs="+",
        choices=CASES,
        default=list(CASES),
        help="what to run (default: all): the kill -9 trials, the damaged-file matrix, and the store-outage, "
        "garbage-pointer, other-run, sigterm, concurrent-folder and changed-config cases",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--launch-timeout-s", type=float, default=LAUNCH_TIMEOUT_S, help="a launch that runs longer is killed"
    )
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--out", type=Path, default=None, help="write <out>/<date>_cpu_fault_injection.json")
    args = parser.parse_args()
    LAUNCH_TIMEOUT_S = args.launch_timeout_s  # a busy machine's launches take longer
    work = args.work or Path(__import__("tempfile").mkdtemp(prefix="fault_injection-"))
    rng = random.Random(args.seed)
    data = _prepare_data(work / "data")
    trials: list[TrialResult] = []
    references = {}
    for ranks in sorted(set(args.ranks) | ({1} if set(args.cases) & set(CASES[2:]) else set())):
        reference_run = quickstart_run(work / f"reference-{ranks}", data, ranks, save_async=False)
        exit_code, output, training_s = launch(reference_run)
        if exit_code != 0:
            raise SystemExit(f"the uninterrupted {ranks}-rank run failed:\n{output}")
        references[ranks] = reference_run
        reference = final_tensors(reference_run.save_folder)
        for save_async in (False, True) if "kills" in args.cases and ranks in args.ranks else ():
            mode = "async" if save_async else "sync"
            config = f"{ranks} rank{'s' * (ranks > 1)}, {mode}"
            for index, kill in enumerate(planned_kills(ranks, args.random_trials, training_s, rng)):
                run = quickstart_run(work / f"r{ranks}-{mode}-{index}", data, ranks, save_async)
                result = run_trial(config, run, kill, reference)
                trials.append(result)
                _print_trial(result)
                shutil.rmtree(run.save_folder.parent, ignore_errors=True)
    matrix = []
    if args.matrix and "matrix" in args.cases and 1 in references:
        matrix = damaged_file_matrix(references[1], data, work / "matrix", final_tensors(references[1].save_folder))
    cases = []
    if "store-outage" in args.cases:
        cases.append(store_outage_case(data, work, final_tensors(references[1].save_folder)))
    if "garbage-pointer" in args.cases:
        cases.append(garbage_pointer_case(references[1], data, work, final_tensors(references[1].save_folder)))
    if "other-run" in args.cases:
        cases.append(other_run_case(references[1], data, work))
    for ranks in args.ranks if "sigterm" in args.cases else ():
        after_s = rng.uniform(0.0, 1.0)  # after the first of 10 checkpoints: well inside the training part
        cases.append(sigterm_case(data, work, final_tensors(references[ranks].save_folder), ranks, after_s))
    if "concurrent-folder" in args.cases:
        cases.append(concurrent_folder_case(data, work))
    if "changed-config" in args.cases:
        cases.append(changed_config_case(references[1], data, work))
    for case in cases:
        print(f"{'PASS' if case['passed'] else 'FAIL'} {case}")
    summary = _summary(trials, matrix, cases)
    print(summary["text"])
    if args.out:
        _write(args.out, trials, matrix, cases, summary)
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


def _summary(trials: list[TrialResult], matrix: list[dict[str, Any]], cases: list[dict[str, Any]]) -> dict[str, Any]:
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
    for case in cases:
        lines.append(f"{case['case']}: {'as expected' if case['passed'] else 'NOT as expected'}")
    all_passed = all(t.passed for t in trials) and matrix_ok and all(case["passed"] for case in cases)
    return {"text": "\n".join(lines), "all_passed": all_passed}


def _write(
    out_dir: Path,
    trials: list[TrialResult],
    matrix: list[dict[str, Any]],
    cases: list[dict[str, Any]],
    summary: dict[str, Any],
) -> None:
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
    path.write_text(json.dumps({**body, "matrix": matrix, "cases": cases}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    raise SystemExit(main())
