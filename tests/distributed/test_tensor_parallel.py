"""Tensor parallelism on 2 gloo ranks: TP2 (with sequence parallelism, and without) trains Llama and MPT as one
rank does; checkpoints and exports move between TP2 and one rank."""

from __future__ import annotations

import pytest
import torch

from distributed.jobs import (
    FLOAT8_LLAMA,
    GLOBAL_BATCH_SIZE,
    assert_same_run,
    build_trainer,
    full_weights,
    initial_weights,
    rank_batches,
    skip_without_cpu_float8,
    train,
    train_float8,
)
from foundry.algorithms.fused_kernels import _swap_norms
from foundry.algorithms.gradient_clipping import GradientClipping
from foundry.callbacks.hand_over import HandOver
from foundry.core.algorithm import Algorithm
from foundry.core.event import Event
from foundry.core.logger import Logger
from foundry.core.state import State

NUM_BATCHES = 8
CLIPPING_THRESHOLD = 0.05
TP2 = {"tensor_parallel_degree": 2}
MODELS = {
    "mpt": {"name": "mpt_causal_lm", "d_model": 32, "n_heads": 4, "n_layers": 2, "vocab_size": 64, "max_seq_len": 16,
            "no_bias": True},
    "llama": {
        "name": "llama_causal_lm", "d_model": 32, "n_heads": 4, "kv_n_heads": None, "n_layers": 2, "vocab_size": 64,
        "max_seq_len": 16, "ffn_hidden_size": 64, "rope_theta": 100.0,
    },
    # grouped-query attention as Llama 3 has it: 4 query heads per key/value head, each rank holding one group
    "llama-gqa": {
        "name": "llama_causal_lm", "d_model": 64, "n_heads": 8, "kv_n_heads": 2, "n_layers": 2, "vocab_size": 64,
        "max_seq_len": 16, "ffn_hidden_size": 64, "rope_theta": 100.0,
    },
}  # fmt: skip
LORA = {"peft_config": {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}}  # every block linear adapted
# adapters on a grouped-query Llama (sequence parallel) and on MPT with biases (added after the row-split sum)
MODELS["llama-gqa-lora"] = {**MODELS["llama-gqa"], **LORA}
MODELS["mpt-bias-lora"] = {**MODELS["mpt"], "no_bias": False, **LORA}


def clipped_accumulated_run(
    folder: str, model_keys: dict, parallelism: dict | None, fsdp_config: dict | None = None
) -> dict | None:
    """``NUM_BATCHES`` steps, each of 2 microbatches, every gradient clipped; losses, norms and final weights."""
    from torch.distributed.tensor import DTensor

    from foundry.distributed import get_rank

    clipping = GradientClipping("norm", CLIPPING_THRESHOLD)
    norms: list[float] = []

    class RecordNorm(GradientClipping):  # runs right after the clipping: the norm it measured
        def apply(self, event, state, logger) -> None:  # type: ignore[no-untyped-def]
            norms.append(float(state.grad_norm))

    trainer = build_trainer(
        NUM_BATCHES, folder, fsdp_config, model_keys=model_keys, parallelism=parallelism,
        device_train_microbatch_size=2, algorithms=[clipping, RecordNorm()],
        optimizer_keys={"lr": 1e-3, "weight_decay": 1e-3},
    )  # fmt: skip
    block_tokens: list[int] = []  # the residual stream's length where it enters a block after the first
    trainer.state.model.transformer.blocks[1].register_forward_pre_hook(
        lambda _module, args: block_tokens.append(args[0].shape[1])
    )
    trainer.fit()
    parameters = list(trainer.state.model.parameters())
    held = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in parameters)
    weights = full_weights(trainer.state.model)
    if get_rank() != 0:
        return None
    losses = next(d for d in trainer.logger.destinations if hasattr(d, "losses")).losses
    weights = {name: tensor.detach().clone() for name, tensor in weights.items()}
    held /= sum(p.numel() for p in parameters)
    return {"losses": losses, "norms": norms, "weights": weights, "held": held, "block_tokens": set(block_tokens)}


