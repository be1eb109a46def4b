"""The evaluation section of a run: when the Trainer evaluates, on how much, and which ICL tasks it scores.

Its keys are LLM Foundry's top-level YAML keys and ``Trainer`` keywords of the same names.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any

from foundry.core.bounds import check_bounds
from foundry.core.time import Time, positive_time
from foundry.errors import ConfigError
from foundry.eval.task_config import parse_gauntlet, parse_icl_tasks
from foundry.schema import doc


@dataclasses.dataclass(kw_only=True)
class EvalConfig:
    eval_interval: Time = field(
        default=Time.parse("1ep"), metadata=doc("how often to evaluate (a bare int counts batches)")
    )
    eval_first: bool = field(default=False, metadata=doc("evaluate before the first batch"))
    eval_subset_num_batches: int = field(default=-1, metadata=doc("batches per evaluation (-1 = the whole eval set)"))
    device_eval_batch_size: int | None = field(default=None, metadata=doc("eval samples per device per batch"))
    icl_tasks: str | list[dict[str, Any]] | None = field(
        default=None, metadata=doc("ICL tasks run at eval_interval: a tasks YAML path or the list (docs/EVAL.md)")
    )
    eval_gauntlet: str | dict[str, Any] | None = field(
        default=None, metadata=doc("averages ICL tasks into categories: a gauntlet YAML path or the mapping")
    )
    icl_seq_len: int | None = field(
        default=None, metadata=doc("tokens per ICL row (none = max_seq_len, else model.max_seq_len)")
    )

    def __post_init__(self) -> None:
        check_bounds(vars(self))
        positive_time(self.eval_interval, "eval_interval")
        if self.icl_tasks is not None:
            parse_icl_tasks(self.icl_tasks)  # a typo fails before training starts
        if self.eval_gauntlet is not None:
            if self.icl_tasks is None:
                raise ConfigError(
                    "'eval_gauntlet' averages ICL tasks, but 'icl_tasks' is not set; add it or drop the gauntlet."
                )
            parse_gauntlet(self.eval_gauntlet)
