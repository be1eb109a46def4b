"""Context parallelism on 2 gloo ranks: the mesh, the split, attention over split sequences, training, resharding."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from flash_attention4_reference import reference_fwd, reference_interface
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils._python_dispatch import TorchDispatchMode

from distributed.jobs import build_trainer, rank_batches, train, train_compiled
from foundry.algorithms.gradient_clipping import GradientClipping
from foundry.callbacks.hand_over import HandOver
from foundry.callbacks.speed_monitor import model_flops_per_batch
from foundry.core import Callback
from foundry.distributed import context_parallel as context_parallel_module
from foundry.distributed import get_rank
from foundry.distributed.config import ParallelismConfig
from foundry.distributed.context_parallel import (
    ContextParallel,
    apply_context_parallel,
    chunks_of_rank,
    shard_sequence,
    unshard_sequence,
)
from foundry.distributed.mesh import build_mesh, parallel_dims
from foundry.errors import ConfigError
from foundry.models import LlamaCausalLM, MPTCausalLM, flash_attention4
from foundry.optim.schedulers import CosineWithWarmupScheduler
from foundry.targets import IGNORE_INDEX, SHIFTED_LABELS_KEY, shifted_targets

NUM_BATCHES = 4
CP2 = {"context_parallel_degree": 2}
FULL_SHARD = {"sharding_strategy": "FULL_SHARD"}
LLAMA = {
    "name": "llama_causal_lm", "d_model": 32, "n_heads": 4, "kv_n_heads": 2, "n_layers": 2, "vocab_size": 64,
    "max_seq_len": 16, "ffn_hidden_size": 64, "rope_theta": 100.0,
}  # fmt: skip


# ------------------------------------------------------------------------------ the split, on one process
def test_each_rank_holds_a_head_and_its_mirrored_tail_so_causal_work_is_equal():
    cp_size = 4
    held = [chunks_of_rank(rank, cp_size) for rank in range(cp_size)]
    assert held == [(0, 7), (1, 6), (2, 5), (3, 4)]
    # chunk c attends to c + 1 chunks of keys: every rank does 2·cp + 1 chunk pairs of attention
    assert {(head + 1) + (tail + 1) for head, tail in held} == {2 * cp_size + 1}


def test_unsharding_the_ranks_pieces_restores_the_sequence():
    sequence = torch.arange(2 * 24).view(2, 24)
    pieces = [shard_sequence(sequence, rank, 3) for rank in range(3)]
    assert pieces[0][0].tolist() == [0, 1, 2, 3, 20, 21, 22, 23]
    assert torch.equal(unshard_sequence(pieces, dim=1), sequence)


def test_a_length_the_chunks_do_not_divide_is_refused():
    with pytest.raises(ConfigError, match="context_parallel_degree=2 cannot split"):
        shard_sequence(torch.zeros(1, 10), 0, 2)


def test_a_batch_with_shifted_labels_keeps_them():
    batch = {"input_ids": torch.tensor([[5, 6, 7]]), SHIFTED_LABELS_KEY: torch.tensor([[1, 2, 3]])}
    assert shifted_targets(batch).tolist() == [[1, 2, 3]]
    assert shifted_targets({"input_ids": torch.tensor([[5, 6, 7]])}).tolist() == [[6, 7, IGNORE_INDEX]]


def test_the_degree_must_divide_the_world(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="does not divide the 2 ranks"):
        parallel_dims("shard", ParallelismConfig(context_parallel_degree=4))
    with pytest.raises(ConfigError, match="parallelism.context_parallel_degree"):
        ParallelismConfig(context_parallel_degree=0)


# ------------------------------------------------------------------------------ on ranks
def mesh_axes(cp: int) -> dict:
    dims = parallel_dims("shard", ParallelismConfig(context_parallel_degree=cp))
    mesh = build_mesh(dims, "cpu")
    names = ("dp_replicate", "dp_shard", "cp", "dp", "dp_shard_cp")
    return {"sizes": {name: mesh[name].size() for name in names}, "fsdp": mesh.fsdp.mesh_dim_names}


def test_the_mesh_shards_parameters_over_data_and_context_ranks(ranks):
    cp2, dp2 = ranks.run(2, mesh_axes, 2)[0], ranks.run(2, mesh_axes, 1)[0]
    assert cp2["sizes"] == {"dp_replicate": 1, "dp_shard": 1, "cp": 2, "dp": 1, "dp_shard_cp": 2}
    assert dp2["sizes"] == {"dp_replicate": 1, "dp_shard": 2, "cp": 1, "dp": 2, "dp_shard_cp": 2}
    assert cp2["fsdp"] == dp2["fsdp"] == ("dp_shard_cp",)


def split_batch_on_rank() -> dict:
    """Rank r loads its own 1 sample of 8 tokens; returns the pieces it trains on."""
    rank = get_rank()
    mesh = build_mesh(parallel_dims("shard", ParallelismConfig(context_parallel_degree=2)), "cpu")
    batch = {"input_ids": torch.arange(8)[None] + 100 * rank}
    return {key: value.tolist() for key, value in ContextParallel(mesh["cp"]).shard(batch).items()}


def test_cp_ranks_split_every_sample_of_their_group_with_whole_sequence_positions_and_targets(ranks):
    rank0, rank1 = ranks.run(2, split_batch_on_rank)
    # both samples (each rank loaded one), rank 0 their chunks 0 and 3, rank 1 chunks 1 and 2
    assert rank0["input_ids"] == [[0, 1, 6, 7], [100, 101, 106, 107]]
    assert rank1["input_ids"] == [[2, 3, 4, 5], [102, 103, 104, 105]]
    assert rank0["position_ids"] == [[0, 1, 6, 7]] * 2 and rank1["position_ids"] == [[2, 3, 4, 5]] * 2
    # targets shifted over the whole sequence: a chunk's last target is the next chunk's first token
    assert rank0[SHIFTED_LABELS_KEY] == [[1, 2, 7, IGNORE_INDEX], [101, 102, 107, IGNORE_INDEX]]
    assert rank1[SHIFTED_LABELS_KEY] == [[3, 4, 5, 6], [103, 104, 105, 106]]


def split_counting_collectives() -> dict:
    """Rank r's pieces of a batch with every per-token key, and the collectives ``shard`` issued for it."""
    rank = get_rank()
    mesh = build_mesh(parallel_dims("shard", ParallelismConfig(context_parallel_degree=2)), "cpu")
    batch = {
        "input_ids": torch.arange(8)[None] + 100 * rank,
        "attention_mask": torch.ones(1, 8, dtype=torch.bool),
        "sequence_id": torch.full((1, 8), rank),
        "position_ids": torch.arange(8)[None] + 10 * rank,
    }
    calls = []
    originals = {
        name: getattr(dist, name)
        for name in ("all_gather", "all_gather_single", "all_gather_into_tensor")
        if hasattr(dist, name)
    }

    def counting(name: str):
        def collective(*args, **kwargs):
            calls.append((name, args[1].device.type))  # args[1]: what this rank sends
            return originals[name](*args, **kwargs)

        return collective

    try:
        for name in originals:
            setattr(dist, name, counting(name))
        pieces = ContextParallel(mesh["cp"]).shard(batch)
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return {"pieces": {key: (value.tolist(), value.dtype) for key, value in pieces.items()}, "calls": calls}


