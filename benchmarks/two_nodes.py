"""Two machines rehearsed on one host: per-GPU MFU of 2 launchers × N GPUs against 1 × 2N, and a node lost.

    python benchmarks/two_nodes.py --corpus a.txt --tokenizer DIR --out OUT [--gpus-per-node 2]
        [--rows one two two-hsdp kill]

Every row is ``foundry train yamls/pretrain/mpt-1b.yaml`` as shipped (only paths, the run's length and the
rows' own keys changed) on MDS data, ``batches`` long with the first left out of the averages:

- ``one``: one launcher, ``--nproc 2N`` (N = ``--gpus-per-node``: 2 on a 4-GPU host);
- ``two``: two launchers on 127.0.0.1, each on its own N GPUs (``CUDA_VISIBLE_DEVICES``), ``--nnodes 2
  --nproc N --node-rank 0|1 --rdzv-endpoint 127.0.0.1:PORT``: what two machines run, NCCL over the host
  instead of a network; the same FULL_SHARD over 2N ranks;
- ``two-hsdp``: the same with ``fsdp_config.sharding_strategy=HYBRID_SHARD`` (shard within a launcher's N
  GPUs, replicate across the two);
- ``kill``: the ``two`` run checkpointing every 2 batches; once the first checkpoint is complete (``latest``),
  launcher 1 and its ranks are SIGKILLed, as a machine lost: the row times how long launcher 0 takes to exit
  and keeps its last lines; then one launcher on node 0's GPUs (``--nproc N``, ``autoresume``) resumes from
  that checkpoint (2N ranks' shards on N) and trains one more batch.

The MFU is the speed monitor's run average (``throughput/run/device/mfu``), as benchmarks/default_path.py reads it.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench_utils import REPO_ROOT, markdown_table, save_json
from default_path import build_data, run_metrics

YAML = REPO_ROOT / "yamls" / "pretrain" / "mpt-1b.yaml"
ROWS = ("one", "two", "two-hsdp", "kill")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def overrides(args: argparse.Namespace, run_folder: Path, batches: int, *extra: str) -> list[str]:
    return [
        f"variables.data_local={args.data}",
        f"tokenizer.name={args.tokenizer}",
        f"max_duration={batches}ba",
        "callbacks.speed_monitor.warmup_batches=1",
        "eval_loader=null",
        f"run_folder={run_folder}",
        *extra,
    ]


def launcher(gpus: str, flags: list[str], keys: list[str], log: Path) -> subprocess.Popen:
    """One ``foundry train`` launcher on ``gpus``, in a session of its own (so a kill takes its ranks too)."""
    command = [sys.executable, "-m", "foundry.cli", "train", str(YAML), *keys, *flags]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpus}
    return subprocess.Popen(
        command, cwd=REPO_ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def node_gpus(node: int, per_node: int) -> str:
    return ",".join(str(gpu) for gpu in range(node * per_node, (node + 1) * per_node))


def two_launchers(keys: list[str], per_node: int, out: Path, name: str) -> list[subprocess.Popen]:
    endpoint = f"127.0.0.1:{free_port()}"
    node_flags = ["--nnodes", "2", "--nproc", str(per_node), "--rdzv-endpoint", endpoint]
    logs = [out / f"{name}-node{node}.log" for node in range(2)]
    return [
        launcher(node_gpus(node, per_node), [*node_flags, "--node-rank", str(node)], keys, logs[node])
        for node in range(2)
    ]


def speed_row(name: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    run_folder = Path(args.work) / name
    keys = overrides(args, run_folder, args.batches)
    if name == "two-hsdp":
        keys.append("fsdp_config.sharding_strategy=HYBRID_SHARD")
    started = time.perf_counter()
    per_node = args.gpus_per_node
    if name == "one":
        processes = [launcher(node_gpus(0, 2 * per_node), ["--nproc", str(2 * per_node)], keys, out / f"{name}.log")]
    else:
        processes = two_launchers(keys, per_node, out, name)
    codes = [process.wait() for process in processes]
    row: dict[str, Any] = {"row": name, "exit": codes, "wall_s": round(time.perf_counter() - started, 1)}
    return row | (run_metrics(run_folder) if codes == [0] * len(codes) else {})


def kill_row(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    run_folder, save_folder = Path(args.work) / "kill", Path(args.work) / "kill-checkpoints"
    keys = overrides(args, run_folder, 6, f"save_folder={save_folder}", "save_interval=2ba", "autoresume=true")
    processes = two_launchers(keys, args.gpus_per_node, out, "kill")
    latest = save_folder / "latest"
    while not latest.exists() and all(process.poll() is None for process in processes):
        time.sleep(0.5)
    checkpoint = latest.read_text().strip() if latest.exists() else None
    os.killpg(processes[1].pid, signal.SIGKILL)  # node 1 and its ranks gone at once, as a machine lost
    killed = time.perf_counter()
    try:
        code = processes[0].wait(timeout=args.kill_wait_s)
    except subprocess.TimeoutExpired:
        os.killpg(processes[0].pid, signal.SIGKILL)
        code = None
    row: dict[str, Any] = {
        "row": "kill",
        "checkpoint": checkpoint,
        "survivor_exit": code,
        "survivor_exit_s": round(time.perf_counter() - killed, 1) if code is not None else None,
        "survivor_last_lines": (out / "kill-node0.log").read_text().strip().splitlines()[-3:],
    }
    resume_keys = overrides(args, run_folder, 3, f"save_folder={save_folder}", "save_interval=2ba", "autoresume=true")
    started = time.perf_counter()
    per_node = args.gpus_per_node
    resumed = launcher(node_gpus(0, per_node), ["--nproc", str(per_node)], resume_keys, out / "kill-resume.log")
    row["resume_exit"] = resumed.wait()
    row["resume_wall_s"] = round(time.perf_counter() - started, 1)
    log = (out / "kill-resume.log").read_text()
    row["resume_said"] = [line for line in log.splitlines() if "esum" in line][:2]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="*", default=list(ROWS), choices=ROWS)
    parser.add_argument("--corpus", nargs="+", help="text files for the MDS data (unless --data is given)")
    parser.add_argument("--data", default=None, help="MDS data already converted (2048-token samples)")
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--samples", type=int, default=3000)
    parser.add_argument("--gpus-per-node", type=int, default=2, help="GPUs each simulated node takes")
    parser.add_argument("--batches", type=int, default=3, help="batches a speed row trains (the first is warm-up)")
    parser.add_argument("--kill-wait-s", type=float, default=120.0)
    parser.add_argument("--work", default="/tmp/foundry-two-nodes")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.data is None:
        args.data = build_data(args.corpus, args.tokenizer, args.samples, Path(args.work) / "data")
    results = []
    for name in args.rows:  # saved after each, so a call cut short keeps what it measured
        results.append(kill_row(args, out) if name == "kill" else speed_row(name, args, out))
        print(results[-1], flush=True)
        save_json(out, "two_nodes", results)
    one = next((row.get("mfu") for row in results if row["row"] == "one"), None)
    for row in results:
        if one and row.get("mfu"):
            row["per_gpu_vs_one"] = round(row["mfu"] / one, 4)
    save_json(out, "two_nodes", results)
    print(markdown_table([{k: v for k, v in row.items() if k != "survivor_last_lines"} for row in results]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
