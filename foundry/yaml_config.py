"""YAML for configs: reading files (anchors unshared), ``key.path=value`` overrides, ``${a.b.c}`` interpolation,
and printing a config back as YAML that reads to the same config."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from foundry.errors import ConfigError, did_you_mean
from foundry.schema import config_to_dict, parse_dataclass


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, reading ``1e-4`` as a float as YAML 1.2 and OmegaConf do (YAML 1.1 needs a dot)."""


T = TypeVar("T")


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """The YAML mapping in ``path``; anchors and aliases are expanded into independent copies."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"Config file '{path}' does not exist (looked in {path.resolve().parent}). Check the path.")
    try:
        data = yaml.load(path.read_text(), Loader=_Loader)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "an unknown line"
        raise ConfigError(f"YAML syntax error in '{path}' at {where}: {error.problem}.") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"Cannot read '{path}' as YAML: {error}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"'{path}' must hold a mapping of keys at the top level, not a {type(data).__name__}.")
    return _copy_tree(data)


def _copy_tree(value: Any) -> Any:
    """A deep copy that also unshares YAML aliases, so an override of one key never edits another."""
    if isinstance(value, dict):
        return {key: _copy_tree(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_copy_tree(item) for item in value]
    return value


# ---------------------------------------------------------------------------------- overrides
# Maps of registered components: in the file, ``speed_monitor:`` with no value means "no arguments" (LLM
# Foundry's YAMLs write it), so an override ``callbacks.speed_monitor=null`` is the way to drop one.
COMPONENT_SECTIONS = ("callbacks", "algorithms", "loggers")


def apply_overrides(cfg: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of ``cfg`` with each ``key.path=value`` set; the value is read as YAML (``[0.9,0.95]``, ``{}``).

    ``callbacks.NAME=null`` (also under ``algorithms`` and ``loggers``) removes that component.
    """
    updated = _copy_tree(dict(cfg))
    for override in overrides:
        key_path, sep, text = override.partition("=")
        if not sep or not key_path.strip():
            raise ConfigError(
                f"Cannot read override '{override}': write key.path=value, e.g. optimizer.lr=3e-4, "
                "optimizer.betas=[0.9,0.95] or loggers.wandb={}."
            )
        try:
            value = yaml.load(text, Loader=_Loader)
        except yaml.YAMLError:
            raise ConfigError(
                f"Cannot read the value of override '{override}' as YAML; quote it if it is text."
            ) from None
        parts = key_path.strip().split(".")
        if value is None and len(parts) == 2 and parts[0] in COMPONENT_SECTIONS:
            section = updated.get(parts[0])
            if isinstance(section, dict):
                section.pop(parts[1], None)
            continue
        _set_path(updated, parts, value, override)
    return updated


def _set_path(root: dict[str, Any], parts: list[str], value: Any, override: str) -> None:
    """Set ``root[p0][p1]...`` creating mappings where keys are missing (or null); ``a.0.b`` indexes lists."""
    node: Any = root
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"Override '{override}': '{part}' is not an index of the {len(node)}-item list.")
            index: Any = int(part)
        elif isinstance(node, dict):
            index = part
            if not last and node.get(part) is None:
                node[part] = {}
        else:
            parent = ".".join(parts[:depth])
            raise ConfigError(f"Override '{override}': '{parent}' is {node!r}, not a mapping, so it has no '{part}'.")
        if last:
            node[index] = value
        else:
            node = node[index]


# ------------------------------------------------------------------------------ interpolation
_REFERENCE = re.compile(r"\$\{([^${}]+)\}")


def resolve_interpolations(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Replace every ``${a.b.c}`` with the value at that path, then drop ``variables``.

    A value that is exactly one reference keeps the referenced value's type (int, list, mapping);
    a reference inside text is substituted as text. References may chain; cycles are errors.
    """
    resolver = _Resolver(cfg)
    return {key: resolver.resolve(value, str(key), ()) for key, value in cfg.items() if key != "variables"}


class _Resolver:
    def __init__(self, root: Mapping[str, Any]) -> None:
        self.root = root

    def resolve(self, value: Any, key_path: str, chain: tuple[str, ...]) -> Any:
        if isinstance(value, dict):
            return {key: self.resolve(item, f"{key_path}.{key}", chain) for key, item in value.items()}
        if isinstance(value, list):
            return [self.resolve(item, f"{key_path}.{index}", chain) for index, item in enumerate(value)]
        if not isinstance(value, str) or "${" not in value:
            return value
        whole = _REFERENCE.fullmatch(value.strip())
        if whole:
            return self.follow(whole.group(1).strip(), key_path, chain)
        return _REFERENCE.sub(lambda match: str(self.follow(match.group(1).strip(), key_path, chain)), value)

    def follow(self, reference: str, key_path: str, chain: tuple[str, ...]) -> Any:
        """The resolved value at ``reference``, which ``key_path`` refers to."""
        chain = (*chain, key_path)
        if any(path == reference or path.startswith(reference + ".") for path in chain):
            raise ConfigError(f"Interpolation cycle: {' -> '.join((*chain, reference))}. Break the loop.")
        return self.resolve(self.lookup(reference, key_path), reference, chain)

    def lookup(self, reference: str, key_path: str) -> Any:
        node: Any = self.root
        parts = reference.split(".")
        for depth, part in enumerate(parts):
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                missing = ".".join(parts[: depth + 1])
                hint = did_you_mean(part, map(str, node)) if isinstance(node, dict) else ""
                raise ConfigError(
                    f"'{key_path}' refers to '${{{reference}}}', but '{missing}' does not exist.{hint} "
                    "Fix the reference or define the value (e.g. under 'variables')."
                )
        return node


# ----------------------------------------------------------------------------------- printing
def to_yaml(cfg: Any) -> str:
    """``cfg`` (a config or plain dict) as YAML that ``foundry train`` reads back to the same config."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False)


def yaml_section(path: str | Path, key: str) -> Any:
    """``key`` of the YAML file at ``path``, with ``${...}`` references resolved."""
    data = resolve_interpolations(load_yaml(path))
    if key not in data:
        raise ConfigError(f"'{path}' has no top-level '{key}:' key (it has: {', '.join(map(str, data)) or 'none'}).")
    return data[key]


# ------------------------------------------------------------------------------------ pipeline
def load_config(
    cls: type[T],
    path: str | Path | None,
    overrides: Sequence[str] = (),
    prepare: Callable[[dict[str, Any]], dict[str, Any]] = lambda data: data,
) -> tuple[T, dict[str, Any]]:
    """A YAML file (none: an empty one) read, overridden, interpolated and parsed into dataclass ``cls``.

    The one pipeline of ``foundry train`` and ``foundry eval``: ``prepare`` sees the resolved mapping
    first (top-level checks with better messages). Returns the config and the resolved mapping; every
    error names ``path``.
    """
    raw = apply_overrides(load_yaml(path) if path else {}, overrides)
    try:
        resolved = resolve_interpolations(raw)
        return parse_dataclass(cls, prepare(resolved), ""), resolved
    except ConfigError as error:
        raise ConfigError(f"{path or 'the command line'}: {error}") from None
