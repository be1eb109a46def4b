"""YAML → TrainConfig: interpolation, overrides, validation messages, and LLM Foundry's own YAMLs."""

from __future__ import annotations

import inspect
import textwrap
from pathlib import Path

import pytest
from helpers import TinyLM

from foundry.algorithms import ActivationCheckpointing
from foundry.config import TrainConfig, load_train_config
from foundry.core.time import Time
from foundry.data import build_finetuning_dataloader, build_text_dataloader
from foundry.data.config import LOADER_DEFAULTS, LoaderConfig, TokenizerConfig
from foundry.distributed.config import FSDP_DEFAULTS, FSDPConfig
from foundry.errors import ConfigError
from foundry.schema import field_defaults
from foundry.trainer import TRAINER_SECTIONS, Trainer
from foundry.yaml_config import apply_overrides, load_yaml, resolve_interpolations, to_yaml

MINIMAL = """\
variables:
  max_seq_len: 64
  run_name: tiny
run_name: ${variables.run_name}
max_seq_len: ${variables.max_seq_len}
model:
  name: tiny_test_model
  max_seq_len: ${variables.max_seq_len}
tokenizer:
  name: gpt2
train_loader:
  name: text
  dataset:
    local: ./data/${variables.run_name}
    max_seq_len: ${variables.max_seq_len}
optimizer:
  name: decoupled_adamw
  lr: 6.0e-4
max_duration: 10ba
global_train_batch_size: 8
"""


def write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


# --------------------------------------------------------------------------------- interpolation
def test_whole_reference_keeps_the_referenced_type() -> None:
    resolved = resolve_interpolations({"variables": {"n": 256}, "model": {"max_seq_len": "${variables.n}"}})
    assert resolved["model"]["max_seq_len"] == 256


def test_embedded_reference_is_substituted_as_text() -> None:
    resolved = resolve_interpolations({"variables": {"n": 4}, "path": "./runs/n${variables.n}/ckpt"})
    assert resolved["path"] == "./runs/n4/ckpt"


def test_references_chain_through_other_references() -> None:
    cfg = {"variables": {"a": "${variables.b}", "b": "${model.d}"}, "model": {"d": [1, 2]}, "x": "${variables.a}"}
    assert resolve_interpolations(cfg)["x"] == [1, 2]


def test_reference_to_a_list_item_by_index() -> None:
    assert resolve_interpolations({"betas": [0.9, 0.95], "b2": "${betas.1}"})["b2"] == 0.95


def test_variables_are_dropped_after_resolution() -> None:
    assert "variables" not in resolve_interpolations({"variables": {"a": 1}, "b": "${variables.a}"})


def test_interpolation_cycle_is_an_error_naming_the_chain() -> None:
    with pytest.raises(ConfigError, match=r"cycle: a -> b -> a"):
        resolve_interpolations({"a": "${b}", "b": "${a}"})


def test_reference_to_its_own_parent_is_a_cycle() -> None:
    with pytest.raises(ConfigError, match="cycle"):
        resolve_interpolations({"model": {"x": "${model}"}})


def test_unknown_reference_names_the_holding_key_and_missing_path() -> None:
    with pytest.raises(ConfigError) as error:
        resolve_interpolations({"variables": {"max_seq_len": 8}, "model": {"n": "${variables.max_seq_lne}"}})
    message = str(error.value)
    assert "'model.n'" in message and "'variables.max_seq_lne' does not exist" in message
    assert "Did you mean 'max_seq_len'?" in message


# ------------------------------------------------------------------------------------ overrides
def test_override_reads_scientific_notation_without_a_dot_as_float() -> None:
    assert apply_overrides({"optimizer": {"lr": 1.0}}, ["optimizer.lr=3e-4"])["optimizer"]["lr"] == 3e-4


def test_override_reads_a_yaml_list() -> None:
    assert apply_overrides({}, ["optimizer.betas=[0.9,0.95]"])["optimizer"]["betas"] == [0.9, 0.95]


def test_override_reads_an_empty_mapping() -> None:
    assert apply_overrides({"loggers": None}, ["loggers.wandb={}"])["loggers"] == {"wandb": {}}


def test_override_creates_missing_nested_mappings() -> None:
    updated = apply_overrides({"model": {"name": "m"}}, ["model.attn_config.alibi=true"])
    assert updated["model"] == {"name": "m", "attn_config": {"alibi": True}}


def test_override_indexes_lists() -> None:
    updated = apply_overrides({"eval_loader": [{"label": "a"}, {"label": "b"}]}, ["eval_loader.1.label=c"])
    assert [loader["label"] for loader in updated["eval_loader"]] == ["a", "c"]