def test_shard_gathers_every_per_token_key_in_one_collective_and_checks_shapes_on_the_host(ranks):
    rank0, rank1 = ranks.run(2, split_counting_collectives)
    # one host-side exchange of the batch layouts, one gather of all five per-token tensors
    gather_single = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    assert rank0["calls"] == [("all_gather", "cpu"), (gather_single, "cpu")]
    assert rank1["pieces"]["input_ids"] == ([[2, 3, 4, 5], [102, 103, 104, 105]], torch.long)
    assert rank1["pieces"]["position_ids"] == ([[2, 3, 4, 5], [12, 13, 14, 15]], torch.long)
    assert rank0["pieces"]["sequence_id"] == ([[0, 0, 0, 0], [1, 1, 1, 1]], torch.long)
    assert rank0["pieces"]["attention_mask"] == ([[True] * 4] * 2, torch.bool)
    assert rank0["pieces"][SHIFTED_LABELS_KEY][0][1] == [101, 102, 107, IGNORE_INDEX]


def split_unequal_batches(differ_in: str) -> str:
    """Rank 1 loads two samples (``shape``) or an attention mask (``keys``) where rank 0 loads one, without."""
    rank = get_rank()
    mesh = build_mesh(parallel_dims("shard", ParallelismConfig(context_parallel_degree=2)), "cpu")
    batch = {"input_ids": torch.zeros(1 + (rank if differ_in == "shape" else 0), 8, dtype=torch.long)}
    if differ_in == "keys" and rank == 1:
        batch["attention_mask"] = torch.ones(1, 8)
    with pytest.raises(ConfigError) as error:
        ContextParallel(mesh["cp"]).shard(batch)
    return str(error.value)


