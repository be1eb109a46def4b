"""What a rank of `foundry train` and its launcher agree on without torch: errors handed to the launcher, said once
and last; preemption signals noted, never fatal, once a run was preempted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from helpers import repo_pythonpath

from foundry.distributed.job import (
    RANK_ERRORS_VARIABLE,
    hand_to_launcher,
    rank_errors_folder_prefix,
    rank_errors_message,
    ranks_lost_contact,
)
from foundry.errors import ConfigError, LostRankError


@pytest.fixture
def launcher_folder(tmp_path, monkeypatch):
    """The folder this process's launcher (its parent, as for torchrun's ranks) reads its errors from."""
    folder = tmp_path / f"{rank_errors_folder_prefix(os.getppid())}x"
    folder.mkdir()
    monkeypatch.setenv(RANK_ERRORS_VARIABLE, str(folder))
    return folder


def test_ranks_that_meet_one_error_hand_it_to_the_launcher_which_says_it_once(launcher_folder, monkeypatch):
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        assert hand_to_launcher(ConfigError("'model.moe_top_k' is 9; set it to 2."))
    assert rank_errors_message(launcher_folder) == "error: 'model.moe_top_k' is 9; set it to 2."


def test_different_errors_are_said_once_each_a_lost_peers_echo_cut_to_who_stopped_and_the_cause_last(
    launcher_folder, monkeypatch
):
    errors = {0: LostRankError("rank 2 died (killed?)."), 1: LostRankError("rank 2 died (killed?)."),
              2: ConfigError("No dataset at 'x'."), 3: ValueError("bad shard")}  # fmt: skip
    for rank, error in errors.items():
        monkeypatch.setenv("RANK", str(rank))
        hand_to_launcher(error)
    assert rank_errors_message(launcher_folder).splitlines() == [
        "ranks 0, 1 stopped: lost contact with a rank that failed (below)",
        "error (rank 2): No dataset at 'x'.",
        "error (rank 3): ValueError: bad shard (traceback above)",
    ]


def test_lost_peers_echoes_are_said_in_full_when_no_rank_said_why(launcher_folder, monkeypatch):
    for rank, error in {0: LostRankError("rank 2 died."), 1: LostRankError("rank 3 died.")}.items():
        monkeypatch.setenv("RANK", str(rank))
        hand_to_launcher(error)
    assert rank_errors_message(launcher_folder).splitlines() == [
        "error (rank 0): rank 2 died.",
        "error (rank 1): rank 3 died.",
    ]


def test_the_launcher_knows_whether_a_rank_stopped_for_a_lost_peer(launcher_folder, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    assert not ranks_lost_contact(launcher_folder)  # no rank said anything
    hand_to_launcher(ConfigError("No dataset at 'x'."))
    assert not ranks_lost_contact(launcher_folder)
    monkeypatch.setenv("RANK", "1")
    hand_to_launcher(LostRankError("rank 0 died."))
    assert ranks_lost_contact(launcher_folder)


def test_a_process_without_a_launcher_prints_its_error_itself(tmp_path, monkeypatch):
    monkeypatch.delenv(RANK_ERRORS_VARIABLE, raising=False)
    assert not hand_to_launcher(ConfigError("x"))
    assert rank_errors_message(tmp_path) is None


def test_a_command_a_rank_runs_in_its_turn_prints_its_error_itself(tmp_path, monkeypatch):
    """It inherits the rank's environment, but its parent is the rank, not the launcher."""
    folder = tmp_path / f"{rank_errors_folder_prefix(os.getpid())}x"  # this process's ranks' folder
    folder.mkdir()
    monkeypatch.setenv(RANK_ERRORS_VARIABLE, str(folder))
    assert not hand_to_launcher(ConfigError("x"))
    assert rank_errors_message(folder) is None


def _signals_itself(code: str, **env: str) -> subprocess.CompletedProcess:
    """``code`` after ``from foundry.distributed.job import *`` in a fresh Python (it signals itself, not pytest)."""
    script = "import os, signal\nfrom foundry.distributed.job import *\n" + textwrap.dedent(code)
    environment = {**os.environ, "PYTHONPATH": repo_pythonpath(), **env}
    for name in ("RANK", "MASTER_ADDR"):
        if name not in env:
            environment.pop(name, None)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=environment)


def test_a_preempted_process_ignores_later_signals_to_its_exit():
    """Python's shutdown resets its own handlers to the default, which dies of SIGTERM: after a preemption the
    process exits through SIG_IGN instead, so a scheduler's second SIGTERM cannot turn exit 5 into 143."""
    done = _signals_itself("""
        with preemption_signals_noted(restore=False) as note:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGUSR1)
            assert note.received == signal.SIGUSR1
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        raise SystemExit(5)
    """)
    assert done.returncode == 5, done.stderr


def test_a_torchrun_rank_dies_of_sigterm_until_its_run_was_preempted():
    """Before that, a SIGTERM is torchrun stopping the rank because another one failed: it must stop at once."""
    done = _signals_itself(
        """
        with preemption_signals_noted() as note:
            os.kill(os.getpid(), signal.SIGTERM)
        raise SystemExit(0)
        """,
        RANK="0",
        MASTER_ADDR="127.0.0.1",
    )
    assert done.returncode == -signal.SIGTERM
