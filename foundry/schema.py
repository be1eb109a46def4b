"""Typed configs from plain dicts: unknown keys, wrong types and bad values fail early with the key path.

Every config in foundry is a dataclass; ``parse_dataclass`` is the one place a YAML mapping becomes
one (``config_to_dict`` the way back), and ``check_call_kwargs`` validates the kwargs a YAML section
passes to a registered class.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import enum
import inspect
import types
import typing
from collections.abc import Callable, Collection, Mapping
from types import SimpleNamespace
from typing import Any, TypeVar

from foundry.core.time import Time, looks_like_time
from foundry.errors import ConfigError, did_you_mean

T = TypeVar("T")


def doc(text: str) -> dict[str, str]:
    """Field metadata: the one-line description ``foundry train --help`` prints for a key."""
    return {"doc": text}


def field_defaults(cls: type) -> SimpleNamespace:
    """The defaults of dataclass ``cls``'s fields by name (fields without one are left out), e.g. ``.precision``."""
    defaults = {}
    for config_field in dataclasses.fields(cls):
        if config_field.default is not dataclasses.MISSING:
            defaults[config_field.name] = config_field.default
        elif config_field.default_factory is not dataclasses.MISSING:
            defaults[config_field.name] = config_field.default_factory()
    return SimpleNamespace(**defaults)


def split_settings(settings: Mapping[str, Any], sections: Collection[type], owner: str) -> list[Any]:
    """One instance of each section dataclass, built from the flat keys of ``settings`` that it owns.

    A run's settings are flat (LLM Foundry's top-level YAML keys, or a ``Trainer``'s keywords); each
    key belongs to exactly one section, whose dataclass checks its type and value.
    """
    owners = {field.name: section for section in sections for field in dataclasses.fields(section) if field.init}
    grouped: dict[type, dict[str, Any]] = {section: {} for section in sections}
    for key, value in settings.items():
        if key not in owners:
            raise ConfigError(f"{owner} got an unknown setting '{key}'.{did_you_mean(key, owners)}")
        grouped[owners[key]][key] = value
    return [parse_dataclass(section, grouped[section], "") for section in sections]


def parse_dataclass(cls: type[T], data: Mapping[str, Any] | T | None, key_path: str) -> T:
    """Build dataclass ``cls`` from ``data``, checking every key and value.

    Raises:
        ConfigError: naming ``key_path.key`` for an unknown key (with the closest valid one), a value
            of the wrong type (with the expected type), or a missing required key.
    """
    if isinstance(data, cls):
        return data
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"'{key_path}' must be a mapping of keys for {cls.__name__}, got {_describe(data)}.")
    fields = {field.name: field for field in dataclasses.fields(cls) if field.init}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise ConfigError(
                f"Unknown key '{_join(key_path, key)}'.{did_you_mean(str(key), fields)} "
                f"Valid keys under '{key_path}': {', '.join(sorted(fields))}."
            )
        kwargs[key] = coerce(value, hints[key], _join(key_path, key))
    missing = [
        name
        for name, field in fields.items()
        if name not in kwargs and field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"Missing required key '{_join(key_path, missing[0])}' ({cls.__name__}).")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as error:
        raise ConfigError(f"Invalid value under '{key_path}': {error}") from error


def config_to_dict(cfg: Any) -> Any:
    """A plain YAML-ready copy of a config: dataclasses become dicts, ``Time`` becomes ``'100ba'``."""
    if isinstance(cfg, Time):
        return str(cfg)
    if isinstance(cfg, enum.Enum):
        return cfg.value
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {field.name: config_to_dict(getattr(cfg, field.name)) for field in dataclasses.fields(cfg)}
    if isinstance(cfg, Mapping):
        return {key: config_to_dict(value) for key, value in cfg.items()}
    if isinstance(cfg, list | tuple):
        return [config_to_dict(value) for value in cfg]
    return cfg


