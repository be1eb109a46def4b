"""Reading a Composer checkpoint (``torch.save`` of a pickle) without running any code it names.

A pickle can call any importable function, so ``torch.load(weights_only=False)`` of a checkpoint from
elsewhere runs whatever it says. ``read_composer_checkpoint`` unpickles through an allowlist instead:
tensors and their storages, plain containers, the numpy arrays and ``datetime`` values Composer
stores (RNG states, wall-clock times), and torch's version string. Composer's own classes (a
``Time``, a ``Timestamp`` of an older Composer) become ``ComposerObject`` records of their
arguments and state: plain data, never the class itself. Anything else is refused before it runs.
"""

from __future__ import annotations

import pickle
import types
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from foundry.errors import CheckpointError

_ALLOWED = {
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("builtins", "complex"),
    ("datetime", "timedelta"),
    ("datetime", "datetime"),
    ("datetime", "date"),
    ("datetime", "timezone"),
    ("_codecs", "encode"),  # bytes pickled by protocol 2
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"),
    ("torch", "Size"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
}


@dataclass
class ComposerObject:
    """What a pickled Composer object held: its class name, constructor arguments and pickled state."""

    name: str
    args: tuple = ()
    state: Any = None
    items: dict = field(default_factory=dict)

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __setitem__(self, key: Any, value: Any) -> None:
        self.items[key] = value


def _composer_class(name: str) -> type:
    """A stand-in for Composer class ``name``: calling it records the arguments instead of running anything."""

    def new(cls: type, *args: Any, **kwargs: Any) -> ComposerObject:
        return ComposerObject(name, args + tuple(kwargs.items()))

    return type(name.rpartition(".")[2], (ComposerObject,), {"__new__": new, "__init__": lambda self, *a, **k: None})


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch.torch_version" and name == "TorchVersion":
            return str
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout)):
            return getattr(torch, name)
        if module == "numpy.dtypes" and name.endswith("DType"):  # numpy 2's dtype classes, data only
            return super().find_class(module, name)
        if module == "composer" or module.startswith("composer."):
            return _composer_class(f"{module}.{name}")
        raise pickle.UnpicklingError(f"{module}.{name}")


# torch.load unpickles with ``pickle_module.Unpickler`` (adding only the storages of the tensors).
_RESTRICTED_PICKLE = types.SimpleNamespace(__name__="foundry_restricted_pickle", Unpickler=_RestrictedUnpickler)
_RESTRICTED_PICKLE.load = lambda file, **kwargs: _RestrictedUnpickler(file, **kwargs).load()


def read_composer_checkpoint(path: Path) -> dict[str, Any]:
    """The contents of Composer checkpoint ``path`` (``{"state": ..., "rng": ...}``) as plain data and tensors.

    Raises:
        CheckpointError: not a Composer checkpoint file, or it names code outside the allowlist.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(
            f"No Composer checkpoint at {path}: give the .pt file Composer wrote (e.g. ep1-ba1000-rank0.pt). "
            "A sharded Composer checkpoint (a folder) must first be saved as one file with Composer."
        )
    if not zipfile.is_zipfile(path):
        raise CheckpointError(
            f"{path} is not a checkpoint written by torch.save (a zip archive). A compressed Composer checkpoint "
            "(.pt.tar, .tar.gz...) must be extracted first."
        )
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False, pickle_module=_RESTRICTED_PICKLE)
    except pickle.UnpicklingError as refused:
        raise CheckpointError(
            f"Refusing to load {path}: it names {refused}, which a Composer checkpoint does not hold and which could "
            "run code when unpickled. Load only checkpoints you trust; foundry unpickles tensors, plain data and "
            "Composer's own records only."
        ) from None
    except Exception as error:
        reason = f"{type(error).__name__}: {error}"
        raise CheckpointError(f"Cannot read {path} as a Composer checkpoint ({reason}).") from error
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state"), dict):
        raise CheckpointError(f"{path} is not a Composer checkpoint: it holds no 'state' mapping.")
    return checkpoint
