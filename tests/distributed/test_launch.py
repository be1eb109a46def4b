"""`foundry train --nproc N` launches ranks through torchrun; a hand-over exits 3, a preemption signal 5, and a
relaunch continues."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import quickstart_corpus, repo_pythonpath

from foundry.checkpoint import kill_points, latest_checkpoint
from foundry.cli import main
from foundry.distributed.launch import ForwardedSignal, preempted_exit_code, ranks_exit_code, torchrun_arguments
from foundry.distributed.rendezvous import Nodes
from foundry.errors import EXIT_PREEMPTED

REPO_ROOT = Path(__file__).resolve().parents[2]
OVERRIDES = [
    "model.d_model=32",
    "model.n_layers=2",
    "model.max_seq_len=32",
    "model.vocab_size=512",
    "variables.max_seq_len=32",
    "global_train_batch_size=8",
    "device_train_microbatch_size=2",
    "device_eval_batch_size=16",
    "eval_first=false",
    "eval_interval=100ba",
    "console_log_interval=1ba",
    "callbacks={}",
    "max_duration=6ba",
    "save_interval=100ba",
    "autoresume=true",
    "device=cpu",  # the 2-rank start runs on CPU ranks; the in-process runs must compute alike on a GPU machine
]
HAND_OVER = ["callbacks={hand_over: {interval: 2ba}}", "fsdp_config={sharding_strategy: FULL_SHARD}"]


def test_single_node_launch_is_standalone_torchrun_of_the_cli():
    arguments = torchrun_arguments(["train", "cfg.yaml", "a=1"], Nodes(nproc=4))
    assert arguments == [
        "--nproc-per-node=4",
        "--nnodes=1",
        "--standalone",
        "-m",
        "foundry.cli",
        "train",
        "cfg.yaml",
        "a=1",
    ]


def test_exit_code_is_the_one_the_failed_ranks_share():
    assert ranks_exit_code([3, -15]) == 3  # rank 1 was stopped by torchrun after rank 0 handed over
    assert ranks_exit_code([3, 1]) == 1


def test_after_a_preemption_signal_the_launcher_exits_5_unless_a_rank_failed_for_its_own_reason(capsys):
    forwarded = ForwardedSignal()
    forwarded.signal = signal.SIGTERM
    assert preempted_exit_code(forwarded, [5, 5]) == EXIT_PREEMPTED
    assert capsys.readouterr().err == ""  # the ranks said it
    assert preempted_exit_code(forwarded, [-15, -15]) == EXIT_PREEMPTED
    assert "before training started" in capsys.readouterr().err
    assert preempted_exit_code(forwarded, [2, -15]) == 2  # a config error stays one
    forwarded.ranks_killed = True
    assert preempted_exit_code(forwarded, [-9, 5]) == EXIT_PREEMPTED
    assert "did not checkpoint within the grace period" in capsys.readouterr().err


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return quickstart_corpus(tmp_path_factory)


def _args(folder: Path, data: Path, *overrides: str) -> list[str]:
    return [
        "train",
        str(REPO_ROOT / "yamls" / "quickstart.yaml"),
        f"variables.data_local={data}",
        f"run_folder={folder / 'run'}",
        f"save_folder={folder / 'ckpt'}",
        *OVERRIDES,
        *overrides,
    ]


def _losses(folder: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss/train/total"] for row in rows if "loss/train/total" in row}


@pytest.mark.slow
def test_hand_over_from_two_ranks_to_one_continues_the_run(tmp_path, data, capsys):
    cpu_ranks = {**os.environ, "PYTHONPATH": repo_pythonpath(), "CUDA_VISIBLE_DEVICES": ""}  # 2 ranks, also on 1 GPU
    launched = subprocess.run(
        [sys.executable, "-m", "foundry.cli", *_args(tmp_path / "b", data, *HAND_OVER)[:1], "--nproc", "2",
         *_args(tmp_path / "b", data, *HAND_OVER)[1:]],
        capture_output=True, text=True, timeout=300, env=cpu_ranks,
    )  # fmt: skip
    assert launched.returncode == 3, launched.stderr[-3000:]
    assert "handed over at batch 2" in launched.stdout
    assert main(_args(tmp_path / "b", data, *HAND_OVER)) == 3
    assert "handed over at batch 4" in capsys.readouterr().out
    assert main(_args(tmp_path / "b", data, *HAND_OVER)) == 0

    assert main(_args(tmp_path / "a", data)) == 0  # the same run, uninterrupted, in one process
    uninterrupted, handed_over = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert sorted(handed_over) == list(range(1, 7))
    for step, loss in uninterrupted.items():
        assert handed_over[step] == pytest.approx(loss, abs=1e-4), step


def foundry_train(arguments: list[str]) -> tuple[int, str, str, bool]:
    """``foundry train`` in this rank's process: its exit code, what it printed, whether fit() gave the SIGTERM
    handler back."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(arguments)
    return code, out.getvalue(), err.getvalue(), signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_sigterm_to_one_rank_of_foundry_train_checkpoints_the_batch_reached_and_exits_5(ranks, tmp_path, data):
    """The run sends itself SIGTERM after batch 3, as a rank of the ``ranks`` pool: never to pytest's process."""
    preempt = {kill_points.ENV_VARIABLE: "train.batch_end@3", kill_points.SIGNAL_VARIABLE: "SIGTERM"}
    arguments = _args(tmp_path, data, "save_interval=2ba")
    code, out, err, handler_restored = ranks.run(1, foundry_train, arguments, env=preempt)[0]
    assert code == EXIT_PREEMPTED, err[-3000:]
    assert f"preempted by SIGTERM at batch 3; checkpoint {tmp_path / 'ckpt' / 'ep0-ba3'}" in out
    assert "Traceback" not in out + err
    assert latest_checkpoint(tmp_path / "ckpt").name == "ep0-ba3"
    assert handler_restored