def check_call_kwargs(
    target: Callable[..., Any], kwargs: Mapping[str, Any], key_path: str, supplied: Collection[str] = ()
) -> dict[str, Any]:
    """Validate and coerce ``kwargs`` against ``target``'s signature (a registered class or function).

    ``supplied`` names arguments the caller passes itself (an optimizer's ``params``): not YAML keys.
    """
    function = target.__init__ if inspect.isclass(target) else target
    signature = inspect.signature(function if function is not object.__init__ else lambda: None)  # takes nothing
    parameters = {n: p for n, p in signature.parameters.items() if n not in ("self", "cls", *supplied)}
    accepts_any = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    try:
        hints = typing.get_type_hints(function)
    except Exception:  # unresolvable annotations: skip type checks, keep key checks
        hints = {}
    checked = {}
    for key, value in kwargs.items():
        parameter = parameters.get(key)
        if parameter is None or parameter.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            if accepts_any:
                checked[key] = value
                continue
            valid = [n for n, p in parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
            raise ConfigError(
                f"Unknown key '{_join(key_path, key)}'.{did_you_mean(str(key), valid)} "
                f"Valid keys under '{key_path}': {', '.join(sorted(valid)) or 'none'}."
            )
        checked[key] = coerce(value, hints[key], _join(key_path, key)) if key in hints else value
    return checked


def coerce(value: Any, expected: Any, key_path: str) -> Any:
    """Return ``value`` as type ``expected`` where that is lossless (int → float, str → Time), else raise."""
    origin = typing.get_origin(expected)
    args = typing.get_args(expected)
    if expected is Any or expected is object:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        if Time in args and looks_like_time(value):  # '-5ba' is a wrong time, not a fine string: name the key
            return coerce(value, Time, key_path)
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return coerce(value, option, key_path)
            except ConfigError as error:
                errors.append(error)
        if len(errors) == 1:  # e.g. `X | None`: the only real option's error is the precise one
            raise errors[0]
        raise _type_error(key_path, value, expected)
    if origin is typing.Literal:
        if value in args:
            return value
        choice = did_you_mean(str(value), [str(a) for a in args])
        raise ConfigError(f"'{key_path}' is {value!r}; it must be one of {', '.join(map(repr, args))}.{choice}")
    if expected is Time:
        if isinstance(value, Time | str | int) and not isinstance(value, bool):
            try:
                return Time.parse(value)
            except ConfigError as error:
                raise ConfigError(f"'{key_path}': {error}") from error
        raise _type_error(key_path, value, expected)
    if dataclasses.is_dataclass(expected) and isinstance(expected, type):
        return parse_dataclass(expected, value, key_path)
    if isinstance(expected, type) and issubclass(expected, enum.Enum):
        try:
            return expected(value)
        except ValueError:
            names = [member.value for member in expected]
            raise ConfigError(
                f"'{key_path}' is {value!r}; it must be one of {names}.{did_you_mean(str(value), map(str, names))}"
            ) from None
    if origin in (list, tuple, typing.Sequence, collections.abc.Sequence):
        if not isinstance(value, list | tuple):
            raise _type_error(key_path, value, expected)
        item_type = args[0] if args else Any
        return [coerce(item, item_type, f"{key_path}[{i}]") for i, item in enumerate(value)]
    if origin in (dict, typing.Mapping, collections.abc.Mapping):
        if not isinstance(value, Mapping):
            raise _type_error(key_path, value, expected)
        value_type = args[1] if len(args) == 2 else Any
        return {key: coerce(item, value_type, _join(key_path, str(key))) for key, item in value.items()}
    if expected is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads '1e-3' as a string (YAML 1.1); accept it
            try:
                return float(value)
            except ValueError:
                pass
        raise _type_error(key_path, value, expected)
    if expected is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise _type_error(key_path, value, expected)
    if expected is bool:
        if isinstance(value, bool):
            return value
        raise _type_error(key_path, value, expected)
    if expected is str:
        if isinstance(value, str):
            return value
        raise _type_error(key_path, value, expected)
    if isinstance(expected, type) and not isinstance(value, expected):
        raise _type_error(key_path, value, expected)
    return value


def _type_error(key_path: str, value: Any, expected: Any) -> ConfigError:
    return ConfigError(f"'{key_path}' is {_describe(value)}; expected {_type_name(expected)}.")


def _type_name(expected: Any) -> str:
    if isinstance(expected, type):
        return {"Time": "a time such as '100ba', '2ep' or '0.5dur'"}.get(expected.__name__, expected.__name__)
    return str(expected).replace("typing.", "")


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _join(key_path: str, key: str) -> str:
    return f"{key_path}.{key}" if key_path else key
