"""launchers/kubernetes/: each manifest parsed with yaml and checked against what its operator does. The pod
environment each node gets is written here as Kubeflow's code writes it (Trainer v2's torch plugin, the Training
Operator's PyTorchJob controller), Kubernetes' $(NAME) expansion is applied to the container's command, and
foundry's own CLI parser and launch check read the result."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from foundry.distributed.job import launched_by_torchrun
from launchers.train_command import parse_train_command

MANIFESTS = Path(__file__).resolve().parents[2] / "launchers" / "kubernetes"
TRAINER_PORT = 29500  # Kubeflow Trainer's ContainerTrainerPort
GRACE_PERIOD_DEFAULT_S = 30  # Kubernetes' terminationGracePeriodSeconds when a pod sets none


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load((MANIFESTS / name).read_text())


def expand(command: list[str], env: dict[str, str]) -> list[str]:
    """The command as Kubernetes runs it: ``$(NAME)`` becomes the variable's value, ``$$`` a ``$``; a reference to
    a variable the container lacks stays as written."""

    def value(match: re.Match) -> str:
        return "$" if match.group(0) == "$$" else env.get(match.group(1), match.group(0))

    return [re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", value, word) for word in command]


def run_env(command: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """What a leading ``env -u NAME ...`` leaves: the command it runs and the environment that command gets."""
    env = dict(env)
    if command[0] == "env":
        command = command[1:]
        while command[0] == "-u":
            env.pop(command[1], None)
            command = command[2:]
    return command, env


def container_env(container: dict[str, Any]) -> dict[str, str]:
    return {variable["name"]: str(variable["value"]) for variable in container.get("env", [])}


def launched_by_torchrun_in(env: dict[str, str]) -> bool:
    """What ``foundry train`` decides in a process whose whole environment is ``env``: train as a rank, or launch."""
    with pytest.MonkeyPatch.context() as patch:
        for name in list(os.environ):
            patch.delenv(name)
        for name, value in env.items():
            patch.setenv(name, value)
        return launched_by_torchrun()


# ------------------------------------------------------------------------------------------------ TrainJob
def trainjob_node_env(job: dict[str, Any], node_rank: int) -> dict[str, str]:
    """A node pod's environment under the torch runtime: the TrainJob's env and the PET_* variables."""
    trainer, name = job["spec"]["trainer"], job["metadata"]["name"]
    return {
        **container_env(trainer),
        "PET_NNODES": str(trainer["numNodes"]),
        "PET_NPROC_PER_NODE": str(trainer.get("numProcPerNode", "auto")),
        "PET_NODE_RANK": str(node_rank),  # the pod's Job completion index
        "PET_MASTER_ADDR": f"{name}-node-0-0.{name}",
        "PET_MASTER_PORT": str(TRAINER_PORT),
    }


def test_trainjob_uses_kubeflow_trainers_torch_runtime() -> None:
    job = load("trainjob.yaml")
    assert (job["apiVersion"], job["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    runtime = job["spec"]["runtimeRef"]
    assert runtime == {
        "apiGroup": "trainer.kubeflow.org",
        "kind": "ClusterTrainingRuntime",
        "name": "torch-distributed",
    }


def test_trainjob_nodes_join_one_rendezvous_with_one_rank_per_gpu() -> None:
    job = load("trainjob.yaml")
    trainer = job["spec"]["trainer"]
    gpus_per_node = int(trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"])
    commands = []
    for node_rank in range(trainer["numNodes"]):
        env = trainjob_node_env(job, node_rank)
        argv, launcher_env = run_env(expand(trainer["command"], env), env)
        commands.append(parse_train_command(argv))
        assert not launched_by_torchrun_in(launcher_env), "foundry train would not start the node's ranks"
    assert trainer["numNodes"] >= 2
    assert [command.node_rank for command in commands] == list(range(trainer["numNodes"]))
    for command in commands:
        assert command.nnodes == trainer["numNodes"]
        assert command.nproc == gpus_per_node
        assert command.rdzv_endpoint == f"{job['metadata']['name']}-node-0-0.{job['metadata']['name']}:{TRAINER_PORT}"
        assert "autoresume=true" in command.overrides


def test_trainjob_pods_get_the_grace_period_the_ranks_need_to_checkpoint() -> None:
    job = load("trainjob.yaml")
    [patch] = job["spec"]["runtimePatches"]
    [node] = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert node["name"] == "node"  # the torch runtime's replicated job
    pod_grace_period_s = node["template"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    command = parse_train_command(expand(job["spec"]["trainer"]["command"], trainjob_node_env(job, 0)))
    assert GRACE_PERIOD_DEFAULT_S < command.grace_period_s < pod_grace_period_s


# ---------------------------------------------------------------------------------------------- PyTorchJob
def pytorchjob_pod_env(job: dict[str, Any], replica_type: str, index: int) -> dict[str, str]:
    """A pod's environment as the Training Operator sets it (``setPodEnv``), spec.nprocPerNode counted as it is."""
    specs = job["spec"]["pytorchReplicaSpecs"]
    master = specs["Master"]["template"]["spec"]["containers"][0]
    [port] = [port["containerPort"] for port in master["ports"] if port["name"] == "pytorchjob-port"]
    replicas = sum(spec["replicas"] for spec in specs.values())
    nproc_per_node = job["spec"].get("nprocPerNode", "1")
    rank = index + (1 if replica_type == "Worker" else 0)
    [container] = specs[replica_type]["template"]["spec"]["containers"]
    address = f"{job['metadata']['name']}-master-0"
    return {
        **container_env(container),
        "MASTER_ADDR": address,
        "MASTER_PORT": str(port),
        "PET_MASTER_ADDR": address,
        "PET_MASTER_PORT": str(port),
        "WORLD_SIZE": str(replicas * (int(nproc_per_node) if nproc_per_node.isdigit() else 1)),
        "RANK": str(rank),
        "PET_NODE_RANK": str(rank),
        "PET_NNODES": str(replicas),
    }


