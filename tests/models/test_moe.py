"""The MoE feed-forward against a dense per-token reference: routing, permutation, outputs, gradients, loss terms."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from helpers import builds_graphs

from foundry.errors import ConfigError
from foundry.models import experts as experts_module
from foundry.models.experts import combine, count_per_expert, dispatch, slot_weights, sort_by_expert, undo_sort
from foundry.models.init import InitConfig, init_weights_
from foundry.models.layers import ActFnConfig
from foundry.models.moe import MoE, MoEConfig, Routing, expert_load, moe_loss_terms

D_MODEL, HIDDEN, EXPERTS = 16, 24, 4


def tiny_moe(**overrides: object) -> MoE:
    torch.manual_seed(0)
    keys = {"num_experts": EXPERTS, "top_k": 2, "hidden_size": HIDDEN, "glu": True, "act": ActFnConfig("silu")}
    moe = MoE(D_MODEL, MoEConfig(**{**keys, **overrides}))
    init_weights_(moe, InitConfig(name="baseline_", init_std=0.2), n_layers=2, d_model=D_MODEL)
    return moe


def reference_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: softmax, top-k, (renormalised) weights, each chosen expert's FFN, shared expert, bias."""
    config, experts = moe.config, moe.experts
    outputs = []
    for token in x.reshape(-1, x.shape[-1]):
        probs = F.softmax(moe.router.layer(token).float(), dim=-1)
        weights, ids = probs.topk(config.top_k)
        if config.normalize_expert_weights is not None:
            weights = weights / weights.norm(p=config.normalize_expert_weights)
        out = torch.zeros_like(token)
        for weight, e in zip(weights, ids.tolist()):
            up = experts.up_proj[e] @ token
            hidden = experts.act(experts.gate_proj[e] @ token) * up if config.glu else experts.act(up)
            out = out + weight * (experts.down_proj[e] @ hidden)
        if moe.shared_expert is not None:
            out = out + moe.shared_expert(token)
        if moe.bias is not None:
            out = out + moe.bias
        outputs.append(out)
    return torch.stack(outputs).view_as(x)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"normalize_expert_weights": 1.0},
        {"glu": False, "act": ActFnConfig("gelu"), "bias": True},
        {"shared_expert_hidden_size": 8, "top_k": 1},
        {"top_k": EXPERTS},
    ],
    ids=["glu-top2", "renormalised", "mlp-bias", "shared-top1", "all-experts"],
)
def test_moe_output_and_gradients_equal_a_per_token_loop(overrides: dict[str, object]) -> None:
    moe = tiny_moe(**overrides)
    x = torch.randn(3, 5, D_MODEL, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out = moe(x)
    expected = reference_moe(moe, x_ref)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x, *moe.parameters()], grad_out)
    expected_grads = torch.autograd.grad(expected, [x_ref, *moe.parameters()], grad_out, allow_unused=True)
    for grad, expected_grad in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected_grad if expected_grad is not None else torch.zeros_like(grad))


def test_sort_by_expert_groups_assignments_with_aligned_padding() -> None:
    expert_ids = torch.tensor([[2, 0], [0, 1], [2, 1], [0, 2]])  # 4 tokens, top-2
    layout = sort_by_expert(expert_ids, num_experts=4, row_alignment=4)
    assert layout.tokens_per_expert.tolist() == [3, 2, 3, 0]
    assert layout.group_ends.tolist() == [4, 8, 12, 12]
    x = torch.arange(4.0)[:, None] + 1  # token t's row is t + 1; padding rows are 0
    rows = dispatch(x, layout).squeeze(1).tolist()
    # expert 0: tokens 0, 1, 3; expert 1: tokens 1, 2; expert 2: tokens 0, 2, 3; padding to multiples of 4
    assert rows[:12] == [1, 2, 4, 0, 2, 3, 0, 0, 1, 3, 4, 0]
    assert len(rows) == 4 * 2 + 4 * 3
    # assignment t * 2 + j sits where its token was copied
    assert [rows[slot] for slot in layout.slot_of_assignment.tolist()] == [1, 1, 2, 2, 3, 3, 4, 4]


def test_dispatch_combine_and_undo_sort_backward_are_the_gathers_transposes() -> None:
    """Their backward passes are gathers written by hand (no scatter-add): autograd's numerical check, with padding."""
    expert_ids = torch.randint(0, 4, (6, 2), generator=torch.Generator().manual_seed(0))
    layout = sort_by_expert(expert_ids, num_experts=4, row_alignment=4)
    x = torch.randn(6, 3, dtype=torch.float64, requires_grad=True)
    rows = torch.randn(layout.source_of_slot.shape[0], 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: dispatch(x, layout), (x,))
    assert torch.autograd.gradcheck(lambda rows: undo_sort(rows, layout), (rows,))
    assert torch.autograd.gradcheck(lambda rows: combine(rows, layout), (rows,))
    weights = torch.rand(6, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda weights: slot_weights(weights, layout), (weights,))
    assert layout.assignment_of_slot[layout.slot_of_assignment].tolist() == list(range(12))


