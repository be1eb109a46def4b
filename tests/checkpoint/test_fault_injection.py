"""A few of benchmarks/fault_injection.py's kill -9 trials, on a small Trainer script: each run is killed once inside
a save, relaunched until it finishes, and must end bit-identical to an uninterrupted run with no leftover folder."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from foundry.checkpoint import latest_checkpoint

REPO_ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("fault_injection", REPO_ROOT / "benchmarks" / "fault_injection.py")
fault_injection = sys.modules["fault_injection"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(fault_injection)

# Six batches, a checkpoint after each, the newest two kept, autoresume: what the harness's runs do, in seconds.
TRAIN = """
import sys
import torch
from foundry.trainer import Trainer

class Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))

    def forward(self, batch):
        return (self.net(batch) - batch[:, :1]).pow(2).mean()

save_folder, save_async = sys.argv[1], sys.argv[2] == "async"
torch.manual_seed(0)
batches = [torch.randn(8, 64, generator=torch.Generator().manual_seed(i)) for i in range(6)]
trainer = Trainer(model=Regression(), train_dataloader=batches, max_duration="6ba", save_folder=save_folder,
                  save_interval="1ba", save_num_checkpoints_to_keep=2, save_async=save_async, autoresume=True,
                  device="cpu", run_folder=save_folder + "-run", log_to_console=False)
print("foundry: run 'fault-injection' starts", flush=True)
trainer.fit()
"""


def _run(folder: Path, mode: str) -> object:
    save_folder = folder / "ckpt"
    command = [sys.executable, "-c", TRAIN, str(save_folder), mode]
    metrics = folder / "ckpt-run" / "metrics.jsonl"
    return fault_injection.Run(command=command, save_folder=save_folder, num_to_keep=2, metrics=metrics, num_batches=6)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    run = _run(tmp_path_factory.mktemp("reference"), "sync")
    exit_code, output, _ = fault_injection.launch(run)
    assert exit_code == 0, output
    return fault_injection.final_tensors(run.save_folder)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_kill_between_publishing_the_folder_and_updating_latest_resumes(tmp_path, reference, mode):
    run = _run(tmp_path, mode)
    kill = fault_injection.Kill(point="publish.renamed", visit=3)
    exit_code, output, _ = fault_injection.launch(run, kill)
    assert exit_code == -9, output
    assert (run.save_folder / "latest").read_text() == "ep0-ba2"  # the pointer lags: ep0-ba3 is already in place
    assert latest_checkpoint(run.save_folder).name == "ep0-ba3"
    exit_code, output, _ = fault_injection.launch(run)
    assert exit_code == 0, output
    assert fault_injection.identical(fault_injection.final_tensors(run.save_folder), reference)
    assert fault_injection.leftovers(run.save_folder, num_to_keep=2) == []
    assert fault_injection.metrics_problems(run) == []  # batch 3's line was flushed before its checkpoint


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_kill_after_publishing_the_last_checkpoint_completes_its_publish_on_resume(tmp_path, reference, mode):
    """Nothing is left to save after the resume, so the resumed run itself must update latest and prune."""
    kill = fault_injection.Kill(point="publish.renamed", visit=6)
    result = fault_injection.run_trial(mode, _run(tmp_path, mode), kill, reference)
    assert result.passed, result
    assert (tmp_path / "ckpt" / "latest").read_text() == "ep0-ba6"


KILLS_INSIDE_A_SAVE = [("async", "save.tensors_written", 4), ("sync", "prune.renamed", 2)]


@pytest.mark.parametrize(("mode", "point", "visit"), KILLS_INSIDE_A_SAVE)
def test_a_kill_inside_a_save_resumes_bit_identically(tmp_path, reference, mode, point, visit):
    kill = fault_injection.Kill(point=point, visit=visit)
    result = fault_injection.run_trial(mode, _run(tmp_path, mode), kill, reference)
    assert result.passed, result
