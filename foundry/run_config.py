"""The run section the Trainer owns: identity, seed, numerics, batching and compilation.

Its keys are LLM Foundry's top-level YAML keys and ``Trainer`` keywords of the same names; the
other sections belong to their components (``CheckpointConfig``, ``EvalConfig``, ``ConsoleConfig``,
``FSDPConfig``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any, Literal

from foundry.checkpoint.config import CheckpointConfig
from foundry.core.bounds import check_bounds
from foundry.core.precision_name import Precision
from foundry.core.run_name import default_run_name, fill_run_name
from foundry.eval.config import EvalConfig
from foundry.loggers.config import ConsoleConfig
from foundry.schema import doc


@dataclasses.dataclass(kw_only=True)
class RunConfig:
    run_name: str | None = field(
        default=None, metadata=doc("default: $RUN_NAME, else foundry-<date>-<time>-<4 random hex digits>")
    )
    seed: int = field(default=17, metadata=doc("seed for weights, data order and dropout"))
    run_folder: str = field(default="runs/{run_name}", metadata=doc("where metrics.jsonl goes"))
    precision: Precision = field(
        default=Precision.AUTO,
        metadata=doc("compute precision: auto (amp_bf16 on a GPU, fp32 on a CPU), fp32, amp_bf16 or amp_fp16 (CUDA)"),
    )
    device: str | None = field(default=None, metadata=doc("cpu, cuda, ... (none = this rank's GPU if any)"))
    device_train_microbatch_size: int | Literal["auto"] | None = field(
        default=None, metadata=doc("samples per forward/backward (gradients accumulate); none = the whole device batch")
    )
    compile_config: bool | Literal["auto"] | dict[str, Any] = field(
        default="auto",
        metadata=doc(
            "torch.compile: auto = on a GPU (whole model on one rank, each block when sharded), never on CPU; "
            "false = eager; true = everywhere; a mapping = algorithms.torch_compile's keys"
        ),
    )
    fuse_weight_grad_accumulation: bool = field(
        default=True,
        metadata=doc(
            "unsharded runs: each linear sums its weight gradient inside the GEMM and casts its weight once a "
            "batch (docs/PERFORMANCE.md); false = autograd's accumulation"
        ),
    )
    expandable_segments: bool = field(
        default=True, metadata=doc("CUDA allocator expandable segments (less fragmentation)")
    )

    def __post_init__(self) -> None:
        check_bounds(vars(self))
        if self.run_name is None:
            self.run_name = default_run_name()

    def run_folder_path(self) -> str:
        """``run_folder`` with ``{run_name}`` filled in."""
        return fill_run_name(self.run_folder, self.run_name)


# The sections whose keys are the Trainer's settings (and a train YAML's top-level keys), in this order.
TRAINER_SECTIONS = (RunConfig, CheckpointConfig, EvalConfig, ConsoleConfig)
