"""torch_compile compiles each block in place: same losses, same parameter names.

The parity test uses dynamo's ``aot_eager`` backend: it traces forward and backward graphs as inductor
does, without inductor's C++/Triton code generation, which takes minutes on a 2-core CPU runner.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from helpers import builds_graphs
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.registry import lookup_backend

from foundry.algorithms import TorchCompile
from foundry.algorithms.torch_compile import from_compile_config
from foundry.core import LoggerDestination
from foundry.core.event import Event
from foundry.core.parallel_dims import ParallelDims
from foundry.errors import ConfigError
from foundry.trainer import Trainer
from tests.algorithms.conftest import train_tiny_mpt

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _broken_compiler(graph, example_inputs):
    raise RuntimeError("this compiler is broken")


def _eager_compiler(graph, example_inputs):
    return graph


BROKEN_FORWARD = _broken_compiler
BROKEN_BACKWARD = aot_autograd(fw_compiler=_eager_compiler, bw_compiler=_broken_compiler)


class Recorder(LoggerDestination):
    """The metrics and texts a run logs."""

    def __init__(self):
        self.metrics, self.texts = [], []

    def log_metrics(self, metrics, step):
        self.metrics.append(metrics)

    def log_text(self, text):
        self.texts.append(text)


@dataclass
class CompiledRun:
    """One compiled training run that several tests inspect (compiling is most of a test's time on a CPU)."""

    trainer: Trainer
    losses: list[float]
    recorder: Recorder
    graphs: list  # each graph the backend was handed, in order
    warnings: list[warnings.WarningMessage]


def _compiled_run(tmp_path_factory, scope: str, **compile_keys) -> CompiledRun:
    graphs = []

    def counting_aot_eager(graph, example_inputs):
        graphs.append(graph)
        return lookup_backend("aot_eager")(graph, example_inputs)

    torch._dynamo.reset()
    recorder = Recorder()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, losses = train_tiny_mpt(
            [TorchCompile(backend=counting_aot_eager, scope=scope, **compile_keys)],
            tmp_path=tmp_path_factory.mktemp(scope),
            loggers=[recorder],
        )
    return CompiledRun(trainer, losses, recorder, graphs, caught)


@pytest.fixture(scope="module")
def eager_losses(tmp_path_factory) -> list[float]:
    return train_tiny_mpt(tmp_path=tmp_path_factory.mktemp("eager"))[1]


@pytest.fixture(scope="module")
def compiled_blocks(tmp_path_factory) -> CompiledRun:
    """Each block compiled, and the loss: 3 batches."""
    return _compiled_run(tmp_path_factory, "blocks", compile_loss=True)


@pytest.fixture(scope="module")
def compiled_model(tmp_path_factory) -> CompiledRun:
    """The whole model compiled: 3 batches."""
    return _compiled_run(tmp_path_factory, "model")


def test_compiled_blocks_train_to_the_same_losses(compiled_blocks, eager_losses):
    assert compiled_blocks.graphs and compiled_blocks.losses == pytest.approx(eager_losses, rel=1e-5)


def test_compile_keeps_parameter_names(compiled_blocks):
    names = [name for name, _ in compiled_blocks.trainer.state.model.named_parameters()]
    assert "transformer.blocks.0.attn.Wqkv.weight" in names
    assert not any("_orig_mod" in name for name in names)


def test_every_block_forward_is_compiled(compiled_blocks):
    blocks = compiled_blocks.trainer.state.model.transformer.blocks
    assert all("forward" in vars(block) for block in blocks)  # an instance attribute: the compiled function


def test_compile_time_is_logged_once(compiled_blocks):
    recorder = compiled_blocks.recorder
    compile_times = [m["time/compile_s"] for m in recorder.metrics if "time/compile_s" in m]
    assert len(compile_times) == 1 and compile_times[0] > 0
    assert sum("the first forward took" in text for text in recorder.texts) == 1


def test_model_without_blocks_is_a_config_error(tiny_lm):
    with pytest.raises(ConfigError, match="torch_compile found no transformer blocks"):
        Trainer(model=tiny_lm, algorithms=[TorchCompile(backend="eager")], device="cpu", log_to_console=False)


def test_whole_model_compile_trains_to_the_same_losses(compiled_model, eager_losses):
    model = compiled_model.trainer.state.model
    assert compiled_model.graphs and compiled_model.losses == pytest.approx(eager_losses, rel=1e-5)
    assert "forward" in vars(model)
    assert not any("forward" in vars(block) for block in model.transformer.blocks)


def test_compiled_training_warns_about_nothing(compiled_model):
    assert not [w for w in compiled_model.warnings if "torch.compile failed" in str(w.message)]


def test_whole_model_compile_runs_eval_forwards_eagerly(compiled_model):
    model, compiled_graphs = compiled_model.trainer.state.model, len(compiled_model.graphs)
    model.eval()
    try:
        with torch.no_grad():
            model({"input_ids": torch.zeros(2, 16, dtype=torch.long)})
    finally:
        model.train()
    assert compiled_graphs > 0 and len(compiled_model.graphs) == compiled_graphs


def test_whole_model_compile_runs_the_fused_loss_outside_the_graph(train):
    fused = {"loss_fn": "fused_crossentropy"}
    _, eager = train(model_keys=fused)
    with builds_graphs():
        _, compiled = train([TorchCompile(backend="aot_eager", scope="model")], model_keys=fused)
    assert compiled == pytest.approx(eager, rel=1e-5)


def test_mode_and_options_together_are_a_config_error():
    with pytest.raises(ConfigError, match="both mode .* and options"):
        TorchCompile(mode="max-autotune", options={"coordinate_descent_tuning": True})


def test_unknown_scope_is_a_config_error():
    with pytest.raises(ConfigError, match="scope is 'layers'"):
        TorchCompile(scope="layers")


def test_unknown_inductor_option_is_a_config_error_naming_close_ones():
    with pytest.raises(ConfigError, match="'coordinate_decent_tuning'.*Did you mean coordinate_descent_tuning"):
        TorchCompile(options={"coordinate_decent_tuning": True})


def test_options_and_scope_reach_torch_compile(train, monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: calls.append((fn, kwargs)) or fn)
    options = {"coordinate_descent_tuning": True}
    trainer, _ = train([TorchCompile(scope="model", options=options)], num_batches=1)
    ((compiled, kwargs),) = calls
    assert compiled.__func__ is type(trainer.state.model).forward and kwargs["options"] == options


@pytest.mark.parametrize("backend", [BROKEN_FORWARD, BROKEN_BACKWARD], ids=["forward", "backward"])
@pytest.mark.parametrize("scope", ["blocks", "model"])
def test_a_compiler_error_falls_back_to_eager_with_one_warning(train, eager_losses, backend, scope):
    with pytest.warns(UserWarning, match="torch.compile failed.*continues with the eager model") as caught:
        trainer, losses = train([TorchCompile(backend=backend, scope=scope, compile_loss=True)])
    assert len([w for w in caught if "torch.compile failed" in str(w.message)]) == 1
    assert losses == pytest.approx(eager_losses, rel=1e-6)
    assert trainer.state.timestamp.batch == 3


def test_a_compiler_error_inside_a_checkpointed_block_stops_with_the_keys_to_change():
    """Part of the block ran compiled (and saved tensors in the checkpoint) before the error; an eager re-run
    would save them twice and backward's recomputation would refuse the mismatch (seen on GPUs, 2026-11-27)."""
    from foundry.algorithms.torch_compile import CompiledForwards
    from foundry.distributed.activation_checkpoint import checkpoint_closing_on_error

    def checkpoint(function, *args, **kwargs):
        return checkpoint_closing_on_error(function, *args, **kwargs)

    graphs = []

    def second_graph_fails(gm, example_inputs):
        graphs.append(gm)
        if len(graphs) > 1:
            raise RuntimeError("the second graph does not compile")
        return gm.forward

    def block(x):
        y = x.sin() * x
        torch._dynamo.graph_break()
        return (y.cos() * y).sum()

    torch._dynamo.reset()
    compiled = CompiledForwards().wrap(block, {"backend": second_graph_fails})
    x = torch.randn(4, requires_grad=True)
    with pytest.raises(ConfigError, match="inside an activation-checkpointed block.*compile_config: false"):
        checkpoint(compiled, x, use_reentrant=False)
    assert len(graphs) == 2  # the first part had compiled and run
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None  # the failed checkpoint closed
    checkpoint(compiled, x, use_reentrant=False).backward()  # later calls run eager: no second failure
    torch.testing.assert_close(x.grad, torch.func.grad(block)(x.detach()))


def test_a_checkpointed_forward_that_raises_leaves_no_hooks_behind() -> None:
    """torch 2.11 left a failed non-reentrant checkpoint's saved-tensor hooks installed while the error lived;
    every later checkpointed block then failed its recomputation (an OOM retried by auto microbatching, say)."""
    from foundry.distributed.activation_checkpoint import checkpoint_closing_on_error

    def fails(x):
        x.sin()
        raise torch.OutOfMemoryError("out of memory")

    x = torch.randn(4, requires_grad=True)
    with pytest.raises(torch.OutOfMemoryError) as caught:
        checkpoint_closing_on_error(fails, x, use_reentrant=False)
    assert caught.value is not None  # the error, and its traceback, still alive
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    checkpoint_closing_on_error(lambda t: (t.sin() * t).sum(), x, use_reentrant=False).backward()
    torch.testing.assert_close(x.grad, x.detach().sin() + x.detach() * x.detach().cos())


def test_compile_config_auto_compiles_only_on_a_gpu():
    assert from_compile_config("auto", CPU, sharded=False) is None
    assert from_compile_config("auto", CUDA, sharded=False).scope == "model"
    assert from_compile_config("auto", CUDA, sharded=True).scope == "blocks"


def test_compile_config_false_never_compiles_and_true_compiles_everywhere():
    assert from_compile_config(False, CUDA, sharded=False) is None
    assert from_compile_config(True, CPU, sharded=True).scope == "blocks"


def test_compile_config_mapping_sets_the_algorithm_keys():
    algorithm = from_compile_config({"scope": "blocks", "backend": "aot_eager"}, CPU, sharded=False)
    assert algorithm.scope == "blocks" and algorithm.compile_kwargs["backend"] == "aot_eager"


@pytest.mark.parametrize(("dynamic", "ep", "compiled_as"), [("auto", 2, None), ("auto", 1, False), (False, 2, False)])
def test_dynamic_auto_gives_symbols_under_expert_parallelism_only(tiny_lm, dynamic, ep, compiled_as):
    """The rows an expert-parallel rank receives change every step; a ``dynamic`` the user sets stays."""
    algorithm = TorchCompile(dynamic=dynamic, backend="eager", scope="model")
    state = SimpleNamespace(model=tiny_lm, parallel_dims=ParallelDims(ep=ep))
    algorithm.apply(Event.INIT, state, logger=None)
    assert algorithm.compile_kwargs["dynamic"] is compiled_as


def test_compile_config_typo_names_the_key():
    with pytest.raises(ConfigError, match=r"'compile_config\.scop'.*Did you mean 'scope'"):
        from_compile_config({"scop": "model"}, CUDA, sharded=False)
