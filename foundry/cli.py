"""The ``foundry`` command: ``foundry train CFG.yaml [key.path=value ...]``, ``foundry eval``, ``foundry data ...``.

Each subcommand is one ``Command`` in ``COMMANDS`` (help, add_arguments, run). Only the chosen
command's arguments are built and its modules imported, so ``foundry --help`` stays fast. To add
``foundry eval``, write its two functions and add an entry; ``"data convert"`` shows a nested one.

This is the one module that imports foundry lazily (inside functions, and through ``_lazy``), on
purpose: ``import foundry.cli`` takes about 0.03 s, ``import foundry.config.build`` (torch, the trainer,
every component) 6 to 10 s on a CPU machine (``python -X importtime``), and ``foundry --help`` should
not wait for torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import importlib
import logging
import os
import re
import sys
import textwrap
import typing
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from foundry.distributed.job import hand_to_launcher
from foundry.errors import EXIT_CHECK_FAILED, EXIT_PREEMPTED, FoundryError

if TYPE_CHECKING:
    from foundry.config import TrainConfig
    from foundry.distributed.rendezvous import Nodes


@dataclasses.dataclass(frozen=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# ---------------------------------------------------------------------------------------- train
def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = train_epilog()
    parser.add_argument("config", help="train YAML (LLM Foundry's schema)")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value", help="set any key; the value is YAML")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    launch = parser.add_argument_group("launch (through torchrun; see docs/DISTRIBUTED.md)")
    launch.add_argument(
        "--nproc", type=int, metavar="N", help="run N ranks on this machine (one per GPU); with --dry-run: GPUs a node"
    )
    launch.add_argument("--nnodes", type=int, metavar="N", help="machines in the job (default 1)")
    launch.add_argument(
        "--node-rank", type=int, metavar="R", help="this machine's rank, 0 to N-1 (0 hosts the rendezvous)"
    )
    launch.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="where the machines' launchers meet (nnodes > 1)")
    launch.add_argument(
        "--rdzv-timeout-s", type=float, metavar="S", help="seconds the machines may take to meet (default 300)"
    )
    launch.add_argument("--rdzv-id", metavar="ID", help="the job's name at the endpoint (default: the run name)")
    launch.add_argument(
        "--grace-period-s",
        type=float,
        default=100.0,
        metavar="S",
        help="after SIGTERM/SIGUSR1, seconds the ranks may take to checkpoint before they are killed (default 100)",
    )
    dry = parser.add_argument_group("dry run (plan a layout on this CPU, without GPUs; see docs/DISTRIBUTED.md)")
    dry.add_argument(
        "--dry-run", action="store_true", help="print per-GPU memory and a step's collectives for the layout, and exit"
    )
    dry.add_argument(
        "--world-size", type=int, metavar="N", help="GPUs of the planned job (default: --nproc x --nnodes)"
    )
    dry.add_argument("--gpu-memory-gib", type=float, default=80.0, metavar="G", help="each GPU's memory (default 80)")
    dry.add_argument("--json", action="store_true", help="with --dry-run: print the plan as JSON")


def run_train(args: argparse.Namespace) -> int:
    """Train in this process (one rank of a launched job, or alone), or launch ``--nproc`` ranks.

    Returns 0 when the run finished, ``HANDED_OVER_EXIT_CODE`` (3) when a ``hand_over`` callback stopped it,
    ``EXIT_PREEMPTED`` (5) when SIGTERM or SIGUSR1 did, ``EXIT_CHECK_FAILED`` (1) when a ``reference_curve``
    callback stopped it (foundry.errors).
    """
    from foundry.config import load_train_config
    from foundry.config.component_keys import check_component_keys
    from foundry.distributed.job import launched_by_torchrun, preemption_signals_noted, stop_with_launcher
    from foundry.yaml_config import to_yaml

    if launched_by_torchrun():
        stop_with_launcher()  # a rank of `foundry train --nproc`: a launcher killed takes its ranks along
    # A preemption signal is noted from here to the exit, never fatal: the exit code stays 5 for any sequence of them.
    with preemption_signals_noted(restore=not args.exits_after):
        cfg, resolved = load_train_config(args.config, args.overrides)  # every key checked before any work (no torch)
        check_component_keys(cfg)  # the built-in components' keys too, read from their source (no torch)
        from foundry.config.build import check_config

        if args.dry_run:
            return _dry_run(cfg, args)
        nodes = None if launched_by_torchrun() else _job_nodes(args, cfg.run_name)  # a rank: its launcher read them
        launching = nodes is not None and (nodes.nproc is not None or nodes.nnodes > 1)
        if args.print_config:
            # what would stop the run before it builds anything stops the printout too
            check_config(cfg, nodes.world_size if launching else None)
            print(to_yaml(cfg), end="")
            return 0
        if launching:
            return _launch_ranks(args, cfg, nodes)
        _configure_logging(cfg.python_log_level)
        return _train(cfg, resolved)


def _train(cfg: TrainConfig, resolved: dict[str, Any]) -> int:
    from foundry import distributed
    from foundry.callbacks.hand_over import HANDED_OVER_EXIT_CODE, handed_over
    from foundry.callbacks.reference_curve import stopped_outside_band
    from foundry.checkpoint.kill_points import kill_point
    from foundry.checkpoint.preemption import preemption_of
    from foundry.config.auto_checkpointing import check_ranks_agree, resolve_for_this_rank, wants_auto
    from foundry.config.build import build_trainer, check_settings

    check_settings(cfg, distributed.get_world_size())  # before the process group starts (torchrun's WORLD_SIZE)
    auto_checkpointing = wants_auto(cfg)
    cfg = resolve_for_this_rank(cfg)  # activation_checkpointing: auto, planned on a fake process group
    if distributed.launched_by_torchrun():
        distributed.init_process_group(cfg.dist_timeout)
    try:
        with distributed.explain_lost_ranks():  # a dead peer's raw gloo/NCCL error becomes one that names it
            # Ranks that each made a default name (foundry-<time>) must share rank 0's: it names the save folder.
            cfg.run_name = resolved["run_name"] = distributed.broadcast_object(cfg.run_name)
            distributed.check_same_config(resolved)  # a node started with another config is refused here
            if auto_checkpointing:
                check_ranks_agree(cfg)
            kill_point("train.started")
            trainer = build_trainer(cfg, resolved)
            main_process = trainer.state.is_main_process
            trainer.fit()
            kill_point("train.fit_returned")
    finally:
        distributed.destroy_process_group()
    if preemption_of(trainer.engine.callbacks):
        if main_process:
            saved = trainer.state.last_checkpoint_path if trainer.save_folder else None
            print(preempted_line(cfg.run_name, trainer.state.stop_reason, saved))
        return EXIT_PREEMPTED
    if handed_over(trainer.engine.callbacks):
        if main_process:
            print(f"foundry: run '{cfg.run_name}' {trainer.state.stop_reason}; relaunch with autoresume: true")
        return HANDED_OVER_EXIT_CODE
    if stopped_outside_band(trainer.engine.callbacks):
        if main_process:
            print(f"foundry: run '{cfg.run_name}' FAILED its reference check: {trainer.state.stop_reason}")
        return EXIT_CHECK_FAILED
    if main_process:
        print(f"foundry: run '{cfg.run_name}' finished; metrics in {trainer.run_folder / 'metrics.jsonl'}")
    return 0


def _dry_run(cfg: TrainConfig, args: argparse.Namespace) -> int:
    """The layout of ``--world-size`` GPUs, ``--nproc`` a node (default 8), planned here on torch's fake backend."""
    from foundry.config.auto_checkpointing import choose_checkpointing, wants_auto
    from foundry.config.dry_run import dry_run

    world_size = args.world_size or (args.nproc or 1) * (args.nnodes or 1)
    if wants_auto(cfg):  # the choice foundry train would make on this card
        cfg, choice = choose_checkpointing(cfg, world_size, args.nproc or 8, args.gpu_memory_gib)
        if not args.json:
            print(choice.line())
    plan = dry_run(cfg, world_size, args.nproc or 8, args.gpu_memory_gib)
    print(plan.to_json() if args.json else plan.table())
    return 0