@pytest.mark.slow  # the one-rank case above covers the run; this adds the launcher's forwarding to two ranks
def test_sigterm_to_the_launcher_of_two_ranks_checkpoints_the_batch_reached_and_exits_5(tmp_path, data):
    """Rank 0 sends SIGTERM to the launcher after batch 2; the launcher forwards it to both ranks. (That the ranks
    agree on the batch and resume bit-identically: tests/distributed/test_preemption.py.)"""
    cpu_ranks = {**os.environ, "PYTHONPATH": repo_pythonpath(), "CUDA_VISIBLE_DEVICES": ""}
    preempt = {kill_points.ENV_VARIABLE: "train.batch_end@2:rank0", kill_points.SIGNAL_VARIABLE: "SIGTERM:parent"}
    arguments = _args(tmp_path, data)
    command = [sys.executable, "-m", "foundry.cli", arguments[0], "--nproc", "2", "--grace-period-s", "60"]
    launched = subprocess.run(
        [*command, *arguments[1:]], capture_output=True, text=True, timeout=300, env={**cpu_ranks, **preempt}
    )
    output = launched.stdout + launched.stderr
    assert launched.returncode == EXIT_PREEMPTED, output[-3000:]
    assert "Traceback" not in output and "SignalException" not in output
    reached = int(latest_checkpoint(tmp_path / "ckpt").name.rsplit("-ba", 1)[1])
    # The batch the ranks agreed on after the signal: the launcher forwards it while they train on, so a fast
    # machine may finish a batch or two more (batches take 75 ms on an H100 host), but never the whole run (6).
    assert 2 <= reached < 6, output[-3000:]
    assert f"preempted by SIGTERM at batch {reached}; checkpoint" in launched.stdout


