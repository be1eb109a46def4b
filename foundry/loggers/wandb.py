"""Weights & Biases: metrics by step, the resolved config, the run's YAML and (optionally) checkpoints.

Keys follow LLM Foundry's ``loggers: {wandb: {...}}``. ``WANDB_MODE=offline`` works without a network:
the run is written under ``<run_folder>/wandb/`` (or ``$WANDB_DIR``) and ``wandb sync`` uploads it later.

Secrets never reach W&B: ``scrub_secrets`` replaces the value of every config key that names a secret
(``api_key``, ``token``, ``secret``, ``password``, ...) and every copy of a secret environment variable's
value (``WANDB_API_KEY``, ``HF_TOKEN``, ...) with ``'***'``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml

from foundry import registry
from foundry.core.callback import LoggerDestination
from foundry.core.event import Event
from foundry.core.logger import Logger
from foundry.core.redact import scrub_secrets
from foundry.core.state import State
from foundry.errors import ConfigError
from foundry.optional import import_optional

CONFIG_FILE_NAME = "foundry_config.yaml"


@registry.loggers.register("wandb")
class WandBLogger(LoggerDestination):
    """Logs to a W&B run started at FIT_START, after a checkpoint loads, so an autoresumed run continues it.

    Args:
        project, group, name, entity, tags: the W&B run's fields; ``name`` defaults to the run name.
        log_artifacts: upload every checkpoint the run saves as a W&B artifact of type 'model'.
        rank_zero_only: only rank 0 logs; otherwise every rank logs to '<name>-rank<r>' in group '<name>'.
        init_kwargs: more ``wandb.init`` arguments (``dir``, ``mode``, ``resume``, ``config``...); they win.
    """

    def __init__(
        self,
        project: str | None = None,
        group: str | None = None,
        name: str | None = None,
        entity: str | None = None,
        tags: list[str] | None = None,
        log_artifacts: bool = False,
        rank_zero_only: bool = True,
        init_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self._wandb = import_wandb()
        self.project, self.group, self.name, self.entity = project, group, name, entity
        self.tags = list(tags or [])
        self.log_artifacts = log_artifacts
        self.rank_zero_only = rank_zero_only
        self.init_kwargs = dict(init_kwargs or {})
        self._config: dict[str, Any] = scrub_secrets(self.init_kwargs.pop("config", {}))
        self._rank = int(os.environ.get("RANK", "0"))  # until an event tells us state.rank
        self._run_name: str | None = None
        self._run_folder: Path | None = None
        self._run: Any = None
        self._resume_id: str | None = None  # the W&B run of the checkpoint this run resumed from
        self._fit_ended = False

    @property
    def logs_on_this_rank(self) -> bool:
        return self._rank == 0 or not self.rank_zero_only

    def run_event(self, event: Event, state: State, logger: Logger) -> None:
        self._rank, self._run_name = state.rank, state.run_name
        self._run_folder = run_folder(state)
        super().run_event(event, state, logger)

    def fit_start(self, state: State, logger: Logger) -> None:
        self._start()

    def fit_end(self, state: State, logger: Logger) -> None:
        self._fit_ended = True

    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        self._upload_checkpoint(state)

    def epoch_checkpoint(self, state: State, logger: Logger) -> None:
        self._upload_checkpoint(state)

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        scrubbed = scrub_secrets(hyperparameters)
        self._config.update(scrubbed)
        if self._run is not None:
            self._run.config.update(scrubbed, allow_val_change=True)
            self._save_config_file()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        run = self._run or self._start()  # Trainer.eval() without fit() logs before any FIT_START
        if run is not None:
            run.log(metrics, step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish(exit_code=0 if self._fit_ended else 1)  # 1 marks the run failed in the W&B UI
            self._run = None

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self._run.id} if self._run is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resume_id = state.get("run_id")

    def _start(self) -> Any:
        if self._run is not None or not self.logs_on_this_rank:
            return self._run
        self._run = self._wandb.init(**self.init_arguments())
        self._save_config_file()
        return self._run

    def init_arguments(self) -> dict[str, Any]:
        """What ``wandb.init`` gets: the YAML keys, then the resumed run's id, then ``init_kwargs``."""
        name = self.name or self._run_name
        group = self.group
        if not self.rank_zero_only and name is not None:
            name, group = f"{name}-rank{self._rank}", group or name
        arguments: dict[str, Any] = {
            "project": self.project,
            "group": group,
            "name": name,
            "entity": self.entity,
            "tags": self.tags or None,
            "config": self._config,
        }
        if "WANDB_DIR" not in os.environ and self._run_folder is not None:
            self._run_folder.mkdir(parents=True, exist_ok=True)
            arguments["dir"] = str(self._run_folder)  # W&B writes '<dir>/wandb/<run>/'
        if self._resume_id is not None and self._rank == 0:  # the checkpoint holds rank 0's run id
            arguments.update(id=self._resume_id, resume="allow")
        return {**arguments, **self.init_kwargs}

    def _save_config_file(self) -> None:
        """The resolved YAML as a file of the run, beside W&B's own flattened config."""
        if not self._config:
            return
        path = Path(self._run.dir) / CONFIG_FILE_NAME
        path.write_text(yaml.safe_dump(self._config, sort_keys=False), encoding="utf-8")
        self._run.save(str(path), base_path=self._run.dir, policy="live")

    def _upload_checkpoint(self, state: State) -> None:
        if not self.log_artifacts or self._run is None or not state.last_checkpoint_path:
            return
        path = Path(state.last_checkpoint_path)
        artifact_name = re.sub(r"[^\w.-]", "_", f"{state.run_name}-checkpoint")
        artifact = self._wandb.Artifact(artifact_name, type="model", metadata={"batch": state.timestamp.batch})
        if path.is_dir():
            artifact.add_dir(str(path))
        else:
            artifact.add_file(str(path))
        self._run.log_artifact(artifact, aliases=["latest", f"ba{state.timestamp.batch}"])


def import_wandb() -> Any:
    return import_optional(
        "wandb",
        needed_for="loggers.wandb",
        package="the wandb package",
        install="pip install 'foundry[wandb]'",
        error=ConfigError,
    )


def run_folder(state: State) -> Path:
    """The Trainer's run folder ('runs/<run_name>' for a State built without one)."""
    return Path(state.run_folder or Path("runs") / state.run_name)