def test_combine_is_dispatchs_transpose_and_sums_each_tokens_rows() -> None:
    """<dispatch(x), rows> = <x, combine(rows)>; combine adds a token's top_k rows and reads no padding row."""
    expert_ids = torch.randint(0, 4, (6, 2), generator=torch.Generator().manual_seed(1))
    layout = sort_by_expert(expert_ids, num_experts=4, row_alignment=4)
    x = torch.randn(6, 3, dtype=torch.float64)
    rows = torch.randn(layout.source_of_slot.shape[0], 3, dtype=torch.float64)
    torch.testing.assert_close((dispatch(x, layout) * rows).sum(), (x * combine(rows, layout)).sum())
    per_assignment = undo_sort(rows, layout).view(6, 2, 3)
    torch.testing.assert_close(combine(rows, layout), per_assignment.sum(1), rtol=0, atol=0)
    padding = layout.assignment_of_slot == 12
    rows[padding] = float("nan")
    assert combine(rows, layout).isfinite().all()


def test_compiled_combine_and_dispatch_backward_sum_as_eager_does() -> None:
    """Compiled, each token's top_k rows are summed as unrolled gathers (one elementwise kernel on a GPU):
    combine's forward and dispatch's backward equal eager's one-gather-and-sum, in bf16 with padding rows."""
    expert_ids = torch.randint(0, 4, (16, 4), generator=torch.Generator().manual_seed(2))
    layout = sort_by_expert(expert_ids, num_experts=4, row_alignment=8)
    x = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True)
    rows = torch.randn(layout.source_of_slot.shape[0], 32, dtype=torch.bfloat16, requires_grad=True)
    grad_out = torch.randn(16, 32, dtype=torch.bfloat16)

    def round_trip(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return combine(dispatch(x, layout) * rows, layout)

    def output_and_grads(fn: Callable[..., torch.Tensor]) -> tuple[torch.Tensor, ...]:
        out = fn(x, rows)
        return out, *torch.autograd.grad(out, (x, rows), grad_out)

    eager_results = output_and_grads(round_trip)
    with builds_graphs():
        compiled_results = output_and_grads(torch.compile(round_trip, backend="aot_eager", fullgraph=True))
    for compiled, eager in zip(compiled_results, eager_results, strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-2, atol=1e-2)


def test_slot_weights_put_each_router_weight_on_its_row() -> None:
    expert_ids = torch.tensor([[2, 0], [0, 1], [2, 1], [0, 2]])
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.9, 0.1], [0.8, 0.2]])
    layout = sort_by_expert(expert_ids, num_experts=4, row_alignment=4)
    # rows as in test_sort_by_expert_groups_assignments_with_aligned_padding: padding rows weigh 0
    expected = [0.4, 0.7, 0.8, 0, 0.3, 0.1, 0, 0, 0.6, 0.9, 0.2, 0]
    assert slot_weights(weights, layout)[:12].tolist() == pytest.approx(expected)
    assert slot_weights(weights, layout)[12:].tolist() == [0.0] * 8


def test_backward_keeps_no_per_assignment_copy_of_the_outputs() -> None:
    """The router weights scale the hidden activation, so combine keeps nothing: of the tensors saved for
    backward, only the dispatched input rows hold (tokens * top_k, d_model) values (HIDDEN != D_MODEL)."""
    moe = tiny_moe(top_k=3)
    tokens, top_k = 10, 3
    assignment_rows_bytes = tokens * top_k * D_MODEL * 4
    saved_storages = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved_storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        moe(torch.randn(1, tokens, D_MODEL, requires_grad=True))
    assert list(saved_storages.values()).count(assignment_rows_bytes) == 1


def test_count_per_expert_equals_bincount_including_unused_experts() -> None:
    expert_ids = torch.randint(0, 6, (257,), generator=torch.Generator().manual_seed(0))  # experts 6, 7 unused
    counts = count_per_expert(expert_ids, num_experts=8)
    assert counts.dtype == torch.long
    assert counts.tolist() == torch.bincount(expert_ids, minlength=8).tolist()