# Row-parallel layers sum their partial products in another order, so gradients differ by round-off (1e-7);
# Adam's first steps divide each element by its own size, which scales that to about lr x 4e-3 on elements whose
# gradient nearly cancels (MPT's tied embedding): lr 1e-3 keeps that below the 1e-5 compared.
@pytest.mark.parametrize(
    ("family", "sequence_parallel"),
    [
        ("mpt", True),
        ("llama", True),
        ("llama-gqa", True),
        ("llama-gqa", False),
        ("llama-gqa-lora", True),
        ("mpt-bias-lora", False),
    ],
    ids=["mpt", "llama", "llama-gqa", "llama-gqa-without-sp", "llama-gqa-lora", "mpt-bias-lora-without-sp"],
)
def test_tp2_matches_one_rank_over_clipped_accumulated_steps(ranks, family, sequence_parallel, tmp_path):
    one = ranks.run(1, clipped_accumulated_run, str(tmp_path / "one"), MODELS[family], None)[0]
    parallelism = {**TP2, "sequence_parallel": sequence_parallel}
    tp2 = ranks.run(2, clipped_accumulated_run, str(tmp_path / "tp2"), MODELS[family], parallelism)[0]
    assert one["held"] == 1 and 0.5 < tp2["held"] < 0.8  # the blocks' linears split, embeddings and norms whole
    assert tp2["block_tokens"] == {8 if sequence_parallel else 16}  # sequence parallelism: half of 16 tokens
    assert min(one["norms"]) > CLIPPING_THRESHOLD  # every step clipped: the clipped global norm is compared too
    assert tp2["norms"] == pytest.approx(one["norms"], rel=1e-5)
    assert sorted(one["losses"]) == list(range(1, NUM_BATCHES + 1))
    assert_same_run(tp2, one)


@pytest.mark.parametrize("family", ["mpt", "llama-gqa", "llama-gqa-lora"])
@pytest.mark.parametrize(
    ("saved_by", "loaded_by"), [((2, TP2), (1, None)), ((1, None), (2, TP2))], ids=["tp2-to-1", "1-to-tp2"]
)
def test_a_checkpoint_moves_between_tensor_parallel_and_one_rank(ranks, family, saved_by, loaded_by, tmp_path):
    keys = {"model_keys": MODELS[family], "optimizer_keys": {"lr": 1e-3}}  # lr: see above
    uninterrupted = ranks.run(1, train, 6, str(tmp_path / "uninterrupted"), **keys)[0]
    relaunch = {"callbacks": [HandOver("3ba")], "save_folder": str(tmp_path / "ckpt"), "autoresume": True, **keys}
    first = ranks.run(saved_by[0], train, 6, str(tmp_path), parallelism=saved_by[1], **relaunch)[0]
    second = ranks.run(loaded_by[0], train, 6, str(tmp_path), parallelism=loaded_by[1], **relaunch)[0]
    assert (first["batch"], second["batch"]) == (3, 6)
    for step, loss in second["losses"].items():
        assert loss == pytest.approx(uninterrupted["losses"][step], abs=1e-5), step
    for name, weight in uninterrupted["weights"].items():
        torch.testing.assert_close(second["weights"][name], weight, atol=1e-5, rtol=0, msg=name)


def exported_weights(folder: str, model_keys: dict, parallelism: dict | None) -> dict | None:
    """What ``hf_checkpointer`` writes: the full state dict it gathers, on rank 0."""
    from foundry.callbacks.hf_checkpointer import full_state_dict
    from foundry.distributed import get_rank, get_world_size

    trainer = build_trainer(1, folder, model_keys=model_keys, parallelism=parallelism)
    weights = full_state_dict(trainer.state.model, get_world_size())
    return weights if get_rank() == 0 else None


