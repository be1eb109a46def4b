"""ConsoleLogger: plain lines at the interval, eval lines, the end-of-fit summary, rank 0 only."""

from __future__ import annotations

import io

from foundry import registry
from foundry.core import Event, Time
from foundry.loggers import ConsoleLogger


def _train_to(console, state, fire, advance, batches, loss=1.0):
    """Train ``batches`` batches the way the Trainer reports them: BATCH_END, then the batch's loss."""
    for _ in range(batches):
        advance()
        fire(console, Event.BATCH_END)
        console.log_metrics({"loss/train/total": loss}, step=state.timestamp.batch)


def test_plain_line_shows_the_key_numbers(state, fire, advance, capsys):
    console = ConsoleLogger(log_interval="10ba", progress_bar=False)
    fire(console, Event.FIT_START)
    console.log_metrics(
        {
            "lr-AdamW/group0": 6e-4,
            "throughput/tokens_per_sec": 12345.0,
            "time/remaining_estimate": 0.1234,
            "memory/allocated_mem": 1.0,
        },
        step=20,
    )
    _train_to(console, state, fire, advance, 20, loss=3.21071)
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == (
        "[batch 20/200] loss/train/total: 3.2107 lr: 6.0e-04 "
        "throughput/tokens_per_sec: 1.2e+04 time/remaining_estimate: 7m24s"
    )


def test_lines_are_printed_only_at_the_interval(state, fire, advance, capsys):
    console = ConsoleLogger(log_interval="10ba", progress_bar=False)
    fire(console, Event.FIT_START)
    console.log_metrics({"loss/train/total": 1.0}, step=1)
    _train_to(console, state, fire, advance, 25)
    assert [line.split("]")[0] for line in capsys.readouterr().out.splitlines()] == ["[batch 10/200", "[batch 20/200"]


def test_line_carries_the_loss_logged_after_its_batch_end(state, fire, advance, capsys):
    console = ConsoleLogger(log_interval="1ba", progress_bar=False)
    fire(console, Event.FIT_START)
    _train_to(console, state, fire, advance, 1, loss=5.0)
    _train_to(console, state, fire, advance, 1, loss=4.0)
    assert capsys.readouterr().out.splitlines()[-1] == "[batch 2/200] loss/train/total: 4.0000"


def test_line_without_a_loss_prints_at_the_next_event(state, fire, advance, capsys):
    console = ConsoleLogger(log_interval="1ba", progress_bar=False)
    fire(console, Event.FIT_START)
    advance()
    fire(console, Event.BATCH_END)
    console.log_metrics({"throughput/tokens_per_sec": 100.0}, step=1)
    assert capsys.readouterr().out == ""
    fire(console, Event.BEFORE_DATALOADER)
    assert capsys.readouterr().out == "[batch 1/200] throughput/tokens_per_sec: 1.0e+02\n"


def test_batch_total_is_omitted_when_the_duration_is_in_tokens(state, fire, advance, capsys):
    state.max_duration = Time.parse("1000tok")
    console = ConsoleLogger(log_interval="1ba", progress_bar=False)
    fire(console, Event.FIT_START)
    _train_to(console, state, fire, advance, 1)
    assert capsys.readouterr().out.startswith("[batch 1] ")


def test_remaining_time_uses_the_estimators_unit(state, fire, advance, capsys):
    console = ConsoleLogger(progress_bar=False)
    console.log_hyperparameters({"time/remaining_estimate_unit": "minutes"})
    fire(console, Event.FIT_START)
    console.log_metrics({"time/remaining_estimate": 7.5}, step=0)
    _train_to(console, state, fire, advance, 1)
    assert capsys.readouterr().out.strip().endswith("time/remaining_estimate: 7m30s")


def test_eval_metrics_are_printed_when_logged(capsys):
    console = ConsoleLogger(progress_bar=False)
    console.log_metrics({"metrics/eval/loss": 3.1, "metrics/eval/perplexity": 22.2}, step=40)
    assert capsys.readouterr().out == "[eval @ batch 40] metrics/eval/loss: 3.1000 metrics/eval/perplexity: 22.2000\n"


def test_llm_foundry_names_stay_off_the_console_but_token_accuracy_shows(capsys):
    console = ConsoleLogger(progress_bar=False)
    console.log_metrics({"metrics/train/LanguageCrossEntropy": 3.0, "metrics/train/TokenAccuracy": 0.2}, step=1)
    assert capsys.readouterr().out == ""  # the train metrics are not an eval line
    eval_metrics = {"metrics/eval/loss": 3.1, "metrics/eval/LanguageCrossEntropy": 3.1}
    console.log_metrics(
        {**eval_metrics, "metrics/eval/LanguagePerplexity": 22.2, "metrics/eval/TokenAccuracy": 0.25}, 40
    )
    assert capsys.readouterr().out == "[eval @ batch 40] metrics/eval/loss: 3.1000 metrics/eval/TokenAccuracy: 0.2500\n"


