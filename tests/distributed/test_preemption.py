"""SIGTERM or SIGUSR1 during fit(): every rank stops after the same batch, which is checkpointed; the relaunch
continues bit-identically. The signal reaches one rank only, as when one process gets it first. Every run here is
a rank of the ``ranks`` pool, a child process: no test signals pytest's own process."""

from __future__ import annotations

import os
import signal

import torch

from distributed.jobs import build_trainer, summary, train
from foundry.checkpoint import latest_checkpoint
from foundry.checkpoint.preemption import preemption_of
from foundry.core import Callback
from foundry.distributed import get_rank


class SignalAt(Callback):
    """Sends this process ``signal_name`` at the end of ``batch`` on ``rank`` (before the ranks agree)."""

    def __init__(self, batch: int, signal_name: str, rank: int = 0) -> None:
        self.batch, self.signal_name, self.rank = batch, signal_name, rank

    def batch_end(self, state, logger) -> None:
        if state.timestamp.batch == self.batch and state.rank == self.rank:
            os.kill(os.getpid(), signal.Signals[self.signal_name])


def preempted_then_relaunched(folder: str, batch: int, signal_name: str, **kwargs) -> dict | None:
    """Train 6 batches, preempted after ``batch`` by ``signal_name`` on rank 0, then relaunch to the end."""
    checkpoints = {"save_folder": f"{folder}/ckpt", "autoresume": True, **kwargs}
    preempted = build_trainer(6, folder, callbacks=[SignalAt(batch, signal_name)], **checkpoints)
    preempted.fit()
    stopped = {
        "stop_reason": preempted.state.stop_reason,
        "latest": latest_checkpoint(f"{folder}/ckpt").name,
        "eval_metrics": dict(preempted.state.eval_metrics),
        "sigterm_handler_restored": signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
    }
    relaunched = build_trainer(6, folder, **checkpoints)
    relaunched.fit()
    result = summary(relaunched)
    return None if get_rank() else {**stopped, "relaunched": result}


def test_sigterm_on_one_of_two_ranks_stops_both_after_that_batch_and_the_relaunch_is_bit_identical(ranks, tmp_path):
    uninterrupted = ranks.run(2, train, 6, str(tmp_path / "a"))[0]
    preempted = ranks.run(2, preempted_then_relaunched, str(tmp_path / "b"), 2, "SIGTERM")[0]
    assert preempted["stop_reason"] == "preempted by SIGTERM at batch 2"
    assert preempted["latest"] == "ep0-ba2"
    assert preempted["sigterm_handler_restored"]
    assert sorted(preempted["relaunched"]["losses"]) == [3, 4, 5, 6]
    for name, weight in uninterrupted["weights"].items():
        assert torch.equal(preempted["relaunched"]["weights"][name], weight), name


def sigusr1_then_relaunched(folder: str) -> tuple[dict | None, dict | None]:
    """Uninterrupted, then preempted by SIGUSR1 after batch 3 with an eval loader, then relaunched (one rank)."""
    uninterrupted = train(6, f"{folder}/a")
    eval_loader = build_trainer(1, folder).state.train_dataloader
    return uninterrupted, preempted_then_relaunched(f"{folder}/b", 3, "SIGUSR1", eval_dataloader=eval_loader)


def test_sigusr1_on_one_rank_checkpoints_without_the_final_eval_and_the_relaunch_is_bit_identical(ranks, tmp_path):
    uninterrupted, preempted = ranks.run(1, sigusr1_then_relaunched, str(tmp_path))[0]  # the rank gets the signal
    assert preempted["stop_reason"] == "preempted by SIGUSR1 at batch 3"
    assert preempted["latest"] == "ep0-ba3"
    assert preempted["eval_metrics"] == {}  # the grace period goes to the checkpoint, not to an evaluation
    for name, weight in uninterrupted["weights"].items():
        assert torch.equal(preempted["relaunched"]["weights"][name], weight), name


def preempted_without_save_folder(folder: str) -> tuple[str | None, int | None, str | None]:
    trainer = build_trainer(6, folder, callbacks=[SignalAt(2, "SIGTERM")])
    trainer.fit()
    stopped_at = preemption_of(trainer.engine.callbacks).stopped_at
    return trainer.state.stop_reason, stopped_at, trainer.state.last_checkpoint_path


def test_a_run_without_save_folder_stops_and_says_nothing_was_saved(ranks, tmp_path):
    stop_reason, stopped_at, checkpoint = ranks.run(1, preempted_without_save_folder, str(tmp_path))[0]
    assert (stop_reason, stopped_at, checkpoint) == ("preempted by SIGTERM at batch 2", 2, None)