@pytest.mark.parametrize(
    ("differ_in", "rank1_loaded"),
    [
        ("shape", "rank 1: 2 x 8 tokens"),
        ("keys", "rank 1: 1 x 8 tokens, input_ids, shifted_labels, position_ids, attention_mask"),
    ],
)
def test_cp_ranks_that_loaded_unequal_batches_are_all_told_which(ranks, differ_in, rank1_loaded):
    for message in ranks.run(2, split_unequal_batches, differ_in):
        assert "different shapes or keys" in message and rank1_loaded in message and "drop_last: true" in message


def attention_against_full(kv_heads: int, flash_attention4: bool = False, attention: str = "end_aligned") -> dict:
    """Split-sequence attention (forward and the gradients of q, k, v) next to full causal attention, and how many
    times the split repeated a tensor's heads (``repeat_interleave``)."""
    mesh = build_mesh(parallel_dims("shard", ParallelismConfig(context_parallel_degree=2)), "cpu")
    context_parallel = ContextParallel(mesh["cp"], attention)
    generator = torch.Generator().manual_seed(0)  # the same whole q, k, v on both ranks
    q = torch.randn(2, 4, 16, 8, generator=generator, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, 16, 8, generator=generator, requires_grad=True) for _ in range(2))
    weights = torch.randn(2, 4, 16, 8, generator=generator)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != 4)
    (full * weights).sum().backward()
    want = {"out": full.detach(), "q": q.grad, "k": k.grad, "v": v.grad}
    rank = get_rank()
    local = [shard_sequence(x.detach(), rank, 2, dim=2).requires_grad_() for x in (q, k, v)]
    with repeats_counted() as repeats:
        out = context_parallel.split_sequence_attention(*local, 8**-0.5, 0.0, flash_attention4)
        (out * shard_sequence(weights, rank, 2, dim=2)).sum().backward()
    got = {"out": out.detach(), "q": local[0].grad, "k": local[1].grad, "v": local[2].grad}
    return {"tensors": {name: (got[name], shard_sequence(want[name], rank, 2, dim=2)) for name in got}, **repeats}


@contextlib.contextmanager
def repeats_counted() -> Iterator[dict[str, int]]:
    """Counts calls of ``repeat_interleave`` (the method and the function) inside the block."""
    counted = {"repeats": 0}

    def counting(original):
        def repeat_interleave(*args, **kwargs):
            counted["repeats"] += 1
            return original(*args, **kwargs)

        return repeat_interleave

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "repeat_interleave", counting(torch.Tensor.repeat_interleave))
        patch.setattr(torch, "repeat_interleave", counting(torch.repeat_interleave))
        yield counted


def assert_matches_full_attention(result: dict) -> None:
    for name, (got, want) in result["tensors"].items():
        # k and v gradients: this rank's share of the sum over both ranks' queries (the reduce-scatter)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["multihead", "grouped-query"])
def test_split_sequence_attention_matches_full_attention_forward_and_backward(ranks, kv_heads):
    for result in ranks.run(2, attention_against_full, kv_heads):
        assert_matches_full_attention(result)


