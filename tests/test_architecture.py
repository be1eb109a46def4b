"""The import graph of foundry/ flows one way: no cycle between files, none between packages.

Every import counts: function-local ones (they still make one module need the other) and
``if TYPE_CHECKING:`` ones (a type a module names is a concept it depends on). A package is
``foundry.<name>`` as one unit (a top-level module is its own unit); ``foundry/__init__.py``, which loads
names lazily, is left out.

A module imports foundry at its top, where a reader sees what it needs: a function-local import of a
foundry module is allowed only where ``LAZY_FOUNDRY_IMPORTS`` says why.
"""

from __future__ import annotations

import ast
import collections
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

FOUNDRY = Path(__file__).resolve().parents[1] / "foundry"

# {module: the foundry modules it may import inside a function (None: any)}, each with its reason.
LAZY_FOUNDRY_IMPORTS: dict[str, set[str] | None] = {
    # The Triton kernels import triton, which a CPU-only install may lack (or cannot run): they are
    # imported once kernels_run_on says they run, so that `import foundry` works without triton.
    "foundry.algorithms.fused_kernels": {"foundry.kernels.norm", "foundry.kernels.glu", "foundry.kernels.rope"},
    "foundry.kernels.linear_cross_entropy": {"foundry.kernels.cross_entropy"},
    # text_dataset imports mosaicml-streaming at its top, which the GPU image lacks (foundry/data/mds.py).
    "foundry.data.text": {"foundry.data.text_dataset"},
    # `foundry --help` must not wait for torch: `import foundry.cli` takes 0.03 s, the trainer's imports
    # 6 s or more; each command imports its modules when it runs (the docstring of foundry/cli.py).
    "foundry.cli": None,
    # A training process loads transformers and torchmetrics only when it needs them (tokenizer, Hugging Face
    # export, ICL tasks): each relaunch, rank and test subprocess then starts about 2 s sooner.
    "foundry.callbacks.hf_checkpointer": {"foundry.convert.commands", "foundry.convert.hf_export"},
    "foundry.peft.export": {"foundry.convert.commands"},  # `convert merge --hf`; hf_checkpointer imports export
    "foundry.eval.during_training": {"foundry.eval.evaluator", "foundry.eval.gauntlet"},
}


def module_files(root: Path = FOUNDRY) -> dict[str, Path]:
    """``{dotted module name: file}`` for every module under ``root``."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_modules(name: str, path: Path, modules: Mapping[str, Path]) -> set[str]:
    """The foundry modules ``name`` imports (the deepest existing module of each imported name)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.update(target for target in import_targets(node, name, path, modules) if target != name)
    return found


def function_local_imports(name: str, path: Path, modules: Mapping[str, Path]) -> list[tuple[int, str]]:
    """``(line, foundry module)`` for each import of a foundry module inside a function of ``name``."""
    found = set()
    for function in ast.walk(ast.parse(path.read_text())):
        if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            for node in ast.walk(function):
                if isinstance(node, ast.Import | ast.ImportFrom):
                    found.update((node.lineno, target) for target in import_targets(node, name, path, modules))
    return sorted(found)