def pytorchjob_pods(job: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any], dict[str, str]]]:
    """Every pod's replica spec, container and environment, Master first."""
    specs = job["spec"]["pytorchReplicaSpecs"]
    return [
        (
            specs[replica_type],
            specs[replica_type]["template"]["spec"]["containers"][0],
            pytorchjob_pod_env(job, replica_type, index),
        )
        for replica_type in ("Master", "Worker")
        for index in range(specs[replica_type]["replicas"])
    ]


def test_pytorchjob_has_a_master_and_workers_in_the_operators_container() -> None:
    job = load("pytorchjob.yaml")
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"} and specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] >= 1
    for spec in specs.values():
        [container] = spec["template"]["spec"]["containers"]
        assert container["name"] == "pytorch"  # the name the operator looks for


def test_pytorchjob_nodes_join_one_rendezvous_with_one_rank_per_gpu() -> None:
    job = load("pytorchjob.yaml")
    pods = pytorchjob_pods(job)
    commands = []
    for _, container, env in pods:
        argv, launcher_env = run_env(expand(container["command"], env), env)
        commands.append(parse_train_command(argv))
        # the operator's RANK and MASTER_ADDR would make `foundry train` one rank of its own, not a launcher
        assert launched_by_torchrun_in(env)
        assert not launched_by_torchrun_in(launcher_env), "foundry train would not start the node's ranks"
    assert [command.node_rank for command in commands] == list(range(len(pods)))
    for (_, container, _), command in zip(pods, commands, strict=True):
        assert command.nnodes == len(pods)
        assert command.nproc == int(container["resources"]["limits"]["nvidia.com/gpu"])
        assert command.rdzv_endpoint == f"{job['metadata']['name']}-master-0:29500"
        assert "autoresume=true" in command.overrides


def test_pytorchjob_restarts_a_preempted_pod_with_time_to_checkpoint() -> None:
    """Exit 5 must restart the container: restartPolicy ExitCode restarts only codes from 128 up (signals)."""
    for replica, container, env in pytorchjob_pods(load("pytorchjob.yaml")):
        assert replica["restartPolicy"] == "OnFailure"
        pod_grace_period_s = replica["template"]["spec"]["terminationGracePeriodSeconds"]
        command = parse_train_command(run_env(expand(container["command"], env), env)[0])
        assert GRACE_PERIOD_DEFAULT_S < command.grace_period_s < pod_grace_period_s
