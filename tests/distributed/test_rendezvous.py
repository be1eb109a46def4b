"""The job's machines: flags, the launchers' variables, the inputs refused before any node waits, and a node
that stops answering."""

from __future__ import annotations

import datetime
import pickle
import socket
import time

import pytest
from helpers import FakeClock, RendezvousStore
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from foundry.distributed.launch import torchrun_arguments
from foundry.distributed.rendezvous import Nodes, NodeWatch, job_nodes, store_lost
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


def test_a_node_that_does_not_host_the_store_knows_when_the_store_closed():
    with socket.create_server(("127.0.0.1", 0)) as server:
        endpoint = f"127.0.0.1:{server.getsockname()[1]}"
        job = {"nnodes": 2, "nproc": 1, "endpoint": endpoint, "timeout_s": 30, "rdzv_id": "run"}
        assert not store_lost(Nodes(node_rank=1, **job))
    assert store_lost(Nodes(node_rank=1, **job))
    assert not store_lost(Nodes(node_rank=0, **job))  # its own store closes with its agent: not a lost node
    assert not store_lost(Nodes(node_rank=None, **job))  # this node may be the host: unknown


def test_a_node_whose_heartbeat_stops_is_lost_once_silent_for_the_limit_unless_the_job_ended(monkeypatch):
    rendezvous = RendezvousStore()  # stands for the store at the endpoint, holding torch's rendezvous state
    backend = C10dRendezvousBackend(rendezvous.store, "run-7")
    talking, silent = _NodeDesc("host-a", 11, 0), _NodeDesc("host-b", 22, 0)
    state = _RendezvousState()
    state.complete, state.participants = True, {talking: 0, silent: 1}

    def write() -> None:
        current = backend.get_state()
        backend.set_state(pickle.dumps(state), current[1] if current else None)

    def beat(second: int, *nodes: _NodeDesc) -> None:
        state.last_heartbeats.update({node: datetime.datetime(2026, 1, 1, 0, 0, second) for node in nodes})
        write()

    clock = FakeClock()
    monkeypatch.setattr(time, "monotonic", clock)
    watch = NodeWatch(Nodes(nnodes=2, nproc=2, endpoint=f"127.0.0.1:{rendezvous.store.port}", rdzv_id="run-7"))
    beat(0, talking, silent)
    assert watch.lost_node() is None
    clock.now, _ = 29.0, beat(29, talking)
    assert watch.lost_node() is None  # silent for 29 s: not yet
    clock.now, _ = 31.0, beat(31, talking)
    lost = watch.lost_node()
    assert lost is not None and lost.startswith("node lost: the launcher on host-b (torchrun's node 1, ranks 2-3) ")
    assert "stopped answering the rendezvous at 127.0.0.1:" in lost and " 31 s ago" in lost
    state.closed = True  # the job ended: the launchers stopped their heartbeats on purpose
    write()
    assert watch.lost_node() is None