def import_targets(node: ast.Import | ast.ImportFrom, name: str, path: Path, modules: Mapping[str, Path]) -> list[str]:
    """The foundry modules one import statement of module ``name`` (file ``path``) reaches."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = name if path.name == "__init__.py" else name.rpartition(".")[0]
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*anchor, *([base] if base else [])])
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
    targets = []
    for target in names:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target:
            targets.append(target)
    return targets


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


def test_foundry_modules_are_imported_at_the_top_of_a_module() -> None:
    unexplained = []
    modules = module_files()
    for name, path in modules.items():
        allowed = LAZY_FOUNDRY_IMPORTS.get(name, set())
        for line, target in function_local_imports(name, path, modules):
            if allowed is not None and target not in allowed:
                unexplained.append(f"{path.relative_to(FOUNDRY.parent)}:{line} imports {target} inside a function")
    assert unexplained == [], "move these to the top of the module, or say why not in LAZY_FOUNDRY_IMPORTS"


def test_every_allowed_lazy_import_still_exists() -> None:
    modules = module_files()
    for name, allowed in LAZY_FOUNDRY_IMPORTS.items():
        found = {target for _, target in function_local_imports(name, modules[name], modules)}
        assert found and (allowed is None or allowed == found), name


def test_the_local_import_finder_finds_one(tmp_path: Path) -> None:
    path = tmp_path / "module.py"
    source = "import foundry.errors\n\ndef f():\n    import json\n    from . import x\n    from foundry import core\n"
    path.write_text(source)
    modules = {name: path for name in ("foundry", "foundry.errors", "foundry.pkg", "foundry.pkg.x", "foundry.core")}
    assert function_local_imports("foundry.pkg.module", path, modules) == [(5, "foundry.pkg.x"), (6, "foundry.core")]


# Only the YAML adapter (foundry.config itself) and the command line read LLM Foundry's YAML schema:
# every component owns its section, and the Trainer takes them without it.
CONFIG_IMPORTERS = {"foundry.cli"}


def test_only_the_yaml_adapter_and_the_command_line_import_foundry_config() -> None:
    files, _ = graphs()
    importers = {
        name
        for name, targets in files.items()
        if any(target == "foundry.config" or target.startswith("foundry.config.") for target in targets)
    }
    assert {name for name in importers if package_of(name) != "foundry.config"} <= CONFIG_IMPORTERS


def test_checkpoint_code_names_no_lora() -> None:
    # LoRA reaches checkpoints through the model's checkpoint_hooks (foundry.checkpoint.hooks).
    named = [
        str(path.relative_to(FOUNDRY.parent))
        for path in (FOUNDRY / "checkpoint").rglob("*.py")
        if any(word in path.read_text().lower() for word in ("lora", "adapter", "peft"))
    ]
    assert named == []


def test_no_lazy_export_is_shadowed_by_a_submodule_of_the_same_name() -> None:
    # Once `foundry.distributed.parallelize` (a module) were imported, `distributed.parallelize` would be it,
    # not the function the package exports: Python sets the attribute, and a module __getattr__ never runs.
    shadowed = []
    for name, path in module_files().items():
        if path.name == "__init__.py" and "_EXPORTS" in path.read_text():
            submodules = {child.stem for child in path.parent.glob("*.py")} | {
                child.name for child in path.parent.iterdir() if (child / "__init__.py").is_file()
            }
            exports = ast.literal_eval(
                next(
                    node.value
                    for node in ast.parse(path.read_text()).body
                    if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "_EXPORTS"
                )
            )
            shadowed += [
                f"{name}.{export}"
                for export, module in exports.items()
                if export in submodules and module != f"{name}.{export}"  # exporting the module itself is fine
            ]
    assert shadowed == []


def test_the_trainer_constructor_stays_short() -> None:
    # The Trainer takes its sections whole (the checkpoint section through its Checkpointer): nothing is relayed.
    tree = ast.parse((FOUNDRY / "trainer.py").read_text())
    trainer = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Trainer")
    init = next(node for node in trainer.body if isinstance(node, ast.FunctionDef) and node.name == "__init__")
    assert init.end_lineno - init.lineno + 1 <= 60


def test_models_do_not_import_the_yaml_module() -> None:
    # A model's config becomes a plain dict through foundry.schema; the YAML reader is the adapter's, above it.
    files, _ = graphs()
    importers = sorted(name for name, targets in files.items() if "foundry.yaml_config" in targets)
    assert not [name for name in importers if package_of(name) == "foundry.models"], importers


def test_importing_the_trainer_loads_neither_transformers_nor_torchmetrics() -> None:
    probe = "import sys, foundry.trainer; print(sorted({'transformers', 'torchmetrics'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_distributed_imports_nothing_from_the_models() -> None:
    # distributed/ plans from what a model declares (foundry.distributed.protocol), never from its classes.
    files, _ = graphs()
    imports = {
        (name, target)
        for name, targets in files.items()
        if package_of(name) == "foundry.distributed"
        for target in targets
        if package_of(target) == "foundry.models"
    }
    assert imports == set()


@pytest.mark.parametrize("name", ["mpt_causal_lm", "llama_causal_lm", "llama_moe"])
def test_the_model_families_declare_what_each_parallelism_acts_on(name: str) -> None:
    from foundry.distributed.protocol import AttentionLayer, ExpertLayer, ParallelModel
    from foundry.models.build import build_model

    keys = {"d_model": 16, "n_heads": 2, "n_layers": 2, "max_seq_len": 8, "vocab_size": 32, "init_device": "meta"}
    keys |= {"kv_n_heads": 2} if name != "mpt_causal_lm" else {}
    moe = name == "llama_moe"
    if moe:
        name, keys = "llama_causal_lm", {**keys, "moe_num_experts": 4, "moe_top_k": 2, "ffn_hidden_size": 8}
    model = build_model({"name": name, **keys})
    assert isinstance(model, ParallelModel)
    assert list(model.parallel_blocks()) == list(model.transformer.blocks)
    attention = model.attention_layers()
    assert len(attention) == 2 and all(isinstance(layer, AttentionLayer) for layer in attention)
    assert all(layer.mask_beyond_causal() is None for layer in attention)
    experts = model.expert_layers()
    assert len(experts) == (2 if moe else 0)
    assert all(isinstance(layer, ExpertLayer) and layer.exchange is None for layer in experts)
