"""One exception family, so users can catch foundry's own failures and read a fix in each message."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

# What a `foundry` command's exit code means, the same for every command (docs/CONVERGENCE.md "Exit codes").
EXIT_OK = 0  # done: the run finished, the check passed
EXIT_CHECK_FAILED = 1  # a verdict is FAIL: `compare`, `eval --reference`, a `reference_curve` that stopped training
EXIT_CONFIG_ERROR = 2  # a config or data error (a FoundryError): fix what the message names
EXIT_HANDED_OVER = 3  # `hand_over` stopped the run to be relaunched elsewhere (foundry.callbacks.hand_over)
EXIT_NOT_DURABLE = 4  # checkpoints did not reach the object store; their local copies are kept (CheckpointUploadError)
EXIT_PREEMPTED = 5  # SIGTERM or SIGUSR1 stopped the run after a checkpoint (foundry.checkpoint.preemption)


class FoundryError(Exception):
    """Base class for every error foundry raises on purpose."""

    exit_code = EXIT_CONFIG_ERROR  # of `foundry` commands that stop with it


class ConfigError(FoundryError, ValueError):
    """A config key, value or type is wrong; the message names the key path and the fix."""


class DataError(FoundryError):
    """Input data is missing, unreadable or malformed; the message names the file."""


class CheckpointError(FoundryError):
    """A checkpoint cannot be written or read; the message names the path."""


class CheckpointUploadError(CheckpointError):
    """Checkpoints did not reach the object store; the message names them and the local copies that hold them."""

    exit_code = EXIT_NOT_DURABLE  # nothing to fix in the config: a relaunch once the store is back uploads the copies


class DamagedCheckpointError(CheckpointError):
    """A checkpoint's files differ from what was saved (missing, truncated, altered); the message names the file."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = problems or [message]  # one line per damaged file


class TrainingError(FoundryError):
    """The run cannot go on (NaN loss, out of memory, ...); the message names the batch."""


class LostRankError(TrainingError):
    """Another rank of the job died; the message names it and says how to resume."""

    exit_code = 1  # nothing to fix in the config: relaunching resumes


def closest_match(name: str, choices: Iterable[str]) -> str | None:
    """The valid name a typo most likely meant, or None when nothing is close."""
    matches = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return matches[0] if matches else None


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """A ' Did you mean ...?' suffix for an error message, or '' when nothing is close."""
    match = closest_match(name, choices)
    return f" Did you mean '{match}'?" if match else ""