def test_sort_by_expert_traces_as_one_graph() -> None:
    """No data-dependent shape in the layout (bincount had one): torch.compile keeps the MoE layer whole."""
    expert_ids = torch.randint(0, 8, (64, 2), generator=torch.Generator().manual_seed(0))
    explanation = torch._dynamo.explain(sort_by_expert)(expert_ids, 8, 8)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_grouped_gemm_layer_traces_as_one_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU path (grouped GEMMs; forced here, on a torch with a CPU grouped_mm): a training forward,
    routing record included, is one torch.compile graph, so a compiled block is not cut around the layout."""
    try:
        torch._grouped_mm(
            torch.ones(8, 8, dtype=torch.bfloat16),
            torch.ones(1, 8, 8, dtype=torch.bfloat16),
            offs=torch.tensor([8], dtype=torch.int32),
        )
    except (RuntimeError, NotImplementedError, AttributeError):
        pytest.skip("this torch has no grouped_mm on the CPU")
    monkeypatch.setattr(experts_module, "grouped_mm_runs_on", lambda device, dtype: True)
    moe = tiny_moe().to(torch.bfloat16)
    explanation = torch._dynamo.explain(moe)(torch.randn(2, 8, D_MODEL, dtype=torch.bfloat16))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert moe.experts.row_alignment(torch.ones(1, dtype=torch.bfloat16)) == experts_module.GROUPED_MM_ROW_ALIGNMENT


def test_load_balancing_loss_is_megablocks_formula_on_a_fixed_routing() -> None:
    counts = torch.tensor([3.0, 1.0, 0.0, 4.0])  # 4 tokens, top-2
    probs = torch.tensor([0.4, 0.1, 0.2, 0.3])
    routing = Routing(tokens_per_expert=counts, mean_probs=probs, z=torch.tensor(0.0))
    # MegaBlocks: num_experts / (tokens * top_k) * dot(tokens_per_expert, mean scores)
    assert routing.load_balancing.item() == pytest.approx(4 / (4 * 2) * (3 * 0.4 + 1 * 0.1 + 4 * 0.3))
    even = Routing(tokens_per_expert=torch.full((4,), 2.0), mean_probs=torch.full((4,), 0.25), z=torch.tensor(0.0))
    assert even.load_balancing.item() == pytest.approx(1.0)


def test_loss_terms_are_weighted_means_over_layers() -> None:
    layers = [tiny_moe(load_balancing_weight=0.01, z_loss_weight=0.001) for _ in range(2)]
    x = torch.randn(2, 4, D_MODEL)
    for layer in layers:
        layer(x)
    terms = moe_loss_terms(layers)
    logits = [layer.router.layer(x.reshape(-1, D_MODEL)) for layer in layers]
    z = [torch.logsumexp(logit, -1).square().mean() for logit in logits]
    torch.testing.assert_close(terms["router_z"], 0.001 * (z[0] + z[1]) / 2)
    lbl = [layer.routing.load_balancing for layer in layers]
    torch.testing.assert_close(terms["load_balancing"], 0.01 * (lbl[0] + lbl[1]) / 2)
    assert moe_loss_terms([tiny_moe()]) == {}  # no forward yet, and no weights


def test_expert_load_is_max_over_mean() -> None:
    assert expert_load(torch.tensor([2, 2, 2, 2])).item() == 1.0
    assert expert_load(torch.tensor([8, 0, 0, 0])).item() == 4.0


def test_uniform_expert_assignment_spreads_tokens_evenly() -> None:
    moe = tiny_moe(uniform_expert_assignment=True)
    moe(torch.randn(1, 8, D_MODEL))
    assert moe.routing.tokens_per_expert.tolist() == [4, 4, 4, 4]


def test_bad_top_k_names_the_keys() -> None:
    with pytest.raises(ConfigError, match="'model.ffn_config.moe_top_k' is 5"):
        MoEConfig(num_experts=4, top_k=5, hidden_size=8)


def test_moe_runs_under_bf16_autocast_and_compile() -> None:
    moe = tiny_moe()
    x = torch.randn(2, 8, D_MODEL)
    expected = moe(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = moe(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=0.05, atol=0.05)
    with builds_graphs():
        torch.testing.assert_close(torch.compile(moe, backend="eager")(x), expected)
    assert math.isfinite(moe.routing.z.item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_moe_layer_has_eager_gradients(dtype: torch.dtype, backend: str) -> None:
    """The whole layer compiled, inputs and every parameter's gradient: torch 2.11's dynamo returned wrong
    gradients for fp32 rows through the combine's unrolled sum (2026-11-28), which the bf16-only check missed."""
    eager = tiny_moe().to(dtype)
    compiled_moe = copy.deepcopy(eager)
    x = torch.randn(2, 8, D_MODEL, dtype=dtype)
    grad = torch.randn_like(x)
    results = []
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for module, fn in ((eager, eager), (compiled_moe, torch.compile(compiled_moe, backend=backend, fullgraph=True))):
        inputs = x.clone().requires_grad_(True)
        fn(inputs).backward(grad)
        results.append([inputs.grad, *(param.grad for param in module.parameters())])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # it compiled, not fell back to eager
    for compiled_grad, eager_grad in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(compiled_grad, eager_grad, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-5)