def flash_attention4_against_full(kv_heads: int) -> dict:
    """``attention_against_full`` on the FlashAttention-4 route, the package stood in for by fp32 math; with the
    (queries, keys, kv_heads) of each forward its kernel ran."""
    kernel_calls = []

    def recording_fwd(q, k, v, **kwargs):
        kernel_calls.append((q.shape[1], k.shape[1], k.shape[2]))
        return reference_fwd(q, k, v, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(flash_attention4, "_interface", lambda: reference_interface(fwd=recording_fwd))
        result = attention_against_full(kv_heads, flash_attention4=True)
    return {**result, "kernel_calls": kernel_calls}


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["multihead", "grouped-query"])
def test_split_sequence_attention_on_flash_attention4_matches_full_attention_without_repeating_kv(ranks, kv_heads):
    rank0, rank1 = ranks.run(2, flash_attention4_against_full, kv_heads)
    for result in (rank0, rank1):
        assert_matches_full_attention(result)
        assert result["repeats"] == 0  # grouped-query heads reach the kernel as they are
    # 16 tokens in 4 chunks: rank 0's head is square (4 queries, 4 keys), every other chunk ends a longer prefix
    assert rank0["kernel_calls"] == [(4, 4, kv_heads), (4, 16, kv_heads)]
    assert rank1["kernel_calls"] == [(4, 8, kv_heads), (4, 12, kv_heads)]


def split_against_full(kv_heads: int) -> dict:
    """``attention_against_full`` with ``context_parallel_attention: split``; the (queries, keys, kernel) of each
    chunk that ran as merged pieces."""
    calls = []
    original = context_parallel_module.end_aligned_attention

    def recording(q, k, v, scale, kernel):
        calls.append((q.shape[2], k.shape[2], kernel))
        return original(q, k, v, scale, kernel)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(context_parallel_module, "end_aligned_attention", recording)
        result = attention_against_full(kv_heads, attention="split")
    return {**result, "split_calls": calls}


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["multihead", "grouped-query"])
def test_split_tail_chunks_merge_to_full_attention_forward_and_backward(ranks, kv_heads):
    rank0, rank1 = ranks.run(2, split_against_full, kv_heads)
    for result in (rank0, rank1):
        assert_matches_full_attention(result)
    # 16 tokens in 4 chunks: rank 0's head is square (plain causal SDPA); every longer prefix runs as two pieces
    assert rank0["split_calls"] == [(4, 16, "cpu")]
    assert rank1["split_calls"] == [(4, 8, "cpu"), (4, 12, "cpu")]


def test_an_unknown_context_parallel_attention_is_refused_naming_the_key_and_choices():
    choices = r"'parallelism.context_parallel_attention' is 'splitt'.*'end_aligned', 'split'"
    with pytest.raises(ConfigError, match=choices):
        ParallelismConfig(context_parallel_degree=2, context_parallel_attention="splitt")


def test_the_sdpa_route_repeats_grouped_kv_heads_for_its_end_aligned_kernel(ranks):
    """The counter above sees a repeat where one happens: SDPA's end-aligned kernels take equal head counts."""
    # k and v for each chunk that ends a longer prefix; rank 0's head is square (SDPA's enable_gqa takes it)
    assert [result["repeats"] for result in ranks.run(2, attention_against_full, 2)] == [2, 4]


def cp_logits(attn_impl: str, flash_attention4_runs: bool) -> dict:
    """A Llama's logits over this rank's pieces under CP2 next to the same pieces of its whole-sequence logits,
    with FlashAttention-4 able to run (stood in for on CPU tensors) or not; and the kernel calls' lengths."""
    kernel_calls = []

    def recording_fwd(q, k, v, **kwargs):
        kernel_calls.append((q.shape[1], k.shape[1]))
        return reference_fwd(q, k, v, **kwargs)

    keys = {key: value for key, value in LLAMA.items() if key != "name"}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(flash_attention4, "_interface", lambda: reference_interface(fwd=recording_fwd))
        reason = "" if flash_attention4_runs else "it runs on NVIDIA GPUs only, not on cpu"
        patch.setattr(flash_attention4, "unsupported_reason", lambda *shape: reason)
        torch.manual_seed(0)
        model = LlamaCausalLM(**keys, attn_impl=attn_impl)
        mesh = build_mesh(parallel_dims("shard", ParallelismConfig(context_parallel_degree=2)), "cpu")
        context_parallel = apply_context_parallel(model, mesh["cp"])
        whole = {"input_ids": torch.arange(32).view(2, 16) % LLAMA["vocab_size"]}
        batch = context_parallel.shard({"input_ids": whole["input_ids"][get_rank()][None]})
        with context_parallel.activated():
            try:
                got = model(batch).detach()
            except ConfigError as error:
                return {"error": str(error)}
        split_calls = list(kernel_calls)
        want = shard_sequence(model(whole).detach(), get_rank(), 2)
    return {"got": got, "want": want, "kernel_calls": split_calls}


