"""The CUDA caching allocator's settings a run applies before it allocates."""

from __future__ import annotations

import torch


def apply_allocator_settings(expandable_segments: bool) -> None:
    """LLM Foundry's default: expandable segments cut fragmentation when sequence lengths vary.

    It applies only before the first CUDA allocation of the process; later calls change nothing.
    """
    if expandable_segments and torch.cuda.is_available():
        # torch 2.10+ names the setter per accelerator (its CUDA alias warns that it is deprecated)
        setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
        (setter or torch.cuda.memory._set_allocator_settings)("expandable_segments:True")
