"""Linear layers that sum their weight gradient inside the GEMM (``foundry.kernels.weight_grad``)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from helpers import builds_graphs
from torch import nn

from foundry.kernels.weight_grad import (
    AccumulatingLinear,
    accumulate_weight_grads_in_place,
    add_weight_grad_,
    gemm_accumulates_in_fp32,
)


class _Net(nn.Module):
    """A linear used twice in one forward (a shared weight), one with and one without bias, one frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(12, 12)
        self.out = nn.Linear(12, 8, bias=False)
        self.frozen = nn.Linear(12, 12)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.shared(self.frozen(torch.tanh(self.shared(x))))))


def _train(model: nn.Module, microbatches: list[torch.Tensor], dtype: torch.dtype | None, sums=None, run=None) -> list:
    """Two optimizer steps of accumulated microbatches (through ``run``, e.g. the compiled model); the gradients."""
    run = run if run is not None else model
    device_type = microbatches[0].device.type
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    grads = []
    for _ in range(2):
        if sums is not None:
            sums.start_batch()
        for x in microbatches:
            if sums is not None:
                sums.prepare(dtype)
            with torch.autocast(device_type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = run(x).float().square().mean()
            loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return grads


def _microbatches(device: torch.device, n: int = 3) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(2, 5, 12, generator=generator, device="cpu").to(device) for _ in range(n)]


def _net(device: torch.device) -> _Net:
    torch.manual_seed(0)
    return _Net().to(device)


@pytest.mark.parametrize("compile_model", [False, True], ids=["eager", "compiled"])
def test_fp32_gradients_and_weights_equal_autograds_over_microbatches_and_steps(compile_model, kernel_device):
    reference = _net(kernel_device)
    model = copy.deepcopy(reference)
    sums = accumulate_weight_grads_in_place(model)
    assert type(model.shared) is AccumulatingLinear and type(model.frozen) is AccumulatingLinear
    assert len(sums) == 3 and model.state_dict().keys() == reference.state_dict().keys()
    # On a CPU, aot_eager traces what inductor traces (dynamo and AOT autograd through the custom function)
    # without inductor's C++ code generation, which takes most of a minute on 2 cores; on a GPU, inductor.
    backend = "inductor" if kernel_device.type == "cuda" else "aot_eager"
    # fullgraph: in fp32 the weight once reached the function twice, a graph break at every linear
    run = torch.compile(model, backend=backend, fullgraph=True) if compile_model else model
    with builds_graphs() if compile_model else contextlib.nullcontext():
        got = _train(model, _microbatches(kernel_device), None, sums, run)
    want = _train(reference, _microbatches(kernel_device), None)
    for step_got, step_want in zip(got, want, strict=True):
        assert step_got.keys() == step_want.keys() == {"shared.weight", "shared.bias", "out.weight"}
        for name in step_want:
            torch.testing.assert_close(step_got[name], step_want[name], rtol=1e-5, atol=1e-6, msg=name)
    for name, param in reference.named_parameters():
        torch.testing.assert_close(model.get_parameter(name), param, rtol=1e-5, atol=1e-6, msg=name)
    assert model.frozen.weight.grad is None  # a frozen layer stays a plain linear: no sum, no memory


def test_bf16_gradients_match_autograds_and_the_cast_weight_follows_each_step(kernel_device):
    reference = _net(kernel_device)
    model = copy.deepcopy(reference)
    sums = accumulate_weight_grads_in_place(model)
    got = _train(model, _microbatches(kernel_device), torch.bfloat16, sums)
    want = _train(reference, _microbatches(kernel_device), torch.bfloat16)
    for step_got, step_want in zip(got, want, strict=True):
        for name in step_want:  # autograd rounds each microbatch's product (and the bias sum) to bf16 first
            torch.testing.assert_close(step_got[name], step_want[name], rtol=2e-2, atol=2e-3, msg=name)
    # The weights moved twice: a stale bf16 copy would show as a different output than plain autocast's.
    sums.start_batch()
    sums.prepare(torch.bfloat16)
    x = _microbatches(kernel_device, 1)[0]
    with torch.autocast(kernel_device.type, dtype=torch.bfloat16):
        summed = model(x).requires_grad_()  # grad on: the summing path
        with torch.no_grad():
            plain = model(x)  # grad off: plain nn.Linear
    torch.testing.assert_close(summed, plain, rtol=0, atol=0)


