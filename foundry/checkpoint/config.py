"""The checkpoint section of a run: where checkpoints go, how often, how many stay, and where a run starts from.

Its keys are LLM Foundry's top-level YAML keys and ``Trainer`` keywords of the same names. The
section is handed whole to ``foundry.checkpoint.saver.Checkpointer``, which acts on it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field

from foundry.core.bounds import check_bounds
from foundry.core.paths import check_storage_path
from foundry.core.run_name import fill_run_name
from foundry.core.time import Time, positive_time
from foundry.errors import ConfigError
from foundry.schema import doc


@dataclasses.dataclass(kw_only=True)
class CheckpointConfig:
    save_folder: str | None = field(
        default=None, metadata=doc("checkpoint folder or object-store URL; {run_name} is filled in")
    )
    save_interval: Time = field(default=Time.parse("1000ba"), metadata=doc("how often to checkpoint"))
    save_num_checkpoints_to_keep: int = field(default=-1, metadata=doc("newest checkpoints kept on disk (-1 = all)"))
    save_overwrite: bool = field(default=False, metadata=doc("overwrite existing checkpoints"))
    save_async: bool = field(default=False, metadata=doc("write checkpoints in the background while training goes on"))
    save_upload_retries: int = field(
        default=3, metadata=doc("object-store save_folder: retries of each failed upload before the checkpoint fails")
    )
    save_upload_backoff_s: float = field(
        default=2.0, metadata=doc("seconds before the first retry of an upload; each next retry waits twice as long")
    )
    save_max_failed_uploads: int = field(
        default=3,
        metadata=doc("stop the run once this many checkpoints in a row failed to upload (kept locally till relaunch)"),
    )
    save_weights_only: bool = field(default=False, metadata=doc("save only model weights (not supported: false)"))
    load_path: str | None = field(default=None, metadata=doc("checkpoint to start from; {run_name} is filled in"))
    load_weights_only: bool = field(default=False, metadata=doc("load only weights (fresh optimizer and schedule)"))
    load_strict_model_weights: bool = field(
        default=True, metadata=doc("fail on missing or unexpected weight names (false is not supported)")
    )
    autoresume: bool = field(default=False, metadata=doc("resume from the newest checkpoint in save_folder"))
    autoresume_accept_changes: bool = field(
        default=False,
        metadata=doc(
            "resume even though global batch, sequence length, seed, train data, optimizer or schedule differ from "
            "the checkpoint's (foundry.checkpoint.resume_check)"
        ),
    )

    def __post_init__(self) -> None:
        check_bounds(vars(self))
        positive_time(self.save_interval, "save_interval")
        check_storage_path(self.save_folder, "'save_folder'")
        check_storage_path(self.load_path, "'load_path'")
        if self.save_weights_only:
            raise ConfigError("save_weights_only: true is not supported yet; remove it to save full checkpoints.")
        if not self.load_strict_model_weights:
            raise ConfigError("load_strict_model_weights: false is not supported yet; checkpoints load strictly.")

    def for_run(self, run_name: str) -> CheckpointConfig:
        """This section (alone, also when it is part of a whole train config) with ``{run_name}`` filled into
        save_folder and load_path: the one place a checkpoint path gets its run's name."""
        values = {key.name: getattr(self, key.name) for key in dataclasses.fields(CheckpointConfig)}
        values["save_folder"] = fill_run_name(self.save_folder, run_name)
        values["load_path"] = fill_run_name(self.load_path, run_name)
        return CheckpointConfig(**values)
