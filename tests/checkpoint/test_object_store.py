"""Checkpoints in an object-store save_folder, against a real S3-protocol server on localhost (moto's)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
from helpers import TinyLM, tiny_trainer, token_batches

from foundry.checkpoint.integrity import verify_checkpoint
from foundry.checkpoint.object_store import ObjectStore
from foundry.checkpoint.remote import fetch_checkpoint, published_checkpoints, store_checkpoints
from foundry.core.paths import local_copy
from foundry.errors import CheckpointError
from foundry.trainer import Trainer

REPO_ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("fault_injection", REPO_ROOT / "benchmarks" / "fault_injection.py")
fault_injection = sys.modules.setdefault("fault_injection", importlib.util.module_from_spec(_spec))
if not hasattr(fault_injection, "launch"):
    _spec.loader.exec_module(fault_injection)


def _trainer(save_folder: str, tmp_path: Path, max_batches: int = 3, **kwargs) -> Trainer:
    return tiny_trainer(
        tmp_path, batches=6, max_duration=f"{max_batches}ba", save_folder=save_folder, save_interval="1ba", **kwargs
    )


def test_a_run_publishes_each_checkpoint_on_the_store_and_keeps_the_newest(s3_bucket, tmp_path):
    url = f"{s3_bucket}/runs/a"
    _trainer(url, tmp_path, save_num_checkpoints_to_keep=2).fit()
    store = ObjectStore(url)
    assert [name for name, _ in published_checkpoints(store)] == ["ep0-ba2", "ep0-ba3"]
    assert set(store_checkpoints(store)) == {"ep0-ba2", "ep0-ba3"}
    assert store.read_bytes("latest") == b"ep0-ba3"
    assert sorted(path.name for path in local_copy(url).iterdir() if path.is_dir()) == ["ep0-ba2", "ep0-ba3"]


# ------------------------------------------------------------------------------------- kill -9
# Six batches, a checkpoint after each, the newest two kept, autoresume: argv = save_folder, run folder.
TRAIN = """
import sys
import torch
from foundry.trainer import Trainer

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
batches = [torch.randn(8, 64, generator=torch.Generator().manual_seed(i)) for i in range(6)]
loss = lambda batch: (model(batch) - batch[:, :1]).pow(2).mean()
class Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = model
    def forward(self, batch):
        return loss(batch)
trainer = Trainer(model=Regression(), train_dataloader=batches, max_duration="6ba", save_folder=sys.argv[1],
                  save_interval="1ba", save_num_checkpoints_to_keep=2, autoresume=True, device="cpu",
                  run_folder=sys.argv[2], log_to_console=False)
print("foundry: run 'fault-injection' starts", flush=True)
trainer.fit()
"""


def _run(save_folder: str, tmp_path: Path, machine: str) -> object:
    command = [sys.executable, "-c", TRAIN, save_folder, str(tmp_path / "run")]
    env = {"FOUNDRY_CACHE_DIR": str(tmp_path / machine)}  # each machine has its own local disk
    return fault_injection.Run(command=command, save_folder=Path(save_folder), env=env)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("reference")
    exit_code, output, _ = fault_injection.launch(_run(str(folder / "ckpt"), folder, "machine"))
    assert exit_code == 0, output
    return fault_injection.final_tensors(folder / "ckpt")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("point", "visit", "resumed_on"),
    [
        ("upload.file_uploaded", 6, "machine-2"),
        ("upload.files_uploaded", 3, "machine-1"),
        ("prune.unpublished", 1, "machine-2"),
    ],
    ids=["mid-upload-new-machine", "before-the-manifest-same-machine", "mid-prune-new-machine"],
)
def test_a_kill_during_an_upload_resumes_from_the_store_bit_identically(
    s3_bucket, tmp_path, reference, point, visit, resumed_on
):
    url = f"{s3_bucket}/run"
    exit_code, output, _ = fault_injection.launch(
        _run(url, tmp_path, "machine-1"), fault_injection.Kill(point=point, visit=visit)
    )
    assert exit_code == -9, output
    store = ObjectStore(url)
    for name, _ in published_checkpoints(store):  # what the store publishes is complete
        verify_checkpoint(fetch_checkpoint(store, name))
    exit_code, output, _ = fault_injection.launch(_run(url, tmp_path, resumed_on))
    assert exit_code == 0, output
    assert fault_injection.identical(fault_injection.final_tensors(url), reference)
    assert sorted(store_checkpoints(store)) == ["ep0-ba5", "ep0-ba6"]  # nothing unpublished is left
    assert [name for name, _ in published_checkpoints(store)] == ["ep0-ba5", "ep0-ba6"]


# ------------------------------------------------------------------------------- reading the store
@pytest.fixture
def saved_run(s3_bucket, tmp_path) -> str:
    """``s3://.../run`` holding ep0-ba1..3, saved from another machine's local copy."""
    url = f"{s3_bucket}/run"
    _trainer(url, tmp_path).fit()
    return url


