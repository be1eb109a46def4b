"""YAML names → classes. Users extend any registry with a decorator or a package entry point.

Example::

    from foundry import registry

    @registry.callbacks.register("my_callback")
    class MyCallback(Callback): ...

or, from another package's ``pyproject.toml``::

    [project.entry-points."foundry.callbacks"]
    my_callback = "my_pkg.callbacks:MyCallback"
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterator, Mapping
from importlib.metadata import entry_points
from typing import Any, TypeVar

from foundry.errors import ConfigError, did_you_mean
from foundry.schema import check_call_kwargs

T = TypeVar("T")


class Registry:
    """A named map from YAML names to constructors."""

    def __init__(self, name: str, builtin_modules: tuple[str, ...] = ()) -> None:
        self.name = name
        self._builtin_modules = builtin_modules
        self._entries: dict[str, Callable[..., Any]] = {}
        self._loaded = False

    def register(self, name: str, obj: Callable[..., Any] | None = None) -> Any:
        """Register ``obj`` under ``name``; usable as ``@registry.register("name")``."""

        def add(target: T) -> T:
            existing = self._entries.get(name)
            if existing is not None and existing is not target:
                raise ConfigError(f"'{name}' is already registered in foundry's {self.name} registry as {existing}.")
            self._entries[name] = target  # type: ignore[assignment]
            return target

        return add(obj) if obj is not None else add

    def get(self, name: str) -> Callable[..., Any]:
        self._load()
        if name not in self._entries:
            raise ConfigError(
                f"Unknown {self.name} '{name}'.{did_you_mean(name, self._entries)} "
                f"Known {self.name}: {', '.join(sorted(self._entries))}. "
                f"Register your own with @foundry.registry.{self.name}.register('{name}')."
            )
        return self._entries[name]

    def name_of(self, target: Any) -> str | None:
        """The name ``target`` itself is registered under (not a parent class's), or None."""
        self._load()
        return next((name for name, entry in self._entries.items() if entry is target), None)

    def __contains__(self, name: str) -> bool:
        self._load()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        self._load()
        return iter(sorted(self._entries))

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        for module in self._builtin_modules:
            importlib.import_module(module)
        for entry in entry_points(group=f"foundry.{self.name}"):
            self._entries.setdefault(entry.name, entry.load())


models = Registry("models", ("foundry.models",))
dataloaders = Registry("dataloaders", ("foundry.data.text", "foundry.data.finetuning", "foundry.data.preference"))
optimizers = Registry("optimizers", ("foundry.optim",))
schedulers = Registry("schedulers", ("foundry.optim",))
callbacks = Registry("callbacks", ("foundry.callbacks",))
algorithms = Registry("algorithms", ("foundry.algorithms",))
loggers = Registry(
    "loggers",
    ("foundry.loggers.console", "foundry.loggers.jsonl", "foundry.loggers.tensorboard", "foundry.loggers.wandb"),
)


# ------------------------------------------------------------------------------- building
def build_components(source: Registry, sections: Mapping[str, Mapping[str, Any] | None], key_path: str) -> list:
    """``{name: kwargs}`` (LLM Foundry's callbacks/algorithms/loggers form; ``{}`` or empty = no kwargs)."""
    return [bound_component(source, name, kwargs, f"{key_path}.{name}")() for name, kwargs in sections.items()]


def component_factory(
    source: Registry, section: Mapping[str, Any], key_path: str, supplied: tuple[str, ...] = ()
) -> Callable[..., Any]:
    """``section['name']`` from ``source`` with the section's other keys bound, checked against its signature.

    Call the result with the arguments named in ``supplied`` (not YAML keys), e.g. an optimizer's ``params``.
    """
    kwargs = dict(section)
    return bound_component(source, kwargs.pop("name"), kwargs, key_path, f"{key_path}.name", supplied)


def bound_component(
    source: Registry,
    name: str,
    kwargs: Mapping[str, Any] | None,
    key_path: str,
    name_path: str | None = None,
    supplied: tuple[str, ...] = (),
) -> functools.partial:
    """``source[name]`` with ``kwargs`` checked and bound; errors name ``key_path`` (``name_path`` for the name)."""
    try:
        constructor = source.get(name)
    except ConfigError as error:
        raise ConfigError(f"'{name_path or key_path}': {error}") from None
    return functools.partial(constructor, **check_call_kwargs(constructor, kwargs or {}, key_path, supplied))