def test_a_flash_layer_runs_its_chunks_on_flash_attention4_where_it_runs(ranks):
    for result in ranks.run(2, cp_logits, "flash", True):
        torch.testing.assert_close(result["got"], result["want"], atol=1e-5, rtol=1e-5)
        assert len(result["kernel_calls"]) == 2 * LLAMA["n_layers"]  # two chunks a layer, all on the kernel
        assert any(queries < keys for queries, keys in result["kernel_calls"])


def test_a_flash_layer_runs_its_chunks_on_sdpa_where_flash_attention4_cannot(ranks):
    for result in ranks.run(2, cp_logits, "flash", False):
        torch.testing.assert_close(result["got"], result["want"], atol=1e-5, rtol=1e-5)
        assert result["kernel_calls"] == []


def test_pinned_fa4_under_cp_names_why_flash_attention4_cannot_run(ranks):
    for result in ranks.run(2, cp_logits, "fa4", False):
        assert (
            "attn_impl' is 'fa4', but FlashAttention-4 cannot run here: it runs on NVIDIA GPUs only"
            in (result["error"])
        )


@pytest.fixture(scope="module")
def one_rank(ranks, tmp_path_factory) -> dict:
    return ranks.run(1, train, NUM_BATCHES, str(tmp_path_factory.mktemp("one_rank")))[0]


def assert_same_run(result: dict, reference: dict) -> None:
    assert sorted(result["losses"]) == list(range(1, NUM_BATCHES + 1))
    for step, loss in reference["losses"].items():
        assert result["losses"][step] == pytest.approx(loss, abs=1e-5), step
    for name, weight in reference["weights"].items():
        torch.testing.assert_close(result["weights"][name], weight, atol=1e-5, rtol=0, msg=name)


def test_cp2_trains_exactly_like_one_rank(ranks, one_rank, tmp_path):
    """MPT with learned position embeddings: the same losses and weights as one process, global batch alike."""
    assert_same_run(ranks.run(2, train, NUM_BATCHES, str(tmp_path), FULL_SHARD, parallelism=CP2)[0], one_rank)


@pytest.mark.parametrize("attention", ["end_aligned", "split"])
def test_cp2_llama_with_rope_and_grouped_query_attention_trains_like_one_rank(ranks, tmp_path, attention):
    reference = ranks.run(1, train, NUM_BATCHES, str(tmp_path / "one"), model_keys=LLAMA)[0]
    parallelism = {**CP2, "context_parallel_attention": attention}
    result = ranks.run(
        2, train, NUM_BATCHES, str(tmp_path / "cp"), FULL_SHARD, model_keys=LLAMA, parallelism=parallelism
    )
    assert_same_run(result[0], reference)


@pytest.mark.slow  # compiling on two CPU ranks
def test_cp2_split_attention_compiles_into_the_blocks_and_trains_like_one_rank(ranks, tmp_path):
    reference = ranks.run(1, train, NUM_BATCHES, str(tmp_path / "one"), model_keys=LLAMA)[0]
    parallelism = {**CP2, "context_parallel_attention": "split"}
    result = ranks.run(
        2, train_compiled, NUM_BATCHES, str(tmp_path / "cp"), fsdp_config=FULL_SHARD, model_keys=LLAMA,
        parallelism=parallelism, compile_config={"backend": "aot_eager"},
    )  # fmt: skip
    assert_same_run(result[0], reference)


class WeightsAfterEachStep(Callback):
    """The full weights (gathered from FSDP's shards) and the pre-clip gradient norm after every batch."""

    def __init__(self) -> None:
        self.weights: list[dict[str, torch.Tensor]] = []
        self.grad_norms: list[float] = []

    def batch_end(self, state, logger) -> None:
        weights = get_model_state_dict(state.model, options=StateDictOptions(full_state_dict=True))
        self.weights.append({name: tensor.detach().clone() for name, tensor in weights.items()})
        self.grad_norms.append(float(state.grad_norm))