def preempted_line(run_name: str, stop_reason: str, checkpoint: str | None) -> str:
    """What ``foundry train`` prints when a preemption signal stopped it."""
    if checkpoint is None:
        return f"foundry: run '{run_name}' {stop_reason}; no save_folder, so nothing was saved"
    return f"foundry: run '{run_name}' {stop_reason}; checkpoint {checkpoint}; relaunch with autoresume: true"


def _job_nodes(args: argparse.Namespace, run_name: str) -> Nodes:
    """The job's machines from the launch options, else the variables torchrun, Kubeflow and Slurm set."""
    from foundry.core.run_name import is_generated_run_name
    from foundry.distributed.rendezvous import job_nodes

    options = ("nproc", "nnodes", "node_rank", "rdzv_endpoint", "rdzv_timeout_s", "rdzv_id")
    # A name foundry made up differs per machine, so it cannot name the job at the endpoint.
    rdzv_id = "foundry" if is_generated_run_name(run_name) else run_name
    return job_nodes({option: getattr(args, option) for option in options}, rdzv_id)


def _launch_ranks(args: argparse.Namespace, cfg: TrainConfig, nodes: Nodes) -> int:
    """``foundry train`` again, as ``--nproc`` ranks under torchrun, all with this run name."""
    from foundry.config.build import check_config
    from foundry.distributed.launch import check_local_ranks, launch

    check_local_ranks(nodes.nproc or 1, cfg.device)  # this machine first: its GPUs or cores
    check_config(cfg, nodes.world_size)  # a config error said once, before any rank starts
    os.environ["RUN_NAME"] = cfg.run_name  # the ranks' default run name, when the YAML sets none
    command = ["train", args.config, *args.overrides, *(["--debug"] if args.debug else [])]
    return launch(command, nodes, args.grace_period_s)


