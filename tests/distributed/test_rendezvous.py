"""The job's machines: flags, the launchers' variables, and the inputs refused before any node waits."""

from __future__ import annotations

import pytest

from foundry.distributed.launch import torchrun_arguments
from foundry.distributed.rendezvous import Nodes, job_nodes
from foundry.errors import ConfigError

NOT_GIVEN = {"nproc": None, "nnodes": None, "node_rank": None, "rdzv_endpoint": None, "rdzv_id": None}


def nodes(env: dict[str, str] | None = None, **given: object) -> Nodes:
    return job_nodes({**NOT_GIVEN, **given}, default_rdzv_id="my-run", env=env or {})


def test_one_machine_by_default_and_the_run_name_names_the_job():
    assert nodes() == Nodes(nnodes=1, nproc=None, node_rank=None, endpoint=None, timeout_s=300.0, rdzv_id="my-run")


def test_kubeflow_variables_set_what_the_command_line_leaves_out():
    env = {"PET_NNODES": "4", "PET_NPROC_PER_NODE": "8", "PET_NODE_RANK": "2", "PET_MASTER_ADDR": "127.0.0.1",
           "PET_MASTER_PORT": "23456"}  # fmt: skip
    assert nodes(env) == Nodes(nnodes=4, nproc=8, node_rank=2, endpoint="127.0.0.1:23456", rdzv_id="my-run")
    assert nodes(env, nnodes=2, node_rank=0).nnodes == 2  # the command line wins


def test_slurm_variables_set_the_nodes_this_node_and_the_job_id():
    env = {"SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_ID": "4242"}
    assert nodes(env, rdzv_endpoint="localhost:29500") == Nodes(
        nnodes=2, node_rank=1, endpoint="localhost:29500", rdzv_id="4242"
    )


def test_several_nodes_need_a_rendezvous_endpoint_naming_where_the_count_came_from():
    with pytest.raises(ConfigError, match=r"\$SLURM_NNODES is 2, which needs --rdzv-endpoint HOST:PORT"):
        nodes({"SLURM_NNODES": "2"})


def test_a_node_rank_beyond_the_nodes_is_refused():
    with pytest.raises(ConfigError, match="--node-rank is 2 but the job has 2 node"):
        nodes(nnodes=2, node_rank=2, rdzv_endpoint="localhost:29500")


def test_an_endpoint_that_does_not_resolve_is_refused_before_any_node_waits():
    with pytest.raises(ConfigError, match="host 'no-such-host.invalid' does not resolve"):
        nodes(nnodes=2, rdzv_endpoint="no-such-host.invalid:29500")
    with pytest.raises(ConfigError, match="it takes HOST:PORT"):
        nodes(nnodes=2, rdzv_endpoint="localhost")


def test_a_count_that_is_no_whole_number_names_its_variable():
    with pytest.raises(ConfigError, match=r"\$PET_NNODES is '1:4'"):
        nodes({"PET_NNODES": "1:4"})


def test_several_nodes_meet_at_the_endpoint_with_the_timeout_and_node_0_hosting_the_store():
    job = Nodes(nnodes=2, nproc=4, node_rank=0, endpoint="node0:29500", timeout_s=30, rdzv_id="run-7")
    assert torchrun_arguments(["train", "cfg.yaml"], job) == [
        "--nproc-per-node=4",
        "--nnodes=2",
        "--rdzv-backend=foundry-c10d",
        "--rdzv-endpoint=node0:29500",
        "--rdzv-id=run-7",
        "--rdzv-conf=join_timeout=30,read_timeout=30,is_host=1",
        "-m",
        "foundry.cli",
        "train",
        "cfg.yaml",
    ]
