"""``ICLEvaluator``: ICL tasks prepared once (prompts, tokens, batches), then scored on any model.

Example::

    evaluator = ICLEvaluator(parse_icl_tasks("light"), tokenizer, seq_len=1024, batch_size=16)
    results = evaluator.evaluate(model, precision="amp_bf16")   # {"arc_easy/3-shot": {metric: value}, ...}

Results are keyed ``<label>/<num_fewshot>-shot`` (``/<category>`` appended for ``has_categories``
tasks), as LLM Foundry names its eval dataloaders. Distributed: each rank scores every
``world_size``-th batch; ranks with fewer batches re-run one uncounted, so FSDP's collectives
stay in step; the metrics sum their counts over ranks.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from foundry import distributed
from foundry.errors import TrainingError
from foundry.eval.batching import Batch, TokenizedExample, make_batches, needs_prefix_space, tokenize_examples
from foundry.eval.metrics import GenerationAccuracy, LanguageModelingAccuracy, MultipleChoiceAccuracy
from foundry.eval.prompts import answer_texts, build_prompts
from foundry.eval.scoring import ContinuationScores, score_continuations
from foundry.eval.task_config import ICLTaskConfig
from foundry.eval.tasks import local_task_files, read_rows, split_by_category
from foundry.models.generation import greedy_generate

# Generated chains of thought may run a little longer than the longest one in the data (LLM Foundry's margin).
_COT_EXTRA_TOKENS = 10

Results = dict[str, dict[str, float]]


@dataclasses.dataclass
class Subtask:
    """One scored unit: a task at one few-shot count (and one category)."""

    name: str
    task: ICLTaskConfig
    examples: list[TokenizedExample]
    batches: list[Batch]
    max_new_tokens: int = 0


class ICLEvaluator:
    """Prepares ``tasks`` for ``tokenizer`` and evaluates models on them.

    Args:
        tasks: parsed ``icl_tasks`` (``foundry.eval.tasks.parse_icl_tasks``).
        tokenizer: the models' tokenizer (a transformers tokenizer).
        seq_len: tokens per row; contexts are trimmed from the left to fit (``icl_seq_len``).
        batch_size: rows per forward (a multiple-choice question's choices count one row each).
        limit: score only the first ``limit`` rows of each task (quick checks and tests).
    """

    def __init__(
        self,
        tasks: Sequence[ICLTaskConfig],
        tokenizer: Any,
        seq_len: int,
        batch_size: int,
        limit: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if self.pad_token_id is None:
            raise ValueError("The ICL tokenizer needs a pad or eos token to pad batches.")
        prefix_space = needs_prefix_space(tokenizer)
        tasks = local_task_files(tasks)  # a wrong path fails now, not after the tasks before it are tokenized
        self.subtasks = [
            subtask
            for task in tasks
            for subtask in self._prepare(
                task, prefix_space, task.max_seq_len or seq_len, task.batch_size or batch_size, limit
            )
        ]
        self.seconds: dict[str, float] = {}  # wall time of each subtask's last evaluation

    def _prepare(
        self, task: ICLTaskConfig, prefix_space: bool, seq_len: int, batch_size: int, limit: int | None
    ) -> list[Subtask]:
        rows = read_rows(task)
        groups = split_by_category(rows) if task.has_categories else {None: rows}
        subtasks = []
        for num_fewshot in task.num_fewshot:
            for category, group in groups.items():
                name = f"{task.label}/{num_fewshot}-shot" + (f"/{category}" if category else "")
                prompts = build_prompts(task, group, num_fewshot, prefix_space, limit)
                new_tokens = self._max_new_tokens(task, group)
                examples = tokenize_examples(prompts, self.tokenizer, seq_len, new_tokens, where=f"icl task '{name}'")
                batches = make_batches(examples, batch_size, self.pad_token_id)
                subtasks.append(Subtask(name, task, examples, batches, new_tokens))
        return subtasks

    def _max_new_tokens(self, task: ICLTaskConfig, rows: list[dict[str, Any]]) -> int:
        """Tokens a generation task may write: its longest answer over all rows, counted as LLM Foundry
        counts it (special tokens included), plus a margin for chains of thought. The contexts are
        trimmed to leave this room, so it also decides where long prompts are cut."""
        if task.icl_task_type != "generation_task_with_answers":
            return 0
        texts = sorted(set(answer_texts(task, rows)))
        longest = max(map(len, self.tokenizer(texts)["input_ids"]))  # one batched call
        return max(longest + (_COT_EXTRA_TOKENS if task.cot_delimiter else 0), 1)

    @property
    def names(self) -> list[str]:
        return [subtask.name for subtask in self.subtasks]

    def num_examples(self, name: str) -> int:
        return next(len(subtask.examples) for subtask in self.subtasks if subtask.name == name)

    @torch.no_grad()
    def evaluate(
        self, model: nn.Module, precision: str = "fp32", device: torch.device | None = None, progress: bool = False
    ) -> Results:
        """``{subtask name: {metric name: value}}`` for ``model`` (every rank gets the same results)."""
        device = device or next(model.parameters()).device
        was_training = model.training
        model.eval()
        bar = _progress_bar(sum(len(s.batches) for s in self.subtasks), progress and distributed.get_rank() == 0)
        results = {}
        try:
            for subtask in self.subtasks:
                start_s = time.perf_counter()
                metric = self._metric(subtask.task).to(device)
                nan_scores = torch.zeros((), device=device)  # requests whose log-likelihood is NaN, on the device
                for batch, counted in _my_share(subtask.batches):
                    scores = self._score_batch(model, subtask, batch, metric if counted else None, precision, device)
                    if scores is not None and counted:
                        nan_scores += scores.logprob_sum.isnan().sum()
                    bar.update(1)
                _refuse_nan_scores(subtask.name, distributed.all_reduce_sum(nan_scores))
                results[subtask.name] = {name: float(value) for name, value in metric.compute().items()}
                self.seconds[subtask.name] = time.perf_counter() - start_s
        finally:
            bar.close()
            model.train(was_training)
        return results

    @staticmethod
    def _metric(task: ICLTaskConfig) -> LanguageModelingAccuracy | MultipleChoiceAccuracy | GenerationAccuracy:
        if task.icl_task_type == "language_modeling":
            return LanguageModelingAccuracy()
        if task.icl_task_type == "generation_task_with_answers":
            return GenerationAccuracy(task.early_stopping_criteria or (), task.cot_delimiter, task.do_normalization)
        return MultipleChoiceAccuracy()

    def _score_batch(
        self, model: nn.Module, subtask: Subtask, batch: Batch, metric: Any, precision: str, device: torch.device
    ) -> ContinuationScores | None:
        """Run ``batch`` through the model; update ``metric`` unless it is None (a rank's padding batch).

        Returns the continuation scores (None for generation)."""
        examples = [subtask.examples[index] for index in batch.example_ids]
        if subtask.task.icl_task_type == "generation_task_with_answers":
            prompts = [example.requests[0][0] for example in examples]
            stops = subtask.task.early_stopping_criteria or ()
            texts = greedy_generate(model, prompts, subtask.max_new_tokens, self.tokenizer, stops, precision, device)
            if metric is not None:
                metric.update(texts, [example.answers for example in examples])
            return None
        scores = score_continuations(
            model,
            batch.input_ids.to(device),
            batch.lengths.to(device),
            batch.continuation_starts.to(device),
            precision,
        )
        if metric is None:
            return scores
        if subtask.task.icl_task_type == "language_modeling":
            metric.update(scores.greedy_match)
            return scores
        logprobs = scores.logprob_sum.split(batch.rows_per_example)
        counts = scores.num_tokens.split(batch.rows_per_example)
        metric.update(logprobs, counts, [example.gold for example in examples])
        return scores


def _refuse_nan_scores(name: str, nan_scores: torch.Tensor) -> None:
    """No accuracy from NaN log-likelihoods: they come from a model that computes nothing meaningful."""
    count = int(nan_scores.item())  # one sync per subtask (computing the metric syncs anyway)
    if count:
        raise TrainingError(
            f"icl task '{name}': the model's log-likelihood is NaN for {count} requests, so its score would mean "
            "nothing and is not reported. Its weights may never have been loaded or may have diverged, or "
            "amp_fp16 overflowed: check the checkpoint (for a LoRA adapters-only one, pass its base with "
            "--model BASE --adapters CKPT) or evaluate with --precision amp_bf16 or fp32."
        )


def _my_share(batches: list[Batch]) -> list[tuple[Batch, bool]]:
    """This rank's batches, each with whether it counts; every rank gets the same number."""
    rank, world_size = distributed.get_rank(), distributed.get_world_size()
    mine = [(batch, True) for batch in batches[rank::world_size]]
    per_rank = math.ceil(len(batches) / world_size)
    return mine + [(batches[0], False)] * (per_rank - len(mine))


class _NoBar:
    def update(self, count: int) -> None:
        del count

    def close(self) -> None:
        pass


def _progress_bar(total: int, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    return tqdm(total=total, desc="icl eval", unit="batch", dynamic_ncols=True)