def train_epilog() -> str:
    """Override syntax and every config key with its type and default, read from ``TrainConfig``."""
    from foundry.config import TrainConfig

    lines = [
        "overrides:",
        "  Any key can be set after the YAML path as key.path=value; the value is read as YAML.",
        "  They apply before ${...} interpolation, so variables.* overrides reach every reference:",
        "    foundry train yamls/quickstart.yaml max_duration=20ba optimizer.lr=3e-4",
        "    foundry train cfg.yaml variables.max_seq_len=256 optimizer.betas=[0.9,0.95] loggers.wandb={}",
        "  callbacks.NAME=null (also algorithms., loggers.) drops a component the YAML lists.",
        "",
        "keys (type = default; an empty value in the YAML means the default):",
    ]
    for field in dataclasses.fields(TrainConfig):
        lines.append(f"  {field.name}: {_field_signature(TrainConfig, field)}")
        lines.append(f"      {field.metadata.get('doc', '')}")
    lines += ["", "sections:"]
    for section, owners in _sections(TrainConfig).items():
        fields = dataclasses.fields(section)
        if all("doc" in f.metadata for f in fields):  # one key a line, with what it does (fsdp_config)
            lines.append(f"  {', '.join(owners)} ({section.__name__}):")
            for f in fields:
                lines += [f"    {f.name}: {_field_signature(section, f)}", f"        {f.metadata['doc']}"]
            continue
        keys = ", ".join(f"{f.name}: {_field_signature(section, f)}" for f in fields)
        text = f"{', '.join(owners)} ({section.__name__}): {keys}"
        lines += textwrap.wrap(text, width=110, initial_indent="  ", subsequent_indent="      ")
    return "\n".join(lines)


