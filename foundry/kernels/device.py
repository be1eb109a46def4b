"""Where foundry's Triton kernels can run, and the launch sizes they take from the device.

Kernels run on CUDA tensors (NVIDIA, and AMD through ROCm's ``cuda`` device) and, with
``TRITON_INTERPRET=1``, on CPU tensors through Triton's interpreter (how the tests exercise them).
Warp size, multiprocessor count and block limits are read from the device, never assumed: a
CDNA GPU has 64-wide wavefronts where NVIDIA has 32-wide warps.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch

from foundry.errors import FoundryError

try:
    import triton
except ImportError:  # a CPU-only install: every caller falls back to PyTorch
    triton = None

# CUDA and HIP both cap a block at 1024 threads.
MAX_THREADS_PER_BLOCK = 1024
# The longest row a one-program-per-row kernel holds in registers (d_model, vocab chunk, ...).
MAX_ROW_BLOCK = 65536
# The interpreter runs each program as one NumPy computation; warps mean nothing there.
_INTERPRETER_WARP_SIZE = 1
_INTERPRETER_PROGRAMS = 4


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernels_run_on(device: torch.device | str) -> bool:
    """Whether the Triton kernels can run on ``device``: a GPU with Triton, or the CPU interpreter."""
    device = torch.device(device)
    if triton is None:
        return False
    if device.type == "cuda":
        return torch.cuda.is_available()
    return device.type == "cpu" and interpreting()


def require_kernels(tensor: torch.Tensor, kernel: str) -> None:
    """Fail with the fix when ``kernel`` is asked to run where Triton cannot."""
    if not kernels_run_on(tensor.device):
        reason = "Triton is not installed" if triton is None else f"the tensor is on {tensor.device.type}"
        raise FoundryError(
            f"The Triton {kernel} kernel cannot run here: {reason}. It needs a CUDA/ROCm GPU, or "
            f"TRITON_INTERPRET=1 for CPU tensors (slow; for tests). Turn the 'fused_kernels' algorithm off "
            f"to use the PyTorch layers."
        )


@functools.cache
def _gpu_limits(device_index: int) -> tuple[int, int]:
    properties = torch.cuda.get_device_properties(device_index)
    return properties.warp_size, properties.multi_processor_count


def warp_size(device: torch.device) -> int:
    """Threads per warp (NVIDIA 32, AMD CDNA 64); 1 under the interpreter."""
    if device.type != "cuda":
        return _INTERPRETER_WARP_SIZE
    return _gpu_limits(device.index if device.index is not None else torch.cuda.current_device())[0]


def parallel_programs(device: torch.device) -> int:
    """How many programs fill the device once: its multiprocessor count (a few under the interpreter)."""
    if device.type != "cuda":
        return _INTERPRETER_PROGRAMS
    return _gpu_limits(device.index if device.index is not None else torch.cuda.current_device())[1]


def row_block(n_cols: int, kernel: str) -> int:
    """The power-of-two block that holds a whole row of ``n_cols`` elements; too long a row fails clearly."""
    block = triton.next_power_of_2(n_cols)
    if block > MAX_ROW_BLOCK:
        raise FoundryError(
            f"The Triton {kernel} kernel holds a row in one block of at most {MAX_ROW_BLOCK} elements; this row "
            f"has {n_cols}. Turn that switch of the 'fused_kernels' algorithm off for this model."
        )
    return block


def num_warps_for(block: int, device: torch.device, elements_per_thread: int = 8) -> int:
    """Warps for a block of ``block`` elements: about ``elements_per_thread`` each, within the device's limits."""
    width = warp_size(device)
    max_warps = max(1, MAX_THREADS_PER_BLOCK // width)
    wanted = max(1, block // (width * elements_per_thread))
    return min(max_warps, triton.next_power_of_2(wanted))


class LazyKernel:
    """A Triton kernel that is compiled (or interpreted) at its first launch, not at import.

    ``triton.jit`` decides between compiling and interpreting when it decorates, so a module-level
    ``@triton.jit`` imported before ``TRITON_INTERPRET=1`` is set would never interpret. Deciding at
    launch lets one process (the test suite) import foundry and Triton first and set the variable later.
    """

    def __init__(self, fn: Callable[..., None]) -> None:
        self.fn = fn
        self._by_mode: dict[bool, Any] = {}

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        mode = interpreting()
        if mode not in self._by_mode:
            self._by_mode[mode] = triton.jit(self.fn)
        launch = self._by_mode[mode][grid]
        return functools.partial(_launch_interpreted, launch) if mode else launch


def _launch_interpreted(launch: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run an interpreted launch with Triton's own jitted helpers (``tl.sum``, ``tl.max``...) interpretable.

    Those helpers were decorated when Triton was imported; if that was before ``TRITON_INTERPRET=1``,
    they are compiled-only ``JITFunction``s that refuse to be called. For the launch, calling one runs
    its Python function through the interpreter, as it would had the variable been set at import.
    """
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    original_call = JITFunction.__call__

    def call_interpreted(self: JITFunction, *call_args: Any, **call_kwargs: Any) -> Any:
        return InterpretedFunction(self.fn)(*call_args, **call_kwargs)

    JITFunction.__call__ = call_interpreted
    try:
        return launch(*args, **kwargs)
    finally:
        JITFunction.__call__ = original_call


def lazy_jit(fn: Callable[..., None]) -> LazyKernel:
    return LazyKernel(fn)
