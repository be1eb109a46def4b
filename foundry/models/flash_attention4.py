"""FlashAttention-4 (the optional ``flash-attn-4`` package) as two custom ops a compiled model keeps in its graph.

On an H100 its causal forward + backward is 10-15% faster than cuDNN's, the fastest kernel SDPA has
(docs/PERFORMANCE.md), mostly in the backward. ``attn_impl: flash`` runs it wherever it can: a Hopper
or Blackwell GPU, fp16/bf16, plain causal attention (no mask or bias, no dropout), heads a multiple
of 8 wide (up to 256 on Hopper, 128 on Blackwell). ``attn_impl: fa4`` pins it. Install it with
``pip install 'foundry[flash]'``; without it ``flash`` runs SDPA's fused kernels as before.

Before a shape first runs here, ``probe_problem`` checks its kernels against fp32 math on a small input;
a kernel that fails or disagrees sends that shape to SDPA with one warning.

The package's autograd function is Python around kernels compiled on first use (a few seconds per
shape), which dynamo cannot trace: a compiled model would break its graph at every layer. Here the
forward (output and log-sum-exp) and the backward (dq, dk, dv) are two opaque custom ops with
shape-only fake implementations, so ``torch.compile`` sees one op per call. They call the package's
``_flash_attn_fwd`` / ``_flash_attn_bwd``, the functions its own autograd function calls.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import logging
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F

PACKAGE = "flash-attn-4"
INSTALL_HINT = f"pip install 'foundry[flash]' (the {PACKAGE} package)"
# Compute capabilities (major) the package has kernels for, and the widest head each takes.
MAX_HEAD_DIM = {9: 256, 10: 128}
HEAD_DIM_MULTIPLE = 8  # 16 bytes of fp16/bf16
# The package's internal entry points and the keywords foundry passes them (tested with 4.0.0b36). They are
# not its public API, so a release that changes them is caught before a run, not at its first forward.
ENTRY_POINTS = {
    "_flash_attn_fwd": ("softmax_scale", "causal", "out", "lse", "return_lse"),
    "_flash_attn_bwd": ("softmax_scale", "causal", "dq", "dk", "dv"),
}

log = logging.getLogger(__name__)


@functools.cache
def _interface() -> ModuleType:
    return importlib.import_module("flash_attn.cute.interface")


@functools.cache
def installed() -> bool:
    """Whether ``flash_attn.cute`` (FlashAttention-4) can be imported."""
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except ModuleNotFoundError:  # a flash_attn without the cute subpackage (FlashAttention-2)
        return False


@functools.cache
def interface_problem() -> str:
    """'' when the installed package imports and has the entry points and keywords foundry calls; else what not."""
    try:
        interface = _interface()
    except Exception as error:  # a broken install (CUDA libraries, the CuTe DSL) is a reason, not a crash
        return (
            f"importing flash_attn.cute.interface failed ({type(error).__name__}: {error}); reinstall: {INSTALL_HINT}"
        )
    for name, keywords in ENTRY_POINTS.items():
        function = getattr(interface, name, None)
        if function is None:
            return (
                f"{PACKAGE} has no flash_attn.cute.interface.{name}; {INSTALL_HINT} installs a version foundry supports"
            )
        missing = [keyword for keyword in keywords if keyword not in inspect.signature(function).parameters]
        if missing:
            return (
                f"{PACKAGE}'s {name} takes no {', '.join(missing)} argument(s); {INSTALL_HINT} installs a version "
                "foundry supports"
            )
    return ""


@torch.compiler.assume_constant_result
def unsupported_reason(
    device_type: str, device_index: int, dtype: torch.dtype, head_dim: int, heads: int, kv_heads: int
) -> str:
    """Why FlashAttention-4 cannot run attention of this shape on this device and dtype; '' when it can.

    A trace-time constant under ``torch.compile``; cached, so an eager forward pays for it once.
    """
    return _unsupported_reason(device_type, device_index, dtype, head_dim, heads, kv_heads)


@functools.cache
def _unsupported_reason(
    device_type: str, device_index: int, dtype: torch.dtype, head_dim: int, heads: int, kv_heads: int
) -> str:
    if device_type != "cuda":
        return f"it runs on NVIDIA GPUs only, not on {device_type}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"it takes fp16/bf16 activations, not {dtype} (use precision: amp_bf16)"
    major, minor = torch.cuda.get_device_capability(device_index)
    if major not in MAX_HEAD_DIM:
        return f"it has kernels for Hopper (9.x) and Blackwell (10.x) GPUs, not compute capability {major}.{minor}"
    if head_dim % HEAD_DIM_MULTIPLE or head_dim > MAX_HEAD_DIM[major]:
        return (
            f"heads must be a multiple of {HEAD_DIM_MULTIPLE} and at most {MAX_HEAD_DIM[major]} wide on "
            f"compute capability {major}.x, not {head_dim}"
        )
    if not installed():
        # Said once per shape (this function is cached): the one case a user can fix with a pip install.
        log.info(
            "FlashAttention-4 would run this attention (compute capability %d.%d, heads %d wide) and is faster than "
            "SDPA's kernels on Hopper (docs/PERFORMANCE.md); using SDPA. To use it: %s.",
            major, minor, head_dim, INSTALL_HINT,
        )  # fmt: skip
        return f"the {PACKAGE} package is not installed ({INSTALL_HINT})"
    if problem := interface_problem() or probe_problem(
        torch.device("cuda", device_index), dtype, head_dim, heads, kv_heads
    ):
        log.warning("FlashAttention-4 is installed but cannot be used: %s. Attention runs on SDPA.", problem)
        return problem
    return ""


PROBE_SEQ = 192  # a few tiles of every kernel configuration, causal diagonal included
# The end-aligned check's queries: the last rows against all keys, more than one 128-row tile (as PROBE_SEQ,
# so it runs the kernels the square probe compiled) and ending the keys off a tile boundary.
PROBE_END_QUERIES = 144
PROBE_TOLERANCE = 4.0  # FlashAttention-4 may be this many times further from fp32 math than SDPA is (both bf16)
_GRADIENT_NAMES = ("output", "dq", "dk", "dv")


@functools.cache
def probe_problem(device: torch.device, dtype: torch.dtype, head_dim: int, heads: int, kv_heads: int) -> str:
    """'' when the kernels for this shape build and agree with fp32 math as closely as SDPA does; else why not.

    The package compiles kernels per shape on first use, and a beta release can fail to build one or build
    a wrong one. Probing a small causal input first (once per shape, a few seconds of compiling the run
    would pay anyway) turns either into SDPA and a warning, instead of a crash or silently wrong attention.
    Two checks: square causal attention (``attn_impl: flash``), and the last queries against all keys, whose
    causal mask must align to the last key (context parallelism runs each sequence chunk that way).
    """
    try:
        return _probe(device, dtype, head_dim, heads, kv_heads)
    except Exception as error:  # the probe's own failure must not stop a run SDPA can carry
        return f"the {PROBE_SEQ}-token probe of this shape failed ({type(error).__name__}: {error})"


def _probe(device: torch.device, dtype: torch.dtype, head_dim: int, heads: int, kv_heads: int) -> str:
    generator = torch.Generator(device).manual_seed(0)
    with torch.inference_mode(False):  # tensors autograd can differentiate, even when called during eval
        q, k, v, grad_out = (
            torch.randn(1, PROBE_SEQ, count, head_dim, device=device, dtype=dtype, generator=generator)
            for count in (heads, kv_heads, kv_heads, heads)
        )
    scale = head_dim**-0.5
    end_q, end_grad_out = q[:, -PROBE_END_QUERIES:], grad_out[:, -PROBE_END_QUERIES:]
    try:
        square = _kernel_outputs_and_grads(q, k, v, grad_out, scale)
        end_aligned = _kernel_outputs_and_grads(end_q, k, v, end_grad_out, scale)
    except Exception as error:  # any failure to build or launch is a reason to use SDPA
        return f"its kernels failed on a {PROBE_SEQ}-token probe of this shape ({type(error).__name__}: {error})"
    reference = _causal_attention_and_grads(q.float(), k.float(), v.float(), grad_out.float(), scale, _math_attention)
    sdpa = _causal_attention_and_grads(q, k, v, grad_out, scale, _sdpa_attention)
    allowed = [(fused.float() - exact).abs().max().item() for fused, exact in zip(sdpa, reference, strict=True)]
    end_reference = _causal_attention_and_grads(
        end_q.float(), k.float(), v.float(), end_grad_out.float(), scale, _math_attention
    )
    checks = (
        (f"on a {PROBE_SEQ}-token probe of this shape", square, reference),
        (f"for the last {PROBE_END_QUERIES} of {PROBE_SEQ} queries against all keys (the causal mask aligned to the "
         "last key, as context parallelism needs)", end_aligned, end_reference),
    )  # fmt: skip
    for where, found, exact in checks:
        for name, got, want, sdpa_error in zip(_GRADIENT_NAMES, found, exact, allowed, strict=True):
            error = (got.float() - want).abs().max().item()
            if not error <= PROBE_TOLERANCE * sdpa_error + 1e-3:  # NaN fails too
                return f"its {name} {where} is {error:.3g} from fp32 math, SDPA's {sdpa_error:.3g}"
    return ""


def _kernel_outputs_and_grads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor, scale: float
) -> tuple[torch.Tensor, ...]:
    """Output, dq, dk, dv of the package's kernels called as the ops call them."""
    out, lse = _forward_outputs(q, v)
    _interface()._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=True, out=out, lse=lse, return_lse=True)
    dq, dk, dv = _input_grads(q, k, v)
    _interface()._flash_attn_bwd(q, k, v, out, grad_out, lse, softmax_scale=scale, causal=True, dq=dq, dk=dk, dv=dv)
    return out, dq, dk, dv


