"""One live run per save_folder: a second is refused at its start, naming the first; stale locks are taken over."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from helpers import tiny_trainer

from foundry.checkpoint import lock
from foundry.errors import ConfigError
from foundry.trainer import Trainer


def _trainer(save_folder, **kwargs) -> Trainer:
    return tiny_trainer(
        Path(save_folder), batches=2, seed=None, save_folder=str(save_folder), run_folder=str(save_folder) + "-run",
        run_name="second", **kwargs,
    )  # fmt: skip


def _write_lock(folder, **holder) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    record = {"host": socket.gethostname(), "run_name": "first", "since": "today", "token": "t", **holder}
    (folder / lock.LOCK_FILE).write_text(json.dumps(record))


@pytest.fixture
def live_process():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield process
    process.kill()
    process.wait()


def test_a_second_run_on_a_folder_a_live_run_holds_is_refused_before_training(tmp_path, live_process):
    _write_lock(tmp_path / "ckpt", pid=live_process.pid, process_start=lock._process_start(live_process.pid))
    with pytest.raises(ConfigError, match=f"in use by run 'first' \\(pid {live_process.pid} on host") as refused:
        _trainer(tmp_path / "ckpt", autoresume=True)
    assert "this run is 'second'" in str(refused.value) and "save_overwrite" not in str(refused.value)


def test_the_lock_names_this_run_while_it_trains_and_is_gone_after_fit(tmp_path):
    trainer = _trainer(tmp_path / "ckpt")
    holder = json.loads((tmp_path / "ckpt" / lock.LOCK_FILE).read_text())
    assert (holder["pid"], holder["host"], holder["run_name"]) == (os.getpid(), socket.gethostname(), "second")
    trainer.fit()
    assert not (tmp_path / "ckpt" / lock.LOCK_FILE).exists()


def test_the_lock_of_a_dead_process_is_taken_over_with_a_warning(tmp_path, caplog):
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _write_lock(tmp_path / "ckpt", pid=int(finished.stdout))
    with caplog.at_level(logging.WARNING, logger="foundry.checkpoint.lock"):
        _trainer(tmp_path / "ckpt").fit()
    assert f"process {int(finished.stdout)} no longer runs" in caplog.text and "run 'first'" in caplog.text


def test_a_reused_pid_does_not_keep_a_lock(tmp_path, live_process):
    _write_lock(tmp_path / "ckpt", pid=live_process.pid, process_start=1)  # that pid started at another time
    assert lock.stale_reason(json.loads((tmp_path / "ckpt" / lock.LOCK_FILE).read_text()), tmp_path / "ckpt")


def test_another_hosts_lock_is_stale_once_its_heartbeat_stops_and_live_while_it_beats(tmp_path, monkeypatch):
    monkeypatch.setattr(lock, "STALE_AFTER_S", 1.0)
    monkeypatch.setattr(lock, "_POLL_S", 0.05)
    path = tmp_path / lock.LOCK_FILE
    _write_lock(tmp_path, host="elsewhere", pid=1)
    os.utime(path, (0, 0))  # last beat long ago
    assert "heartbeat stopped" in lock.stale_reason({"host": "elsewhere", "pid": 1}, path)

    os.utime(path)
    stop = threading.Event()
    beats = threading.Thread(target=lambda: [os.utime(path) for _ in iter(lambda: stop.wait(0.1), True)])
    beats.start()
    try:
        assert lock.stale_reason({"host": "elsewhere", "pid": 1}, path) is None
    finally:
        stop.set()
        beats.join()


def test_a_later_trainer_of_the_same_process_takes_the_lock_over(tmp_path):
    first = _trainer(tmp_path / "ckpt")
    second = _trainer(tmp_path / "ckpt")
    first.checkpoints.release_lock()  # the first one's release leaves the second's lock in place
    assert (tmp_path / "ckpt" / lock.LOCK_FILE).exists()
    second.fit()
    assert not (tmp_path / "ckpt" / lock.LOCK_FILE).exists()
