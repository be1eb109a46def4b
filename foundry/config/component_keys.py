"""A train YAML's component keys checked from foundry's source, so that a typo is reported before torch loads.

A section that names a registered component (``model``, ``optimizer``, ``scheduler``, ``callbacks``,
``algorithms``, ``loggers``) is checked against the component's signature when the run is built, which
imports the component's module and torch with it: seconds, half a minute on a busy machine. This reads
the built-in components' source instead (``ast``, nothing imported): the keyword names of each
``@registry.X.register("name")`` target, or, for a constructor taking ``config: SomeConfig | Mapping,
**keys``, the fields of that dataclass. It rejects only what it is sure of, with the words of the full
check; what it cannot read (a component registered elsewhere, ``**kwargs`` passed on, a base class it
cannot see) is left to the full check.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from foundry import registry
from foundry.errors import ConfigError, did_you_mean

if TYPE_CHECKING:
    from foundry.config import TrainConfig

_FOUNDRY = Path(__file__).resolve().parents[1]
_SUPPLIED = {"optimizers": {"params"}}  # arguments the builder passes itself, never YAML keys
_Definition = ast.ClassDef | ast.FunctionDef


def check_component_keys(cfg: TrainConfig) -> None:
    """Raise ``ConfigError`` for a built-in component's key that its constructor cannot take (see module doc)."""
    sections: list[tuple[registry.Registry, str, Mapping[str, Any], str]] = []
    for source, section, key_path in (
        (registry.models, cfg.model, "model"),
        (registry.optimizers, cfg.optimizer, "optimizer"),
        (registry.schedulers, cfg.scheduler, "scheduler"),
    ):
        if section:
            sections.append((source, str(section["name"]), {k: v for k, v in section.items() if k != "name"}, key_path))
    for source, components, key in (
        (registry.callbacks, cfg.callbacks, "callbacks"),
        (registry.algorithms, cfg.algorithms, "algorithms"),
        (registry.loggers, cfg.loggers, "loggers"),
    ):
        sections += [(source, name, kwargs or {}, f"{key}.{name}") for name, kwargs in components.items()]
    for source, name, kwargs, key_path in sections:
        accepted = accepted_keys(source, name)
        if accepted is None:
            continue
        for key in kwargs:
            if key not in accepted:
                raise ConfigError(
                    f"Unknown key '{key_path}.{key}'.{did_you_mean(str(key), accepted)} "
                    f"Valid keys under '{key_path}': {', '.join(sorted(accepted))}."
                )


def accepted_keys(source: registry.Registry, name: str) -> set[str] | None:
    """The keys built-in component ``name`` of ``source`` takes, read from its source; None if not sure."""
    files = _builtin_files(source.name, tuple(source._builtin_modules))
    target = _registered(source.name, name, files)
    if target is None:
        return None
    function = target if isinstance(target, ast.FunctionDef) else _constructor(target, files)
    if function is None:
        return None
    arguments = [*function.args.posonlyargs, *function.args.args, *function.args.kwonlyargs]
    names = {argument.arg for argument in arguments} - {"self", "cls"} - _SUPPLIED.get(source.name, set())
    if function.args.kwarg is None:
        return names
    for argument in arguments:  # `config: XConfig | Mapping | None = None, **config_keys`: the dataclass's fields
        for config_class in _annotation_names(argument.annotation):
            fields = _dataclass_fields(config_class, files)
            if fields is not None:
                return fields
    return None


@functools.cache
def _builtin_files(registry_name: str, modules: tuple[str, ...]) -> tuple[Path, ...]:
    """The source files of a registry's built-in modules (a package: every file in it)."""
    del registry_name  # part of the cache key only
    files: list[Path] = []
    for module in modules:
        path = _FOUNDRY.parent.joinpath(*module.split("."))
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")]
    return tuple(file for file in files if file.is_file())


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _registered(registry_name: str, name: str, files: tuple[Path, ...]) -> _Definition | None:
    """The class or function decorated ``@registry.<registry_name>.register("<name>")``, if one is in ``files``."""
    marker = f'register("{name}")'
    for path in files:
        if marker not in path.read_text():
            continue
        for node in _tree(path).body:
            if isinstance(node, _Definition) and any(_registers(d, registry_name, name) for d in node.decorator_list):
                return node
    return None


def _registers(decorator: ast.expr, registry_name: str, name: str) -> bool:
    if not (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute)):
        return False
    owner = decorator.func.value
    return (
        decorator.func.attr == "register"
        and isinstance(owner, ast.Attribute)
        and owner.attr == registry_name
        and len(decorator.args) == 1
        and isinstance(decorator.args[0], ast.Constant)
        and decorator.args[0].value == name
    )


def _class(name: str, files: tuple[Path, ...]) -> ast.ClassDef | None:
    for path in files:
        if f"class {name}" in path.read_text():
            for node in _tree(path).body:
                if isinstance(node, ast.ClassDef) and node.name == name:
                    return node
    return None


def _constructor(cls: ast.ClassDef, files: tuple[Path, ...]) -> ast.FunctionDef | None:
    """``cls.__init__``, or the one it inherits from a base class in ``files``; None if it is out of sight."""
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == "__init__":
            return node
    if len(cls.bases) != 1 or not isinstance(cls.bases[0], ast.Name):
        return None
    base = _class(cls.bases[0].id, files)
    return _constructor(base, files) if base is not None else None


def _dataclass_fields(name: str, files: tuple[Path, ...]) -> set[str] | None:
    """The field names of dataclass ``name`` (defined in ``files``, without base classes), or None."""
    cls = _class(name, files)
    if cls is None or cls.bases or not any("dataclass" in ast.unparse(d) for d in cls.decorator_list):
        return None
    fields = set()
    for node in cls.body:
        is_field = isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        if is_field and "ClassVar" not in ast.unparse(node.annotation):
            fields.add(node.target.id)
    return fields


def _annotation_names(annotation: ast.expr | None) -> list[str]:
    """The plain names in an annotation (``MPTConfig | Mapping[str, Any] | None`` → MPTConfig, Mapping, ...)."""
    if annotation is None:
        return []
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):  # a quoted annotation
        annotation = ast.parse(annotation.value, mode="eval").body
    return [node.id for node in ast.walk(annotation) if isinstance(node, ast.Name)]
