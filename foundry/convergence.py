"""Did a run converge like a reference run? Loss curves aligned by tokens, a tolerance band, a yes/no answer.

``foundry compare REF RUN [RUN ...]`` reads each run's ``metrics.jsonl``, puts every curve on the axis of
tokens trained (so runs with other batch sizes or world sizes line up), interpolates the reference at
each other run's points, and reports per segment of the token range the largest and the mean
|Δ loss|, for the train loss and the eval loss. A run passes when, in every segment, its mean |Δ| is
within ``tolerance`` and its largest |Δ| within ``max_factor`` times that.

The default tolerance (0.02 nats on the mean, 0.1 on a single point) is twice the largest gap
docs/PERFORMANCE.md measured between bf16 and fp32 training of the same MPT-125M run over 200 batches
on an H100 (mean 0.0105, largest single step 0.043): a run that stays inside it differs from the
reference by no more than changing the arithmetic precision does. Runs that should match more closely
(the same device and precision) can pass a tighter ``--tolerance``, or derive it from a noise run: two
runs the user considers identical (``--noise RUN_A RUN_B``: the tolerance becomes twice their mean |Δ|).
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from foundry.errors import EXIT_CHECK_FAILED, EXIT_OK, DataError, FoundryError
from foundry.plotting import figure_class, metrics_path, read_run

TRAIN_LOSS = "loss/train/total"
EVAL_LOSS = "metrics/eval/loss"
TOKENS = "trainer/tokens"
DEFAULT_TOLERANCE = 0.02  # mean |Δ loss| per segment, nats (see the module docstring)
DEFAULT_MAX_FACTOR = 5.0  # the largest single |Δ| may be this many tolerances (0.1 nats by default)
MEASURABLE_NOISE = 1e-6  # train losses of two runs closer than this everywhere are the same run (float32 rounding)

Curve = list[tuple[float, float]]  # (tokens, loss), by increasing tokens


def loss_curves(run: str | Path) -> dict[str, Curve]:
    """``{metric: [(tokens, value), ...]}`` for the train and eval loss of a run folder or metrics.jsonl.

    Tokens come from ``trainer/tokens`` (logged with every train loss); a run written before that metric
    existed gets tokens from its hyperparameters (global_train_batch_size x max_seq_len a batch).
    """
    series = read_run(run)
    tokens_at = dict(series.get(TOKENS, [])) or _tokens_from_hyperparameters(run, series)
    steps = sorted(tokens_at)
    curves = {}
    for metric in (TRAIN_LOSS, EVAL_LOSS):
        points = []
        for step, value in series.get(metric, []):
            if step in tokens_at:
                points.append((float(tokens_at[step]), value))
            elif step == 0 and steps:  # an eval before the first batch (eval_first)
                points.append((0.0, value))
        if points:
            curves[metric] = points
    return curves


def _tokens_from_hyperparameters(run: str | Path, series: dict) -> dict[int, float]:
    path = metrics_path(run)
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        row = json.loads(line) if line.startswith('{"hyperparameters"') else None
        if row:
            config = row["hyperparameters"]
            seq_len = config.get("max_seq_len") or (config.get("model") or {}).get("max_seq_len")
            batch = config.get("global_train_batch_size")
            if seq_len and batch:
                steps = {step for points in series.values() for step, _ in points}
                return {step: float(step * batch * seq_len) for step in steps}
    raise DataError(
        f"{path} has no '{TOKENS}' metric and no hyperparameters row with global_train_batch_size and max_seq_len, "
        "so its curve cannot be placed on the token axis. Re-run it with this foundry, which logs trainer/tokens."
    )


def interpolate(curve: Curve, tokens: float) -> float | None:
    """The curve's value at ``tokens`` (linear between its points), or None outside its range."""
    xs = [x for x, _ in curve]
    if not xs or tokens < xs[0] or tokens > xs[-1]:
        return None
    index = bisect.bisect_left(xs, tokens)
    if xs[index] == tokens:
        return curve[index][1]
    (x0, y0), (x1, y1) = curve[index - 1], curve[index]
    return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)