def _causal_attention_and_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    scale: float,
    attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor],
) -> tuple[torch.Tensor, ...]:
    """Output, dq, dk, dv of ``attention`` on (batch, seq, heads, head_dim) inputs, in their own dtype."""
    # The probe runs inside the model's forward, which may be under autocast (fp32 must stay fp32), no_grad or
    # inference_mode (eval, generation): gradients on for these few tensors.
    with torch.inference_mode(False), torch.enable_grad(), torch.autocast(q.device.type, enabled=False):
        inputs = tuple(x.detach().requires_grad_() for x in (q, k, v))
        out = attention(*(x.transpose(1, 2) for x in inputs), scale).transpose(1, 2)
        return out.detach(), *torch.autograd.grad(out, inputs, grad_out)


def _math_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention, the mask aligned to the last key where keys outnumber queries (as FlashAttention's)."""
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    scores = (q @ k.transpose(-2, -1)) * scale
    queries, keys = scores.shape[-2:]
    causal = torch.ones(queries, keys, dtype=torch.bool, device=q.device).tril(keys - queries)
    return scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v


def _sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


# No device_types: the selection above only routes CUDA tensors here, and tests stand a reference in
# for the package on CPU tensors.
@torch.library.custom_op("foundry::flash_attention4_forward", mutates_args=())
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of q (batch, seq, heads, head_dim), k and v (batch, keys, kv_heads, head_dim).

    With more keys than queries the causal mask aligns to the last key: query i sees keys up to
    keys - seq + i (``probe_problem`` checks the package does so). Returns the output (q's shape,
    contiguous) and the log-sum-exp of each query row (batch, heads, seq) in fp32.
    """
    out, lse = _forward_outputs(q, v)
    _interface()._flash_attn_fwd(q, k, v, softmax_scale=scale, causal=True, out=out, lse=lse, return_lse=True)
    return out, lse


@_forward.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward_outputs(q, v)


def _forward_outputs(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    batch, seq, heads, _ = q.shape
    out = q.new_empty(batch, seq, heads, v.shape[-1])
    return out, torch.empty(batch, heads, seq, dtype=torch.float32, device=q.device)


@torch.library.custom_op("foundry::flash_attention4_backward", mutates_args=())
def _backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (contiguous, the shapes of q, k, v) of ``_forward``'s output given its gradient."""
    dq, dk, dv = _input_grads(q, k, v)
    _interface()._flash_attn_bwd(
        q, k, v, out, grad_out.contiguous(), lse, softmax_scale=scale, causal=True, dq=dq, dk=dk, dv=dv
    )
    return dq, dk, dv


@_backward.register_fake
def _(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, ...]:
    return _input_grads(q, k, v)


def _input_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple) -> None:
    q, k, v, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.scale = scale


def _autograd_backward(
    ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor, grad_lse: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.foundry.flash_attention4_backward(grad_out, q, k, v, out, lse, ctx.scale)
    return dq, dk, dv, None


_forward.register_autograd(_autograd_backward, setup_context=_setup_context)


def flash_attention4(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention, q (batch, n_heads, seq, head_dim), k and v (batch, kv_heads, seq, head_dim) -> q's shape.

    The kernels take (batch, seq, heads, head_dim): the models' q, k, v are transposed views of that
    layout, so the transposes here cost nothing.
    """
    out, _ = torch.ops.foundry.flash_attention4_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale)
    return out.transpose(1, 2)
