"""LRMonitor: one metric per optimizer param group, named as Composer users know."""

from __future__ import annotations

import torch

from foundry import registry


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(1))]


def test_logs_every_param_group(state, recorder, train_batch):
    state.optimizers = [torch.optim.SGD([{"params": _params(), "lr": 0.1}, {"params": _params(), "lr": 0.01}])]
    train_batch(registry.callbacks.get("lr_monitor")())
    assert recorder.calls[-1][0] == {"lr-SGD/group0": 0.1, "lr-SGD/group1": 0.01}


def test_two_optimizers_of_one_class_do_not_overwrite_each_other(state, recorder, train_batch):
    state.optimizers = [torch.optim.AdamW(_params(), lr=1e-3), torch.optim.AdamW(_params(), lr=2e-3)]
    train_batch(registry.callbacks.get("lr_monitor")())
    assert recorder.calls[-1][0] == {"lr-AdamW/group0": 1e-3, "lr-AdamW_1/group0": 2e-3}
