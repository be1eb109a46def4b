"""MPT-125M: what compile options beyond regional compile buy (rows run through ``benchmarks/mfu.py``).

    python benchmarks/mpt125m_levers.py --out OUT

Four rows at microbatch 32 (8 microbatches a batch, 2 warm-up + 3 timed batches, as in the MFU
table): regional compile as shipped (``torch_compile: {compile_loss: true}``, SDPA), the same
with inductor's ``coordinate_descent_tuning`` (tunes the launch sizes of the fused elementwise
and reduction kernels), the whole transformer compiled as one graph (fusions across block
boundaries), and both. Measurement only: whole-model compile is not an algorithm option.
"""

from __future__ import annotations

import argparse
import os
import sys

import mfu
import torch
import torch._inductor.config as inductor_config
from bench_utils import save_json

from foundry import registry
from foundry.core.algorithm import Algorithm
from foundry.core.event import Event


@registry.algorithms.register("whole_model_compile")
class WholeModelCompile(Algorithm):
    """Compile the whole transformer (and the loss) as one graph instead of block by block."""

    def match(self, event, state) -> bool:
        return event == Event.INIT

    def apply(self, event, state, logger) -> None:
        state.model.transformer.forward = torch.compile(state.model.transformer.forward)
        state.model.loss = torch.compile(state.model.loss)


WHOLE = mfu.Row(mfu.MPT_125M, 32, {"whole_model_compile": {}}, mfu.SDPA, use_fsdp_config=False)
ROWS = {  # name -> (row, coordinate_descent_tuning)
    "regional": (mfu.fast(mfu.MPT_125M, 32), False),
    "regional+coordinate-descent": (mfu.fast(mfu.MPT_125M, 32), True),
    "whole-model": (WHOLE, False),
    "whole-model+coordinate-descent": (WHOLE, True),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    cli = parser.parse_args()
    if not torch.cuda.is_available():
        print("mpt125m_levers.py needs a CUDA device.", file=sys.stderr)
        return 2
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    args = argparse.Namespace(
        warmup=2, steps=3, accum=8, peak_tflops=mfu.H100_BF16_PEAK_TFLOPS, profile=False, profile_steps=2
    )
    results = []
    for name, (row, coordinate_descent) in ROWS.items():
        inductor_config.coordinate_descent_tuning = coordinate_descent
        torch._dynamo.reset()
        result = mfu.measure(name, row, args)
        results.append(result)
        print(
            f"{name}: MFU {result['mfu']:.1%}, step {result['step_ms']:.0f} ms, peak {result['peak_mem_gib']:.1f} GiB"
        )
    save_json(cli.out, "mpt125m_levers", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