def test_summary_shows_first_and_last_losses_and_checkpoint(state, fire, advance, clock, capsys):
    console = ConsoleLogger(log_interval="100ba", progress_bar=False, clock=clock)
    fire(console, Event.FIT_START)
    for train_loss, eval_loss in [(10.5, 10.4), (4.25, 4.5), (3.125, 3.375)]:
        _train_to(console, state, fire, advance, 1, loss=train_loss)
        console.log_metrics({"metrics/eval/loss": eval_loss}, step=state.timestamp.batch)
    state.last_checkpoint_path = "runs/demo/checkpoints/ba3.pt"
    fire(console, Event.BATCH_CHECKPOINT)
    clock.now = 133.0
    fire(console, Event.FIT_END)
    summary = capsys.readouterr().out.split("Run summary\n")[1]
    assert summary.splitlines() == [
        "  batches            3",
        "  tokens             96",
        "  wall time          2m13s",
        "  loss/train/total   10.5000 (first) -> 3.1250 (last)",
        "  metrics/eval/loss  10.4000 (first) -> 3.3750 (last)",
        "  checkpoint         runs/demo/checkpoints/ba3.pt",
    ]


def test_summary_states_the_steady_throughput_and_mfu(state, fire, advance, clock, capsys):
    console = ConsoleLogger(log_interval="100ba", progress_bar=False, clock=clock)
    fire(console, Event.FIT_START)
    _train_to(console, state, fire, advance, 3)
    run_averages = {"throughput/run/tokens_per_sec": 61234.5, "throughput/run/device/mfu": 0.5763}
    console.log_metrics({**run_averages, "throughput/run/batches": 38, "time/first_batch_s": 48.2}, step=3)
    fire(console, Event.FIT_END)
    summary = capsys.readouterr().out.split("Run summary\n")[1]
    expected = "61,234 tokens/s, MFU 57.6% (average over the last 38 batches; the first took 48.2s)"
    assert f"  throughput        {expected}" in summary.splitlines()


def test_summary_does_not_show_the_checkpoint_the_run_loaded_as_its_checkpoint(state, fire, advance, clock, capsys):
    state.last_checkpoint_path = "runs/base/checkpoints/ep0-ba100"  # loaded before FIT_START; nothing saved
    console = ConsoleLogger(progress_bar=False, clock=clock)
    fire(console, Event.FIT_START)
    _train_to(console, state, fire, advance, 1)
    fire(console, Event.FIT_END)
    assert "checkpoint" not in capsys.readouterr().out.split("Run summary\n")[1]


def test_other_ranks_print_nothing(state, fire, advance, capsys):
    state.rank = 1
    console = ConsoleLogger(progress_bar=False)
    fire(console, Event.FIT_START)
    console.log_metrics({"loss/train/total": 1.0, "metrics/eval/loss": 1.0}, step=1)
    _train_to(console, state, fire, advance, 2)
    fire(console, Event.FIT_END)
    assert capsys.readouterr().out == ""


def test_progress_bar_counts_batches_and_carries_the_loss(state, fire, advance):
    state.max_duration = Time.parse("3ba")
    stream = io.StringIO()
    console = ConsoleLogger(progress_bar=True, stream=stream)
    fire(console, Event.FIT_START)
    _train_to(console, state, fire, advance, 3, loss=2.5)
    fire(console, Event.FIT_END)
    output = stream.getvalue()
    assert "3/3" in output
    assert "loss=2.5000" in output


def test_progress_bar_shows_the_loss_of_the_batch_it_counts(state, fire, advance):
    state.max_duration = Time.parse("3ba")
    stream = io.StringIO()
    console = ConsoleLogger(progress_bar=True, stream=stream)
    fire(console, Event.FIT_START)
    _train_to(console, state, fire, advance, 1, loss=5.0)
    _train_to(console, state, fire, advance, 1, loss=4.0)
    shown = stream.getvalue().split("\r")[-1]  # what the terminal shows now
    assert "2/3" in shown and "loss=4.0000" in shown


def test_progress_bar_loss_is_current_between_intervals(state, fire, advance):
    state.max_duration = Time.parse("30ba")
    stream = io.StringIO()
    console = ConsoleLogger(log_interval="10ba", progress_bar=True, stream=stream)
    fire(console, Event.FIT_START)
    _train_to(console, state, fire, advance, 1, loss=5.0)
    _train_to(console, state, fire, advance, 1, loss=4.0)
    shown = stream.getvalue().split("\r")[-1]
    assert "2/30" in shown and "loss=4.0000" in shown


def test_registered_as_console():
    assert registry.loggers.get("console") is ConsoleLogger