def test_a_weight_changed_outside_the_optimizer_is_cast_again(kernel_device):
    """``load_state_dict`` between batches (a checkpoint load, an EMA swap) refreshes the bf16 copy."""
    model, other = _net(kernel_device), _Net().to(kernel_device)
    sums = accumulate_weight_grads_in_place(model)
    x = _microbatches(kernel_device, 1)[0]
    sums.prepare(torch.bfloat16)
    with torch.autocast(kernel_device.type, dtype=torch.bfloat16):
        model(x).float().sum().backward()
    model.load_state_dict(other.state_dict())
    model.zero_grad(set_to_none=True)
    sums.start_batch()
    sums.prepare(torch.bfloat16)
    with torch.autocast(kernel_device.type, dtype=torch.bfloat16):
        got = model(x)
        want = other(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_weight_written_through_data_without_a_version_bump_is_cast_again_at_the_next_batch(kernel_device):
    """Optimizers that write ``p.data`` (and fused ones) leave the version counter alone: no cast may rely on it."""
    model = _net(kernel_device)
    sums = accumulate_weight_grads_in_place(model)
    x = _microbatches(kernel_device, 1)[0]

    def forward() -> torch.Tensor:
        sums.prepare(torch.bfloat16)
        with torch.autocast(kernel_device.type, dtype=torch.bfloat16):
            return model(x)

    before = forward()
    with torch.no_grad():
        model.out.weight.data.mul_(-1)
    sums.start_batch()
    after = forward()
    with torch.no_grad(), torch.autocast(kernel_device.type, dtype=torch.bfloat16):
        plain = model(x)
    torch.testing.assert_close(after, plain, rtol=0, atol=0)
    assert not torch.equal(after, before)


def test_zero_grad_without_set_to_none_and_a_grad_set_by_hand_are_honoured(kernel_device):
    model = _net(kernel_device)
    sums = accumulate_weight_grads_in_place(model)
    x = _microbatches(kernel_device, 1)[0]

    def backward() -> None:
        sums.prepare(None)
        model(x).square().mean().backward()

    backward()
    once = model.out.weight.grad.clone()
    model.zero_grad(set_to_none=False)  # zeroes the sum itself (it is .grad)
    backward()
    torch.testing.assert_close(model.out.weight.grad, once)
    model.out.weight.grad = torch.ones_like(once)  # autograd would add on top of a .grad set by hand
    backward()
    torch.testing.assert_close(model.out.weight.grad, once + 1)


def test_released_or_never_prepared_layers_are_plain_linears_for_autograd(kernel_device):
    """Outside the Trainer nothing prepares the sums: autograd must fill ``.grad`` itself."""
    model = _net(kernel_device)
    sums = accumulate_weight_grads_in_place(model)
    x = _microbatches(kernel_device, 1)[0]
    model(x).square().mean().backward()  # never prepared
    never = model.out.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    sums.prepare(None)
    sums.release()
    model(x).square().mean().backward()
    torch.testing.assert_close(model.out.weight.grad, never)
    assert model.out.weight_grad_sum is None and model.out.compute_weight is None


def test_only_exact_linears_are_swapped():
    class Custom(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(4, 4), Custom(4, 4))
    sums = accumulate_weight_grads_in_place(model)
    assert type(model[0]) is AccumulatingLinear and type(model[1]) is Custom and len(sums) == 1


def _accumulated_weight_grad(device: str, chunks: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_weight_grad_`` over ``chunks`` bf16 products, and their exact sum in fp64."""
    torch.manual_seed(0)
    products = [(torch.randn(32, 48, device=device).bfloat16(), torch.randn(32, 16, device=device).bfloat16())
                for _ in range(chunks)]  # fmt: skip
    weight_grad = torch.zeros(48, 16, device=device)
    for dlogits, hidden in products:
        add_weight_grad_(weight_grad, dlogits, hidden)
    return weight_grad, sum(dlogits.double().T @ hidden.double() for dlogits, hidden in products)


def test_weight_gradient_falls_back_to_adding_bf16_products_where_gemms_cannot_accumulate_in_fp32() -> None:
    assert not gemm_accumulates_in_fp32(torch.device("cpu"), torch.bfloat16)
    weight_grad, exact = _accumulated_weight_grad("cpu")
    torch.testing.assert_close(weight_grad.double(), exact, rtol=2e-2, atol=0.3)  # each product rounded to bf16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_gpu_the_weight_gradient_accumulates_in_fp32_inside_the_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fp32-accumulating GEMM keeps the sum of 64 products to fp32 precision; adding bf16 products does not."""
    assert gemm_accumulates_in_fp32(torch.device("cuda", torch.cuda.current_device()), torch.bfloat16)
    weight_grad, exact = _accumulated_weight_grad("cuda")
    accumulated = (weight_grad.double() - exact).abs().max().item()
    monkeypatch.setattr("foundry.kernels.weight_grad.gemm_accumulates_in_fp32", lambda device, dtype: False)
    weight_grad, _ = _accumulated_weight_grad("cuda")
    rounded_per_chunk = (weight_grad.double() - exact).abs().max().item()
    assert accumulated < 1e-3 < rounded_per_chunk, (accumulated, rounded_per_chunk)


def test_a_bias_free_layer_on_an_input_without_gradient_still_starts_backward(kernel_device):
    """Its cast weight holds no graph: the weight itself must tie the output to it."""
    torch.manual_seed(0)
    layer = nn.Linear(12, 4, bias=False).to(kernel_device)
    reference = copy.deepcopy(layer)
    sums = accumulate_weight_grads_in_place(layer)
    x = _microbatches(kernel_device, 1)[0]
    sums.prepare(torch.bfloat16)
    with torch.autocast(kernel_device.type, dtype=torch.bfloat16):
        layer(x).float().sum().backward()
        reference(x).float().sum().backward()
    torch.testing.assert_close(layer.weight.grad, reference.weight.grad, rtol=2e-2, atol=2e-2)
