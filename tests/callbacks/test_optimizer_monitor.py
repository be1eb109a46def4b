"""OptimizerMonitor: Composer's norm names with exact values, logged at its interval with one host read."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import RendezvousStore, TinyLM, token_batches

from foundry.callbacks import OptimizerMonitor
from foundry.callbacks.optimizer_monitor import full_norms
from foundry.core import Event
from foundry.errors import ConfigError
from foundry.trainer import Trainer

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def adam_state(state):
    """The callbacks' State holding TinyLM with gradients from one loss and an Adam optimizer."""
    state.model = TinyLM()
    state.optimizers = [torch.optim.Adam(state.model.parameters(), lr=0.1)]
    batch = token_batches(1, batch_size=2)[0]
    state.model.loss(state.model(batch), batch).backward()
    return state


def _one_batch(monitor: OptimizerMonitor, state, fire) -> None:
    """The events of one batch around a real optimizer step (grads cleared as the Trainer does)."""
    fire(monitor, Event.BEFORE_OPTIMIZER_STEP)
    state.optimizers[0].step()
    state.optimizers[0].zero_grad(set_to_none=True)
    fire(monitor, Event.AFTER_OPTIMIZER_STEP)
    state.timestamp = state.timestamp.after_batch(2, 16, 0.0)
    fire(monitor, Event.BATCH_END)


def test_norms_match_a_per_parameter_computation(adam_state, fire, recorder):
    model = adam_state.model
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    _one_batch(OptimizerMonitor(log_interval="1ba"), adam_state, fire)
    metrics, step = recorder.calls[-1]
    assert step == 1
    adam = adam_state.optimizers[0].state
    expected_global = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()]))
    assert metrics["l2_norm/grad/global"] == pytest.approx(expected_global.item(), rel=1e-6)
    for name, param in model.named_parameters():
        assert metrics[f"l2_norm/grad/{name}"] == pytest.approx(grads[name].norm().item(), rel=1e-6)
        assert metrics[f"l2_norm/param/{name}"] == pytest.approx(param.norm().item(), rel=1e-6)
        assert metrics[f"l2_norm/moment/{name}"] == pytest.approx(adam[param]["exp_avg"].norm().item(), rel=1e-6)
        second = adam[param]["exp_avg_sq"].sqrt().norm().item()
        assert metrics[f"l2_norm/second_moment_sqrt/{name}"] == pytest.approx(second, rel=1e-6)


def test_without_optimizer_metrics_only_the_global_norm_is_logged(adam_state, fire, recorder):
    _one_batch(OptimizerMonitor(log_optimizer_metrics=False, log_interval="1ba"), adam_state, fire)
    assert list(recorder.calls[-1][0]) == ["l2_norm/grad/global"]


def test_global_norm_reuses_gradient_clippings_pre_clip_norm(adam_state, fire, recorder):
    adam_state.grad_norm = torch.tensor(123.0)  # as gradient_clipping sets it
    _one_batch(OptimizerMonitor(log_optimizer_metrics=False, log_interval="1ba"), adam_state, fire)
    assert recorder.last("l2_norm/grad/global") == 123.0


def test_one_host_read_per_logged_batch(adam_state, fire, host_reads):
    monitor = OptimizerMonitor(log_interval="1ba")
    fire(monitor, Event.BEFORE_OPTIMIZER_STEP)
    adam_state.optimizers[0].step()
    host_reads.clear()  # torch's Adam reads its step count on CPU; only the monitor's reads count here
    fire(monitor, Event.AFTER_OPTIMIZER_STEP)
    fire(monitor, Event.BATCH_END)
    assert host_reads == ["tolist"]


def test_logs_only_every_log_interval_batches(tmp_path, recorder):
    trainer = Trainer(
        model=TinyLM(),
        train_dataloader=token_batches(4, batch_size=2),
        max_duration="4ba",
        callbacks=[OptimizerMonitor(log_interval="2ba")],
        loggers=[recorder],
        log_to_console=False,
        run_folder=str(tmp_path / "run"),
    )
    trainer.fit()
    logged = [(step, metrics) for metrics, step in recorder.calls if "l2_norm/grad/global" in metrics]
    assert [step for step, _ in logged] == [2, 4]
    assert "l2_norm/moment/head.weight" in logged[-1][1]


def test_log_interval_must_be_in_batches():
    with pytest.raises(ConfigError, match="log_interval"):
        OptimizerMonitor(log_interval="1ep")


def _sharded_norms(rank: int, world_size: int, rendezvous_env: dict[str, str], queue) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    os.environ.update(rendezvous_env)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        torch.manual_seed(0)
        full = [torch.randn(4, 3), torch.randn(3), torch.randn(1, 2)]  # (3,) and (1, 2): uneven and empty shards
        sharded = [distribute_tensor(tensor, mesh, [Shard(0)]) for tensor in full]
        queue.put((rank, full_norms(sharded).tolist(), full_norms(sharded, ord=1).tolist()))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_fsdp2_shards_give_the_global_norm_on_every_rank(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO_ROOT))  # spawned ranks import this module as tests.callbacks...
    rendezvous = RendezvousStore()
    context = mp.get_context("spawn")
    queue = context.Queue()
    mp.start_processes(_sharded_norms, args=(2, rendezvous.env, queue), nprocs=2, start_method="spawn")
    torch.manual_seed(0)
    full = [torch.randn(4, 3), torch.randn(3), torch.randn(1, 2)]
    expected_l2 = [tensor.norm().item() for tensor in full]
    expected_l1 = [tensor.abs().sum().item() for tensor in full]
    for _ in range(2):
        _, l2, l1 = queue.get(timeout=30)
        assert l2 == pytest.approx(expected_l2, rel=1e-6)
        assert l1 == pytest.approx(expected_l1, rel=1e-6)
