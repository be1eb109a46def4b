"""Config → components → Trainer, with tiny fake components registered under test-only names."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers import TinyLM, token_batches

from foundry import registry
from foundry.algorithms.torch_compile import TorchCompile, compile_algorithm
from foundry.config import TrainConfig
from foundry.config import build as builders
from foundry.config.build import build_eval_dataloaders, build_trainer, device_train_batch_size
from foundry.core import Callback
from foundry.core.time import Time
from foundry.data.config import LoaderConfig, TokenizerConfig
from foundry.errors import ConfigError
from foundry.models.build import build_model
from foundry.preference import PreferenceConfig
from foundry.registry import build_components, component_factory
from foundry.trainer import Trainer

VOCAB_SIZE = 32


class VocabLM(TinyLM):
    def __init__(self, vocab_size: int = VOCAB_SIZE, d_model: int = 8) -> None:
        super().__init__(vocab_size, d_model)
        self.vocab_size = vocab_size


def config_lm(vocab_size: int = VOCAB_SIZE) -> TinyLM:
    """A model that keeps vocab_size on .config, as MPT and Hugging Face models do."""
    model = TinyLM(vocab_size)
    model.config = SimpleNamespace(vocab_size=vocab_size)
    return model


class FakeTokenizer:
    def __init__(self, name: str, vocab_size: int = VOCAB_SIZE) -> None:
        self.name = name
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return self.vocab_size


LOADER_CALLS: list[dict[str, Any]] = []


def fake_loader(
    tokenizer: Any,
    device_batch_size: int,
    dataset: dict[str, Any],
    drop_last: bool,
    num_workers: int,
    pin_memory: bool,
    prefetch_factor: int | None,
    persistent_workers: bool,
    timeout: float,
) -> list:
    LOADER_CALLS.append({"device_batch_size": device_batch_size, "dataset": dataset, "num_workers": num_workers})
    return token_batches(dataset.get("num_batches", 2), device_batch_size, vocab_size=VOCAB_SIZE)


class CountBatches(Callback):
    def __init__(self, every: int = 1) -> None:
        self.every = every
        self.batches = 0

    def batch_end(self, state, logger) -> None:
        self.batches += 1


registry.models.register("test_builders_lm", VocabLM)
registry.models.register("test_builders_config_lm", config_lm)
registry.dataloaders.register("test_builders_loader", fake_loader)
registry.callbacks.register("test_builders_count", CountBatches)


@pytest.fixture(autouse=True)
def fake_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(builders, "load_tokenizer", FakeTokenizer)
    LOADER_CALLS.clear()


def make_config(tmp_path: Path, **changes: Any) -> TrainConfig:
    cfg = TrainConfig(
        run_name="tiny",
        model={"name": "test_builders_lm"},
        tokenizer=TokenizerConfig(name="fake"),
        train_loader=LoaderConfig(name="test_builders_loader", dataset={"num_batches": 3}, num_workers=1),
        optimizer={"name": "decoupled_adamw", "lr": "3e-4"},
        max_duration=Time.parse("2ba"),
        global_train_batch_size=4,
        precision="fp32",
        device="cpu",
        progress_bar=False,
        log_to_console=False,
        expandable_segments=False,
        run_folder=str(tmp_path / "{run_name}"),
    )
    return dataclasses.replace(cfg, **changes)


# ---------------------------------------------------------------------------------- batch sizes
def test_device_batch_is_the_global_batch_split_over_processes() -> None:
    assert device_train_batch_size(256, 8) == 32


def test_indivisible_global_batch_names_both_numbers() -> None:
    with pytest.raises(ConfigError, match=r"global_train_batch_size \(10\) is not divisible .*\(4\)"):
        device_train_batch_size(10, 4)


def test_tensor_parallel_ranks_share_their_samples() -> None:
    assert device_train_batch_size(8, 4, tensor_parallel_degree=2) == 4
    with pytest.raises(ConfigError, match=r"different samples \(3: 6 processes / parallelism.tensor_parallel_degree 2"):
        device_train_batch_size(8, 6, tensor_parallel_degree=2)


TP_LLAMA = {"name": "llama_causal_lm", "d_model": 32, "n_heads": 4, "n_layers": 2, "vocab_size": 64, "max_seq_len": 16}


@pytest.mark.parametrize(
    ("model", "parallelism", "world_size", "named"),
    [
        ({**TP_LLAMA, "kv_n_heads": 1}, {"tensor_parallel_degree": 2}, 2, "divide model.kv_n_heads .* \\(1\\)"),
        ({**TP_LLAMA, "kv_n_heads": None}, {"tensor_parallel_degree": 2}, 3, "does not divide the 3 ranks"),
        (
            {**TP_LLAMA, "kv_n_heads": None},
            {"tensor_parallel_degree": 2, "expert_parallel_degree": 2},
            2,
            "'parallelism.expert_parallel_degree' is 2; foundry does not combine tensor and expert parallelism",
        ),
        (
            {"name": "test_builders_lm"},
            {"tensor_parallel_degree": 2},
            2,
            "'test_builders_lm' declares no tensor-parallel",
        ),
        ({**TP_LLAMA, "kv_n_heads": None, "icl_tasks": True}, {"tensor_parallel_degree": 2}, 2, "icl_tasks are set"),
        ({**TP_LLAMA, "kv_n_heads": None, "fused_kernels": True}, {"tensor_parallel_degree": 2}, 2, "fused_kernels"),
        ({**TP_LLAMA, "kv_n_heads": None, "blockwise": True}, {"tensor_parallel_degree": 2}, 2, "recipe: blockwise"),
        (
            {
                **TP_LLAMA,
                "kv_n_heads": None,
                "peft_config": {"r": 2, "target_modules": ["Wqkv"]},
                "hf_checkpointer": True,
            },
            {"tensor_parallel_degree": 2},
            2,
            "callbacks.hf_checkpointer",
        ),
    ],
    ids=["kv-heads", "world", "with-ep", "no-plan", "icl", "sp-fused-norms", "blockwise-float8", "lora-export"],
)
def test_tensor_parallel_degree_is_checked_before_any_rank_starts(tmp_path, model, parallelism, world_size, named):
    from foundry.distributed.config import ParallelismConfig

    icl = {"icl_tasks": [{"label": "t", "dataset_uri": "t.jsonl", "icl_task_type": "language_modeling"}]}
    sections = icl if model.pop("icl_tasks", None) else {}
    sections |= {"algorithms": {"fused_kernels": {}}} if model.pop("fused_kernels", None) else {}
    sections |= {"algorithms": {"float8": {"recipe": "blockwise"}}} if model.pop("blockwise", None) else {}
    sections |= (
        {"callbacks": {"hf_checkpointer": {"save_folder": "x", "save_interval": "1ba"}}}
        if model.pop("hf_checkpointer", None)
        else {}
    )
    cfg = make_config(tmp_path, model=model, parallelism=ParallelismConfig(**parallelism), **sections)
    with pytest.raises(ConfigError, match=f"tensor_parallel_degree' is 2.*{named}"):
        builders.check_settings(cfg, world_size)


# --------------------------------------------------------------------------------------- models
def test_model_is_built_from_its_section() -> None:
    model = build_model({"name": "test_builders_lm", "vocab_size": 48}, FakeTokenizer("x", 40))
    assert isinstance(model, VocabLM) and model.vocab_size == 48


def test_tokenizer_larger_than_model_vocab_names_both_sizes() -> None:
    with pytest.raises(ConfigError, match=r"tokenizer has 40 tokens but model\.vocab_size is 32"):
        build_model({"name": "test_builders_lm"}, FakeTokenizer("x", 40))


def test_vocab_check_reads_the_model_config_too() -> None:
    with pytest.raises(ConfigError, match=r"model\.vocab_size is 32"):
        build_model({"name": "test_builders_config_lm"}, FakeTokenizer("x", 40))


def test_model_kwarg_typo_names_the_key_path() -> None:
    with pytest.raises(ConfigError, match=r"'model\.d_modle'\. Did you mean 'd_model'"):
        build_model({"name": "test_builders_lm", "d_modle": 8})


def test_unknown_model_name_is_an_error_with_a_suggestion() -> None:
    with pytest.raises(ConfigError, match=r"'model\.name'.*Did you mean 'test_builders_lm'"):
        build_model({"name": "test_builders_lmm"})


# --------------------------------------------------------------------------- optimizer & friends
def test_optimizer_kwargs_are_coerced_and_bound() -> None:
    factory = component_factory(registry.optimizers, {"name": "decoupled_adamw", "lr": "3e-4"}, "optimizer")
    optimizer = factory(VocabLM().parameters())
    assert optimizer.param_groups[0]["lr"] == pytest.approx(3e-4)


def test_optimizer_kwarg_typo_names_the_key_path() -> None:
    with pytest.raises(ConfigError, match=r"'optimizer\.lrr'\. Did you mean 'lr'"):
        component_factory(registry.optimizers, {"name": "decoupled_adamw", "lrr": 1.0}, "optimizer")


def test_callbacks_are_built_from_name_to_kwargs_with_empty_meaning_none() -> None:
    callbacks = build_components(registry.callbacks, {"test_builders_count": None}, "callbacks")
    assert isinstance(callbacks[0], CountBatches) and callbacks[0].every == 1


def test_unknown_callback_names_its_key_path() -> None:
    with pytest.raises(ConfigError, match=r"'callbacks\.test_builders_cont'.*Did you mean 'test_builders_count'"):
        build_components(registry.callbacks, {"test_builders_cont": {}}, "callbacks")


# ------------------------------------------------------------------------------------ eval data
def test_single_eval_loader_is_labelled_eval_and_uses_the_eval_batch_size(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, eval_loader=LoaderConfig(name="test_builders_loader"), device_eval_batch_size=3)
    loaders = build_eval_dataloaders(cfg, FakeTokenizer("x"))
    assert list(loaders) == ["eval"] and LOADER_CALLS[-1]["device_batch_size"] == 3


def test_eval_loader_without_eval_batch_size_is_an_error(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, eval_loader=LoaderConfig(name="test_builders_loader"))
    with pytest.raises(ConfigError, match="device_eval_batch_size"):
        build_eval_dataloaders(cfg, FakeTokenizer("x"))


def test_unlabelled_loader_among_several_is_an_error(tmp_path: Path) -> None:
    loaders = [LoaderConfig(name="test_builders_loader", label="a"), LoaderConfig(name="test_builders_loader")]
    cfg = make_config(tmp_path, eval_loaders=loaders, device_eval_batch_size=2)
    with pytest.raises(ConfigError, match=r"'eval_loaders\[1\]\.label' is missing"):
        build_eval_dataloaders(cfg, FakeTokenizer("x"))


# -------------------------------------------------------------------------------------- trainer
def test_built_trainer_trains_for_max_duration(tmp_path: Path) -> None:
    trainer = build_trainer(make_config(tmp_path, callbacks={"test_builders_count": {}}))
    trainer.fit()
    assert trainer.state.timestamp.batch == 2
    assert [c.batches for c in trainer.engine.callbacks if isinstance(c, CountBatches)] == [2]


def test_train_loader_gets_the_device_batch_and_its_settings(tmp_path: Path) -> None:
    build_trainer(make_config(tmp_path))
    assert LOADER_CALLS == [{"device_batch_size": 4, "dataset": {"num_batches": 3}, "num_workers": 1}]


def test_run_name_is_filled_into_run_and_save_folders(tmp_path: Path) -> None:
    trainer = build_trainer(make_config(tmp_path, save_folder=str(tmp_path / "{run_name}" / "ckpt")))
    assert Path(trainer.run_folder) == tmp_path / "tiny"
    assert trainer.save_folder == str(tmp_path / "tiny" / "ckpt")


def test_resolved_config_is_handed_to_the_trainer(tmp_path: Path) -> None:
    trainer = build_trainer(make_config(tmp_path), {"run_name": "tiny", "from": "yaml"})
    assert trainer.config == {"run_name": "tiny", "from": "yaml"}


def test_unimplemented_setting_is_rejected_not_ignored(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="save_weights_only"):
        build_trainer(make_config(tmp_path, save_weights_only=True))


# -------------------------------------------------------------------------------------- compile_config
CPU, GPU = torch.device("cpu"), torch.device("cuda")


def test_compile_config_auto_compiles_nothing_on_a_cpu() -> None:
    assert compile_algorithm("auto", [], CPU, sharded=False) == []


def test_compile_config_auto_compiles_the_whole_model_on_one_gpu_and_blocks_when_sharded() -> None:
    (one_gpu,) = compile_algorithm("auto", [], GPU, sharded=False)
    (sharded,) = compile_algorithm("auto", [], GPU, sharded=True)
    assert one_gpu.scope == "model" and sharded.scope == "blocks"


def test_compile_config_false_turns_compile_off_on_a_gpu() -> None:
    assert compile_algorithm(False, [], GPU, sharded=False) == []


def test_compile_config_auto_yields_to_an_explicit_torch_compile_algorithm() -> None:
    assert compile_algorithm("auto", [TorchCompile()], GPU, sharded=False) == []


@pytest.mark.parametrize("setting", [False, True, {"scope": "blocks"}])
def test_compile_config_and_torch_compile_algorithm_together_is_an_error(tmp_path: Path, setting: Any) -> None:
    cfg = make_config(tmp_path, compile_config=setting, algorithms={"torch_compile": {}})
    with pytest.raises(ConfigError, match="compile_config is .* and a torch_compile algorithm is given.*Keep one"):
        build_trainer(cfg)


def test_the_python_trainer_applies_compile_config_itself(tmp_path: Path) -> None:
    # The same selection foundry train makes: Trainer(...) adds the compile algorithm without a YAML.
    compiled = Trainer(VocabLM(), run_folder=str(tmp_path), device="cpu", compile_config=True)
    eager = Trainer(VocabLM(), run_folder=str(tmp_path), device="cpu")  # auto: never on a CPU
    assert [type(a) for a in compiled.engine.algorithms] == [TorchCompile]
    assert eager.engine.algorithms == []


def test_an_algorithm_listed_under_callbacks_names_its_section(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'callbacks\.nan_guard' is an algorithm.*move it under 'algorithms'"):
        build_trainer(make_config(tmp_path, callbacks={"nan_guard": {}}))


# ---------------------------------------------------------------------------------- preference tuning
def test_a_preference_section_without_a_preference_loader_is_refused_naming_the_loader(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, preference=PreferenceConfig())
    with pytest.raises(ConfigError, match=r"'preference' is set but 'train_loader.name' is 'test_builders_loader'"):
        builders.check_settings(cfg)


def test_a_preference_loader_without_a_preference_section_is_refused(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, train_loader=LoaderConfig(name="preference", dataset={"builtin": True}))
    with pytest.raises(ConfigError, match=r"'train_loader.name' is preference.*no 'preference' section"):
        builders.check_settings(cfg)


def test_preference_tuning_under_context_parallelism_is_refused_naming_the_degree(tmp_path: Path) -> None:
    loader = LoaderConfig(name="preference", dataset={"builtin": True})
    cfg = make_config(
        tmp_path, preference=PreferenceConfig(), train_loader=loader, parallelism={"context_parallel_degree": 2}
    )
    with pytest.raises(ConfigError, match=r"'parallelism.context_parallel_degree' is 2, but preference tuning"):
        builders.check_settings(cfg)
