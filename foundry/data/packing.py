"""Sequence packing: several finetuning examples per row, with per-example ``sequence_id`` and positions.

``pack_rows`` plans an epoch as LLM Foundry's BinPackCollator does: each step draws
``packing_ratio × rows_per_step`` examples (plus what did not fit last step), places them
first-fit-decreasing into ``rows_per_step`` rows of ``max_seq_len`` tokens, and carries the
rest over; the epoch's leftovers fill extra rows at its end, so no example is lost. The plan
depends only on the example order and lengths, so a resumed run rebuilds it exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from foundry.batches import IGNORE_INDEX

Row = list[int]  # indices of the examples packed into one row, in row order


def pack_rows(
    lengths: Sequence[int], order: Sequence[int], packing_ratio: float | None, rows_per_step: int, max_seq_len: int
) -> list[Row]:
    """The epoch's rows: one example each without packing, else greedily packed per step."""
    if packing_ratio is None:
        return [[index] for index in order]
    examples_per_step = max(rows_per_step, round(packing_ratio * rows_per_step))
    rows: list[Row] = []
    pool: list[int] = []
    for start in range(0, len(order), examples_per_step):
        pool += order[start : start + examples_per_step]
        step_rows, pool = _first_fit_decreasing(pool, lengths, rows_per_step, max_seq_len)
        rows += step_rows
    while pool:
        step_rows, pool = _first_fit_decreasing(pool, lengths, rows_per_step, max_seq_len)
        rows += step_rows
    return rows


def resolve_packing_ratio(
    ratio: float | str | None, lengths: Sequence[int], order: Sequence[int], rows_per_step: int, max_seq_len: int
) -> float | None:
    """None (one example per row) for null or 1; 'auto' profiles the packing order (the same on every rank)."""
    if ratio == "auto":
        ratio = profile_packing_ratio(lengths, order, rows_per_step, max_seq_len)
    return None if ratio is None or float(ratio) == 1 else float(ratio)


def profile_packing_ratio(
    lengths: Sequence[int], order: Sequence[int], rows_per_step: int, max_seq_len: int, max_steps: int = 64
) -> float:
    """``packing_ratio: auto``: the highest ratio (1, 1.5, 2, ...) at which no example is carried over.

    Each candidate packs the first ``max_steps`` steps of ``order``; it passes when every step's
    examples fit in the step's rows. The highest candidate tried is ``max_seq_len`` over the
    shortest example (no row can hold more), capped at 32.
    """
    highest = min(32.0, max_seq_len / max(1, min(lengths)))
    candidates = [1 + step / 2 for step in range(int((highest - 1) * 2) + 1)]
    return max(ratio for ratio in candidates if _fits_without_carry_over(
        lengths, order, ratio, rows_per_step, max_seq_len, max_steps
    ))  # fmt: skip


def _fits_without_carry_over(
    lengths: Sequence[int], order: Sequence[int], ratio: float, rows_per_step: int, max_seq_len: int, max_steps: int
) -> bool:
    examples_per_step = max(rows_per_step, round(ratio * rows_per_step))
    profiled = min(len(order), examples_per_step * max_steps)
    for start in range(0, profiled, examples_per_step):
        step = list(order[start : min(start + examples_per_step, profiled)])
        if _first_fit_decreasing(step, lengths, rows_per_step, max_seq_len)[1]:
            return False
    return True


def _first_fit_decreasing(
    pool: list[int], lengths: Sequence[int], num_rows: int, max_seq_len: int
) -> tuple[list[Row], list[int]]:
    """Up to ``num_rows`` rows filled longest-first, and the examples that did not fit (in pool order)."""
    rows: list[Row] = [[] for _ in range(num_rows)]
    used = [0] * num_rows
    leftover = []
    for index in sorted(pool, key=lambda i: -lengths[i]):  # stable: ties keep pool order
        row = next((r for r in range(num_rows) if used[r] + lengths[index] <= max_seq_len), None)
        if row is None:
            leftover.append(index)
            continue
        rows[row].append(index)
        used[row] += lengths[index]
    position = {index: rank for rank, index in enumerate(pool)}
    return [row for row in rows if row], sorted(leftover, key=position.__getitem__)


def rank_batches(
    rows: list[Row], device_batch_size: int, rank: int, world_size: int, drop_last: bool
) -> list[list[Row]]:
    """This rank's batches: each step's ``device_batch_size × world_size`` rows dealt out by rank.

    Every rank gets the same number of batches (distributed steps must match): a last, partial step is
    dropped with ``drop_last``, else dealt out with an all-padding row for a rank left without one.
    """
    rows_per_step = device_batch_size * world_size
    full_steps, remainder = divmod(len(rows), rows_per_step)
    batches = []
    for step in range(full_steps):
        start = step * rows_per_step + rank * device_batch_size
        batches.append(rows[start : start + device_batch_size])
    if remainder and not drop_last:
        tail = rows[full_steps * rows_per_step :]
        share = -(-len(tail) // world_size)
        batches.append(tail[rank * share : (rank + 1) * share] or [[]])
    return batches


def collate_packed_rows(
    rows: Sequence[Row],
    input_ids: Sequence[np.ndarray],
    labels: Sequence[np.ndarray],
    max_seq_len: int,
    pad_token_id: int,
    trim_to_multiple_of: int | None = None,
) -> dict[str, torch.Tensor]:
    """Rows of examples → ``input_ids``, ``labels``, ``attention_mask``, ``sequence_id``, ``position_ids``.

    All (batch, seq) int64. ``sequence_id`` is the example's index within its row (-1 on padding);
    positions restart at 0 per example. Each example's first label is already -100 (see
    ``finetuning.build_example``), so no token predicts the next example's first token.
    """
    batch_size = len(rows)
    tokens = torch.full((batch_size, max_seq_len), pad_token_id, dtype=torch.int64)
    targets = torch.full((batch_size, max_seq_len), IGNORE_INDEX, dtype=torch.int64)
    sequence_id = torch.full((batch_size, max_seq_len), -1, dtype=torch.int64)
    position_ids = torch.zeros((batch_size, max_seq_len), dtype=torch.int64)
    longest = 0
    for row_index, row in enumerate(rows):
        start = 0
        for example_index, example in enumerate(row):
            end = start + len(input_ids[example])
            tokens[row_index, start:end] = torch.from_numpy(input_ids[example])
            targets[row_index, start:end] = torch.from_numpy(labels[example])
            sequence_id[row_index, start:end] = example_index
            position_ids[row_index, start:end] = torch.arange(end - start)
            start = end
        longest = max(longest, start)
    batch = {
        "input_ids": tokens,
        "labels": targets,
        "attention_mask": (sequence_id >= 0).long(),
        "sequence_id": sequence_id,
        "position_ids": position_ids,
    }
    if trim_to_multiple_of:
        keep = min(max_seq_len, -(-max(longest, 1) // trim_to_multiple_of) * trim_to_multiple_of)
        batch = {key: value[:, :keep] for key, value in batch.items()}
    return batch
