"""Gated activations ``act(gate) * up`` (SwiGLU, GeGLU, ReGLU), forward and backward, elementwise.

The elementwise half of foundry's ``GLU`` feed-forward (``down(act(gate(x)) * up(x))``); the three
projections stay cuBLAS GEMMs. Fusing it reads gate and up once and writes one tensor, where eager
PyTorch writes ``act(gate)`` and re-reads it for the product, and the backward likewise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foundry.errors import FoundryError
from foundry.kernels.device import lazy_jit, num_warps_for, require_kernels

# Activation codes (constexpr in the kernel).
_ACTIVATIONS = {("silu", "none"): 0, ("gelu", "none"): 1, ("gelu", "tanh"): 2, ("relu", "none"): 3}
_BLOCK = 1024


@lazy_jit
def _glu(
    gate_ptr, up_ptr, dy_ptr, out_ptr, dup_ptr, numel,
    ACTIVATION: tl.constexpr, BACKWARD: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Forward: out = act(gate) * up. Backward: out = dgate = dy * up * act'(gate), dup = dy * act(gate)."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    gate = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    if ACTIVATION == 0:  # silu: g s, slope s (1 + g (1 - s))
        sigmoid = tl.sigmoid(gate)
        activated = gate * sigmoid
        slope = sigmoid * (1.0 + gate * (1.0 - sigmoid))
    elif ACTIVATION == 1:  # exact gelu: g Phi(g), slope Phi(g) + g phi(g)
        cdf = 0.5 * (1.0 + tl.math.erf(gate * 0.7071067811865476))
        activated = gate * cdf
        slope = cdf + gate * tl.exp(-0.5 * gate * gate) * 0.3989422804014327
    elif ACTIVATION == 2:  # tanh gelu; tanh(z) = 2 sigmoid(2z) - 1 (no libdevice: runs on every backend)
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        tanh = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
        activated = 0.5 * gate * (1.0 + tanh)
        inner_slope = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * gate * gate)
        slope = 0.5 * (1.0 + tanh) + 0.5 * gate * (1.0 - tanh * tanh) * inner_slope
    else:  # relu
        activated = tl.maximum(gate, 0.0)
        slope = tl.where(gate > 0.0, 1.0, 0.0)
    if BACKWARD:
        dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offsets, (dy * up * slope).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(dup_ptr + offsets, (dy * activated).to(dup_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + offsets, (activated * up).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(gate: torch.Tensor, up: torch.Tensor, dy: torch.Tensor | None, out: torch.Tensor,
            dup: torch.Tensor | None, activation: int) -> None:  # fmt: skip
    numel = gate.numel()
    _glu[(triton.cdiv(numel, _BLOCK),)](
        gate,
        up,
        dy if dy is not None else gate,
        out,
        dup if dup is not None else out,
        numel,
        ACTIVATION=activation,
        BACKWARD=dy is not None,
        BLOCK=_BLOCK,
        num_warps=num_warps_for(_BLOCK, gate.device),
    )


class _GLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, activation):  # type: ignore[override]
        gate, up = gate.contiguous(), up.contiguous()
        y = torch.empty_like(gate, dtype=torch.promote_types(gate.dtype, up.dtype))
        _launch(gate, up, None, y, None, activation)
        ctx.save_for_backward(gate, up)
        ctx.activation = activation
        return y

    @staticmethod
    def backward(ctx, dy):  # type: ignore[override]
        gate, up = ctx.saved_tensors
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        _launch(gate, up, dy.contiguous(), dgate, dup, ctx.activation)
        return dgate, dup, None


def glu(gate: torch.Tensor, up: torch.Tensor, activation: str = "silu", approximate: str = "none") -> torch.Tensor:
    """``act(gate) * up`` for ``activation`` silu (SwiGLU), gelu (GeGLU; ``approximate`` none or tanh) or relu."""
    require_kernels(gate, "glu")
    code = _ACTIVATIONS.get((activation, approximate))
    if code is None:
        known = ", ".join(f"{name} (approximate={approx})" for name, approx in _ACTIVATIONS)
        raise FoundryError(f"The Triton glu kernel has no activation {activation!r} (approximate={approximate!r}); "
                           f"it has {known}.")  # fmt: skip
    if gate.shape != up.shape:
        raise FoundryError(f"glu: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have one shape.")
    return _GLU.apply(gate, up, code)