def _field_signature(cls: type, field: dataclasses.Field) -> str:
    hint = typing.get_type_hints(cls)[field.name]
    type_text = re.sub(r"\b(?:\w+\.)+", "", hint.__name__ if isinstance(hint, type) else str(hint))
    type_text = type_text.replace("NoneType", "None")
    if field.default is not dataclasses.MISSING:
        default = field.default.value if isinstance(field.default, enum.Enum) else field.default
        return f"{type_text} = {default if type(default).__name__ == 'Time' else repr(default)}"
    if field.default_factory is not dataclasses.MISSING:
        return f"{type_text} = {field.default_factory()!r}"
    return f"{type_text} (required)"


def _sections(cls: type) -> dict[type, list[str]]:
    """Nested config dataclasses and the keys that hold them, e.g. ``LoaderConfig: [train_loader, ...]``."""
    owners: dict[type, list[str]] = {}
    for name, hint in typing.get_type_hints(cls).items():
        for section in _config_classes(hint):
            owners.setdefault(section, []).append(name)
    return owners


def _config_classes(hint: Any) -> list[type]:
    """Config dataclasses (of a component's ``config`` module) inside a type hint (``LoaderConfig | None`` →
    ``[LoaderConfig]``)."""
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return [hint] if hint.__module__.endswith(".config") else []
    return [found for arg in typing.get_args(hint) for found in _config_classes(arg)]


def _configure_logging(level: str | None) -> None:
    if level is not None:
        logging.basicConfig(format="%(asctime)s: %(levelname)s: %(name)s: %(message)s")
        logging.getLogger("foundry").setLevel(level.upper())


# ------------------------------------------------------------------------------- data convert
def add_convert_arguments(parser: argparse.ArgumentParser) -> None:
    from foundry.data.convert import add_convert_arguments as add_arguments

    add_arguments(parser)


def run_convert(args: argparse.Namespace) -> int:
    from foundry.data.convert import run_convert as run

    return run(args)


# ------------------------------------------------------------------------ convert to-hf / from-hf
def _lazy(module: str, function: str) -> Callable[..., Any]:
    """``module.function``, imported only when the command runs (keeps ``foundry --help`` fast)."""

    def call(*args: Any) -> Any:
        return getattr(importlib.import_module(module), function)(*args)

    return call


COMMANDS: dict[str, Command] = {
    "train": Command("train a model from a YAML config", add_train_arguments, run_train),
    "data convert": Command("tokenize text into streaming (MDS) shards", add_convert_arguments, run_convert),
    "convert to-hf": Command(
        "write a checkpoint as a Hugging Face model directory",
        _lazy("foundry.convert.commands", "add_to_hf_arguments"),
        _lazy("foundry.convert.commands", "run_to_hf"),
    ),
    "convert export-adapter": Command(
        "write a LoRA run's adapters in PEFT's format, for the Hugging Face export of its base",
        _lazy("foundry.peft.export", "add_export_adapter_arguments"),
        _lazy("foundry.peft.export", "run_export_adapter"),
    ),
    "convert merge": Command(
        "fold a LoRA run's adapters into its weights: a plain foundry checkpoint, or a Hugging Face directory (--hf)",
        _lazy("foundry.peft.export", "add_merge_arguments"),
        _lazy("foundry.peft.export", "run_merge"),
    ),
    "convert from-hf": Command(
        "write a Hugging Face model directory as a foundry checkpoint",
        _lazy("foundry.convert.commands", "add_from_hf_arguments"),
        _lazy("foundry.convert.commands", "run_from_hf"),
    ),
    "convert from-composer": Command(
        "write an LLM Foundry (Composer) checkpoint as a foundry checkpoint, optionally with its optimizer state",
        _lazy("foundry.convert.composer", "add_from_composer_arguments"),
        _lazy("foundry.convert.composer", "run_from_composer"),
    ),
    "eval": Command(
        "evaluate checkpoints or Hugging Face models on ICL tasks (and compare them)",
        _lazy("foundry.eval_arguments", "add_eval_arguments"),
        _lazy("foundry.eval_command", "run_eval"),
    ),
    "convert consolidate": Command(
        "one file (safetensors, or .pt with the optimizer) from a sharded checkpoint",
        _lazy("foundry.checkpoint.consolidate", "add_consolidate_arguments"),
        _lazy("foundry.checkpoint.consolidate", "run_consolidate"),
    ),
    "plot": Command(
        "plot loss and throughput curves of one or several runs to a PNG",
        _lazy("foundry.plotting", "add_plot_arguments"),
        _lazy("foundry.plotting", "run_plot"),
    ),
    "compare": Command(
        "did runs converge like a reference run? loss curves by tokens against a band (exit 1 if not)",
        _lazy("foundry.convergence", "add_compare_arguments"),
        _lazy("foundry.convergence", "run_compare"),
    ),
}
GROUP_HELP = {"data": "prepare datasets", "convert": "move weights to and from Hugging Face"}


