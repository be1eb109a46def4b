"""An object store that goes down mid-run: the run fails, the local copies survive, the relaunch uploads them.

Against a moto S3 server of the test's own, stopped by a callback at a chosen batch and started again on the
same port (its buckets live in this process, so they are still there; ``empty`` clears one).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import TinyLM, token_batches

from foundry.checkpoint.integrity import verify_checkpoint
from foundry.checkpoint.object_store import ObjectStore
from foundry.checkpoint.remote import published_checkpoints
from foundry.core import Callback, Logger, State
from foundry.core.paths import local_copy
from foundry.errors import CheckpointUploadError
from foundry.trainer import Trainer


class Server:
    """A moto S3 server on localhost that a test can stop and start again on the same port."""

    def __init__(self, moto_server) -> None:
        self._moto_server = moto_server
        self._server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        self.host, self.port = self._server.get_host_and_port()
        self.running = True

    def stop(self) -> None:
        if self.running:
            self._server.stop()
            self.running = False

    def start(self) -> None:
        self._server = self._moto_server.ThreadedMotoServer(ip_address=self.host, port=self.port, verbose=False)
        self._server.start()
        self.running = True


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    pytest.importorskip("boto3")
    server = Server(pytest.importorskip("moto.server"))
    endpoint = f"http://{server.host}:{server.port}"
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
        "S3_ENDPOINT_URL": endpoint,
        "AWS_MAX_ATTEMPTS": "1",  # botocore's own retries would only slow the failing uploads down
        "FOUNDRY_CACHE_DIR": str(tmp_path / "cache"),
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    yield server
    server.stop()


@pytest.fixture
def url(server: Server) -> str:
    import boto3

    bucket = f"bucket-{secrets.token_hex(6)}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    return f"s3://{bucket}/run"


class StopServer(Callback):
    """Stops the server before batch ``batch``, once the uploads queued before it are done."""

    def __init__(self, server: Server, batch: int) -> None:
        self.server, self.batch, self.trainer = server, batch, None

    def batch_start(self, state: State, logger: Logger) -> None:
        if state.timestamp.batch + 1 == self.batch:
            self.trainer.checkpoints.uploader.wait()
            self.server.stop()


def _trainer(url: str, tmp_path: Path, *, stop: StopServer | None = None, **kwargs) -> Trainer:
    torch.manual_seed(0)
    options = {"max_duration": "4ba", "save_upload_retries": 0, "save_max_failed_uploads": 10, "autoresume": True}
    trainer = Trainer(
        model=TinyLM(),
        train_dataloader=token_batches(6, 4),
        save_folder=url,
        save_interval="1ba",
        device="cpu",
        run_folder=str(tmp_path / "run"),
        log_to_console=False,
        callbacks=[stop] if stop else [],
        **{**options, **kwargs},
    )
    if stop is not None:
        stop.trainer = trainer
    return trainer


def _published(url: str) -> list[str]:
    return [name for name, _ in published_checkpoints(ObjectStore(url))]


def _empty(url: str) -> None:
    store = ObjectStore(url)
    store.delete(store.list())


def test_a_store_down_mid_run_fails_the_run_naming_the_checkpoints_and_the_local_copies(server, url, tmp_path):
    trainer = _trainer(url, tmp_path, stop=StopServer(server, batch=3))
    with pytest.raises(CheckpointUploadError, match=r"not every checkpoint reached the store") as failure:
        trainer.fit()
    assert f"Not on {url}: ep0-ba3, ep0-ba4" in str(failure.value)
    assert str(local_copy(url)) in str(failure.value)
    assert failure.value.exit_code == 4
    for name in ["ep0-ba3", "ep0-ba4"]:  # kept, intact
        verify_checkpoint(local_copy(url) / name)


@pytest.mark.parametrize("store_after", ["as-it-was", "empty"])
def test_the_relaunch_uploads_the_local_copies_and_resumes_from_the_newest(server, url, tmp_path, caplog, store_after):
    with pytest.raises(CheckpointUploadError):
        _trainer(url, tmp_path, stop=StopServer(server, batch=3)).fit()
    server.start()
    if store_after == "empty":
        _empty(url)
    resumed = _trainer(url, tmp_path)
    assert resumed.state.timestamp.batch == 4  # no retraining: the final checkpoint is the local one
    assert "Uploaded checkpoint ep0-ba4" in caplog.text and "autoresume resumes from it" in caplog.text
    resumed.fit()
    assert _published(url) == ["ep0-ba1", "ep0-ba2", "ep0-ba3", "ep0-ba4"]  # an empty store gets the local copies


def test_a_store_down_for_several_saves_in_a_row_stops_the_run_early(server, url, tmp_path):
    trainer = _trainer(url, tmp_path, stop=StopServer(server, batch=2), save_max_failed_uploads=2, max_duration="6ba")
    expected = r"The last 2 checkpoints in a row could not be uploaded.* Not on s3://.*: ep0-ba2, ep0-ba3, ep0-ba4 \("
    with pytest.raises(CheckpointUploadError, match=expected):
        trainer.fit()
    assert trainer.state.timestamp.batch == 4  # batches 2 and 3 failed; batch 4 is saved locally, not uploaded
    verify_checkpoint(local_copy(url) / "ep0-ba4")
    server.start()
    assert _published(url) == ["ep0-ba1"]


@pytest.mark.parametrize(("retries", "succeeds"), [(0, False), (1, True)])
def test_a_failed_upload_is_retried(server, url, tmp_path, monkeypatch, retries, succeeds):
    store = ObjectStore(url)
    upload_file = store._uploader.upload_file
    failures = iter([ConnectionError("the store blinked")])

    def fail_once(name: str) -> None:
        error = next(failures, None)
        if error is not None:
            raise error
        upload_file(name)

    monkeypatch.setattr(store._uploader, "upload_file", fail_once)
    monkeypatch.setattr("foundry.checkpoint.saver.object_store", lambda _: store)
    trainer = _trainer(url, tmp_path, save_upload_retries=retries, save_upload_backoff_s=0.0, max_duration="1ba")
    if succeeds:
        trainer.fit()
        assert _published(url) == ["ep0-ba1"]
    else:
        with pytest.raises(CheckpointUploadError, match=r"the store blinked"):
            trainer.fit()
