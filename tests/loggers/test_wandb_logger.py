"""WandBLogger: an offline W&B run of a real fit, read back from its .wandb file; secrets never reach it.

Wiring (names, ranks, resume, artifacts) is checked against a fake ``wandb`` module; one real offline
run, shared by the tests that read it, checks what the client actually writes.
"""

from __future__ import annotations

import json
import struct
import sys
import time
import types
from pathlib import Path

import pytest
import yaml
from helpers import TinyLM, token_batches

from foundry import registry
from foundry.core import Event
from foundry.core.redact import scrub_secrets
from foundry.errors import ConfigError
from foundry.loggers import WandBLogger
from foundry.loggers.wandb import CONFIG_FILE_NAME
from foundry.trainer import Trainer

FAKE_API_KEY = "0123456789abcdef0123456789abcdef01234567"  # 40 characters, like a real key


# ------------------------------------------------------------------------------- a fake client
class FakeRun:
    def __init__(self, run_dir: Path, **kwargs) -> None:
        self.init_kwargs = kwargs
        self.id = "fake-id"
        self.dir = str(run_dir)
        self.config: dict = {}
        self.logged: list = []
        self.artifacts: list = []
        self.exit_code: int | None = None

    def log(self, metrics, step):
        self.logged.append((step, dict(metrics)))

    def save(self, path, base_path, policy):
        pass

    def log_artifact(self, artifact, aliases):
        self.artifacts.append((artifact, aliases))

    def finish(self, exit_code):
        self.exit_code = exit_code


class FakeArtifact:
    def __init__(self, name, type, metadata):
        self.name, self.type, self.paths = name, type, []

    def add_dir(self, path):
        self.paths.append(path)

    add_file = add_dir


@pytest.fixture
def fake_wandb(tmp_path, monkeypatch):
    """A ``wandb`` module whose ``init`` records its arguments; ``.runs`` holds every run started."""
    module = types.ModuleType("wandb")
    module.runs = []

    def init(**kwargs):
        module.runs.append(FakeRun(tmp_path, **kwargs))
        return module.runs[-1]

    module.init, module.Artifact = init, FakeArtifact
    monkeypatch.setitem(sys.modules, "wandb", module)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.chdir(tmp_path)  # the default run folder, runs/<run_name>, is created relative to it
    return module


def test_is_registered_as_wandb():
    assert registry.loggers.get("wandb") is WandBLogger


def test_missing_wandb_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError, match=r"pip install 'foundry\[wandb\]'"):
        WandBLogger()


def test_the_run_is_named_after_the_run_and_written_under_its_folder(fake_wandb, state, fire):
    state.run_name = "demo"
    fire(WandBLogger(project="proj"), Event.FIT_START)
    (run,) = fake_wandb.runs
    assert run.init_kwargs["name"] == "demo" and run.init_kwargs["project"] == "proj"
    assert run.init_kwargs["dir"] == str(Path("runs") / "demo")


def test_init_kwargs_override_the_yaml_keys(fake_wandb, state, fire):
    fire(WandBLogger(name="from-yaml", init_kwargs={"name": "from-init-kwargs", "mode": "disabled"}), Event.FIT_START)
    assert fake_wandb.runs[0].init_kwargs["name"] == "from-init-kwargs"


def test_only_rank_zero_starts_a_run(fake_wandb, state, fire):
    state.rank = 1
    logger = WandBLogger()
    fire(logger, Event.FIT_START)
    logger.log_metrics({"x": 1.0}, step=1)
    assert fake_wandb.runs == []


def test_every_rank_gets_its_own_run_in_one_group_without_rank_zero_only(fake_wandb, state, fire):
    state.rank, state.run_name = 1, "demo"
    fire(WandBLogger(rank_zero_only=False), Event.FIT_START)
    assert fake_wandb.runs[0].init_kwargs["name"] == "demo-rank1"
    assert fake_wandb.runs[0].init_kwargs["group"] == "demo"


def test_a_resumed_fit_continues_the_checkpointed_wandb_run(fake_wandb, state, fire):
    first = WandBLogger()
    fire(first, Event.FIT_START)
    resumed = WandBLogger()
    resumed.load_state_dict(first.state_dict())
    fire(resumed, Event.FIT_START)
    assert fake_wandb.runs[1].init_kwargs["id"] == "fake-id"
    assert fake_wandb.runs[1].init_kwargs["resume"] == "allow"


def test_checkpoints_are_uploaded_as_artifacts_with_log_artifacts(fake_wandb, state, fire, tmp_path):
    state.last_checkpoint_path = str(tmp_path / "ep0-ba2")
    state.timestamp = state.timestamp.after_batch(4, 32, duration_s=0.0).after_batch(4, 32, duration_s=0.0)
    logger = WandBLogger(log_artifacts=True)
    fire(logger, Event.FIT_START)
    fire(logger, Event.BATCH_CHECKPOINT)
    ((artifact, aliases),) = fake_wandb.runs[0].artifacts
    assert artifact.type == "model" and aliases == ["latest", "ba2"]


def test_a_fit_that_never_ended_finishes_the_run_as_failed(fake_wandb, state, fire):
    logger = WandBLogger()
    fire(logger, Event.FIT_START)
    logger.close()
    assert fake_wandb.runs[0].exit_code == 1