def test_override_of_a_component_to_null_drops_it() -> None:
    cfg = {"callbacks": {"speed_monitor": None, "lr_monitor": {}}, "loggers": {"wandb": {}}}
    updated = apply_overrides(cfg, ["callbacks.speed_monitor=null", "loggers.wandb=null", "algorithms.ema=null"])
    assert updated["callbacks"] == {"lr_monitor": {}} and updated["loggers"] == {}
    assert "algorithms" not in updated or not updated["algorithms"]


def test_icl_max_seq_len_is_icl_seq_len(tmp_path: Path) -> None:
    cfg, _ = load_train_config(write(tmp_path, MINIMAL + "icl_max_seq_len: 96\n"))
    assert cfg.icl_seq_len == 96
    with pytest.raises(ConfigError, match="keep one"):
        load_train_config(write(tmp_path, MINIMAL + "icl_max_seq_len: 96\nicl_seq_len: 64\n"))


def test_a_loader_dataset_without_max_seq_len_takes_the_top_level_one(tmp_path: Path) -> None:
    text = MINIMAL.replace(
        "    max_seq_len: ${variables.max_seq_len}\noptimizer", "optimizer"
    )  # as a `<<:` merge drops it
    cfg, _ = load_train_config(write(tmp_path, text))
    assert (
        "max_seq_len: ${variables" not in text.split("train_loader")[1]
        and cfg.train_loader.dataset["max_seq_len"] == 64
    )


def test_override_keeps_the_value_after_the_first_equals_sign() -> None:
    assert apply_overrides({}, ["load_path=s3://b/x=1.pt"])["load_path"] == "s3://b/x=1.pt"


def test_override_does_not_edit_the_input() -> None:
    cfg = {"optimizer": {"lr": 1.0}}
    apply_overrides(cfg, ["optimizer.lr=2.0"])
    assert cfg["optimizer"]["lr"] == 1.0


def test_override_without_equals_sign_is_an_error_with_an_example() -> None:
    with pytest.raises(ConfigError, match=r"key\.path=value, e\.g\. optimizer\.lr=3e-4"):
        apply_overrides({}, ["optimizer.lr"])


def test_override_of_a_variable_reaches_every_reference(tmp_path: Path) -> None:
    cfg, _ = load_train_config(write(tmp_path, MINIMAL), ["variables.max_seq_len=256"])
    assert cfg.max_seq_len == 256 and cfg.model["max_seq_len"] == 256
    assert cfg.train_loader.dataset["max_seq_len"] == 256


def test_override_of_an_interpolated_key_wins_over_the_variable(tmp_path: Path) -> None:
    cfg, _ = load_train_config(write(tmp_path, MINIMAL), ["model.max_seq_len=32"])
    assert cfg.model["max_seq_len"] == 32 and cfg.max_seq_len == 64


def test_override_through_a_yaml_alias_changes_only_its_own_key(tmp_path: Path) -> None:
    path = write(tmp_path, "a: &shared {x: 1}\nb: *shared\n")
    updated = apply_overrides(load_yaml(path), ["a.x=2"])
    assert updated["a"]["x"] == 2 and updated["b"]["x"] == 1


# ------------------------------------------------------------------------------ files and typing
def test_yaml_file_reads_exponent_floats_as_floats(tmp_path: Path) -> None:
    assert load_yaml(write(tmp_path, "lr: 1e-4\n"))["lr"] == pytest.approx(1e-4)


def test_missing_yaml_file_error_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nope.yaml' does not exist"):
        load_yaml(tmp_path / "nope.yaml")


def test_yaml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "model:\n  name: x\n bad: [1\n")
    with pytest.raises(ConfigError, match=r"cfg\.yaml' at line 3"):
        load_yaml(path)


def test_minimal_yaml_parses_into_typed_config(tmp_path: Path) -> None:
    cfg, resolved = load_train_config(write(tmp_path, MINIMAL))
    assert cfg.max_duration == Time.parse("10ba")
    assert cfg.optimizer == {"name": "decoupled_adamw", "lr": 6.0e-4}
    assert isinstance(cfg.train_loader, LoaderConfig) and cfg.train_loader.dataset["local"] == "./data/tiny"
    assert resolved["run_name"] == "tiny" and "variables" not in resolved


def test_unknown_top_level_key_names_it_and_the_closest_key(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + "max_durations: 5ba\n")
    expected = r"cfg\.yaml: Unknown top-level key 'max_durations'\. Did you mean 'max_duration'"
    with pytest.raises(ConfigError, match=expected):
        load_train_config(path)


def test_unknown_nested_key_names_its_path_and_the_closest_key(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + "fsdp_config:\n  sharding_stratgy: FULL_SHARD\n")
    with pytest.raises(ConfigError, match=r"'fsdp_config\.sharding_stratgy'\. Did you mean 'sharding_strategy'"):
        load_train_config(path)


