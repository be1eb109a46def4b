"""A few of benchmarks/fault_injection.py's kill -9 trials, on a small Trainer script: each run is killed once inside
a save, relaunched until it finishes, and must end bit-identical to an uninterrupted run with no leftover folder."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from foundry.checkpoint import latest_checkpoint

REPO_ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # each test kills and relaunches `foundry train` processes
_spec = importlib.util.spec_from_file_location("fault_injection", REPO_ROOT / "benchmarks" / "fault_injection.py")
fault_injection = sys.modules["fault_injection"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(fault_injection)

# Six batches, a checkpoint after each, the newest two kept, autoresume: what the harness's runs do, in seconds.
MODEL_AND_DATA = """
import os, signal, sys
import torch
from foundry.core import Callback
from foundry.errors import FoundryError
from foundry.trainer import Trainer

class Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))

    def forward(self, batch):
        return (self.net(batch) - batch[:, :1]).pow(2).mean()

torch.manual_seed(0)
batches = [torch.randn(8, 64, generator=torch.Generator().manual_seed(i)) for i in range(6)]
"""
TRAIN = (
    MODEL_AND_DATA
    + """
save_folder, save_async = sys.argv[1], sys.argv[2] == "async"
trainer = Trainer(model=Regression(), train_dataloader=batches, max_duration="6ba", save_folder=save_folder,
                  save_interval="1ba", save_num_checkpoints_to_keep=2, save_async=save_async, autoresume=True,
                  device="cpu", run_folder=save_folder + "-run", log_to_console=False)
print("foundry: run 'fault-injection' starts", flush=True)
trainer.fit()
"""
)


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


# The harness's store-outage case on the small script, made deterministic: before batch 3 (once the first two
# uploads are done) the script kills the store's server, whose pid $STORE_PID names (first launch only).
# argv: save_folder URL, run folder; it exits with foundry's exit code, as `foundry train` does.
STORE_TRAIN = (
    MODEL_AND_DATA
    + """
class KillStore(Callback):
    def batch_start(self, state, logger):
        if state.timestamp.batch == 2 and os.environ.get("STORE_PID"):
            trainer.checkpoints.uploader.wait()
            os.kill(int(os.environ["STORE_PID"]), signal.SIGKILL)

trainer = Trainer(model=Regression(), train_dataloader=batches, max_duration="6ba", save_folder=sys.argv[1],
                  save_interval="1ba", save_num_checkpoints_to_keep=2, save_upload_retries=0, autoresume=True,
                  device="cpu", run_folder=sys.argv[2], log_to_console=False, callbacks=[KillStore()])
try:
    trainer.fit()
except FoundryError as error:
    print(f"error: {error}")
    sys.exit(error.exit_code)
"""
)


def test_a_store_killed_mid_run_exits_3_and_the_relaunch_finishes_without_retraining(tmp_path, reference):
    pytest.importorskip("moto.server")
    server, bucket = fault_injection.MotoServer(), "outage"
    env = server.env(tmp_path / "cache")
    url = f"s3://{bucket}/run"
    command = [sys.executable, "-c", STORE_TRAIN, url, str(tmp_path / "run")]
    metrics = tmp_path / "run" / "metrics.jsonl"
    run = fault_injection.Run(command=command, save_folder=tmp_path, env=env, metrics=metrics, num_batches=6)
    server.start(bucket)
    try:
        exit_code, output, _ = fault_injection.launch(replace(run, env={**env, "STORE_PID": str(server.process.pid)}))
        assert exit_code == 4, output
        assert "Not on s3://outage/run: ep0-ba3, ep0-ba4, ep0-ba5, ep0-ba6 (" in output and "They are kept in" in output
        server.kill()
        server.start(bucket)  # back, empty
        exit_code, output, _ = fault_injection.launch(run)
        assert exit_code == 0, output
        assert "Uploaded checkpoint" in output
        with pytest.MonkeyPatch.context() as patch:
            for name, value in env.items():
                patch.setenv(name, value)
            assert fault_injection.identical(fault_injection.final_tensors(url), reference)
        assert fault_injection.metrics_problems(run) == []
    finally:
        server.kill()
