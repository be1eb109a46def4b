"""The loop's contract: event order, algorithms apply, exact gradient accumulation, exact resumption."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import TinyLM, token_batches

from foundry import Algorithm, Callback, Event, LoggerDestination
from foundry.errors import ConfigError
from foundry.optim import CosineWithWarmupScheduler, DecoupledAdamW
from foundry.trainer import Trainer


class RecordEvents(Callback):
    def __init__(self) -> None:
        self.events: list[Event] = []

    def run_event(self, event, state, logger) -> None:
        self.events.append(event)


def _trainer(tmp_path, model=None, **kwargs) -> Trainer:
    kwargs.setdefault("train_dataloader", token_batches(4, batch_size=4))
    kwargs.setdefault("max_duration", "4ba")
    kwargs.setdefault("log_to_console", False)
    kwargs.setdefault("precision", "fp32")  # exact gradients and losses: no bf16 autocast
    kwargs.setdefault("device", "cpu")  # its checks compare with CPU tensors, also on a GPU machine
    return Trainer(model=model or TinyLM(), run_folder=str(tmp_path / "run"), **kwargs)


def test_event_order_for_a_fit_with_eval_and_checkpoint(tmp_path):
    recorder = RecordEvents()
    trainer = _trainer(
        tmp_path,
        train_dataloader=token_batches(2, batch_size=4),
        max_duration="2ba",
        device_train_microbatch_size=2,
        eval_dataloader=token_batches(1, batch_size=2),
        eval_interval="2ba",
        save_folder=str(tmp_path / "ckpt"),
        save_interval="2ba",
        callbacks=[recorder],
    )
    trainer.fit()
    microbatch = [
        Event.BEFORE_FORWARD,
        Event.AFTER_FORWARD,
        Event.BEFORE_LOSS,
        Event.AFTER_LOSS,
        Event.BEFORE_BACKWARD,
        Event.AFTER_BACKWARD,
    ]
    batch = [
        Event.BEFORE_DATALOADER,
        Event.AFTER_DATALOADER,
        Event.BATCH_START,
        *microbatch,
        *microbatch,
        Event.BEFORE_OPTIMIZER_STEP,
        Event.AFTER_OPTIMIZER_STEP,
        Event.BATCH_END,
    ]
    evaluation = [
        Event.EVAL_START,
        Event.EVAL_BATCH_START,
        Event.EVAL_BEFORE_FORWARD,
        Event.EVAL_AFTER_FORWARD,
        Event.EVAL_BATCH_END,
        Event.EVAL_END,
    ]
    assert recorder.events == [
        Event.INIT,
        Event.AFTER_LOAD,
        Event.FIT_START,
        Event.EPOCH_START,
        *batch,
        *batch,
        Event.BEFORE_CHECKPOINT,
        Event.BATCH_CHECKPOINT,
        Event.EPOCH_END,
        *evaluation,
        Event.FIT_END,
    ]
    assert trainer.state.last_checkpoint_path.endswith("ep0-ba2")


def test_epochs_and_counters(tmp_path):
    trainer = _trainer(tmp_path, train_dataloader=token_batches(3, batch_size=2, seq_len=5), max_duration="2ep")
    trainer.fit()
    stamp = trainer.state.timestamp
    assert (stamp.epoch, stamp.batch, stamp.sample, stamp.token, stamp.batch_in_epoch) == (2, 6, 12, 60, 0)


def test_algorithm_that_changes_state_is_applied(tmp_path):
    class ZeroLoss(Algorithm):
        def match(self, event, state):
            return event == Event.AFTER_LOSS

        def apply(self, event, state, logger):
            state.loss = state.loss * 0.0

    model = TinyLM()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = _trainer(
        tmp_path, model=model, algorithms=[ZeroLoss()], optimizers=lambda params: torch.optim.SGD(params, lr=1.0)
    )
    trainer.fit()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # Without the algorithm the same run moves the weights: the test above can fail.
    other = TinyLM()
    _trainer(tmp_path, model=other, optimizers=lambda params: torch.optim.SGD(params, lr=1.0)).fit()
    assert not all(torch.equal(a, b) for a, b in zip(before, other.parameters()))


class CaptureGrads(Callback):
    def before_optimizer_step(self, state, logger) -> None:
        self.grads = [p.grad.detach().clone() for p in state.model.parameters()]


def _padded_batch(batch_size: int = 8, seq_len: int = 6) -> dict:
    generator = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, 32, (batch_size, seq_len), generator=generator)
    lengths = torch.tensor([6, 2, 5, 3, 6, 4, 2, 6])  # uneven real tokens per sample
    attention_mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()
    return {"input_ids": input_ids, "attention_mask": attention_mask}


@pytest.mark.parametrize("microbatch_size", [8, 2, 3])
def test_gradient_accumulation_matches_one_big_batch(tmp_path, microbatch_size):
    torch.manual_seed(0)
    reference_model = TinyLM()
    batch = _padded_batch()
    reference_model.loss(reference_model(batch), batch).backward()
    expected = [p.grad.detach().clone() for p in reference_model.parameters()]

    model = TinyLM()
    model.load_state_dict(reference_model.state_dict())
    capture = CaptureGrads()
    _trainer(
        tmp_path,
        model=model,
        train_dataloader=[batch],
        max_duration="1ba",
        callbacks=[capture],
        device_train_microbatch_size=microbatch_size,
    ).fit()
    for got, want in zip(capture.grads, expected):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def _resumable_trainer(tmp_path, max_duration: str, **kwargs) -> Trainer:
    torch.manual_seed(0)
    model = TinyLM()
    return _trainer(
        tmp_path,
        model=model,
        train_dataloader=token_batches(4, batch_size=4),
        max_duration=max_duration,
        optimizers=lambda params: DecoupledAdamW(params, lr=1e-2, weight_decay=1e-2),
        schedulers=CosineWithWarmupScheduler(t_warmup="2ba", alpha_f=0.1, t_max="6ba"),
        **kwargs,
    )


def test_resume_continues_the_exact_run(tmp_path):
    uninterrupted = _resumable_trainer(tmp_path / "a", "6ba")
    uninterrupted.fit()

    first = _resumable_trainer(tmp_path / "b", "3ba", save_folder=str(tmp_path / "ckpt"), save_interval="3ba")
    first.fit()
    resumed = _resumable_trainer(tmp_path / "c", "6ba", load_path=str(tmp_path / "ckpt"))
    assert resumed.state.timestamp.batch == 3
    resumed.fit()
    for a, b in zip(uninterrupted.state.model.parameters(), resumed.state.model.parameters()):
        assert torch.equal(a, b)
    assert resumed.state.lrs == uninterrupted.state.lrs


def test_eval_reports_token_weighted_loss_and_perplexity(tmp_path):
    eval_batches = token_batches(2, batch_size=3)
    trainer = _trainer(tmp_path, eval_dataloader=eval_batches)
    metrics = trainer.eval()["eval"]
    model = trainer.state.model
    with torch.no_grad():
        losses = [model.loss(model(b), b) * model.loss_weight(b) for b in eval_batches]
        expected = sum(losses) / sum(model.loss_weight(b) for b in eval_batches)
    assert metrics["loss"] == pytest.approx(expected.item(), rel=1e-6)
    assert metrics["perplexity"] == pytest.approx(torch.exp(expected).item(), rel=1e-6)


def test_plain_module_returning_a_loss_trains(tmp_path):
    class Regression(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(2, 1)

        def forward(self, x, y):
            return torch.nn.functional.mse_loss(self.linear(x), y)

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(16, 2, generator=generator)
    data = [{"x": x, "y": x @ torch.tensor([[2.0], [-1.0]])}]
    trainer = _trainer(
        tmp_path,
        model=Regression(),
        train_dataloader=data,
        max_duration="200ba",
        optimizers=lambda params: torch.optim.SGD(params, lr=0.1),
    )
    trainer.fit()
    assert trainer.state.loss.item() < 1e-3


def test_stop_reason_ends_fit_after_the_batch(tmp_path):
    class StopAtTwo(Callback):
        def batch_end(self, state, logger):
            if state.timestamp.batch == 2:
                state.stop_reason = "enough"

    trainer = _trainer(tmp_path, callbacks=[StopAtTwo()], max_duration="10ba")
    trainer.fit()
    assert trainer.state.timestamp.batch == 2


def test_skip_optimizer_step_drops_only_that_batchs_update(tmp_path):
    class SkipSecond(Callback):
        def before_optimizer_step(self, state, logger):
            state.skip_optimizer_step = state.timestamp.batch == 1

    def trained_weights(batches, callbacks):
        torch.manual_seed(0)
        trainer = _trainer(
            tmp_path, model=TinyLM(), train_dataloader=batches, max_duration=f"{len(batches)}ba",
            optimizers=lambda params: torch.optim.SGD(params, lr=0.1), callbacks=callbacks,
        )  # fmt: skip
        trainer.fit()
        return [p.detach() for p in trainer.state.model.parameters()]

    b0, b1, b2 = token_batches(3, batch_size=4)
    skipped = trained_weights([b0, b1, b2], [SkipSecond()])
    without_b1 = trained_weights([b0, b2], [])
    assert all(torch.equal(a, b) for a, b in zip(skipped, without_b1))


def test_fit_without_dataloader_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="train_dataloader"):
        _trainer(tmp_path, train_dataloader=None).fit()


def test_amp_fp16_on_cpu_is_rejected(tmp_path):
    with pytest.raises(ConfigError, match="amp_fp16"):
        _trainer(tmp_path, precision="amp_fp16", device="cpu")


def test_amp_bf16_trains_on_cpu(tmp_path):
    trainer = _trainer(tmp_path, precision="amp_bf16")
    assert trainer.state.precision == "amp_bf16"  # asked for: kept, although the CPU default is fp32
    trainer.fit()
    assert torch.isfinite(trainer.state.loss)


def test_a_cpu_trainer_given_no_precision_computes_in_fp32(tmp_path):
    trainer = Trainer(TinyLM(), train_dataloader=token_batches(1, batch_size=2), max_duration="1ba", device="cpu",
                      run_folder=str(tmp_path), log_to_console=False)  # fmt: skip
    assert trainer.state.precision == "fp32"
    trainer.fit()
    assert trainer.state.loss.dtype == torch.float32


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))],
)
def test_a_meta_model_starts_from_the_cpu_init_weights_on_any_device(tmp_path, device):
    """The CUDA generator draws other numbers than the CPU's: placement initialises on the CPU, then moves."""
    from helpers import TINY_MPT

    from foundry.models import MPTCausalLM

    torch.manual_seed(0)
    expected = MPTCausalLM(**TINY_MPT, init_device="cpu").state_dict()
    model = MPTCausalLM(**TINY_MPT, init_device="meta")
    trainer = Trainer(model=model, device=device, seed=0, run_folder=str(tmp_path), log_to_console=False)
    placed = trainer.state.model.state_dict()
    for name, weight in expected.items():
        assert torch.equal(placed[name].cpu(), weight), name


