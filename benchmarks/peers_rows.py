"""What each row of benchmarks/peers.py runs: the command, its environment, the shape it trains.

A row is one workload run by one framework through its own entry point and its own recommended fast
settings, on the token stream of ``peers.py prepare``, at its sequence length (2048, or 65,536 for the
long-context rows) and the same global batch:

- ``torchtitan-llama-1b`` / ``-8b``: ``torch.distributed.run -m torchtitan.train --job.config_file`` with a TOML
  of its llama3_8b.toml's settings: FSDP2, ``compile`` of model and loss, fused AdamW, bf16 parameters, and
  ``PYTORCH_ALLOC_CONF=expandable_segments:True`` as its ``run_train.sh`` launches every run. No activation
  checkpointing at 1B; at 8B on two 80 GB cards its own lever for memory, ``activation_checkpoint.mode = "full"``
  (every block recomputed, as foundry's 8B rows pin), at local batch 4: that TOML's selective per-op
  checkpointing runs out of memory there, since its fp32 weights, gradients and two AdamW moments alone take
  16 bytes x 8.03B / 2 cards = 59.8 GiB of the 79.2 a card.
- ``llm-foundry-mpt-1b``: LLM Foundry's ``scripts/train/train.py`` (``train_from_yaml``) on its ``mpt-1b.yaml``,
  paths changed; ``attn_impl: torch`` and ``loss_fn: torch_crossentropy`` where flash-attn (its YAML's ``flash``
  attention and fused cross-entropy) is not installed.
- ``hf-trainer-llama-1b``: ``benchmarks/peers_hf_trainer.py``, transformers' ``Trainer`` with bf16, SDPA,
  ``torch_compile`` and fused AdamW.
- ``foundry-*``: ``foundry train yamls/pretrain/<yaml>``, the YAML's settings, except that the ``llama-8b.yaml``
  rows pin every block checkpointed (``fsdp_config.activation_checkpointing=true``; the YAML ships ``auto``,
  which keeps blocks whole on cards with room), as their peers' ``full`` mode does and as they were measured;
  ``foundry-llama-8b-float8`` and ``foundry-llama-8b-unfused-loss`` add one override each
  (``algorithms.float8={}``; ``model.loss_fn=torch_crossentropy``: the output projection and the loss unfused, to
  weigh the fused loss at 8B).

Long context (``LONG_CONTEXT_ROWS``, two GPUs, 65,536-token sequences, one sequence a microbatch):

- ``foundry-llama-8b-64k``: ``foundry train yamls/pretrain/llama-8b-64k.yaml --nproc 2`` as shipped: context
  parallelism over both GPUs (head-tail balanced), FSDP2 over both, every block checkpointed keeping attention
  outputs, AdamW moments in bf16, on the same tokens cut into 65,536-token samples (``mds-65536``).
- ``foundry-llama-8b-64k-end-aligned``: the same with ``parallelism.context_parallel_attention=end_aligned``
  (the chunks that see more keys than they hold on FlashAttention-2's end-aligned kernel, instead of the
  YAML's ``auto``, which on an H100 splits them into cuDNN calls merged by log-sum-exp).
- ``torchtitan-llama-8b-64k``: its 8B TOML's settings with what its context parallelism asks for:
  ``parallelism.context_parallel_degree = 2`` (its FSDP then shards over dp_shard x cp = both GPUs), its SDPA
  attention (the only kind its CP runs for Llama 3 without a document mask; cuDNN, then flash, kernels), its
  ``headtail`` load balancer and ``allgather`` K/V rotation (its defaults, written out), local batch 1,
  ``activation_checkpoint.mode = "full"`` and compile, as its published 64k row (FSDP 4 x CP 2 on 8 GPUs).
  No float8 (foundry's row has none). On two cards this does not fit by the arithmetic: fp32 weights,
  gradients and both AdamW moments take 16 B x 8.03B / 2 = 59.8 GiB a card before the 32,768 tokens a GPU
  holds (8 GiB of checkpointed block inputs, 7.8 GiB of bf16 logits and as much again for their gradient);
  the row runs anyway and keeps its error.
- ``torchtitan-llama-8b-64k-bf16``: the same with its one lever that does fit, ``training.dtype =
  "bfloat16"`` (weights, gradients and moments in bf16: 29.9 GiB a card; foundry keeps fp32 weights and
  gradients and only its moments in bf16, so this row carries less state than foundry's).

Four GPUs (``FOUR_GPU_ROWS``, 8,192-token sequences, one a microbatch, FSDP2 over four): ``foundry-llama-8b-8k-4gpu-
float8`` (``llama-8b.yaml``, every block checkpointed, with ``algorithms.float8={}``: tensorwise, float8
all-gathers, the first and last blocks in bf16) against ``torchtitan-llama-8b-8k-4gpu-float8`` (its float8 recipe for
FSDP, the output layer in bf16, every block checkpointed too), then ``foundry-llama-8b-8k-4gpu-float8-rowwise``
(the rowwise recipe), then the pair again with checkpointing by memory: ``-float8-ac-auto``
(``activation_checkpointing: auto``, set explicitly) against torchtitan's ``-float8-ac-none``, then that foundry row
with every block's linears in float8 (``-all-blocks-ac-auto``, as torchtitan converts them) and with two sequences a
microbatch, no block checkpointed (``-ac-none-mb2``), and with the judge's finer recipes
(``-rowwise-with-gw-hp-ac-auto``, ``-blockwise-ac-auto``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench_utils import EVERY_BLOCK_CHECKPOINTED

from foundry.models import flops

BENCHMARKS = Path(__file__).resolve().parent
REPO_ROOT = BENCHMARKS.parent
SEQ_LEN = 2048
LONG_SEQ_LEN = 65536
EIGHT_K = 8192
# foundry's 8B YAML at 8,192 tokens a sequence, one a microbatch, weights drawn on the GPUs (faster setup)
FOUR_GPU_8K = ("variables.max_seq_len=8192", "device_train_microbatch_size=1", "model.init_device=cuda")
# LLM Foundry's scripts/train/train.py (0.22), whole: the wheel ships llmfoundry, not scripts/.
LLM_FOUNDRY_TRAIN_PY = (
    "import sys; from llmfoundry.command_utils import train_from_yaml; train_from_yaml(sys.argv[1], sys.argv[2:])"
)
# What torchtitan's run_train.sh sets for every run it launches (the caching allocator's expandable segments).
TITAN_LAUNCH_ENV = {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}
VERSION_PACKAGES = {
    None: ("torch", "transformers", "mosaicml-streaming"),
    "titan": ("torchtitan", "torch", "torchdata", "datasets"),
    "llmf": ("llm-foundry", "mosaicml", "transformers", "torch", "mosaicml-streaming"),
}


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the MFU formula needs of a decoder (LLM Foundry's, foundry.models.flops)."""

    family: str  # llama | mpt
    d_model: int
    n_layers: int
    vocab_size: int
    n_heads: int = 0
    kv_heads: int = 0
    ffn_hidden: int = 0
    tied: bool = True

    def active_params(self) -> int:
        """Parameters that cost FLOPs per token: all, less the input embedding when untied (a lookup)."""
        d = self.d_model
        if self.family == "mpt":  # Wqkv 3d^2, out d^2, FFN 2 * 4d^2, their biases 9d, two LayerNorms 4d
            per_layer = 12 * d * d + 13 * d
            final_norm = 2 * d + SEQ_LEN * d  # + learned position embeddings, counted as LLM Foundry does
        else:  # q, o d^2 each; k, v d * kv_heads * head_dim each; SwiGLU 3 * d * ffn; two RMSNorms
            kv_width = self.kv_heads * (d // self.n_heads)
            per_layer = 2 * d * d + 2 * d * kv_width + 3 * d * self.ffn_hidden + 2 * d
            final_norm = d
        embedding = self.vocab_size * d
        output = 0 if self.tied else self.vocab_size * d
        total = self.n_layers * per_layer + final_norm + embedding + output
        return total if self.tied else total - embedding

    def flops_per_token(self, seq_len: int = SEQ_LEN) -> int:
        return flops.flops_per_token(self.active_params(), self.n_layers, self.d_model, seq_len)


LLAMA_1B = Shape("llama", 2048, 16, 128256, n_heads=32, kv_heads=8, ffn_hidden=8192, tied=True)
LLAMA_8B = Shape("llama", 4096, 32, 128256, n_heads=32, kv_heads=8, ffn_hidden=14336, tied=False)
MPT_1B = Shape("mpt", 2048, 24, 50368)


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    framework: str  # foundry | torchtitan | llm-foundry | hf-trainer
    shape: Shape
    gpus: int
    microbatch: int  # per GPU
    step_pattern: str  # regex whose group 1 is the optimizer step of a line the framework prints per step
    peer: str | None = None  # its own install target (None: the image's packages plus foundry's)
    compare_to: str | None = None  # the foundry row of the same shape
    yaml: str | None = None  # foundry / LLM Foundry rows
    titan_flavor: str | None = None
    titan_ac: str = "none"
    seq_len: int = SEQ_LEN
    context_parallel: int = 1  # torchtitan's parallelism.context_parallel_degree (foundry's is in its YAML)
    titan_dtype: str = "float32"  # torchtitan's training.dtype: of its weights, gradients and optimizer moments
    timeout_s: int | None = None  # where it differs from --row-timeout's default
    overrides: tuple[str, ...] = ()  # foundry rows: key=value overrides on top of the YAML
    titan_float8: bool = False  # torchtitan's float8 linears (tensorwise, float8 all-gathers, output layer kept)


FOUNDRY_STEP = r"\[batch (\d+)/"
ROWS = {
    row.name: row
    for row in (
        Row("torchtitan-llama-1b", "torchtitan", LLAMA_1B, 1, 8, r"step:\s*(\d+)", "titan", "foundry-llama-1b",
            titan_flavor="1B"),
        Row("llm-foundry-mpt-1b", "llm-foundry", MPT_1B, 1, 4, r"\[batch=(\d+)/", "llmf", "foundry-mpt-1b",
            yaml="llm-foundry/mpt-1b.yaml"),
        Row("hf-trainer-llama-1b", "hf-trainer", LLAMA_1B, 1, 4, r"peers-step (\d+)", None, "foundry-llama-1b"),
        Row("foundry-llama-1b", "foundry", LLAMA_1B, 1, 16, FOUNDRY_STEP, yaml="yamls/pretrain/llama-1b.yaml"),
        Row("foundry-mpt-1b", "foundry", MPT_1B, 1, 16, FOUNDRY_STEP, yaml="yamls/pretrain/mpt-1b.yaml"),
        Row("llm-foundry-mpt-1b-2gpu", "llm-foundry", MPT_1B, 2, 4, r"\[batch=(\d+)/", "llmf", "foundry-mpt-1b-2gpu",
            yaml="llm-foundry/mpt-1b.yaml"),
        Row("foundry-mpt-1b-2gpu", "foundry", MPT_1B, 2, 16, FOUNDRY_STEP, yaml="yamls/pretrain/mpt-1b.yaml"),
        Row("torchtitan-llama-8b", "torchtitan", LLAMA_8B, 2, 4, r"step:\s*(\d+)", "titan", "foundry-llama-8b",
            titan_flavor="8B", titan_ac="full"),
        Row("foundry-llama-8b", "foundry", LLAMA_8B, 2, 4, FOUNDRY_STEP, yaml="yamls/pretrain/llama-8b.yaml",
            overrides=(EVERY_BLOCK_CHECKPOINTED,)),
        # the 8B pair's profiled gap is GEMM time in the fused output projection + loss: the same row unfused
        Row("foundry-llama-8b-unfused-loss", "foundry", LLAMA_8B, 2, 4, FOUNDRY_STEP,
            yaml="yamls/pretrain/llama-8b.yaml",
            overrides=(EVERY_BLOCK_CHECKPOINTED, "model.loss_fn=torch_crossentropy")),
        Row("torchtitan-llama-8b-float8", "torchtitan", LLAMA_8B, 2, 4, r"step:\s*(\d+)", "titan",
            "foundry-llama-8b-float8", titan_flavor="8B", titan_ac="full", titan_float8=True),
        Row("foundry-llama-8b-float8", "foundry", LLAMA_8B, 2, 4, FOUNDRY_STEP, yaml="yamls/pretrain/llama-8b.yaml",
            overrides=(EVERY_BLOCK_CHECKPOINTED, "algorithms.float8={}")),
        # Long context, in the order they run: foundry, then torchtitan where it fits, then as it ships
        # (expected out of memory). Timeouts: start-up ~90 s (foundry) / ~50 s (torchtitan) + 3 steps of ~20-25 s.
        Row("foundry-llama-8b-64k", "foundry", LLAMA_8B, 2, 1, FOUNDRY_STEP, yaml="yamls/pretrain/llama-8b-64k.yaml",
            seq_len=LONG_SEQ_LEN, timeout_s=220),
        Row("torchtitan-llama-8b-64k-bf16", "torchtitan", LLAMA_8B, 2, 1, r"step:\s*(\d+)", "titan",
            "foundry-llama-8b-64k", titan_flavor="8B", titan_ac="full", seq_len=LONG_SEQ_LEN, context_parallel=2,
            titan_dtype="bfloat16", timeout_s=180),
        Row("foundry-llama-8b-64k-end-aligned", "foundry", LLAMA_8B, 2, 1, FOUNDRY_STEP,
            yaml="yamls/pretrain/llama-8b-64k.yaml", seq_len=LONG_SEQ_LEN, timeout_s=220,
            overrides=("parallelism.context_parallel_attention=end_aligned",)),
        Row("torchtitan-llama-8b-64k", "torchtitan", LLAMA_8B, 2, 1, r"step:\s*(\d+)", "titan",
            "foundry-llama-8b-64k", titan_flavor="8B", titan_ac="full", seq_len=LONG_SEQ_LEN, context_parallel=2,
            timeout_s=110),
        # Four GPUs at 8,192 tokens, one sequence a microbatch: both frameworks' float8 (tensorwise, float8
        # all-gathers), then foundry's rowwise recipe.
        Row("foundry-llama-8b-8k-4gpu-float8", "foundry", LLAMA_8B, 4, 1, FOUNDRY_STEP,
            yaml="yamls/pretrain/llama-8b.yaml", seq_len=EIGHT_K, timeout_s=300,
            overrides=(*FOUR_GPU_8K, EVERY_BLOCK_CHECKPOINTED, "algorithms.float8={}")),
        Row("torchtitan-llama-8b-8k-4gpu-float8", "torchtitan", LLAMA_8B, 4, 1, r"step:\s*(\d+)", "titan",
            "foundry-llama-8b-8k-4gpu-float8", titan_flavor="8B", titan_ac="full", seq_len=EIGHT_K,
            titan_float8=True, timeout_s=300),
        Row("foundry-llama-8b-8k-4gpu-float8-rowwise", "foundry", LLAMA_8B, 4, 1, FOUNDRY_STEP,
            yaml="yamls/pretrain/llama-8b.yaml", seq_len=EIGHT_K, timeout_s=300,
            overrides=(*FOUR_GPU_8K, EVERY_BLOCK_CHECKPOINTED, "algorithms.float8={recipe: rowwise}")),
        # Checkpointing by memory: foundry's auto (none on 141 GB cards) against torchtitan without checkpointing.
        Row("foundry-llama-8b-8k-4gpu-float8-ac-auto", "foundry", LLAMA_8B, 4, 1, FOUNDRY_STEP,
            yaml="yamls/pretrain/llama-8b.yaml", seq_len=EIGHT_K, timeout_s=300,
            overrides=(*FOUR_GPU_8K, "algorithms.float8={}", "fsdp_config.activation_checkpointing=auto")),
        Row("torchtitan-llama-8b-8k-4gpu-float8-ac-none", "torchtitan", LLAMA_8B, 4, 1, r"step:\s*(\d+)", "titan",
            "foundry-llama-8b-8k-4gpu-float8-ac-auto", titan_flavor="8B", titan_ac="none", seq_len=EIGHT_K,
            titan_float8=True, timeout_s=300),
        # The levers left at 8k, each against the pair above: every block's linears in float8 (as torchtitan's
        # recipe converts them; foundry keeps the first and last blocks in bf16), and two sequences a microbatch.
        Row("foundry-llama-8b-8k-4gpu-float8-all-blocks-ac-auto", "foundry", LLAMA_8B, 4, 1, FOUNDRY_STEP,
            yaml="yamls/pretrain/llama-8b.yaml", seq_len=EIGHT_K, timeout_s=300,
            overrides=(*FOUR_GPU_8K, "algorithms.float8={keep_first_and_last_blocks: false}",
                       "fsdp_config.activation_checkpointing=auto")),
        # (auto would checkpoint 17 blocks at microbatch 2: its plan put microbatch 1 at 100.3 GiB, 81.2 measured)
        Row("foundry-llama-8b-8k-4gpu-float8-ac-none-mb2", "foundry", LLAMA_8B, 4, 2, FOUNDRY_STEP,
            yaml="yamls/pretrain/llama-8b.yaml", seq_len=EIGHT_K, timeout_s=300,
            overrides=(*FOUR_GPU_8K, "device_train_microbatch_size=2", "algorithms.float8={}",
                       "fsdp_config.activation_checkpointing=false")),
        # The finer recipes the float8 judge weighs (docs/PERFORMANCE.md "Float8 judge"), at the auto row's settings.
        *(Row(f"foundry-llama-8b-8k-4gpu-float8-{recipe.replace('_', '-')}-ac-auto", "foundry", LLAMA_8B, 4, 1,
              FOUNDRY_STEP, yaml="yamls/pretrain/llama-8b.yaml", seq_len=EIGHT_K, timeout_s=300,
              overrides=(*FOUR_GPU_8K, f"algorithms.float8={{recipe: {recipe}}}",
                         "fsdp_config.activation_checkpointing=auto"))
          for recipe in ("rowwise_with_gw_hp", "blockwise")),
    )
}  # fmt: skip
ONE_GPU_ROWS = [name for name, row in ROWS.items() if row.gpus == 1]
TWO_GPU_ROWS = [name for name, row in ROWS.items() if row.gpus == 2 and row.seq_len == SEQ_LEN]
LONG_CONTEXT_ROWS = [name for name, row in ROWS.items() if row.gpus == 2 and row.seq_len > SEQ_LEN]
FOUR_GPU_ROWS = [name for name, row in ROWS.items() if row.gpus == 4]

# The CPU smoke test (--smoke): the same entry points on tiny models, fp32, uncompiled.
# Three blocks: float8 keeps the first and last in bf16 and refuses a model with no middle block to convert.
SMOKE_FOUNDRY = {
    "llama": ["model.d_model=64", "model.n_layers=3", "model.n_heads=4", "model.kv_n_heads=2",
              "model.ffn_hidden_size=128", "model.vocab_size=50304"],
    "mpt": ["model.d_model=64", "model.n_layers=3", "model.n_heads=4"],
}  # fmt: skip
SMOKE_SEQ_LEN = 256  # the loaders cut the 2048-token samples to this
SMOKE_SETTINGS = [
    "precision=fp32", "model.init_device=cpu", "train_loader.num_workers=0", f"variables.max_seq_len={SMOKE_SEQ_LEN}"
]  # fmt: skip


@dataclasses.dataclass
class Settings:
    data: Path  # the prepared folder (data/peers)
    work: Path  # run folders, TOMLs, install targets
    global_batch: int
    steps: int  # optimizer steps, warm-up included
    smoke: bool = False
    flash_attn_available: bool = False  # in LLM Foundry's environment
    peak_tflops: float = 989.5  # dense bf16 of the device (H100 SXM)
    profile: bool = False  # one step more, profiled by the framework's own profiler (foundry and torchtitan rows)

    @property
    def run_steps(self) -> int:
        """Steps a row runs: ``steps``, plus the profiled one (left out of the timing)."""
        return self.steps + self.profile

    def mds(self, seq_len: int) -> Path:
        """The MDS dataset of ``seq_len``-token samples: ``prepare``'s, else the one ``run`` builds in ``work``."""
        if seq_len == SEQ_LEN:
            return self.data / "mds"
        prepared = self.data / f"mds-{seq_len}"
        return prepared if (prepared / "train" / "index.json").exists() else self.work / f"mds-{seq_len}"


def command(row: Row, settings: Settings) -> tuple[list[str], dict[str, str]]:
    """The row's command line and its extra environment variables."""
    build = {"foundry": _foundry, "llm-foundry": _llm_foundry, "hf-trainer": _hf_trainer, "torchtitan": _torchtitan}
    return build[row.framework](row, settings)


def _yaml_overrides(row: Row, settings: Settings) -> list[str]:
    """What foundry's and LLM Foundry's rows change in their YAMLs (same schema): data, tokenizer, length, batch."""
    return [
        f"variables.data_local={settings.mds(row.seq_len)}",
        f"tokenizer.name={settings.data / 'tokenizer'}",
        f"max_duration={settings.run_steps}ba",
        f"global_train_batch_size={settings.global_batch}",
        "eval_loader=null",
    ]


def _foundry(row: Row, settings: Settings) -> tuple[list[str], dict[str, str]]:
    overrides = [
        *_yaml_overrides(row, settings),
        "console_log_interval=1ba",
        f"run_folder={settings.work / 'runs' / row.name}",
        *row.overrides,
    ]
    if settings.profile:  # the last step, written as <run_folder>/profile/rank<r>.trace.json.gz
        overrides += ["callbacks.profiler={}", f"callbacks.profiler.skip_batches={settings.steps}"]
    if settings.smoke:
        microbatch = min(2, row.microbatch)
        overrides += [*SMOKE_FOUNDRY[row.shape.family], *SMOKE_SETTINGS, f"device_train_microbatch_size={microbatch}"]
    launch = ["--nproc", str(row.gpus)] if row.gpus > 1 else []
    return [sys.executable, "-m", "foundry.cli", "train", str(REPO_ROOT / row.yaml), *overrides, *launch], {}


def _llm_foundry(row: Row, settings: Settings) -> tuple[list[str], dict[str, str]]:
    yaml = settings.data / ("llm-foundry/mpt-small-cpu.yaml" if settings.smoke else row.yaml)
    overrides = _yaml_overrides(row, settings)
    if settings.smoke:
        overrides += ["device_train_microbatch_size=2", f"variables.max_seq_len={SMOKE_SEQ_LEN}"]
        overrides += ["fsdp_config=null"] if row.gpus > 1 else []  # Composer's FSDP needs CUDA: DDP over gloo
    elif not settings.flash_attn_available:
        # flash-attn's package also holds the fused cross-entropy its YAML's loss_fn names
        overrides += ["model.attn_config.attn_impl=torch", "model.loss_fn=torch_crossentropy"]
    if row.gpus == 1:
        return [sys.executable, "-c", LLM_FOUNDRY_TRAIN_PY, str(yaml), *overrides], {"RUN_NAME": row.name}
    # several GPUs: Composer reads torchrun's RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE, and NODE_RANK
    # (which its own launcher sets and torchrun does not)
    script = settings.work / "llm_foundry_train.py"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(LLM_FOUNDRY_TRAIN_PY + "\n")
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={row.gpus}"]
    return [*launch, str(script), str(yaml), *overrides], {"RUN_NAME": row.name, "NODE_RANK": "0"}


def _hf_trainer(row: Row, settings: Settings) -> tuple[list[str], dict[str, str]]:
    batch = 2 if settings.smoke else row.microbatch
    argv = [sys.executable, str(BENCHMARKS / "peers_hf_trainer.py"), "--tokens", str(settings.data / "tokens.bin")]
    argv += ["--steps", str(settings.steps), "--batch", str(batch)]
    argv += ["--accumulation", str(settings.global_batch // batch), "--output-dir", str(settings.work / row.name)]
    return argv + (["--tiny", "--seq-len", str(SMOKE_SEQ_LEN)] if settings.smoke else []), {}


def titan_config(row: Row, settings: Settings) -> dict[str, dict[str, Any]]:
    """torchtitan's TOML for the row: its llama3_8b.toml's settings, our shape, data, length and batch."""
    return {
        "job": {"dump_folder": str(settings.work / "runs" / row.name), "description": row.name},
        "metrics": {"log_freq": 1, "enable_tensorboard": False, "disable_color_printing": True},
        "model": {"name": "llama3", "flavor": "peers_tiny" if settings.smoke else row.titan_flavor,
                  "hf_assets_path": str(settings.data / "tokenizer"),
                  "converters": ["quantize.linear.float8"] if row.titan_float8 else []},
        "optimizer": {"name": "AdamW", "lr": 3e-4, "eps": 1e-8},
        "lr_scheduler": {"warmup_steps": min(2, settings.steps - 1)},
        "training": {"local_batch_size": row.microbatch, "global_batch_size": settings.global_batch,
                     "seq_len": row.seq_len, "max_norm": 1.0, "steps": settings.run_steps, "dataset": "c4_test",
                     "dataset_path": str(settings.data / "text"), "dtype": row.titan_dtype},
        # FSDP over what the other axes leave (-1): with CP its mesh is dp_shard x cp, every GPU.
        "parallelism": {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": -1,
                        "context_parallel_degree": row.context_parallel,
                        "context_parallel_load_balancer": "headtail", "context_parallel_rotate_method": "allgather"},
        "checkpoint": {"enable": False},
        "compile": {"enable": not settings.smoke, "components": ["model", "loss"]},
        "activation_checkpoint": {"mode": row.titan_ac, "selective_ac_option": "op"},
        "experimental": {"custom_import": "peers_torchtitan_flavors"},
        # the last step, written as <dump_folder>/profile_traces/iteration_<step>/rank<r>_trace.json
        **({"profiling": {"enable_profiling": True, "profile_freq": settings.run_steps, "profiler_warmup": 1,
                          "profiler_active": 1, "save_traces_folder": "profile_traces"}} if settings.profile else {}),
        # its float8 recipe for FSDP (docs/float8.md): tensorwise scales, float8 all-gathers, the output layer kept
        **({"quantize.linear.float8": {"enable_fsdp_float8_all_gather": True,
                                       "precompute_float8_dynamic_scale_for_fsdp": True,
                                       "filter_fqns": ["output"]}} if row.titan_float8 else {}),
    }  # fmt: skip


def _torchtitan(row: Row, settings: Settings) -> tuple[list[str], dict[str, str]]:
    path = settings.work / f"{row.name}.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_toml(titan_config(row, settings)))
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={row.gpus}"]
    return [*launch, "-m", "torchtitan.train", "--job.config_file", str(path)], dict(TITAN_LAUNCH_ENV)


# torchtitan trains on CUDA only: on the CPU its row checks that the TOML parses through its ConfigManager,
# the flavor registers, the model builds (on the meta device) and the parallel degrees are valid for the row's
# GPUs (its ParallelDims, and the sequence divisible as its parallelize_llama asserts), and prints what it read.
TITAN_CHECK_PY = """
import importlib, sys, torch
from torchtitan.config import ConfigManager
from torchtitan.distributed import ParallelDims
from torchtitan.protocols.train_spec import get_train_spec
config = ConfigManager().parse_args(["--job.config_file", sys.argv[1]])
importlib.import_module(config.experimental.custom_import)
spec = get_train_spec(config.model.name)
model_args = spec.model_args[config.model.flavor]
model_args.update_from_config(config)
with torch.device("meta"):
    model = spec.model_cls(model_args)
p = config.parallelism
dims = ParallelDims(dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree,
                    cp=p.context_parallel_degree, tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree,
                    ep=p.expert_parallel_degree, etp=p.expert_tensor_parallel_degree, world_size=int(sys.argv[2]))
assert config.training.seq_len % dims.seq_len_divisor == 0, (config.training.seq_len, dims.seq_len_divisor)
print("torchtitan-config-ok", config.model.flavor, config.training.global_batch_size,
      sum(parameter.numel() for parameter in model.parameters()), f"seq_len={config.training.seq_len}",
      f"dp_shard={dims.dp_shard}", f"cp={dims.cp}", f"attention={model_args.attn_type}",
      f"dtype={config.training.dtype}")
"""


def titan_check(row: Row, settings: Settings) -> list[str]:
    """The command of the torchtitan row's CPU check (the TOML as the run would use it)."""
    argv, _ = _torchtitan(row, settings)
    return [sys.executable, "-c", TITAN_CHECK_PY, argv[-1], str(row.gpus)]


def to_toml(tables: dict[str, dict[str, Any]]) -> str:
    """A TOML document of tables of scalars and lists (all torchtitan's config needs)."""
    lines = []
    for table, values in tables.items():
        lines.append(f"[{table}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in values.items()]
        lines.append("")
    return "\n".join(lines)


def install_peer(peer: str, wheels: Path, target: Path) -> None:
    """pip-install the peer's wheels (``wheels/peers/common`` + ``wheels/peers/<peer>``) into ``target``."""
    if (target / ".installed").exists():
        return
    files = sorted((wheels / "peers" / "common").glob("*.whl")) + sorted((wheels / "peers" / peer).glob("*.whl"))
    if not files:
        raise FileNotFoundError(f"no wheels under {wheels}/peers/{{common,{peer}}}: run `peers.py wheels` first")
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--upgrade"]
    subprocess.run([*pip, "--target", str(target), *map(str, files)], check=True, capture_output=True, text=True)
    (target / ".installed").write_text("\n".join(file.name for file in files))


def peer_environment(peer: str | None, site: Path | None) -> dict[str, str]:
    """The process environment of a row: the peer's target first on PYTHONPATH, then benchmarks/ and the repo."""
    paths = [str(site)] if site else []
    paths += [str(BENCHMARKS), str(REPO_ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)), "PYTHONUNBUFFERED": "1"}


def versions(peer: str | None, environment: dict[str, str]) -> dict[str, str]:
    """Installed versions of the row's packages, as its own environment sees them."""
    probe = "import json, sys, importlib.metadata as m\nout = {}\nfor name in sys.argv[1:]:\n"
    probe += "    try: out[name] = m.version(name)\n    except m.PackageNotFoundError: out[name] = None\n"
    probe += "print(json.dumps(out))"
    process = subprocess.run([sys.executable, "-c", probe, *VERSION_PACKAGES[peer]], env=environment,
                             capture_output=True, text=True)  # fmt: skip
    return json.loads(process.stdout) if process.returncode == 0 else {"error": process.stderr.strip()[-300:]}
