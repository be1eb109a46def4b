"""Split-sequence attention on 2 GPUs (NCCL, bf16) against full attention: forward, backward, eager and compiled.

Both are compared with an fp32 reference on the same inputs: the context-parallel error must stay within
twice the error of plain bf16 attention. Run as a test (skips without 2 CUDA devices), or directly:
``torchrun --nproc-per-node 2 tests/distributed/test_context_parallel_gpu.py OUT_FOLDER``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from foundry.distributed import destroy_process_group, init_process_group
from foundry.distributed.config import ParallelismConfig
from foundry.distributed.context_parallel import ContextParallel, shard_sequence
from foundry.distributed.mesh import parallel_dims

# (batch, heads, kv_heads, seq, head_dim): Llama-8B's grouped-query heads; MPT's multi-head 64-wide heads
SHAPES = {"llama_gqa": (1, 8, 2, 8192, 128), "mpt_mha": (2, 16, 16, 4096, 64)}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_split_sequence_attention_matches_full_attention_on_two_gpus(tmp_path):
    from helpers import repo_pythonpath

    env = {**os.environ, "PYTHONPATH": repo_pythonpath()}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__]
    done = subprocess.run([*command, str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    for name, errors in json.loads((tmp_path / "errors.json").read_text()).items():
        assert errors["context_parallel"] <= 2 * errors["full_bf16"] + 1e-3, (name, errors)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def compare(shape: tuple[int, ...], compiled: bool) -> dict[str, dict[str, float]]:
    batch, heads, kv_heads, seq, head_dim = shape
    device, rank = torch.device("cuda", torch.cuda.current_device()), int(os.environ["RANK"])
    mesh = parallel_dims("shard", ParallelismConfig(context_parallel_degree=2)).build_mesh("cuda")
    context_parallel = ContextParallel(mesh["cp"])
    generator = torch.Generator().manual_seed(0)  # the same whole inputs on both ranks
    inputs = [torch.randn(batch, n, seq, head_dim, generator=generator) for n in (heads, kv_heads, kv_heads)]
    weights = torch.randn(batch, heads, seq, head_dim, generator=generator).to(device)

    def run(dtype: torch.dtype, split: bool) -> dict[str, torch.Tensor]:
        q, k, v = (x.to(device, dtype, copy=True) for x in inputs)
        if split:
            q, k, v = (shard_sequence(x, rank, 2, dim=2) for x in (q, k, v))
        q, k, v = (x.requires_grad_() for x in (q, k, v))
        if split:
            attention = context_parallel.split_sequence_attention
            out = (torch.compile(attention) if compiled else attention)(q, k, v, head_dim**-0.5, 0.0)
            (out.float() * shard_sequence(weights, rank, 2, dim=2)).sum().backward()
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != heads)
            (out.float() * weights).sum().backward()
        found = {"out": out, "q": q.grad, "k": k.grad, "v": v.grad}
        return found if split else {name: shard_sequence(x, rank, 2, dim=2) for name, x in found.items()}

    reference, full, split = run(torch.float32, False), run(torch.bfloat16, False), run(torch.bfloat16, True)
    return {
        name: {
            "context_parallel": relative_error(split[name], reference[name]),
            "full_bf16": relative_error(full[name], reference[name]),
        }
        for name in reference
    }


def main(out_folder: str) -> None:
    init_process_group()
    errors = {}
    for name, shape in SHAPES.items():
        for compiled in (False, True):
            for tensor, pair in compare(shape, compiled).items():
                errors[f"{name}{'_compiled' if compiled else ''}_{tensor}_rank{os.environ['RANK']}"] = pair
    gathered: list = [None, None]
    torch.distributed.all_gather_object(gathered, errors)
    if int(os.environ["RANK"]) == 0:
        merged = {key: value for each in gathered for key, value in each.items()}
        Path(out_folder, "errors.json").write_text(json.dumps(merged, indent=1))
        print(json.dumps(merged, indent=1))
    destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
