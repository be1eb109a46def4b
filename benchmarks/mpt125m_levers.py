"""MPT-125M: what each lever beyond regional compile buys (rows run through ``benchmarks/mfu.py``).

    python benchmarks/mpt125m_levers.py --out OUT
    python benchmarks/mpt125m_levers.py --rows regional whole-fused-residual --profile --out OUT

Every row is ``yamls/pretrain/mpt-125m.yaml`` on one device with SDPA, microbatch 32 unless named,
8 microbatches a batch, 2 warm-up + 3 timed batches (as in the MFU table). The levers:
- ``residual``: the ``low_precision_residual`` algorithm (bf16 residual stream, as FSDP PURE has);
- ``fused``: ``loss_fn: fused_crossentropy`` (chunked linear + cross-entropy) instead of the
  compiled loss;
- ``whole``: ``torch_compile`` ``scope: model`` (fusions across block boundaries);
- ``cd``: inductor's ``coordinate_descent_tuning`` (tunes the fused kernels' launch sizes);
- ``fsdp-pure``: the YAML's own fsdp_config (FSDP2 on one rank, ``mixed_precision: PURE``);
- ``fa4``: FlashAttention-4 pinned (``attn_impl: fa4``) instead of SDPA's cuDNN kernel.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import mfu
import torch
from mfu import FAST as COMPILED_LOSS
from mfu import RESIDUAL, WHOLE, WHOLE_CD

REGIONAL = {"torch_compile": {}}
WHOLE_COMPILED_LOSS = {"torch_compile": {"scope": "model", "compile_loss": True}}
WHOLE_AGGRESSIVE = {"torch_compile": {"scope": "model", "options": {"aggressive_fusion": True}}}
WHOLE_AUTOTUNE = {"torch_compile": {"scope": "model", "options": {"max_autotune_gemm": True}}}
WHOLE_CD_AGGRESSIVE = {
    "torch_compile": {"scope": "model", "options": {"coordinate_descent_tuning": True, "aggressive_fusion": True}}
}


def row(
    algorithms: dict[str, Any], fused: bool = False, microbatch: int = 32, fsdp: bool = False, attn: str = "sdpa"
) -> mfu.Row:
    attention = (f"model.attn_config.attn_impl={attn}",)
    return mfu.Row(mfu.MPT_125M, microbatch, algorithms, attention + (mfu.FUSED_CE if fused else ()), fsdp)


ROWS = {
    "regional": row(COMPILED_LOSS),  # the fast path as shipped before these levers
    "regional-residual": row({**COMPILED_LOSS, **RESIDUAL}),
    "fused": row(REGIONAL, fused=True),
    "fused-residual": row({**REGIONAL, **RESIDUAL}, fused=True),
    "whole-residual": row({**WHOLE_COMPILED_LOSS, **RESIDUAL}),
    "whole-fused-residual": row({**WHOLE, **RESIDUAL}, fused=True),
    "whole-fused-residual-mb64": row({**WHOLE, **RESIDUAL}, fused=True, microbatch=64),
    "fsdp-pure": row(COMPILED_LOSS, fsdp=True),
    "whole-fused-residual-cd": row({**WHOLE_CD, **RESIDUAL}, fused=True),
    "whole-fused-residual-mb96": row({**WHOLE, **RESIDUAL}, fused=True, microbatch=96),
    "whole-fused-residual-cd-mb64": row({**WHOLE_CD, **RESIDUAL}, fused=True, microbatch=64),
    "whole-fused-residual-cd-mb96": row({**WHOLE_CD, **RESIDUAL}, fused=True, microbatch=96),
    "whole-fused-residual-mb112": row({**WHOLE, **RESIDUAL}, fused=True, microbatch=112),
    "whole-fused-residual-mb128": row({**WHOLE, **RESIDUAL}, fused=True, microbatch=128),
    "whole-fused-residual-mb128-fa4": row({**WHOLE, **RESIDUAL}, fused=True, microbatch=128, attn="fa4"),
    "whole-fused-residual-autotune-mb96": row({**WHOLE_AUTOTUNE, **RESIDUAL}, fused=True, microbatch=96),
    "whole-fused-residual-aggressive-mb96": row({**WHOLE_AGGRESSIVE, **RESIDUAL}, fused=True, microbatch=96),
    "whole-fused-residual-cd-aggressive-mb96": row({**WHOLE_CD_AGGRESSIVE, **RESIDUAL}, fused=True, microbatch=96),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--profile", action="store_true", help="profile 2 more batches per row")
    parser.add_argument("--out", default=None)
    cli = parser.parse_args()
    if not torch.cuda.is_available():
        print("mpt125m_levers.py needs a CUDA device.", file=sys.stderr)
        return 2
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    args = argparse.Namespace(
        warmup=2, steps=3, accum=8, peak_tflops=mfu.H100_BF16_PEAK_TFLOPS, profile=cli.profile, profile_steps=2,
        out=cli.out,
    )  # fmt: skip
    mfu.run_rows({name: ROWS[name] for name in cli.rows}, args, "mpt125m_levers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