CLIPPING_THRESHOLD = 0.05
MANY_BATCHES = 8
CHECKPOINTED = {**FULL_SHARD, "activation_checkpointing": True}


def train_as_the_long_context_yaml(folder: str, parallelism: dict | None) -> dict | None:
    """Llama on 2 ranks as llama-8b-64k.yaml trains it (clipping, weight decay, warmup then cosine, one
    sample a microbatch, activation checkpointing: backward recomputes split attention), with a learning
    rate high enough that any difference in the gradients grows."""
    recorder = WeightsAfterEachStep()
    trainer = build_trainer(
        MANY_BATCHES, folder, CHECKPOINTED, model_keys=LLAMA, parallelism=parallelism,
        optimizer_keys={"lr": 1e-2, "weight_decay": 1e-3}, algorithms=[GradientClipping("norm", CLIPPING_THRESHOLD)],
        schedulers=CosineWithWarmupScheduler(t_warmup="3ba", alpha_f=0.1), device_train_microbatch_size=1,
        callbacks=[recorder],
    )  # fmt: skip
    trainer.fit()
    losses = next(d for d in trainer.logger.destinations if hasattr(d, "losses")).losses
    return {"losses": losses, "weights": recorder.weights, "grad_norms": recorder.grad_norms}


def test_cp2_matches_fsdp_alone_after_every_step_of_a_clipped_accumulated_run(ranks, tmp_path):
    """CP2 against the same 2 ranks without context parallelism, weights compared after each optimizer step:
    an error that only accumulates (loss weighting over cp ranks, the clipping norm's group, weight decay, the
    schedule, several microbatches a step: 4 half-sequences a rank under CP, 2 whole ones without) shows here."""
    fsdp = ranks.run(2, train_as_the_long_context_yaml, str(tmp_path / "fsdp"), None)[0]
    cp2 = ranks.run(2, train_as_the_long_context_yaml, str(tmp_path / "cp2"), CP2)[0]
    assert min(fsdp["grad_norms"]) > CLIPPING_THRESHOLD  # every step clipped: the clipped norm is compared too
    assert sorted(cp2["losses"]) == list(range(1, MANY_BATCHES + 1))
    for step, loss in fsdp["losses"].items():
        assert cp2["losses"][step] == pytest.approx(loss, rel=1e-5), step
    for step, (got, want) in enumerate(zip(cp2["weights"], fsdp["weights"], strict=True), start=1):
        for name, weight in want.items():
            torch.testing.assert_close(got[name], weight, rtol=1e-5, atol=1e-6, msg=f"{name} after step {step}")


def eval_loss(folder: str, parallelism: dict | None) -> float:
    trainer = build_trainer(1, folder, FULL_SHARD if parallelism else None, parallelism=parallelism)
    trainer.state.eval_dataloaders = {"eval": rank_batches(2)}
    return trainer.eval()["eval"]["loss"]


def test_evaluation_under_cp2_gives_one_ranks_loss(ranks, tmp_path):
    one = ranks.run(1, eval_loss, str(tmp_path / "one"), None)[0]
    assert ranks.run(2, eval_loss, str(tmp_path / "cp"), CP2) == [pytest.approx(one, abs=1e-6)] * 2


def flops_of_a_batch(folder: str, parallelism: dict | None) -> int:
    trainer = build_trainer(1, folder, FULL_SHARD if parallelism else None, parallelism=parallelism)
    trainer.fit()
    return model_flops_per_batch(trainer.state)


