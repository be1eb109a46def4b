"""Values that cannot work are refused before any model or loader is built, naming the key and the fix."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path
from typing import Any

import pytest
from helpers import TinyLM, token_batches

from foundry import registry
from foundry.cli import main
from foundry.config import TrainConfig, load_train_config
from foundry.config import build as builders
from foundry.config.build import build_trainer
from foundry.core.time import Time
from foundry.data.config import LoaderConfig, TokenizerConfig
from foundry.errors import ConfigError
from foundry.trainer import Trainer


def _never_built(**_: Any) -> Any:
    raise AssertionError("a model or loader was built before the config was validated")


registry.models.register("test_validation_never_built", _never_built)
registry.dataloaders.register("test_validation_never_built", _never_built)

YAML = """\
model: {name: test_validation_never_built}
tokenizer: {name: no-such-tokenizer}
train_loader: {name: test_validation_never_built}
optimizer: {name: decoupled_adamw, lr: 6.0e-4, betas: [0.9, 0.95], eps: 1.0e-8}
max_duration: 10ba
global_train_batch_size: 8
"""


def _load(tmp_path: Path, *overrides: str) -> TrainConfig:
    path = tmp_path / "cfg.yaml"
    path.write_text(textwrap.dedent(YAML))
    return load_train_config(path, overrides)[0]


def _config(tmp_path: Path, **changes: Any) -> TrainConfig:
    cfg = TrainConfig(
        run_name="v",
        model={"name": "test_validation_never_built"},
        tokenizer=TokenizerConfig(name="no-such-tokenizer"),
        train_loader=LoaderConfig(name="test_validation_never_built"),
        optimizer={"name": "decoupled_adamw", "lr": 6e-4},
        max_duration=Time.parse("10ba"),
        global_train_batch_size=8,
        run_folder=str(tmp_path / "run"),
    )
    return dataclasses.replace(cfg, **changes)


# ------------------------------------------------------------------------------ times and counts
@pytest.mark.parametrize(
    ("key", "fix"),
    [
        ("max_duration", "Set how long to train"),
        ("eval_interval", "'1dur'"),
        ("save_interval", "'1dur'"),
        ("console_log_interval", "longer interval"),
    ],
)
def test_a_zero_time_is_refused_naming_the_key_and_the_fix(tmp_path: Path, key: str, fix: str) -> None:
    with pytest.raises(ConfigError, match=rf"'{key}' is 0ba; it must be more than 0\. .*{fix}"):
        _load(tmp_path, f"{key}=0ba")


@pytest.mark.parametrize("key", ["max_duration", "save_interval"])
def test_a_negative_time_is_refused(tmp_path: Path, key: str) -> None:
    with pytest.raises(ConfigError, match=r"-4ba is negative"):
        _load(tmp_path, f"{key}=-4ba")


@pytest.mark.parametrize("value", [0, -2])
def test_eval_subset_num_batches_of_zero_is_refused(tmp_path: Path, value: int) -> None:
    expected = rf"'eval_subset_num_batches' is {value}; it must be an integer >= 1 .*, or -1 \(the whole eval set\)"
    with pytest.raises(ConfigError, match=expected):
        _load(tmp_path, f"eval_subset_num_batches={value}")


def test_the_trainer_refuses_zero_times_and_subsets_too(tmp_path: Path) -> None:
    common = {"model": TinyLM(), "train_dataloader": token_batches(1, 2), "run_folder": str(tmp_path)}
    with pytest.raises(ConfigError, match=r"'save_interval' is 0ba"):
        Trainer(**common, max_duration="1ba", save_interval="0ba")
    with pytest.raises(ConfigError, match=r"'max_duration' is 0ep"):
        Trainer(**common, max_duration="0ep")
    with pytest.raises(ConfigError, match=r"'eval_subset_num_batches' is 0"):
        Trainer(**common, max_duration="1ba", eval_subset_num_batches=0)


# ------------------------------------------------------------------------------------ paths
@pytest.mark.parametrize("url", ["hdfs://cluster/ckpts", "http://host/ckpts", "hf://org/repo"])
@pytest.mark.parametrize("key", ["save_folder", "load_path"])
def test_an_unsupported_url_scheme_is_refused_at_validation_with_the_supported_ones(
    tmp_path: Path, key: str, url: str
) -> None:
    with pytest.raises(
        ConfigError, match=rf"'{key}' is '{url}', a \w+:// URL.*Supported object stores: s3://, gs://, oci://, azure://"
    ):
        _load(tmp_path, f"{key}={url}")


@pytest.mark.parametrize("url", ["s3://bucket/ckpts", "gs://bucket/ckpts", "oci://bucket@ns/ckpts", "azure://c/ckpts"])
def test_an_object_store_save_folder_and_load_path_pass_validation(tmp_path: Path, url: str) -> None:
    cfg = _load(tmp_path, f"save_folder={url}", f"load_path={url}/ep0-ba4")
    assert (cfg.save_folder, cfg.load_path) == (url, f"{url}/ep0-ba4")


def test_the_trainer_refuses_an_unsupported_url_without_writing_a_local_folder(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"'save_folder' is 'ftp://host/x'.*Supported object stores"):
        Trainer(model=TinyLM(), max_duration="1ba", save_folder="ftp://host/x", run_folder=str(tmp_path))
    assert not Path("ftp:").exists()


def test_an_unwritable_save_folder_is_refused_before_anything_is_built(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"'save_folder' is '.*a-file/ckpts', but .*a-file is a file.*another"):
        build_trainer(_config(tmp_path, save_folder=str(blocker / "ckpts")))


def test_a_missing_load_path_is_refused_before_anything_is_built(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'load_path' is '.*absent', where nothing exists.*checkpoint folder"):
        build_trainer(_config(tmp_path, load_path=str(tmp_path / "absent")))


# ------------------------------------------------------------------------------------ optimizer
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optimizer.lr=-1", r"'optimizer.lr' is -1.0; it must be a finite number >= 0, e.g. 6.0e-4"),
        ("optimizer.lr=.nan", r"'optimizer.lr' is nan; it must be a finite number >= 0"),
        ("optimizer.lr=.inf", r"'optimizer.lr' is inf; it must be a finite number >= 0"),
        ("optimizer.betas=[0.9]", r"'optimizer.betas' is \[0.9\]; it must be a pair \[beta1, beta2\], each in"),
        ("optimizer.betas=[0.9,1.0]", r"'optimizer.betas' is \[0.9, 1.0\]; it must be a pair"),
        ("optimizer.eps=0", r"'optimizer.eps' is 0.0; it must be a finite number > 0, e.g. 1.0e-8"),
        ("optimizer.weight_decay=-0.1", r"'optimizer.weight_decay' is -0.1; it must be a finite number >= 0"),
    ],
)
def test_optimizer_hyperparameters_are_checked_before_anything_is_built(
    tmp_path: Path, override: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        build_trainer(_load(tmp_path, override, f"run_folder={tmp_path / 'run'}"))


def test_the_command_line_prints_the_message_and_exits_2(tmp_path: Path, capsys) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text(YAML)
    assert main(["train", str(path), "optimizer.lr=-1", f"run_folder={tmp_path / 'run'}"]) == 2
    assert "'optimizer.lr' is -1.0" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("scheduler.t_warmup=-5ba", "scheduler.t_warmup"),
        ("scheduler.t_max=0.5ep", "scheduler.t_max"),
        ("callbacks={hand_over: {interval: -2ba}}", "callbacks.hand_over.interval"),
        ("callbacks={optimizer_monitor: {log_interval: -1ba}}", "callbacks.optimizer_monitor.log_interval"),
        ("algorithms={ema: {half_life: -10ba}}", "algorithms.ema.half_life"),
    ],
)
def test_a_wrong_time_names_its_key_before_anything_is_built(override, key, monkeypatch, capsys):
    def must_not_build(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a component was built before the config was checked")

    monkeypatch.setattr(builders, "build_components", must_not_build)
    monkeypatch.setattr(builders, "build_model", must_not_build)
    assert main(["train", str(Path(__file__).parents[1] / "yamls" / "quickstart.yaml"), override]) == 2
    assert f"'{key}'" in capsys.readouterr().err
