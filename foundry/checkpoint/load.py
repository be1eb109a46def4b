"""Reading checkpoints: model and optimizer tensors resharded to this run's layout, then the training state.

Every file is first checked against the checkpoint's manifest (``foundry.checkpoint.integrity``);
tensors then load through ``SafeFileSystemReader`` (no unpickling of code) into whatever sharding
the model has now, so a checkpoint resumes on any world size or device. ``autoresume`` walks back
past damaged checkpoints to the newest intact one; an explicit ``load_path`` never does.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

from foundry.checkpoint.find import checkpoint_folders, resolve_checkpoint_path
from foundry.checkpoint.hooks import checkpoint_hooks
from foundry.checkpoint.integrity import no_intact_checkpoint, verify_checkpoint
from foundry.checkpoint.layout import (
    META_FILE,
    native_tensor_state,
    root_cause,
    set_aside,
    single_process_quiet,
    stateful_key_pairs,
)
from foundry.checkpoint.meta import dotted_leaves, model_section, model_section_of, read_meta
from foundry.checkpoint.remote import newest_intact_on_store
from foundry.checkpoint.rng import load_rng_file, rng_file_for_rank
from foundry.checkpoint.safe_reader import SafeFileSystemReader, SafeLoadPlanner
from foundry.core.paths import is_object_store_url
from foundry.core.state import State
from foundry.core.time import Timestamp
from foundry.distributed.env import barrier
from foundry.distributed.tensor_parallel import gather_parts, split_parts_like
from foundry.errors import CheckpointError, ConfigError, DamagedCheckpointError

log = logging.getLogger(__name__)


def resume_or_load(
    state: State,
    *,
    save_folder: str | None,
    load_path: str | None,
    weights_only: bool,
    autoresume: bool,
    callbacks: Sequence = (),
    algorithms: Sequence = (),
) -> Path | None:
    """Load the checkpoint a run starts from into ``state``; returns its folder, or None to start afresh.

    ``autoresume`` takes the newest intact checkpoint in ``save_folder`` with all its state (a restarted
    run continues; damaged newer ones are skipped with a warning and set aside); without one,
    ``load_path`` (a checkpoint folder, or a save_folder's latest). Either may be on an object store
    (downloaded first). Every rank must call this.
    """
    path = None
    if autoresume:
        if not save_folder:
            raise ConfigError("autoresume: true needs save_folder, where the run's checkpoints are found.")
        if is_object_store_url(save_folder):
            path = newest_intact_on_store(save_folder, state.rank)
        else:
            path = newest_intact_checkpoint(Path(save_folder), state.rank)
        weights_only = weights_only and path is None
    if path is None and load_path:
        path = resolve_checkpoint_path(load_path)
    if path is None:
        return None
    # A model may need other weights first (a checkpoint of part of its weights loads its base).
    checkpoint_hooks(state.model).before_load(path, state, lambda base: load_checkpoint(base, state, weights_only=True))
    load_checkpoint(path, state, callbacks=callbacks, algorithms=algorithms, weights_only=weights_only)
    state.last_checkpoint_path = str(path)
    return path


def newest_intact_checkpoint(save_folder: Path, rank: int) -> Path | None:
    """The last published checkpoint of ``save_folder`` whose files all match their checksums, or None.

    Each newer damaged one is logged (what is wrong with it) and renamed to ``<name>.damaged`` by rank 0,
    so the resumed run can write its own checkpoint of that name. If no checkpoint is intact, nothing is
    renamed and the damage is raised: starting afresh is for a person to decide.
    """
    skipped: list[tuple[Path, DamagedCheckpointError]] = []
    for folder in reversed(checkpoint_folders(save_folder)):
        try:
            verify_checkpoint(folder, collective=True)
        except DamagedCheckpointError as damage:
            skipped.append((folder, damage))
            continue
        for damaged_folder, damage in skipped:
            _set_aside(damaged_folder, damage, folder, rank)
        barrier()
        return folder
    if skipped:
        raise no_intact_checkpoint(str(save_folder), [(folder.name, damage) for folder, damage in skipped])
    return None


def _set_aside(folder: Path, damage: DamagedCheckpointError, resume_from: Path, rank: int) -> None:
    if rank != 0:
        return
    aside = set_aside(folder)
    log.warning(
        "autoresume skipped checkpoint %s, which is damaged (%s), and resumes from %s instead. The damaged folder "
        "was renamed to %s: delete it once you no longer need it.",
        folder,
        "; ".join(damage.problems),
        resume_from.name,
        aside.name,
    )


def load_checkpoint(
    path: str | Path,
    state: State,
    *,
    callbacks: Sequence = (),
    algorithms: Sequence = (),
    weights_only: bool = False,
    strict: bool = True,
) -> dict:
    """Restore ``state`` (and callbacks, algorithms) in place from a checkpoint; returns its meta.json.

    ``weights_only=True`` loads only the model (fine-tuning from a pretrained run). ``strict=False``
    tolerates model keys missing on either side.
    """
    path = resolve_checkpoint_path(path)
    meta = _read_meta(path)
    _load_tensors(path, state, weights_only=weights_only, strict=strict, model_change=_model_change(meta, state.model))
    if not weights_only:
        _restore_training_state(path, meta, state, callbacks, algorithms)
    return meta


def _read_meta(path: Path) -> dict:
    meta = read_meta(path)
    if not isinstance(meta.get("timestamp"), dict) or not isinstance(meta.get("schedulers", []), list):
        raise CheckpointError(f"{path / META_FILE} lacks the run's timestamp or schedulers: the file is damaged.")
    return meta


def _model_change(meta: Mapping[str, Any], model: Any) -> str:
    """How this run's model section differs from the checkpoint's (``n_layers: 4 in the checkpoint, 2 in this
    run``), or "" when either names none or they agree: what explains weights that do not fit."""
    saved, current = model_section(meta), model_section_of(model)
    if saved is None or current is None:
        return ""
    saved, current = dotted_leaves(saved), dotted_leaves(current)
    changes = [
        f"{key}: {saved.get(key, '(unset)')!r} in the checkpoint, {current.get(key, '(unset)')!r} in this run"
        for key in sorted(set(saved) | set(current))
        if saved.get(key) != current.get(key)
    ]
    return f" The model differs from the checkpoint's: {'; '.join(changes)}." if changes else ""


_MODEL_MISMATCH_FIX = (
    " To resume from this checkpoint, set the model's keys back to the values it was saved with; to train this "
    "model from fresh weights instead, give the run a new save_folder and no load_path."
)


def _load_tensors(path: Path, state: State, *, weights_only: bool, strict: bool, model_change: str = "") -> None:
    reader = SafeFileSystemReader(path)
    saved_keys = set(reader.read_metadata().state_dict_metadata)
    saved_model_keys = {key.removeprefix("model.") for key in saved_keys if key.startswith("model.")}
    hooks = checkpoint_hooks(state.model)
    frozen = hooks.loads_frozen_weights(saved_model_keys)
    native = native_tensor_state(state, model_only=weights_only, frozen=frozen, as_stored=True)
    absent: set[str] = set()
    if strict:
        absent = _check_model_keys(path, state.model, set(native["model"]), saved_model_keys, model_change)
        native["model"] = {key: value for key, value in native["model"].items() if key not in absent}
    if "optim" in native and not any(key.startswith("optim.") for key in saved_keys):
        raise CheckpointError(
            f"Checkpoint {path} holds no optimizer state. Pass load_weights_only=True to load only its model."
        )
    every_key = strict and not absent and frozen  # frozen=False: the model's other weights stay as they are
    for part in hooks.parts_to_load(native):  # a model with 4-bit weights loads a block at a time
        whole = part["model"].keys() == native["model"].keys()
        _load_part(path, reader, state, part, strict=strict, every_key=every_key and whole, model_change=model_change)


def _load_part(
    path: Path, reader: SafeFileSystemReader, state: State, part: dict, *, strict: bool, every_key: bool,
    model_change: str,
) -> None:  # fmt: skip
    """Read ``part`` (model tensors, maybe optimizer state) from the checkpoint and copy it into the model."""
    wanted = gather_parts(part)
    try:
        with single_process_quiet():
            dcp.load(wanted, storage_reader=reader, planner=SafeLoadPlanner(allow_partial_load=not strict))
    except (Exception, dcp.CheckpointException) as exc:
        cause = root_cause(exc)
        if isinstance(cause, CheckpointError):
            raise cause from exc
        fix = f"{model_change}{_MODEL_MISMATCH_FIX}" if model_change else ""
        raise CheckpointError(
            f"Cannot load the tensors of checkpoint {path} ({type(cause).__name__}: {cause}).{fix}"
        ) from exc
    wanted = split_parts_like(wanted, part)
    options = StateDictOptions(strict=every_key)
    if "optim" in wanted:
        set_state_dict(
            state.model,
            state.optimizers,
            model_state_dict=wanted["model"],
            optim_state_dict=wanted["optim"],
            options=options,
        )
    else:
        set_model_state_dict(state.model, wanted["model"], options=options)


def _check_model_keys(
    path: Path, model: Any, model_keys: set[str], saved_model_keys: set[str], model_change: str
) -> set[str]:
    """The model keys the checkpoint may lack (the model's hooks say which); raises on any other mismatch."""
    missing, unexpected = sorted(model_keys - saved_model_keys), sorted(saved_model_keys - model_keys)
    if not unexpected and checkpoint_hooks(model).loadable_without(missing, saved_model_keys):
        return set(missing)
    if missing or unexpected:
        raise CheckpointError(
            f"Checkpoint {path} does not match the model: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}."
            f"{model_change or ' Check that the model section matches the run that saved it.'}{_MODEL_MISMATCH_FIX}"
        )


def _restore_training_state(path: Path, meta: dict, state: State, callbacks: Sequence, algorithms: Sequence) -> None:
    saved_world_size = meta.get("run", {}).get("world_size", state.world_size)
    if saved_world_size != state.world_size:
        log.warning("Checkpoint %s was saved by %d ranks; resuming on %d.", path, saved_world_size, state.world_size)
    state.timestamp = Timestamp.from_state_dict(meta["timestamp"])
    _load_schedulers(path, state.schedulers, meta["schedulers"])
    load_rng_file(rng_file_for_rank(path, state.rank))
    saved_dataloader = meta.get("dataloader")
    if saved_dataloader is not None:
        if hasattr(state.train_dataloader, "load_state_dict"):
            state.train_dataloader.load_state_dict(saved_dataloader)
        else:
            log.warning("Checkpoint %s has dataloader state but this dataloader cannot load it.", path)
    _load_stateful(path, callbacks, meta.get("callbacks", {}))
    _load_stateful(path, algorithms, meta.get("algorithms", {}))


def _load_schedulers(path: Path, schedulers: Sequence, saved: list[dict]) -> None:
    if schedulers and not saved:  # e.g. converted from Composer: foundry's schedules follow the timestamp
        log.warning("Checkpoint %s holds no LR scheduler state; this run's schedules continue from its batch.", path)
        return
    if len(schedulers) != len(saved):
        raise CheckpointError(
            f"Checkpoint {path} has {len(saved)} LR scheduler(s) but this run has {len(schedulers)}. Use the "
            "same schedulers as the saved run, or load_weights_only=True to start schedules afresh."
        )
    for scheduler, saved_state in zip(schedulers, saved):
        # Merge over the live state: entries that were not JSON (e.g. lambdas) keep their current value.
        scheduler.load_state_dict({**scheduler.state_dict(), **saved_state})


def _load_stateful(path: Path, objects: Sequence, saved: dict[str, Any]) -> None:
    restored = set()
    for key, obj in stateful_key_pairs(objects):
        if key in saved and hasattr(obj, "load_state_dict"):
            obj.load_state_dict(saved[key])
            restored.add(key)
    if unused := sorted(set(saved) - restored):
        log.warning("Checkpoint %s has state for %s, which this run does not have.", path, unused)