@dataclasses.dataclass
class Segment:
    """One stretch of the token range: how far a run's loss strayed from the reference's there."""

    metric: str
    start_tokens: float
    end_tokens: float
    points: int
    max_abs_diff: float
    mean_abs_diff: float
    max_at_tokens: float
    passed: bool


@dataclasses.dataclass
class Comparison:
    """A run against the reference: every segment of every loss both logged, and the verdict."""

    run: str
    reference: str
    segments: list[Segment]
    tolerance: float
    max_factor: float

    @property
    def passed(self) -> bool:
        return all(segment.passed for segment in self.segments)

    def first_failure(self) -> Segment | None:
        return next((segment for segment in self.segments if not segment.passed), None)


def compare(
    reference: str | Path,
    run: str | Path,
    tolerance: float = DEFAULT_TOLERANCE,
    max_factor: float = DEFAULT_MAX_FACTOR,
    segments: int = 4,
) -> Comparison:
    """``run``'s train and eval loss against ``reference``'s, on the tokens both trained, in ``segments`` parts."""
    if tolerance <= 0 or max_factor < 1 or segments < 1:
        raise FoundryError(
            f"compare needs tolerance > 0, max_factor >= 1 and segments >= 1 (got {tolerance}, {max_factor}, "
            f"{segments})."
        )
    reference_curves, run_curves = loss_curves(reference), loss_curves(run)
    found = []
    for metric in (TRAIN_LOSS, EVAL_LOSS):
        if metric not in reference_curves or metric not in run_curves:
            continue
        diffs = [
            (tokens, abs(value - expected))
            for tokens, value in run_curves[metric]
            if (expected := interpolate(reference_curves[metric], tokens)) is not None
            and math.isfinite(value) and math.isfinite(expected)
        ]  # fmt: skip
        found += _segments(metric, diffs, tolerance, max_factor, segments)
    if not found:
        raise DataError(
            f"{run} and {reference} share no tokens with a {TRAIN_LOSS} or {EVAL_LOSS} in both: nothing to compare. "
            "Compare runs of the same model and data over an overlapping stretch of training."
        )
    return Comparison(str(run), str(reference), found, tolerance, max_factor)


def _segments(
    metric: str, diffs: list[tuple[float, float]], tolerance: float, max_factor: float, count: int
) -> list[Segment]:
    if not diffs:
        return []
    start, end = diffs[0][0], diffs[-1][0]
    width = (end - start) / count or 1.0
    groups: list[list[tuple[float, float]]] = [[] for _ in range(count)]
    for tokens, diff in diffs:
        groups[min(int((tokens - start) / width), count - 1)].append((tokens, diff))
    segments = []
    for index, group in enumerate(groups):
        if not group:
            continue
        worst_tokens, worst = max(group, key=lambda point: point[1])
        mean = sum(diff for _, diff in group) / len(group)
        passed = mean <= tolerance and worst <= tolerance * max_factor
        bounds = (start + index * width, start + (index + 1) * width)
        segments.append(Segment(metric, *bounds, len(group), worst, mean, worst_tokens, passed))
    return segments


def noise_tolerance(run_a: str | Path, run_b: str | Path) -> float:
    """A tolerance from two runs the user considers identical: twice their mean |Δ train loss|."""
    comparison = compare(run_a, run_b, tolerance=math.inf, max_factor=1.0, segments=1)
    train = [segment for segment in comparison.segments if segment.metric == TRAIN_LOSS]
    if not train:
        raise DataError(f"{run_a} and {run_b} share no train loss to measure noise from.")
    if train[0].max_abs_diff < MEASURABLE_NOISE:
        raise DataError(
            f"--noise {run_a} {run_b}: the two runs' train losses differ by at most {train[0].max_abs_diff:.2g} over "
            f"{train[0].points} shared points, so they measure no noise and the band would be zero wide (any other "
            "run would fail). They are the same "
            "run, or a deterministic setup repeated exactly: give two runs that differ only where the runs you "
            "compare will differ (another seed, another machine), or pass --tolerance."
        )
    return 2 * train[0].mean_abs_diff