class RecordLosses(LoggerDestination):
    """Each ``loss/train/total`` as it reaches a destination: (step, value, the batch the run was at)."""

    def __init__(self) -> None:
        self.received: list[tuple[int, float, int]] = []
        self.batch = 0

    def batch_end(self, state, logger) -> None:
        self.batch = state.timestamp.batch

    def log_metrics(self, metrics, step) -> None:
        if "loss/train/total" in metrics:
            self.received.append((step, metrics["loss/train/total"], self.batch))


def test_train_loss_reaches_metric_loggers_every_batch_not_only_at_the_console_interval(tmp_path):
    recorder = RecordLosses()
    _trainer(tmp_path, console_log_interval="2ba", loggers=[recorder]).fit()
    assert [step for step, _, _ in recorder.received] == [1, 2, 3, 4]


def test_device_losses_wait_on_the_device_until_the_interval_then_arrive_in_order(tmp_path, monkeypatch):
    # CPU tensors convert for free; treat them as on an accelerator to see the queue a GPU run uses.
    monkeypatch.setattr("foundry.core.logger._on_accelerator", lambda value: isinstance(value, torch.Tensor))
    recorder = RecordLosses()
    trainer = _trainer(tmp_path, console_log_interval="2ba", loggers=[recorder])
    trainer.fit()
    assert [(step, at_batch) for step, _, at_batch in recorder.received] == [(1, 2), (2, 2), (3, 4), (4, 4)]
    assert all(isinstance(value, float) for _, value, _ in recorder.received)