# --------------------------------------------------------------------------------- secrets
def test_secret_keys_are_redacted_at_any_depth_and_tokenizer_keys_are_kept():
    config = {
        "loggers": {"wandb": {"init_kwargs": {"api_key": "k1"}}},
        "hub": [{"hfToken": "k2", "Password": "k3"}],
        "tokenizer": {"name": "gpt2", "kwargs": {"max_tokens": 8}},
    }
    assert scrub_secrets(config, secret_values=[]) == {
        "loggers": {"wandb": {"init_kwargs": {"api_key": "***"}}},
        "hub": [{"hfToken": "***", "Password": "***"}],
        "tokenizer": {"name": "gpt2", "kwargs": {"max_tokens": 8}},
    }


def test_secret_environment_values_are_redacted_under_any_key(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", FAKE_API_KEY)
    assert scrub_secrets({"notes": f"key={FAKE_API_KEY}"}) == {"notes": "key=***"}


# ------------------------------------------------------------------------- a real offline run
def _records(path: Path):
    """Protobuf records of a .wandb file: W&B's LevelDB-style log of 32 KiB blocks (no public reader exists)."""
    from wandb.proto import wandb_internal_pb2

    block_bytes, header_bytes = 32768, 7  # each chunk: crc32 (4), length (2), type (1: full, 4: last piece)
    data, offset, pieces = path.read_bytes(), header_bytes, b""  # the file opens with ':W&B', magic, version
    while offset + header_bytes <= len(data):
        if block_bytes - offset % block_bytes < header_bytes:  # a block's tail too short for a header is padding
            offset += block_bytes - offset % block_bytes
            continue
        _, length, kind = struct.unpack("<IHB", data[offset : offset + header_bytes])
        pieces += data[offset + header_bytes : offset + header_bytes + length]
        offset += header_bytes + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            pieces = b""
            yield record


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory):
    """A 4-batch fit logged to an offline W&B run; returns (its folder, the trainer's metrics.jsonl rows)."""
    wandb = pytest.importorskip("wandb")
    root = tmp_path_factory.mktemp("wandb")
    with pytest.MonkeyPatch.context() as patch:
        for name, value in {
            "WANDB_MODE": "offline",
            "WANDB_SILENT": "true",
            "WANDB_CONSOLE": "off",
            "WANDB_API_KEY": FAKE_API_KEY,
            "WANDB_DIR": str(root / "dir"),
            "WANDB_CACHE_DIR": str(root / "cache"),
            "WANDB_CONFIG_DIR": str(root / "config"),
            "WANDB_DATA_DIR": str(root / "data"),
        }.items():
            patch.setenv(name, value)
        (root / "dir").mkdir()
        trainer = Trainer(
            model=TinyLM(),
            train_dataloader=token_batches(4, batch_size=2),
            max_duration="4ba",
            loggers=[WandBLogger(project="foundry-test", tags=["test"])],
            run_folder=str(root / "run"),
            run_name="offline-demo",
            log_to_console=False,
            config={
                "tokenizer": {"name": "gpt2"},
                "variables": {"copied_key": FAKE_API_KEY},
                "loggers": {"wandb": {"init_kwargs": {"api_key": FAKE_API_KEY}}},
            },
        )
        trainer.fit()
        wandb.teardown()  # wandb keeps the first run's settings (WANDB_DIR) for the process: the next run starts anew
    (run_dir,) = (root / "dir" / "wandb").glob("offline-run-*")
    rows = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    return run_dir, rows


def _flushed_records(path: Path, timeout_s: float = 60.0) -> list:
    """The file's records once W&B's service has written the run's exit record (it writes after finish())."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = list(_records(path))
        if any(record.WhichOneof("record_type") == "exit" for record in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


def test_offline_run_holds_the_trainers_losses_by_step(offline_run):
    run_dir, rows = offline_run
    (wandb_file,) = run_dir.glob("*.wandb")
    history = {}
    for record in _flushed_records(wandb_file):
        if record.WhichOneof("record_type") == "history":
            # wandb-core writes history keys as one-element nested_key lists, not key.
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            if "loss/train/total" in items:
                history[items["_step"]] = items["loss/train/total"]
    logged = {row["step"]: row["loss/train/total"] for row in rows if "loss/train/total" in row}
    assert len(logged) == 4
    assert history == pytest.approx(logged, rel=1e-12)


def test_offline_run_config_is_the_yaml_with_secrets_redacted(offline_run):
    run_dir, _ = offline_run
    (wandb_file,) = run_dir.glob("*.wandb")
    (run_record,) = [r.run for r in _records(wandb_file) if r.WhichOneof("record_type") == "run"]
    config = {item.key: json.loads(item.value_json) for item in run_record.config.update}
    assert run_record.display_name == "offline-demo"
    assert config["tokenizer"] == {"name": "gpt2"}
    assert config["loggers"]["wandb"]["init_kwargs"]["api_key"] == "***"
    assert config["variables"]["copied_key"] == "***"


def test_the_runs_yaml_is_saved_with_the_run(offline_run):
    run_dir, _ = offline_run
    saved = yaml.safe_load((run_dir / "files" / CONFIG_FILE_NAME).read_text())
    assert saved["tokenizer"] == {"name": "gpt2"}


def test_the_api_key_appears_in_no_file_of_the_offline_run(offline_run):
    run_dir, _ = offline_run
    files = [path for path in run_dir.rglob("*") if path.is_file()]
    assert len(files) >= 3  # the .wandb log, the saved YAML, W&B's own logs
    assert not [path for path in files if FAKE_API_KEY.encode() in path.read_bytes()]
