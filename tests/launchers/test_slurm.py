"""launchers/slurm/foundry.sbatch, run by bash with stub ``srun``, ``scontrol`` and ``foundry`` first on PATH: the
stub srun starts the command once per simulated node (its own SLURM_NODEID, as Slurm does) and forwards signals to
them; each stub foundry records the command line it got; the stub scontrol names the nodes and records requeues."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launchers.train_command import parse_train_command

SBATCH = Path(__file__).resolve().parents[2] / "launchers" / "slurm" / "foundry.sbatch"
NODES = ["gpu-a", "gpu-b", "gpu-c"]
JOB_ID = "4242"
OVERRIDES = ["max_duration=10ba", "optimizer.betas=[0.9, 0.95]"]  # one with a space, which must stay one word
SCRIPT_TIMEOUT_S = 30

STUB_SRUN = """
import os, signal, subprocess, sys
tasks = []
def forward(number, frame):
    for task in tasks:
        task.send_signal(number)
for number in (signal.SIGUSR1, signal.SIGTERM):
    signal.signal(number, forward)
for node in range(int(os.environ["SLURM_NNODES"])):
    node_env = {**os.environ, "SLURM_NODEID": str(node), "SLURM_PROCID": str(node), "SLURM_LOCALID": "0"}
    tasks.append(subprocess.Popen(sys.argv[1:], env=node_env))
sys.exit(max(task.wait() for task in tasks))  # srun exits with its tasks' highest exit code
"""

STUB_SCONTROL = """
import os, sys
if sys.argv[1:3] == ["show", "hostnames"]:
    print("\\n".join(sys.argv[3].split(",")))
elif sys.argv[1] == "requeue":
    with open(os.path.join(os.environ["STUB_RECORDS"], "requeued"), "a") as log:
        log.write(sys.argv[2] + "\\n")
"""

# STUB_EXIT_CODE is an exit code, or "on-signal": wait for SIGUSR1 or SIGTERM and exit 5, as a preempted run does.
STUB_FOUNDRY = """
import json, os, signal, sys
def record(**fields):
    path = os.path.join(os.environ["STUB_RECORDS"], "node-" + os.environ["SLURM_NODEID"])
    with open(path + ".tmp", "w") as file:
        json.dump({"argv": ["foundry", *sys.argv[1:]], "run_name": os.environ.get("RUN_NAME"), **fields}, file)
    os.replace(path + ".tmp", path + ".json")
exit_code = os.environ["STUB_EXIT_CODE"]
if exit_code != "on-signal":
    record()
    sys.exit(int(exit_code))
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGTERM})
record(signal=None)
received = signal.sigwait({signal.SIGUSR1, signal.SIGTERM})
record(signal=signal.Signals(received).name)
sys.exit(5)
"""


@pytest.fixture
def slurm(tmp_path: Path) -> dict[str, str]:
    """The environment of the batch script on the first of ``NODES``, with the stubs first on PATH."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, source in {"srun": STUB_SRUN, "scontrol": STUB_SCONTROL, "foundry": STUB_FOUNDRY}.items():
        (stubs / name).write_text(f"#!{sys.executable} -IS\n{source}")  # the standard library is all they need
        (stubs / name).chmod(0o755)
    (tmp_path / "records").mkdir()
    return {
        "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}",
        "STUB_RECORDS": str(tmp_path / "records"),
        "SLURM_JOB_ID": JOB_ID,
        "SLURM_JOB_NAME": "foundry",
        "SLURM_JOB_NODELIST": ",".join(NODES),
        "SLURM_NNODES": str(len(NODES)),
        "SLURM_NODEID": "0",  # the batch shell runs on the first node; each srun task gets its own
        "SLURM_GPUS_ON_NODE": "8",
    }


def start_job(env: dict[str, str], exit_code: str) -> subprocess.Popen:
    command = ["bash", str(SBATCH), "yamls/pretrain/mpt-7b.yaml", *OVERRIDES]
    return subprocess.Popen(command, env={**env, "STUB_EXIT_CODE": exit_code}, stdout=subprocess.DEVNULL)


def node_records(env: dict[str, str]) -> list[dict]:
    return [json.loads((Path(env["STUB_RECORDS"]) / f"node-{node}.json").read_text()) for node in range(len(NODES))]


def requeued(env: dict[str, str]) -> list[str]:
    log = Path(env["STUB_RECORDS"]) / "requeued"
    return log.read_text().split() if log.exists() else []


def test_every_node_joins_one_rendezvous_with_its_own_node_rank(slurm: dict[str, str]) -> None:
    job = start_job(slurm, exit_code="0")
    assert job.wait(timeout=SCRIPT_TIMEOUT_S) == 0
    records = node_records(slurm)
    commands = [parse_train_command(record["argv"]) for record in records]
    assert [command.node_rank for command in commands] == list(range(len(NODES)))
    for command in commands:
        assert command.nnodes == len(NODES)
        assert command.nproc == 8
        assert command.rdzv_endpoint == f"{NODES[0]}:29500"  # the first node, as `scontrol show hostnames` lists it
        assert command.rdzv_id == JOB_ID
        assert command.config == "yamls/pretrain/mpt-7b.yaml"
        assert command.overrides == [*OVERRIDES, "autoresume=true"]
    # a requeued job keeps its id, so its run name and save_folder stay the same
    assert {record["run_name"] for record in records} == {f"foundry-{JOB_ID}"}
    assert requeued(slurm) == []


def test_a_handed_over_run_is_requeued(slurm: dict[str, str]) -> None:
    job = start_job(slurm, exit_code="3")
    assert job.wait(timeout=SCRIPT_TIMEOUT_S) == 3
    assert requeued(slurm) == [JOB_ID]


@pytest.mark.parametrize("exit_code", [0, 1, 2, 5])
def test_a_run_that_ends_without_the_time_limit_warning_or_a_hand_over_is_not_requeued(
    slurm: dict[str, str], exit_code: int
) -> None:
    job = start_job(slurm, exit_code=str(exit_code))
    assert job.wait(timeout=SCRIPT_TIMEOUT_S) == exit_code
    assert requeued(slurm) == []


@pytest.mark.parametrize(
    ("signal_number", "requeues"), [(signal.SIGUSR1, True), (signal.SIGTERM, False)], ids=["USR1", "TERM"]
)
def test_a_signal_to_the_batch_script_reaches_every_node(
    slurm: dict[str, str], signal_number: signal.Signals, requeues: bool
) -> None:
    """``--signal=B:USR1@120`` signals the batch shell only, as scancel and preemption do with SIGTERM: it reaches
    every node's launcher through srun, and all nodes checkpoint and exit 5. The time-limit warning requeues the
    job; SIGTERM does not (scancel means stop; Slurm requeues a preempted job itself)."""
    job = start_job(slurm, exit_code="on-signal")
    records = Path(slurm["STUB_RECORDS"])
    deadline = time.monotonic() + SCRIPT_TIMEOUT_S
    while len(list(records.glob("node-*.json"))) < len(NODES):  # every node waits for the signal
        assert job.poll() is None and time.monotonic() < deadline, "the nodes did not all start"
        time.sleep(0.02)
    job.send_signal(signal_number)
    assert job.wait(timeout=SCRIPT_TIMEOUT_S) == 5
    assert [record["signal"] for record in node_records(slurm)] == [signal_number.name] * len(NODES)
    assert requeued(slurm) == ([JOB_ID] if requeues else [])
