"""What the ranks' per-batch agreement on a preemption signal costs: one CPU all-reduce (gloo) after each batch.

Each rank runs a loop of GPU work standing in for a training step (``--matmuls`` bf16 matmuls of
``--size``², queued without a host sync), with and without ``Preemption``'s agreement after each step, and
reports the time per step of both and their difference. The agreement must not wait for the GPU: the
difference should be the all-reduce's round trip, not a step's GPU time. Two GPUs::

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/preemption_overhead.py --out $OUT

On a CPU machine (gloo only) it runs the same loop with CPU matmuls.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from foundry.checkpoint.preemption import Preemption
from foundry.distributed import destroy_process_group, get_rank, get_world_size, init_process_group


def seconds_per_step(work: torch.Tensor, steps: int, agree: Preemption | None) -> float:
    """Seconds per step of ``steps`` steps, each queueing the matmuls then (optionally) agreeing."""
    device = work.device
    for _ in range(3):  # warm-up
        _step(work, agree)
    if device.type == "cuda":
        torch.cuda.synchronize()
    torch.distributed.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        _step(work, agree)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def _step(work: torch.Tensor, agree: Preemption | None) -> None:
    out = work
    for _ in range(ARGS.matmuls):
        out = out @ work
    if agree is not None:
        agree._agreed_signal()


def main() -> None:
    init_process_group()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else None
    device = device or torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    work = torch.randn(ARGS.size, ARGS.size, device=device, dtype=dtype) / ARGS.size**0.5
    agree = Preemption()
    agree.fit_start(SimpleNamespace(world_size=get_world_size()), logger=None)  # type: ignore[arg-type]
    agree.close()  # the signal handlers are not needed here
    plain_s = seconds_per_step(work, ARGS.steps, None)
    agreed_s = seconds_per_step(work, ARGS.steps, agree)
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "world_size": get_world_size(),
        "backend": str(torch.distributed.get_backend()),
        "matmuls_per_step": ARGS.matmuls,
        "size": ARGS.size,
        "steps": ARGS.steps,
        "step_ms": round(plain_s * 1e3, 4),
        "step_with_agreement_ms": round(agreed_s * 1e3, 4),
        "agreement_cost_ms": round((agreed_s - plain_s) * 1e3, 4),
        "torch": torch.__version__,
    }
    if get_rank() == 0:
        print(json.dumps(result))
        if ARGS.out:
            Path(ARGS.out).mkdir(parents=True, exist_ok=True)
            (Path(ARGS.out) / "preemption_overhead.json").write_text(json.dumps(result, indent=1))
    destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--matmuls", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default=None)
    ARGS = parser.parse_args()
    main()