def _new_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str = "machine-2") -> None:
    monkeypatch.setenv("FOUNDRY_CACHE_DIR", str(tmp_path / name))


def test_load_path_on_the_store_loads_the_checkpoint_it_names_or_the_latest(saved_run, tmp_path, monkeypatch):
    _new_machine(tmp_path, monkeypatch)
    assert _trainer(None, tmp_path, load_path=f"{saved_run}/ep0-ba2").state.timestamp.batch == 2
    assert _trainer(None, tmp_path, load_path=saved_run).state.timestamp.batch == 3


def test_messages_name_the_store_not_its_local_copy(saved_run, tmp_path, monkeypatch, capsys):
    _new_machine(tmp_path, monkeypatch)
    trainer = Trainer(
        model=TinyLM(),
        train_dataloader=token_batches(6, 4),
        max_duration="4ba",
        save_folder=saved_run,
        save_interval="1ba",
        autoresume=True,
        device="cpu",
        run_folder=str(tmp_path / "run"),
        progress_bar=False,
    )
    trainer.fit()
    printed = capsys.readouterr().out
    assert f"Loaded checkpoint {saved_run}/ep0-ba3 at batch 3." in printed
    assert re.search(rf"checkpoint +{re.escape(saved_run)}/ep0-ba4\n", printed)
    assert str(tmp_path / "machine-2") not in printed


def test_autoresume_ignores_a_folder_the_store_never_published_and_the_next_run_deletes_it(
    saved_run, tmp_path, monkeypatch
):
    store = ObjectStore(saved_run)
    store.delete(["ep0-ba3/manifest.json"])  # as if the upload was killed before its manifest
    _new_machine(tmp_path, monkeypatch)
    trainer = _trainer(saved_run, tmp_path, max_batches=4, autoresume=True)
    assert trainer.state.timestamp.batch == 2
    assert sorted(store_checkpoints(store)) == ["ep0-ba1", "ep0-ba2"]


def test_autoresume_skips_a_damaged_checkpoint_on_the_store_naming_the_file(saved_run, tmp_path, monkeypatch, caplog):
    store = ObjectStore(saved_run)
    damaged = tmp_path / "__0_0.distcp"
    damaged.write_bytes(b"\0" + store.read_bytes("ep0-ba3/__0_0.distcp")[1:])
    store.upload(damaged, "ep0-ba3/__0_0.distcp")
    _new_machine(tmp_path, monkeypatch)
    trainer = _trainer(saved_run, tmp_path, max_batches=4, autoresume=True)
    assert trainer.state.timestamp.batch == 2
    assert "ep0-ba3, which is damaged (__0_0.distcp differs from its checksum" in caplog.text


def test_a_missing_bucket_is_refused_naming_the_url_and_what_to_check(s3_bucket, tmp_path):
    with pytest.raises(CheckpointError, match=r"Could not reach s3://no-such-bucket/x .*bucket exists.*credentials"):
        _trainer("s3://no-such-bucket/x", tmp_path)


def test_a_missing_sdk_names_the_extra_that_installs_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "boto3", None)  # import boto3 now raises ImportError
    with pytest.raises(CheckpointError, match=r"s3://b/x.*pip install 'foundry\[s3\]'"):
        ObjectStore("s3://b/x")


def test_credentials_stay_out_of_checkpoints_on_the_store(s3_bucket, tmp_path, monkeypatch):
    secret = "local-0123456789abcdef0123456789abcdef"
    monkeypatch.setenv("AZURE_ACCOUNT_ACCESS_KEY", secret)  # as a run on Azure would have it
    url = f"{s3_bucket}/run"
    _trainer(url, tmp_path, max_batches=1, config={"notes": f"key {secret}", "tokenizer": "t"}).fit()
    store = ObjectStore(url)
    saved = [store.read_bytes(key) for key in store.list()]
    assert any(b'"tokenizer": "t"' in data for data in saved) and not any(secret.encode() in data for data in saved)