# ------------------------------------------------------------------------------------- parser
def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``foundry`` command; returns the exit code (2 with a one-paragraph message on a FoundryError).

    Without ``argv`` this is the process's own command (the ``foundry`` script, ``python -m foundry``, a rank under
    torchrun), which exits right after: ``foundry train`` then keeps noting preemption signals until the exit.
    """
    exits_after = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(selected_command(argv))
    args, extra = parser.parse_known_args(argv)
    args.exits_after = exits_after
    if extra:  # overrides may follow options: `foundry train cfg.yaml --print-config a=1`
        if not hasattr(args, "overrides") or any(token.startswith("-") for token in extra):
            args.help_parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides += extra
    if args.run is None:
        args.help_parser.print_help()
        return 2
    try:
        return args.run(args)
    except FoundryError as error:
        if args.debug:
            raise
        if not hand_to_launcher(error):  # a rank of `foundry train --nproc`: its launcher says it once, last
            print(f"error: {error}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        return 130
    except Exception as error:  # a bug or a library's internal error: the launcher names it as the cause
        hand_to_launcher(error)
        raise


def selected_command(argv: Sequence[str]) -> str | None:
    """The ``COMMANDS`` key that ``argv`` names, if any (options are skipped)."""
    words = [token for token in argv if not token.startswith("-")]
    for name in COMMANDS:
        if words[: len(name.split())] == name.split():
            return name
    return None


def build_parser(selected: str | None) -> argparse.ArgumentParser:
    """The ``foundry`` parser; only ``selected`` gets its full arguments (and imports)."""
    parser = argparse.ArgumentParser(prog="foundry", description="Train and evaluate LLMs. See `foundry COMMAND -h`.")
    parser.add_argument("--debug", action="store_true", help="show full tracebacks for foundry's own errors")
    parser.set_defaults(run=None, help_parser=parser)
    groups = {(): parser.add_subparsers(title="commands", metavar="COMMAND")}
    for name, command in COMMANDS.items():
        words = tuple(name.split())
        for depth in range(1, len(words)):
            if words[:depth] not in groups:
                group = groups[words[: depth - 1]].add_parser(words[depth - 1], help=GROUP_HELP.get(words[depth - 1]))
                group.set_defaults(help_parser=group)
                groups[words[:depth]] = group.add_subparsers(title="commands", metavar="COMMAND")
        leaf = groups[words[:-1]].add_parser(
            words[-1], help=command.help, description=command.help, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        leaf.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show full tracebacks")
        leaf.set_defaults(run=command.run, help_parser=leaf)
        if name == selected:
            command.add_arguments(leaf)
    return parser


if __name__ == "__main__":  # `torchrun -m foundry.cli train ...` runs this module as a script
    raise SystemExit(main())