def test_mfu_counts_attention_over_whole_sequences_under_cp(ranks, tmp_path):
    """A cp rank's FLOPs are those of its loaded samples at their whole length: attention's seq² is not
    split into (seq / cp)² pieces. One rank holds the whole global batch: twice a cp rank's count."""
    one = ranks.run(1, flops_of_a_batch, str(tmp_path / "one"), None)[0]
    cp_ranks = ranks.run(2, flops_of_a_batch, str(tmp_path / "cp"), CP2)
    assert cp_ranks == [one // 2] * 2


@pytest.mark.parametrize(
    ("saved_by", "loaded_by"),
    [((2, FULL_SHARD, CP2), (1, None, None)), ((1, None, None), (2, FULL_SHARD, CP2))],
    ids=["cp2-to-1-rank", "1-rank-to-cp2"],
)
def test_a_cp2_checkpoint_resumes_on_one_rank_and_the_reverse(ranks, one_rank, saved_by, loaded_by, tmp_path):
    relaunch = {"callbacks": [HandOver("2ba")], "save_folder": str(tmp_path / "ckpt"), "autoresume": True}
    for world_size, fsdp_config, parallelism in (saved_by, loaded_by):
        last = ranks.run(
            world_size, train, NUM_BATCHES, str(tmp_path), fsdp_config, parallelism=parallelism, **relaunch
        )
    assert sorted(last[0]["losses"]) == [3, 4]
    for step, loss in last[0]["losses"].items():
        assert loss == pytest.approx(one_rank["losses"][step], abs=1e-5), step
    for name, weight in one_rank["weights"].items():
        torch.testing.assert_close(last[0]["weights"][name], weight, atol=1e-5, rtol=0, msg=name)


def refusal(attn_config: dict) -> str:
    model = MPTCausalLM(d_model=16, n_heads=2, n_layers=1, vocab_size=32, max_seq_len=8, attn_config=attn_config)
    mesh = build_mesh(parallel_dims("shard", ParallelismConfig(context_parallel_degree=2)), "cpu")
    with pytest.raises(ConfigError) as error:
        apply_context_parallel(model, mesh["cp"])
    return str(error.value)


@pytest.mark.parametrize(
    ("attn_config", "key"),
    [
        ({"alibi": True}, "alibi"),
        ({"attn_uses_sequence_id": True}, "attn_uses_sequence_id"),
        ({"sliding_window_size": 4}, "sliding_window_size"),
    ],
)
def test_masks_beyond_causal_are_refused_by_key(ranks, attn_config, key):
    assert f"model.attn_config.{key}" in ranks.run(2, refusal, attn_config)[0]


def padded_forward() -> str:
    model = MPTCausalLM(d_model=16, n_heads=2, n_layers=1, vocab_size=32, max_seq_len=8)
    mesh = build_mesh(parallel_dims("shard", ParallelismConfig(context_parallel_degree=2)), "cpu")
    context_parallel = apply_context_parallel(model, mesh["cp"])
    batch = context_parallel.shard(
        {"input_ids": torch.ones(1, 8, dtype=torch.long), "attention_mask": torch.ones(1, 8)}
    )
    batch["attention_mask"][0, 0] = 0  # a padded token
    with context_parallel.activated(), pytest.raises(ConfigError) as error:
        model(batch)
    return str(error.value)


def test_a_padded_batch_is_refused_at_its_forward(ranks):
    assert all("this batch needs a mask: padding" in message for message in ranks.run(2, padded_forward))


class _BackwardGradientStrides(TorchDispatchMode):
    """The strides of the output gradient and output that SDPA's CPU flash backward is handed."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
            grad_out, _, _, _, out = args[:5]
            self.seen.append((grad_out.stride(), out.stride()))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("layout", ["batch_sliced", "head_sliced"])
def test_the_first_chunks_gradient_reaches_sdpa_in_the_layout_of_its_output(layout):
    """CP's first chunk gets its output gradient as a slice of the whole sequence's (torch.cat's backward); cuDNN's
    backward misreads such strides, so the chunk hands SDPA the gradient in the output's own layout (the CPU kernel
    stands in here for the check of what reaches it; the GPU test checks the gradients)."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 16, 4, 8, generator=generator).requires_grad_() for _ in range(3))
    if layout == "batch_sliced":  # (batch, seq, heads, dim), as the models hand attention's output on
        whole = torch.randn(2, 32, 4, 8, generator=generator)[:, :16]
    else:
        whole = torch.randn(2, 4, 32, 8, generator=generator)[:, :, :16].transpose(1, 2)
    with _BackwardGradientStrides() as strides:
        context_parallel_module._sdpa_prefix_attention(q, k, v, 8**-0.5, 0.0).backward(whole)
    assert whole.stride() != strides.seen[0][1]  # the slice is laid out unlike the output
    assert strides.seen == [(strides.seen[0][1], strides.seen[0][1])]
