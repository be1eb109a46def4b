"""ICL eval on 2 gloo ranks (replicated and FSDP-sharded) gives exactly the accuracies of one rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import ByteTokenizer

ROWS = [{"query": f"q{i} {'z' * (i % 5)}", "choices": ["ab", "ba", "bb"], "gold": i % 3} for i in range(11)]


def evaluate(data_dir: str, fsdp: bool) -> dict:
    from foundry import distributed
    from foundry.distributed.config import FSDPConfig
    from foundry.eval.evaluator import ICLEvaluator
    from foundry.eval.task_config import parse_icl_tasks
    from foundry.models import MPTCausalLM

    path = Path(data_dir) / "mc.jsonl"
    if distributed.get_rank() == 0:
        path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    distributed.barrier()
    torch.manual_seed(0)
    model = MPTCausalLM(d_model=32, n_heads=2, n_layers=2, vocab_size=257, max_seq_len=64)
    if fsdp:
        distributed.parallelize(model, FSDPConfig(), torch.device("cpu"), "fp32")
    tasks = parse_icl_tasks(
        [{"label": "mc", "dataset_uri": str(path), "icl_task_type": "multiple_choice", "num_fewshot": [0, 2]}]
    )
    return ICLEvaluator(tasks, ByteTokenizer(), seq_len=64, batch_size=6).evaluate(model)


@pytest.fixture(scope="module")
def one_rank(ranks, tmp_path_factory) -> dict:
    return ranks.run(1, evaluate, str(tmp_path_factory.mktemp("one")), False)[0]


@pytest.mark.parametrize("fsdp", [False, True], ids=["replicated", "fsdp"])
def test_two_ranks_give_the_accuracy_of_one(ranks, one_rank, tmp_path, fsdp) -> None:
    results = ranks.run(2, evaluate, str(tmp_path), fsdp)
    assert results[0] == results[1] == one_rank
