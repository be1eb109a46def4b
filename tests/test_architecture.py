"""The import graph of foundry/ flows one way: no cycle between files, none between packages.

Every import counts, function-local ones too (they still make one module need the other); only
``if TYPE_CHECKING:`` imports, which never run, do not. A package is ``foundry.<name>`` as one unit
(a top-level module is its own unit); ``foundry/__init__.py``, which loads names lazily, is left out.
"""

from __future__ import annotations

import ast
import collections
from collections.abc import Iterable, Mapping
from pathlib import Path

FOUNDRY = Path(__file__).resolve().parents[1] / "foundry"


def module_files(root: Path = FOUNDRY) -> dict[str, Path]:
    """``{dotted module name: file}`` for every module under ``root``."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_modules(name: str, path: Path, modules: Mapping[str, Path]) -> set[str]:
    """The foundry modules ``name`` imports (the deepest existing module of each imported name)."""
    tree = ast.parse(path.read_text())
    type_checking = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for inner in ast.walk(node)
    }
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_checking:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for neighbour in sorted(graph.get(node, ())):
            if neighbour not in index:
                visit(neighbour)
                low[node] = min(low[node], low[neighbour])
            elif neighbour in on_stack:
                low[node] = min(low[node], index[neighbour])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def package_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def graphs() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    modules = module_files()
    files = {name: imported_modules(name, path, modules) - {"foundry"} for name, path in modules.items()}
    files.pop("foundry", None)
    packages: dict[str, set[str]] = collections.defaultdict(set)
    for name, targets in files.items():
        for target in targets:
            if package_of(target) != package_of(name):
                packages[package_of(name)].add(package_of(target))
    return files, dict(packages)


def test_no_import_cycle_between_files() -> None:
    files, _ = graphs()
    assert cycles(files) == []


def test_no_import_cycle_between_packages() -> None:
    _, packages = graphs()
    assert cycles(packages) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
