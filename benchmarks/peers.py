"""foundry side by side with its peers (torchtitan, LLM Foundry + Composer, the Hugging Face Trainer) in one call.

Here, once (writes the token stream and LLM Foundry's YAMLs into DATA, and the peers' wheels into WHEELS):

    python benchmarks/peers.py prepare --corpus CORPUS/tinyshakespeare/input.txt CORPUS/wikitext-2/*.txt \\
        --tokenizer TOKENIZERS/gpt-neox-20b --llm-foundry-yamls REFERENCE/llm-foundry-yamls/pretrain --out data/peers
    python benchmarks/peers.py wheels --out .whl

On the GPU machine (one GPU: five rows; ``--two-gpu``: the MPT-1B and 8B pairs on two GPUs; ``--long-context``: the 8B
rows at 65,536 tokens with context parallelism on two GPUs, global batch 2, 1 warm-up + 2 timed steps; ``--four-gpu``:
the 8B float8 rows at 8,192 tokens on four GPUs, global batch 16, 2 warm-up + 5 timed steps):

    python benchmarks/peers.py run --data data/peers --wheels .whl --out OUT [--rows ...] [--two-gpu | --long-context |
        --four-gpu]

Each peer is installed from the wheels in ``--wheels`` into its own target (``/tmp/site-<peer>``, first on its
PYTHONPATH) and runs through its own entry point with its own fast settings (peers_rows.py has the table),
every row on the same tokens, at its sequence length (2048; 65,536 for the long-context rows) and the same
global batch (``--global-batch``, default 16 sequences; 2 with ``--long-context``), for ``--warmup`` +
``--steps`` optimizer steps. A row that cannot be set up or fails keeps its exact error and the script goes on.
``--smoke`` runs the same entry points on tiny models on the CPU.

One measurement for every row, from outside the framework: each framework prints a line per optimizer step;
this script stamps the time each line arrives. tokens/s per GPU = global batch x seq_len x timed steps / (time
of the last step's line - time of the last warm-up step's line) / GPUs. MFU = tokens/s per GPU x FLOPs per token
by LLM Foundry's formula (3 x (2 x active parameters + 4 x layers x d_model x seq_len): attention over the full
seq_len² square, no causal discount, as foundry's speed monitor counts it; foundry.models.flops; the shape's,
so every framework is charged the same FLOPs) / ``--peak-tflops``. Peak memory is the largest
``nvidia-smi`` memory.used of any GPU while the row ran (CUDA context and allocator cache included). Time to
first batch is from the process start to the first step's line (imports, setup, data, compile). What each
framework reports itself is kept beside these (``own``).

``--profile`` runs one step more on the foundry and torchtitan rows, profiled by the framework's own profiler
(foundry's ``callbacks.profiler``, torchtitan's ``[profiling]``) and left out of the timing; rank 0's Chrome
trace of that step is summarised by one function for both (``profile_summary.summarize_chrome_trace``: kernel
time by category, compute / exposed communication / idle on the device's timeline, the top kernels) into the
row's ``profile``: where the time of two frameworks' steps on the same shape differs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench_utils import environment, markdown_table
from peers_data import write_long_samples
from peers_rows import (
    FOUR_GPU_ROWS,
    LONG_CONTEXT_ROWS,
    ONE_GPU_ROWS,
    ROWS,
    SEQ_LEN,
    TWO_GPU_ROWS,
    Row,
    Settings,
    command,
    install_peer,
    peer_environment,
    titan_check,
)
from peers_rows import versions as package_versions
from profile_summary import summarize_chrome_trace

from foundry.errors import FoundryError

H100_BF16_PEAK_TFLOPS = 989.5
LOG_TAIL_LINES = 60
# Unset options' values; --long-context's are short since one step of two 65,536-token sequences takes ~20 s
# on two H100s (foundry's 3,350 tokens/s per GPU).
DEFAULTS = {"global_batch": 16, "warmup": 3, "steps": 20}
LONG_CONTEXT_DEFAULTS = {"global_batch": 2, "warmup": 1, "steps": 2}
FOUR_GPU_DEFAULTS = {"global_batch": 16, "warmup": 2, "steps": 5}  # a step: 16 sequences of 8,192 tokens
ROW_TIMEOUT_S = 240  # where neither --row-timeout nor the row names one
LLM_FOUNDRY_WITHOUT_FLASH = (
    "attn_impl: torch, loss_fn: torch_crossentropy (flash-attn, its YAML's FA2 and fused loss, is not installed)"
)


def run_row(row: Row, settings: Settings, wheels: Path, sites: dict[str, Path], warmup: int, timeout_s: int) -> dict:
    """Set the row's peer up, run it, and measure it; any failure becomes the row's ``error``."""
    result: dict[str, Any] = {"row": row.name, "framework": row.framework, "gpus": row.gpus, "seq_len": row.seq_len,
                              "microbatch": row.microbatch, "global_batch": settings.global_batch}  # fmt: skip
    site = None
    if row.peer:
        site = sites.get(row.peer) or settings.work / f"site-{row.peer}"
        try:
            if row.peer not in sites:  # --site names a target already installed
                install_peer(row.peer, wheels, site)
        except (OSError, subprocess.CalledProcessError) as error:
            return {**result, "error": f"setup: {getattr(error, 'stderr', None) or error}".strip()[-600:]}
    if row.framework == "foundry" and row.seq_len != SEQ_LEN:
        try:
            ensure_long_samples(row.seq_len, settings)
        except (FoundryError, OSError) as error:
            return {**result, "error": f"data: {error}"[:600]}
    env = peer_environment(row.peer, site)
    result["versions"] = package_versions(row.peer, env)
    argv, extra_env = command(row, settings)
    result["command"] = " ".join(argv)
    if settings.smoke and row.framework == "torchtitan":
        check = subprocess.run(titan_check(row, settings), env=env, capture_output=True, text=True)
        if check.returncode != 0:
            return {**result, "error": f"config check: {last_error_line(check.stderr.splitlines())}"}
        return {**result, "note": "CPU: " + check.stdout.strip().splitlines()[-1] + " (torchtitan trains on CUDA only)"}
    watched = watch(argv, {**env, **extra_env}, re.compile(row.step_pattern), timeout_s)
    result.update(measure(row, settings, warmup, watched))
    result["log_tail"] = watched["log"][-LOG_TAIL_LINES:]
    result["own"] = own_report(row, settings, watched["log"])
    if settings.profile and row.framework in ("foundry", "torchtitan"):
        result["profile"] = profile_of(row, settings)
    return result


def profile_of(row: Row, settings: Settings) -> dict:
    """Rank 0's profiled step (the row's last), summarised from the trace its framework wrote."""
    run_folder = settings.work / "runs" / row.name
    pattern = (
        "profile/rank0.trace.json.gz" if row.framework == "foundry" else "profile_traces/iteration_*/rank0_trace.json"
    )
    traces = sorted(run_folder.glob(pattern))
    if not traces:
        return {"error": f"no trace under {run_folder} ({pattern})"}
    return {"trace": str(traces[-1]), **summarize_chrome_trace(traces[-1])}


def watch(argv: list[str], env: dict[str, str], step_pattern: re.Pattern, timeout_s: int) -> dict:
    """Run ``argv``; stamp the first line naming each step, poll GPU memory, keep the output."""
    started_s = time.perf_counter()
    # its own process group: a timeout kills the launcher and every worker it started, which would otherwise
    # keep their GPU memory (the next row then runs out of it) and the output pipe open
    process = subprocess.Popen(argv, env=env, cwd=Path(__file__).resolve().parent.parent, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=1,
                               start_new_session=True)  # fmt: skip
    memory = MemoryPoller()
    timer = threading.Timer(timeout_s, os.killpg, (process.pid, signal.SIGKILL))
    timer.start()
    step_times_s: dict[int, float] = {}
    log: list[str] = []
    try:
        for line in process.stdout:
            log.append(line.rstrip())
            match = step_pattern.search(line)
            if match:
                step_times_s.setdefault(int(match.group(1)), time.perf_counter() - started_s)
        returncode = process.wait()
    finally:  # also when this script is stopped (run() turns SIGTERM into SystemExit): no row outlives it
        timer.cancel()
        with contextlib.suppress(ProcessLookupError):  # workers left behind by a launcher that exited
            os.killpg(process.pid, signal.SIGKILL)
    killed = returncode == -signal.SIGKILL
    return {"returncode": returncode, "killed": killed, "wall_s": time.perf_counter() - started_s,
            "step_times_s": step_times_s, "peak_gib": memory.stop(), "log": log}  # fmt: skip


class MemoryPoller:
    """The largest memory.used (GiB) of any GPU, read from nvidia-smi every second until ``stop``."""

    def __init__(self) -> None:
        self.peak_mib: float | None = None
        self._done = threading.Event()
        if shutil.which("nvidia-smi"):
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()

    def _poll(self) -> None:
        query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # nvidia-smi ignores it: a shared machine's other GPUs
        if visible:
            query.append(f"--id={visible}")
        while not self._done.wait(1.0):
            output = subprocess.run(query, capture_output=True, text=True).stdout
            used = [float(value) for value in output.split() if value.replace(".", "", 1).isdigit()]
            if used:
                self.peak_mib = max(self.peak_mib or 0.0, *used)

    def stop(self) -> float | None:
        self._done.set()
        return None if self.peak_mib is None else round(self.peak_mib / 1024, 2)


def measure(row: Row, settings: Settings, warmup: int, watched: dict) -> dict:
    """tokens/s per GPU, MFU, time to first batch and peak memory by the one method of the module docstring."""
    steps = watched["step_times_s"]
    out: dict[str, Any] = {"wall_s": round(watched["wall_s"], 1), "peak_gib_nvidia_smi": watched["peak_gib"],
                           "first_batch_s": round(steps[1], 1) if 1 in steps else None,
                           "steps_seen": max(steps, default=0)}  # fmt: skip
    if watched["returncode"] != 0:
        reason = "timed out" if watched["killed"] else f"exit {watched['returncode']}"
        return {**out, "error": f"{reason}: {last_error_line(watched['log'])}"}
    last = max((step for step in steps if step <= settings.steps), default=0)  # not the profiled step
    if warmup not in steps or last <= warmup:
        return {**out, "error": f"no timed steps: step lines seen {sorted(steps)[:5]}..., warm-up {warmup}"}
    timed_s = steps[last] - steps[warmup]
    tokens_per_s = settings.global_batch * row.seq_len * (last - warmup) / timed_s / row.gpus
    out.update(timed_steps=last - warmup, step_s=round(timed_s / (last - warmup), 4))
    if settings.smoke:  # tiny models on shorter samples: the plumbing, not a speed
        return out
    flops_per_token = row.shape.flops_per_token(row.seq_len)
    return {**out, "tokens_per_s_per_gpu": round(tokens_per_s, 1), "flops_per_token": flops_per_token,
            "mfu": tokens_per_s * flops_per_token / (settings.peak_tflops * 1e12)}  # fmt: skip


def last_error_line(log: list[str]) -> str:
    """The most telling line of a failed run: the last exception line, else the last line."""
    errors = [line for line in log if re.search(r"(Error|Exception)\b.*:", line)]
    return (errors or log or ["(no output)"])[-1].strip()[:500]


def own_report(row: Row, settings: Settings, log: list[str]) -> dict:
    """What the framework itself said of its speed and memory (its last reported values)."""
    text = "\n".join(log)
    if row.framework == "foundry":
        metrics = settings.work / "runs" / row.name / "metrics.jsonl"
        if not metrics.exists():
            return {}
        latest = {key: value for line in metrics.read_text().splitlines() for key, value in json.loads(line).items()}
        return {key: latest.get(key) for key in ("throughput/run/tokens_per_sec", "throughput/run/device/mfu",
                                                 "memory/peak_allocated_mem", "time/first_batch_s")}  # fmt: skip
    patterns = {
        "torchtitan": {"tps": r"tps:\s*([\d,]+)", "mfu_pct": r"mfu:\s*([\d.]+)%",
                       "memory_gib": r"memory:\s*([\d.]+)GiB"},
        "llm-foundry": {"throughput/device/tokens_per_sec": r"throughput/device/tokens_per_sec:\s*([\d.e+]+)",
                        "throughput/device/mfu": r"throughput/device/mfu:\s*([\d.e+-]+)",
                        "memory/peak_allocated_mem": r"memory/peak_allocated_mem:\s*([\d.e+]+)"},
        "hf-trainer": {"peak_allocated_gib": r"peers-peak-allocated-gib ([\d.]+)"},
    }  # fmt: skip
    found = {key: re.findall(pattern, text) for key, pattern in patterns[row.framework].items()}
    return {key: float(values[-1].replace(",", "")) for key, values in found.items() if values}


def ratios(results: list[dict]) -> None:
    """Each peer row's speed against foundry's row of the same shape (foundry tokens/s / peer tokens/s)."""
    speed = {row["row"]: row.get("tokens_per_s_per_gpu") for row in results}
    for result in results:
        reference = ROWS[result["row"]].compare_to
        if reference and speed.get(reference) and result.get("tokens_per_s_per_gpu"):
            result["foundry_vs_peer"] = round(speed[reference] / result["tokens_per_s_per_gpu"], 3)


def table(results: list[dict]) -> str:
    shown = []
    for result in results:
        tokens_per_s = result.get("tokens_per_s_per_gpu")  # whole: markdown_table prints 66427.5 as 6.643e+04
        versions = result.get("versions") or {}
        package = {"torchtitan": "torchtitan", "llm-foundry": "llm-foundry", "hf-trainer": "transformers"}.get(
            result["framework"], "torch"
        )
        version = f"{package} {versions.get(package)}" + (", foundry" if result["framework"] == "foundry" else "")
        shown.append({
            "row": result["row"], "version": version, "GPUs": result["gpus"], "seq_len": result.get("seq_len"),
            "microbatch": result["microbatch"], "tokens/s per GPU": round(tokens_per_s) if tokens_per_s else None,
            "MFU": f"{result['mfu']:.1%}" if result.get("mfu") else None,
            "foundry / peer": result.get("foundry_vs_peer"), "peak GiB (nvidia-smi)": result.get("peak_gib_nvidia_smi"),
            "first batch s": result.get("first_batch_s"),
            "note": "; ".join(filter(None, (result.get("note"), result.get("error")))),  # a failed row shows its error
        })  # fmt: skip
    return markdown_table([{key: "" if value is None else value for key, value in row.items()} for row in shown])


def save(out: Path | None, settings: Settings, warmup: int, results: list[dict]) -> None:
    document = {
        "environment": environment(),
        "settings": {"global_batch": settings.global_batch, "seq_len": "each row's (seq_len)",
                     "warmup_steps": warmup, "steps": settings.steps, "smoke": settings.smoke,
                     "peak_tflops": settings.peak_tflops,
                     "mfu_formula": "3 * (2 * active_params + 4 * n_layers * d_model * seq_len) per token "
                                    "(LLM Foundry's, attention over the full seq_len^2; foundry.models.flops)"},
        "rows": results,
    }  # fmt: skip
    text = table(results)
    print(text, flush=True)
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "peers.json").write_text(json.dumps(document, indent=2, default=str))
        (out / "peers.md").write_text(text + "\n")


def llm_foundry_has_flash(wheels: Path, sites: dict[str, Path], work: Path) -> bool:
    """Whether flash-attn imports in LLM Foundry's environment (its YAML's ``attn_impl: flash`` needs it)."""
    site = sites.get("llmf") or work / "site-llmf"
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('flash_attn') is None)"
    return subprocess.run([sys.executable, "-c", probe], env=peer_environment("llmf", site)).returncode == 0


def resolve_defaults(args: argparse.Namespace) -> None:
    """Fill the options left unset with --long-context's or --four-gpu's defaults, or the usual ones."""
    defaults = LONG_CONTEXT_DEFAULTS if args.long_context else FOUR_GPU_DEFAULTS if args.four_gpu else DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def ensure_long_samples(seq_len: int, settings: Settings) -> None:
    """Build the MDS of ``seq_len``-token samples where ``prepare`` did not (from ``tokens.bin``, in ``work``)."""
    mds = settings.mds(seq_len)
    if not (mds / "train" / "index.json").exists():
        count = write_long_samples(settings.data / "tokens.bin", seq_len, mds)
        print(f"wrote {count} samples of {seq_len} tokens to {mds}", flush=True)


def run(args: argparse.Namespace) -> int:
    # a `timeout` around this script sends SIGTERM: exit through the finally blocks that stop the running row
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    resolve_defaults(args)
    groups = {"long_context": LONG_CONTEXT_ROWS, "two_gpu": TWO_GPU_ROWS, "four_gpu": FOUR_GPU_ROWS}
    names = args.rows or next((rows for flag, rows in groups.items() if getattr(args, flag)), ONE_GPU_ROWS)
    steps = args.warmup + args.steps
    settings = Settings(
        Path(args.data).resolve(), Path(args.work), args.global_batch, steps, args.smoke,
        peak_tflops=args.peak_tflops, profile=args.profile,
    )  # fmt: skip
    sites = dict(spec.split("=", 1) for spec in args.site)
    sites = {peer: Path(path) for peer, path in sites.items()}
    wheels = Path(args.wheels).resolve()
    if any(ROWS[name].peer == "llmf" for name in names) and not args.dry_run:
        try:
            if "llmf" not in sites:
                install_peer("llmf", wheels, settings.work / "site-llmf")
            settings.flash_attn_available = llm_foundry_has_flash(wheels, sites, settings.work)
        except (OSError, subprocess.CalledProcessError):
            pass  # the row reports the setup error
    out = Path(args.out) if args.out else None
    results: list[dict] = []
    for name in names:
        row = ROWS[name]
        if args.dry_run:
            argv, _ = command(row, settings)
            print(name, " ".join(argv))
            continue
        print(f"== {name}", flush=True)
        timeout_s = args.row_timeout or row.timeout_s or ROW_TIMEOUT_S
        result = run_row(row, settings, wheels, sites, args.warmup, timeout_s)
        if row.framework == "llm-foundry" and not settings.flash_attn_available and not settings.smoke:
            result["note"] = LLM_FOUNDRY_WITHOUT_FLASH
        results.append(result)
        print({key: value for key, value in result.items() if key not in ("log_tail", "command")}, flush=True)
        ratios(results)
        save(out, settings, args.warmup, results)
        if out:
            with (out / "peers_logs.txt").open("a") as logs:
                tail = "\n".join(result.get("log_tail", []))
                logs.write(f"===== {name}\n{result.get('command', '')}\n{tail}\n")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="action", required=True)
    prepare_parser = commands.add_parser("prepare", help="write the token stream (here, before the GPU call)")
    prepare_parser.add_argument("--corpus", nargs="+", required=True)
    prepare_parser.add_argument("--tokenizer", required=True, help="gpt-neox-20b tokenizer directory")
    prepare_parser.add_argument("--llm-foundry-yamls", required=True, help="LLM Foundry's scripts/train/yamls/pretrain")
    prepare_parser.add_argument("--samples", type=int, default=700, help="2048-token train samples (at least)")
    prepare_parser.add_argument("--out", required=True)
    wheels_parser = commands.add_parser("wheels", help="download the peers' wheels (here, before the GPU call)")
    wheels_parser.add_argument("--out", required=True, help="the folder to copy to the GPU machine (.whl)")
    run_parser = commands.add_parser("run", help="run the rows")
    run_parser.add_argument("--rows", nargs="*", choices=list(ROWS), help="default: every one-GPU row")
    rows_group = run_parser.add_mutually_exclusive_group()
    rows_group.add_argument("--two-gpu", action="store_true", help="the two-GPU rows (8B, FSDP2) instead")
    rows_group.add_argument("--long-context", action="store_true",
                            help="the 65,536-token rows (8B, CP2, two GPUs): global batch 2, 1 + 2 steps")  # fmt: skip
    rows_group.add_argument("--four-gpu", action="store_true",
                            help="the 8,192-token float8 rows (8B, four GPUs): batch 16, 2 + 5 steps")  # fmt: skip
    run_parser.add_argument("--data", default="data/peers", help="the folder `prepare` wrote")
    run_parser.add_argument("--wheels", default=".whl", help="the folder `wheels` wrote")
    run_parser.add_argument("--site", nargs="*", default=[], metavar="PEER=DIR", help="use an installed target")
    run_parser.add_argument("--global-batch", type=int, help="sequences per optimizer step (default 16)")
    run_parser.add_argument("--warmup", type=int, help="optimizer steps left out of the timing (default 3)")
    run_parser.add_argument("--steps", type=int, help="timed optimizer steps (default 20)")
    run_parser.add_argument("--peak-tflops", type=float, default=H100_BF16_PEAK_TFLOPS)
    run_parser.add_argument("--row-timeout", type=int, help="seconds before a row is stopped (default: the row's)")
    run_parser.add_argument("--work", default="/tmp/foundry-peers")
    run_parser.add_argument("--smoke", action="store_true", help="tiny models on the CPU: checks the plumbing")
    run_parser.add_argument("--dry-run", action="store_true", help="print each row's command and stop")
    run_parser.add_argument("--profile", action="store_true", help="profile one step more (foundry, torchtitan rows)")
    run_parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.action == "prepare":
        from peers_data import prepare

        corpus = args.corpus
        print(prepare(corpus, args.tokenizer, args.samples, Path(args.llm_foundry_yamls), Path(args.out)))
        return 0
    if args.action == "wheels":
        from peers_wheels import download

        download(Path(args.out))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