def test_wrong_type_error_names_key_value_and_expected_type(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + "eval_first: maybe\n")
    with pytest.raises(ConfigError, match=r"'eval_first' is 'maybe' \(str\); expected bool"):
        load_train_config(path)


def test_bad_literal_value_lists_the_choices(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'precision' is 'amp_bf61'.*Did you mean 'amp_bf16'"):
        load_train_config(write(tmp_path, MINIMAL), ["precision=amp_bf61"])


def test_microbatch_size_accepts_auto(tmp_path: Path) -> None:
    cfg, _ = load_train_config(write(tmp_path, MINIMAL), ["device_train_microbatch_size=auto"])
    assert cfg.device_train_microbatch_size == "auto"


def test_empty_section_means_its_default(tmp_path: Path) -> None:
    cfg, _ = load_train_config(write(tmp_path, MINIMAL + "callbacks:\nsave_interval:\n"))
    assert cfg.callbacks == {} and cfg.save_interval == Time.parse("1000ba")


def test_fsdp_config_parses_llm_foundry_keys(tmp_path: Path) -> None:
    text = MINIMAL + "fsdp_config:\n  mixed_precision: PURE\n  limit_all_gathers: true\n"
    cfg, _ = load_train_config(write(tmp_path, text))
    assert cfg.fsdp_config == FSDPConfig(mixed_precision="PURE", limit_all_gathers=True)


def test_eval_loader_list_becomes_labelled_eval_loaders(tmp_path: Path) -> None:
    text = MINIMAL + "eval_loader:\n  - {name: text, label: c4}\n  - {name: text, label: code}\n"
    cfg, _ = load_train_config(write(tmp_path, text))
    assert cfg.eval_loader is None and [loader.label for loader in cfg.eval_loaders] == ["c4", "code"]


def test_missing_icl_tasks_file_is_named_under_its_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'icl_tasks'.*eval/yamls/tasks.yaml.*neither a file.*v0.3"):
        load_train_config(write(tmp_path, MINIMAL + "icl_tasks: eval/yamls/tasks.yaml\n"))


def test_missing_run_name_comes_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUN_NAME", "from-env")
    cfg, resolved = load_train_config(write(tmp_path, MINIMAL), ["variables.run_name=null"])
    assert cfg.run_name == "from-env" and resolved["run_name"] == "from-env"


def test_printed_config_loads_back_to_the_same_config(tmp_path: Path) -> None:
    cfg, _ = load_train_config(write(tmp_path, MINIMAL + "fsdp_config: {verbose: true}\n"))
    again, _ = load_train_config(write(tmp_path, to_yaml(cfg), name="printed.yaml"))
    assert again == cfg


def test_python_api_builds_the_same_config_without_yaml() -> None:
    cfg = TrainConfig(
        model={"name": "m"},
        tokenizer=TokenizerConfig(name="gpt2"),
        train_loader=LoaderConfig(name="text"),
        optimizer={"name": "adamw"},
        max_duration=Time.parse("1ep"),
        global_train_batch_size=4,
        run_name="api",
    )
    assert cfg.seed == 17 and cfg.run_name == "api"


def keyword_defaults(function: object, defaults: object, leave_out: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """(``function``'s keyword defaults, the config's) for the keys that both give a default."""
    parameters = inspect.signature(function).parameters
    shared = [
        name
        for name in vars(defaults)
        if name in parameters and parameters[name].default is not inspect.Parameter.empty and name not in leave_out
    ]
    return {name: parameters[name].default for name in shared}, {name: getattr(defaults, name) for name in shared}


def test_the_trainers_settings_and_the_yamls_keys_are_the_same_sections() -> None:
    # One field per setting: a train YAML's keys are the Trainer's sections, never copies of them.
    assert all(issubclass(TrainConfig, section) for section in TRAINER_SECTIONS)


def test_a_trainer_given_no_settings_runs_with_the_yamls_defaults(tmp_path: Path) -> None:
    trainer = Trainer(TinyLM(), run_folder=str(tmp_path), run_name="defaults")
    yaml = field_defaults(TrainConfig)
    given = {"run_name", "run_folder"}
    settings = {f: getattr(section, f) for section in trainer.settings for f in section.__dataclass_fields__}
    assert {key: value for key, value in settings.items() if key not in given} == {
        key: getattr(yaml, key) for key in settings if key not in given
    }
    assert settings["precision"] == "auto" and settings["save_interval"] == Time.parse("1000ba")


def test_an_unknown_trainer_setting_names_the_closest_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown setting 'save_foldr'.*save_folder"):
        Trainer(TinyLM(), run_folder=str(tmp_path), save_foldr="x")


def test_a_trainer_setting_of_the_wrong_type_names_the_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'precision' is 'bf16'"):
        Trainer(TinyLM(), run_folder=str(tmp_path), precision="bf16")


@pytest.mark.parametrize("build", [build_text_dataloader, build_finetuning_dataloader])
def test_dataloader_keywords_default_to_the_loader_section_defaults(build: object) -> None:
    builder, yaml = keyword_defaults(build, LOADER_DEFAULTS)
    assert "drop_last" in builder and builder == yaml


def test_activation_checkpointing_is_non_reentrant_by_default_from_both_switches() -> None:
    algorithm = inspect.signature(ActivationCheckpointing).parameters["reentrant"].default
    fsdp_config = FSDPConfig().activation_checkpointing_reentrant
    assert algorithm is fsdp_config is FSDP_DEFAULTS.activation_checkpointing_reentrant is False


def test_generated_run_names_of_the_same_second_differ(monkeypatch):
    from foundry.core.run_name import default_run_name, is_generated_run_name

    monkeypatch.delenv("RUN_NAME", raising=False)
    monkeypatch.delenv("COMPOSER_RUN_NAME", raising=False)
    monkeypatch.setattr("time.strftime", lambda pattern: "20261126-120000")  # one second for every launch
    names = {default_run_name() for _ in range(20)}
    assert len(names) > 15  # 4 hex digits: two of 20 launches collide with a chance of 0.3%
    assert all(is_generated_run_name(name) for name in names)
    assert is_generated_run_name("foundry-20261126-120000")  # a name older foundry generated
    assert not is_generated_run_name("foundry-20261126-120000-mine")


def _keys_it_takes(target) -> set[str]:
    """The keywords a component takes: its signature's, or for ``config: XConfig | ..., **keys`` XConfig's fields."""
    import dataclasses
    import typing

    function = target.__init__ if inspect.isclass(target) else target
    if function is object.__init__:
        return set()
    parameters = inspect.signature(function).parameters
    names = {name for name, p in parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    if not any(p.kind == p.VAR_KEYWORD for p in parameters.values()):
        return names - {"self", "params"}
    hints = typing.get_type_hints(function)
    configs = [arg for hint in hints.values() for arg in typing.get_args(hint) if dataclasses.is_dataclass(arg)]
    return {field.name for field in dataclasses.fields(configs[0])}


def test_component_keys_read_from_the_source_are_the_ones_each_component_takes() -> None:
    from foundry import registry
    from foundry.config.component_keys import accepted_keys

    read = 0
    sources = (registry.models, registry.optimizers, registry.schedulers, registry.callbacks, registry.algorithms)
    for source in (*sources, registry.loggers):
        for name in source:
            static = accepted_keys(source, name)
            if static is not None:
                read += 1
                assert static == _keys_it_takes(source.get(name)), f"{source.name}.{name}"
    assert read >= 30  # every built-in component but those without a constructor of their own (lr_monitor)


def test_a_component_key_typo_names_the_closest_key_before_the_component_is_imported() -> None:
    from foundry.config.component_keys import check_component_keys

    cfg, _ = load_train_config(Path(__file__).parents[1] / "yamls" / "quickstart.yaml", ["model.n_layrs=2"])
    with pytest.raises(ConfigError, match=r"Unknown key 'model\.n_layrs'\. Did you mean 'n_layers'\?"):
        check_component_keys(cfg)
    cfg, _ = load_train_config(Path(__file__).parents[1] / "yamls" / "quickstart.yaml")
    check_component_keys(cfg)  # the quickstart's own keys pass


def test_a_component_that_takes_no_keys_refuses_one_by_name() -> None:
    from foundry import registry

    with pytest.raises(ConfigError, match=r"Unknown key 'callbacks\.lr_monitor\.x'.*'callbacks\.lr_monitor': none\."):
        registry.bound_component(registry.callbacks, "lr_monitor", {"x": 1}, "callbacks.lr_monitor")


# ---------------------------------------------------------------------------------- tp_config
def test_llm_foundry_tp_config_sets_the_tensor_parallel_degree(tmp_path: Path) -> None:
    cfg, _ = load_train_config(write(tmp_path, MINIMAL + "tp_config:\n  tensor_parallel_degree: 2\n"))
    assert cfg.parallelism.tensor_parallel_degree == 2


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ("tp_config:\n  strategy: ffn\n  tensor_parallel_degree: 2\n", "'tp_config.strategy' has no foundry"),
        ("tp_config:\n  layer_plan: {}\n", "'tp_config.layer_plan' has no foundry"),
        (
            "tp_config:\n  tensor_parallel_degree: 2\nparallelism:\n  tensor_parallel_degree: 4\n",
            "'tp_config.tensor_parallel_degree' is 2 but 'parallelism.tensor_parallel_degree' is 4",
        ),
    ],
    ids=["strategy", "layer_plan", "two-degrees"],
)
def test_tp_config_keys_without_an_equivalent_are_refused_by_name(tmp_path: Path, extra: str, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        load_train_config(write(tmp_path, MINIMAL + extra))