def _foundry_train(arguments: list[str], *options: str, env: dict[str, str] | None = None) -> tuple[int, list[str]]:
    """``python -m foundry train`` (its own process, as a user runs it) with ``options`` after the YAML; the exit
    code and the non-empty lines of stdout and stderr (the ranks', torchrun's and the launcher's)."""
    cpu_ranks = {**os.environ, "PYTHONPATH": repo_pythonpath(), "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    command = [sys.executable, "-m", "foundry", arguments[0], arguments[1], *options, *arguments[2:]]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=cpu_ranks)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    return done.returncode, lines


def test_a_config_error_under_nproc_is_said_once_and_last_before_any_rank_starts(tmp_path, data):
    arguments = _args(tmp_path, data, "parallelism.expert_parallel_degree=3")
    code, lines = _foundry_train(arguments, "--nproc", "2")
    assert code == 2, lines[-20:]
    assert lines == [lines[-1]] and lines[-1].startswith("error: 'parallelism.expert_parallel_degree' is 3")


@pytest.mark.slow  # two ranks start and fail (about 15 s on 2 cores)
def test_an_error_every_rank_meets_is_said_once_and_last(tmp_path, data):
    code, lines = _foundry_train(_args(tmp_path, data, f"variables.data_local={tmp_path / 'absent'}"), "--nproc", "2")
    assert code == 2, lines[-20:]
    errors = [line for line in lines if "No dataset at" in line]
    assert len(errors) == 1 and lines[-1] == errors[0] and errors[0].startswith("error: "), lines[-20:]
    assert not any("failed (exitcode" in line or "OMP_NUM_THREADS" in line for line in lines), lines[-20:]


# Rank 1 fails in data loading with the error a rank met on GPUs when another job took its shared memory.
RANK_1_FAILS_IN_DATA_LOADING = """
import os
if os.environ.get("RANK") == "1":
    from foundry.data import shm_prefix

    def _attach(prefix, streams_local):
        raise RuntimeError("Internal error: shared memory registered does not match local leader")

    shm_prefix._attach = _attach
"""


@pytest.mark.slow  # two ranks start and fail (about 20 s on 2 cores)
def test_a_rank_that_fails_is_named_as_the_cause_not_its_peers_lost_contact(tmp_path, data):
    (tmp_path / "sitecustomize.py").write_text(RANK_1_FAILS_IN_DATA_LOADING)
    pythonpath = f"{tmp_path}{os.pathsep}{repo_pythonpath()}"
    code, lines = _foundry_train(_args(tmp_path, data), "--nproc", "2", env={"PYTHONPATH": pythonpath})
    assert code == 1, lines[-20:]
    cause = "RuntimeError: Internal error: shared memory registered does not match local leader (traceback above)"
    assert lines[-1] in (f"error: {cause}", f"error (rank 1): {cause}"), lines[-20:]
    assert not any("out of host memory" in line for line in lines), lines[-20:]


SECOND_SIGTERM = {
    kill_points.SIGNAL_VARIABLE: "SIGTERM",
    kill_points.ENV_VARIABLE: "train.batch_end@2,train.fit_returned",
}


def test_a_second_sigterm_after_the_run_checkpointed_still_exits_5(tmp_path, data):
    """The second comes once fit() has given its handlers back: it used to find the default handler (exit 143)."""
    code, lines = _foundry_train(_args(tmp_path, data), env=SECOND_SIGTERM)
    assert code == EXIT_PREEMPTED, lines[-20:]
    assert lines[-1].endswith(f"preempted by SIGTERM at batch 2; checkpoint {tmp_path / 'ckpt' / 'ep0-ba2'}; "
                              "relaunch with autoresume: true"), lines[-20:]  # fmt: skip


def test_a_sigterm_before_training_started_trains_one_batch_checkpoints_it_and_exits_5(tmp_path, data):
    before = {kill_points.SIGNAL_VARIABLE: "SIGTERM", kill_points.ENV_VARIABLE: "train.started"}
    code, lines = _foundry_train(_args(tmp_path, data), env=before)
    assert code == EXIT_PREEMPTED, lines[-20:]
    assert lines[-1].endswith(f"preempted by SIGTERM at batch 1; checkpoint {tmp_path / 'ckpt' / 'ep0-ba1'}; "
                              "relaunch with autoresume: true"), lines[-20:]  # fmt: skip


@pytest.mark.slow  # two ranks (about 20 s on 2 cores)
def test_a_second_sigterm_to_the_launcher_of_two_ranks_still_exits_5_naming_the_checkpoint(tmp_path, data):
    """Rank 0 sends the launcher SIGTERM after batch 2 and again once fit() returned; the launcher forwards both."""
    twice = {kill_points.SIGNAL_VARIABLE: "SIGTERM:parent"}
    twice[kill_points.ENV_VARIABLE] = "train.batch_end@2:rank0,train.fit_returned:rank0"
    code, lines = _foundry_train(_args(tmp_path, data), "--nproc", "2", "--grace-period-s", "60", env=twice)
    assert code == EXIT_PREEMPTED, lines[-20:]
    reached = latest_checkpoint(tmp_path / "ckpt").name
    assert f"; checkpoint {tmp_path / 'ckpt' / reached}; relaunch with autoresume: true" in lines[-1], lines[-20:]
    assert not any("nothing new to checkpoint" in line for line in lines), lines[-20:]


@pytest.mark.slow  # two ranks train (about 30 s on 2 cores)
def test_the_quickstart_llama_trains_on_two_cpu_ranks_with_context_parallelism_and_says_so_once(tmp_path, data):
    arguments = _args(tmp_path, data, "model.ffn_hidden_size=64", "max_duration=3ba", "autoresume=false")
    arguments[1] = str(REPO_ROOT / "yamls" / "quickstart-llama.yaml")
    code, lines = _foundry_train(arguments, "--nproc", "2", "parallelism.context_parallel_degree=2")
    assert code == 0, lines[-20:]
    said = [line for line in lines if "context parallelism on" in line]
    assert said == ["foundry: context parallelism on: each sequence split over 2 ranks "
                    "(parallelism.context_parallel_degree: 2)"], lines[-20:]  # fmt: skip
    assert lines[-1].startswith("foundry: run 'quickstart-llama' finished"), lines[-20:]


@pytest.mark.slow  # two 2-rank jobs share 2 cores (about 40 s)
def test_two_jobs_of_two_ranks_started_together_on_one_host_both_train(tmp_path, data):
    """Each job has its own MDS folder; started in the same instant, their ranks elect streaming's shared memory at
    once, and none may take the other job's (foundry/data/shm_prefix.py)."""
    cpu_ranks = {**os.environ, "PYTHONPATH": repo_pythonpath(), "CUDA_VISIBLE_DEVICES": ""}
    commands = []
    for name in ("a", "b"):
        shutil.copytree(data, tmp_path / name / "data")
        arguments = _args(tmp_path / name, tmp_path / name / "data", "max_duration=2ba", "autoresume=false")
        commands.append([sys.executable, "-m", "foundry", *arguments[:2], "--nproc", "2", *arguments[2:]])
    jobs = [
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cpu_ranks)
        for command in commands
    ]
    outputs = [job.communicate(timeout=300)[0] for job in jobs]
    for name, job, output in zip("ab", jobs, outputs, strict=True):
        assert job.returncode == 0, output[-3000:]
        assert sorted(_losses(tmp_path / name)) == [1, 2], output[-3000:]