def test_trainer_is_importable_from_the_package() -> None:
    import foundry

    assert foundry.Trainer is Trainer


def test_default_run_name_and_run_folder_are_the_yamls(tmp_path, monkeypatch):
    monkeypatch.delenv("RUN_NAME", raising=False)
    monkeypatch.setenv("COMPOSER_RUN_NAME", "from-env")
    monkeypatch.chdir(tmp_path)
    trainer = Trainer(model=TinyLM(), train_dataloader=token_batches(1, 4), max_duration="1ba", log_to_console=False)
    assert trainer.state.run_name == "from-env"
    assert trainer.run_folder == Path("runs/from-env")


class _DataSGD(torch.optim.Optimizer):
    """SGD that writes ``p.data``, as some optimizers do: the weights change without a version-counter bump."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.data.add_(param.grad, alpha=-group["lr"])


class BatchLosses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def batch_end(self, state, logger) -> None:
        self.losses.append(state.loss.item())


def _losses_and_head(tmp_path, precision: str, fuse: bool) -> tuple[list[float], torch.nn.Module]:
    torch.manual_seed(0)
    model, record = TinyLM(), BatchLosses()
    _trainer(
        tmp_path / f"{precision}-{fuse}",
        model=model,
        train_dataloader=token_batches(1, batch_size=4) * 6,  # one batch again: the loss falls fast
        max_duration="6ba",
        precision=precision,
        device_train_microbatch_size=2,
        optimizers=lambda params: _DataSGD(params, lr=2.0),
        fuse_weight_grad_accumulation=fuse,
        callbacks=[record],
    ).fit()
    return record.losses, model.head


@pytest.mark.parametrize("precision", ["fp32", "amp_bf16"])
def test_summing_weight_gradients_in_the_gemm_trains_like_autograd(tmp_path, precision):
    """The default (each linear sums its weight gradient, bf16 weights cast once a batch) against plain autograd."""
    from foundry.kernels.weight_grad import AccumulatingLinear

    fused, fused_head = _losses_and_head(tmp_path, precision, fuse=True)
    plain, plain_head = _losses_and_head(tmp_path, precision, fuse=False)
    assert type(fused_head) is AccumulatingLinear and type(plain_head) is torch.nn.Linear
    assert fused_head.weight_grad_sum is None  # released after fit: a plain linear for loops of one's own
    assert plain[-1] < plain[0] - 0.1  # the weights move enough that a stale bf16 copy would show
    tolerance = {"fp32": 1e-5, "amp_bf16": 1e-2}[precision]
    torch.testing.assert_close(torch.tensor(fused), torch.tensor(plain), rtol=tolerance, atol=tolerance)


def test_llm_foundry_metric_names_are_logged_for_train_and_eval(tmp_path, recorder):
    batches = token_batches(1, batch_size=4)
    trainer = _trainer(
        tmp_path, train_dataloader=batches, eval_dataloader=batches, max_duration="1ba", loggers=[recorder]
    )
    model = trainer.state.model
    with torch.no_grad():  # the batch as the model sees it before its one step
        logits = model(batches[0])
        loss = model.loss(logits, batches[0])
        targets = torch.roll(batches[0]["input_ids"], -1, dims=1)[:, :-1]
        accuracy = (logits[:, :-1].argmax(-1) == targets).float().mean()
    trainer.fit()
    assert recorder.last("metrics/train/LanguageCrossEntropy") == pytest.approx(loss.item(), rel=1e-5)
    assert recorder.last("metrics/train/LanguageCrossEntropy") == pytest.approx(recorder.last("loss/train/total"))
    assert recorder.last("metrics/train/LanguagePerplexity") == pytest.approx(torch.exp(loss).item(), rel=1e-5)
    assert recorder.last("metrics/train/TokenAccuracy") == pytest.approx(accuracy.item())
    with torch.no_grad():  # after the step: what eval scores
        logits = model(batches[0])
        eval_loss = model.loss(logits, batches[0])
        eval_accuracy = (logits[:, :-1].argmax(-1) == targets).float().mean()
    assert recorder.last("metrics/eval/LanguageCrossEntropy") == pytest.approx(eval_loss.item(), rel=1e-5)
    assert recorder.last("metrics/eval/LanguagePerplexity") == pytest.approx(torch.exp(eval_loss).item(), rel=1e-5)
    assert recorder.last("metrics/eval/TokenAccuracy") == pytest.approx(eval_accuracy.item())
    assert recorder.last("metrics/eval/loss") == pytest.approx(eval_loss.item(), rel=1e-5)  # foundry's own names too