def test_an_export_regroups_grouped_query_parts_as_one_rank_holds_them(ranks, tmp_path):
    one = ranks.run(1, initial_weights, str(tmp_path / "one"), model_keys=MODELS["llama-gqa"])[0]
    tp2 = ranks.run(2, exported_weights, str(tmp_path / "tp2"), MODELS["llama-gqa"], TP2)[0]
    assert tp2.keys() == one.keys()
    for name, weight in one.items():
        torch.testing.assert_close(tp2[name], weight, atol=0, rtol=0, msg=name)


def refusal_of_tokens(folder: str, tokens: int) -> str:
    """The error a forward of one ``tokens``-long sequence through a TP2 sequence-parallel Llama raises."""
    from foundry.errors import TrainingError

    trainer = build_trainer(1, folder, model_keys=MODELS["llama"], parallelism=TP2)
    try:
        trainer.state.model({"input_ids": torch.zeros(1, tokens, dtype=torch.long)})
    except TrainingError as error:
        return str(error)
    return "no error"


def test_sequence_parallelism_refuses_a_sequence_the_degree_does_not_divide(ranks, tmp_path):
    refusals = ranks.run(2, refusal_of_tokens, str(tmp_path), 15)
    assert all("parallelism.sequence_parallel" in refusal and "hold 15 tokens" in refusal for refusal in refusals)


@pytest.mark.parametrize("family", ["mpt", "llama-gqa"])
def test_a_meta_device_model_trains_under_tp2_from_the_weights_one_rank_draws(ranks, family, tmp_path):
    keys = {"model_keys": {**MODELS[family], "init_device": "meta"}, "optimizer_keys": {"lr": 1e-3}}
    one = ranks.run(1, train, 4, str(tmp_path / "one"), **keys)[0]
    tp2 = ranks.run(2, train, 4, str(tmp_path / "tp2"), parallelism=TP2, **keys)[0]
    assert_same_run(tp2, one)