def report(comparison: Comparison) -> str:
    """The comparison as lines a person reads: one per segment, then PASS or FAIL with where and why."""
    lines = [
        f"{comparison.run} vs {comparison.reference} (tolerance: mean |Δ| <= {comparison.tolerance:.4g}, "
        f"largest <= {comparison.tolerance * comparison.max_factor:.4g})"
    ]
    for segment in comparison.segments:
        mark = "ok" if segment.passed else "OUT"
        lines.append(
            f"  {mark:3} {segment.metric:18} tokens {segment.start_tokens:>14,.0f} .. {segment.end_tokens:<14,.0f} "
            f"points {segment.points:4}  mean |Δ| {segment.mean_abs_diff:.4f}  max |Δ| {segment.max_abs_diff:.4f} "
            f"(at {segment.max_at_tokens:,.0f} tokens)"
        )
    failure = comparison.first_failure()
    if failure is None:
        lines.append("PASS: within the band in every segment.")
    else:
        lines.append(
            f"FAIL: {failure.metric} left the band between {failure.start_tokens:,.0f} and {failure.end_tokens:,.0f} "
            f"tokens: mean |Δ| {failure.mean_abs_diff:.4f}, largest {failure.max_abs_diff:.4f} at "
            f"{failure.max_at_tokens:,.0f} tokens."
        )
    return "\n".join(lines)


def plot_band(reference: str | Path, runs: Sequence[str | Path], tolerance: float, out_path: Path) -> Path:
    """A PNG of the train loss by tokens: the reference with its ± tolerance band, and each run."""
    figure = figure_class()(figsize=(8, 4), layout="constrained")
    ax = figure.subplots()
    curve = loss_curves(reference).get(TRAIN_LOSS, [])
    if curve:
        xs, ys = zip(*curve)
        ax.fill_between(xs, [y - tolerance for y in ys], [y + tolerance for y in ys], alpha=0.25, label="band")
        ax.plot(xs, ys, label=f"{Path(reference).name} (reference)")
    for run in runs:
        points = loss_curves(run).get(TRAIN_LOSS, [])
        if points:
            ax.plot(*zip(*points), label=Path(run).name, linewidth=1)
    ax.set_xlabel("tokens")
    ax.set_ylabel(TRAIN_LOSS)
    ax.grid(alpha=0.3)
    ax.legend()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out_path, dpi=100)
    return out_path


# ---------------------------------------------------------------------------- foundry compare
def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("reference", metavar="REFERENCE", help="the reference run folder (or its metrics.jsonl)")
    parser.add_argument("runs", nargs="+", metavar="RUN", help="runs to hold against it")
    parser.add_argument(
        "--tolerance", type=float, default=None, help=f"mean |Δ loss| allowed (default {DEFAULT_TOLERANCE})"
    )
    parser.add_argument(
        "--noise", nargs=2, metavar=("RUN_A", "RUN_B"), help="two identical runs: tolerance = 2x their mean |Δ|"
    )
    parser.add_argument(
        "--max-factor", type=float, default=DEFAULT_MAX_FACTOR, help="largest |Δ| allowed, in tolerances"
    )
    parser.add_argument("--segments", type=int, default=4, help="parts of the token range judged separately")
    parser.add_argument("-o", "--out", default=None, help="PNG with the band (default: none)")  # fmt: skip


def run_compare(args: argparse.Namespace) -> int:
    """``EXIT_OK`` (0) when every run passes, ``EXIT_CHECK_FAILED`` (1) when one leaves the band."""
    if args.tolerance is not None and args.noise:
        raise FoundryError("Give --tolerance or --noise, not both.")
    tolerance = noise_tolerance(*args.noise) if args.noise else args.tolerance or DEFAULT_TOLERANCE
    comparisons = [compare(args.reference, run, tolerance, args.max_factor, args.segments) for run in args.runs]
    for comparison in comparisons:
        print(report(comparison))
    if args.out:
        print(f"foundry compare: wrote {plot_band(args.reference, args.runs, tolerance, Path(args.out))}")
    failed = [comparison.run for comparison in comparisons if not comparison.passed]
    if failed:
        print(f"foundry compare: {len(failed)} of {len(comparisons)} run(s) left the band.", file=sys.stderr)
        return EXIT_CHECK_FAILED
    return EXIT_OK
