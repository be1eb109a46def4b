"""A rank that dies is named: by its surviving peers, and by `foundry train --nproc` when torchrun stops the rest."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import RendezvousStore, repo_pythonpath
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from foundry.distributed import launch as launch_module
from foundry.distributed.rendezvous import Nodes

REPO_ROOT = Path(__file__).resolve().parents[2]

# Two ranks all-reduce in a loop; rank 1 kills itself with SIGKILL at the third step.
TWO_RANKS = textwrap.dedent(
    """
    import os, signal
    import torch
    from foundry.distributed import all_reduce_sum, explain_lost_ranks, init_process_group
    from foundry.errors import LostRankError

    init_process_group(timeout_s=60)
    try:
        with explain_lost_ranks():
            for step in range(1000):
                if os.environ["RANK"] == "1" and step == 3:
                    os.kill(os.getpid(), signal.SIGKILL)
                all_reduce_sum(torch.ones(4))
    except LostRankError as error:
        print(error, flush=True)
    """
)


@pytest.mark.distributed
def test_the_surviving_rank_names_the_dead_one_and_how_to_resume():
    rendezvous = RendezvousStore()
    env = {**os.environ, "PYTHONPATH": repo_pythonpath(), **rendezvous.env}
    env.update(WORLD_SIZE="2", CUDA_VISIBLE_DEVICES="")
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", TWO_RANKS],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [rank.communicate(timeout=120) for rank in ranks]
    survivor_out, survivor_err = outputs[0]
    assert ranks[1].returncode == -9
    lost = "Rank 0 of 2 lost contact with the other ranks: rank 1 (node 0, on this machine) died"
    assert lost in survivor_out, survivor_err
    assert "Relaunch the same command: with autoresume: true" in survivor_out
    assert "Connection" in survivor_out  # the collective's own words, for the curious


def test_the_launcher_names_the_rank_a_signal_killed(monkeypatch, capsys):
    killed = ProcessFailure(local_rank=1, pid=123, exitcode=-9, error_file="/nonexistent")
    stopped = ProcessFailure(local_rank=0, pid=122, exitcode=-15, error_file="/nonexistent")

    def run(arguments):
        raise ChildFailedError("foundry.cli", {0: stopped, 1: killed})

    monkeypatch.setattr("torch.distributed.run.run", run)
    assert launch_module.launch(["train", "cfg.yaml"], Nodes(nproc=2)) == 1
    message = capsys.readouterr().err
    assert "rank 1 of 2 was killed (SIGKILL) and torchrun stopped the others" in message
    assert "Relaunch the same command" in message