def eval_metrics_of_tagged_samples(folder: str, parallelism: dict | None) -> dict | None:
    """One eval pass over batches whose samples carry their dataset index (as the text loader's eval loaders do)."""
    from foundry.batches import SAMPLE_INDEX_KEY
    from foundry.distributed import get_rank

    degree = (parallelism or {}).get("tensor_parallel_degree", 1)
    batches = rank_batches(2, degree)
    share = len(batches[0]["input_ids"])
    first = (get_rank() // degree) * share
    for number, batch in enumerate(batches):
        batch[SAMPLE_INDEX_KEY] = torch.arange(share) + first + number * GLOBAL_BATCH_SIZE
    trainer = build_trainer(1, folder, model_keys=MODELS["mpt"], parallelism=parallelism, eval_dataloader=batches)
    metrics = trainer.eval()
    return metrics if get_rank() == 0 else None


def test_tp2_eval_counts_each_tagged_sample_once_as_one_rank_does(ranks, tmp_path):
    # tensor-parallel ranks hold the same samples: neither may count the other's as a repeat
    one = ranks.run(1, eval_metrics_of_tagged_samples, str(tmp_path / "one"), None)[0]
    tp2 = ranks.run(2, eval_metrics_of_tagged_samples, str(tmp_path / "tp2"), TP2)[0]
    assert tp2["eval"] == pytest.approx(one["eval"], rel=1e-5)


def refusal_of_python_trainer(folder: str, feature: str) -> str:
    """The error a Python ``Trainer(...)`` under TP2 gives ``feature``, which tensor parallelism does not support."""
    from foundry.callbacks.hf_checkpointer import HFCheckpointer
    from foundry.errors import ConfigError

    try:
        if feature == "icl_tasks":
            icl_tasks = [{"label": "t", "dataset_uri": "t.jsonl", "icl_task_type": "language_modeling"}]
            build_trainer(1, folder, model_keys=MODELS["llama"], parallelism=TP2, icl_tasks=icl_tasks)
        elif feature == "fused_norms":  # fused_kernels' swap, as on a GPU (on a CPU it keeps the PyTorch norms)
            build_trainer(1, folder, model_keys=MODELS["llama"], parallelism=TP2, algorithms=[TritonNorms()])
        elif feature == "blockwise_float8":  # the blockwise recipe's conversion, as on a Hopper GPU
            build_trainer(1, folder, model_keys=FLOAT8_LLAMA, parallelism=TP2, algorithms=[BlockwiseLinears()])
        elif feature == "loader_by_world_rank":  # each rank its own slice: the tp ranks of a group differ
            trainer = build_trainer(1, folder, model_keys=MODELS["llama"], parallelism=TP2)
            trainer.state.train_dataloader = rank_batches(1, tensor_parallel_degree=1)
            trainer.fit()
        else:
            exporter = HFCheckpointer(f"{folder}/hf", "1ba")
            keys = {"model_keys": MODELS["llama-gqa-lora"], "parallelism": TP2, "callbacks": [exporter]}
            build_trainer(1, folder, **keys).fit()
    except ConfigError as error:
        return str(error)
    return "no error"


class TritonNorms(Algorithm):
    """What algorithms.fused_kernels does to the norms at INIT where its kernels run."""

    def match(self, event: Event, state: State) -> bool:
        return event == Event.INIT

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        _swap_norms(state.model, want_rms=True, want_layernorm=True)


class BlockwiseLinears(Algorithm):
    """What algorithms.float8's blockwise recipe does to the middle block's linears at INIT on a Hopper GPU."""

    def match(self, event: Event, state: State) -> bool:
        return event == Event.INIT

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        from foundry.algorithms.float8 import BlockwiseFloat8Linear

        for linear in (state.model.transformer.blocks[1].ffn.up_proj, state.model.transformer.blocks[1].ffn.down_proj):
            BlockwiseFloat8Linear.convert(linear)


@pytest.mark.parametrize(
    ("feature", "named"),
    [
        ("icl_tasks", "icl_tasks"),
        ("adapters", "hf_checkpointer"),
        ("fused_norms", "sequence_parallel"),
        ("blockwise_float8", "blockwise"),
        ("loader_by_world_rank", "replication=2"),
    ],
)
def test_a_python_trainer_under_tp2_refuses_what_tp_does_not_support(ranks, tmp_path, feature, named):
    if feature == "blockwise_float8":
        pytest.importorskip("torchao")
    refusals = ranks.run(2, refusal_of_python_trainer, str(tmp_path), feature)
    assert all("tensor_parallel_degree" in refusal and " is 2" in refusal and named in refusal for refusal in refusals)


def test_float8_under_tp2_computes_the_forward_one_rank_does(ranks, tmp_path):
    # Weight scales come from each whole weight (FSDP2 gathers them in float8), so the first step's loss is one
    # rank's; the next differs by less than float8's own rounding (the fused query/key/value projection's output
    # gradient is scaled per rank's heads, a finer scale than one rank's).
    skip_without_cpu_float8()
    tp2_sp = {**TP2, "sequence_parallel": True}
    exact = ranks.run(1, train_float8, str(tmp_path / "fp32"), False)[0]
    one = ranks.run(1, train_float8, str(tmp_path / "one"), True)[0]
    tp2 = ranks.run(2, train_float8, str(tmp_path / "tp2"), True, parallelism=tp2_sp)[0]
    linears = ("attn.Wqkv", "attn.out_proj", "ffn.up_proj", "ffn.gate_proj", "ffn.down_proj")
    assert tp2["float8"] == one["float8"] == sorted(f"transformer.blocks.{b}.{n}" for b in range(3) for n in linears)
    assert abs(one["losses"][1] - exact["losses"][1]) > 1e-4  # float8 rounds: the comparison below can fail
    assert tp2["losses"][1] == pytest.approx(one["losses"][1], abs=1e-6)
    float8_rounding = abs(one["losses"][2] - exact["losses"][2])
    assert abs(tp2["losses"][2] - one["losses"][2]) < float8_rounding / 2
    compiled = ranks.run(2, train_float8, str(tmp_path / "compiled"), True, True, parallelism=tp2_sp)[0]
    assert compiled["losses"] == pytest.approx(tp2["losses"], abs=1e-6)  # Wqkv's float8 forward traces as it runs
