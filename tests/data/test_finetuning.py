"""The finetuning loader: rows, labels, chat templates, truncation counts and bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from foundry import registry
from foundry.batches import IGNORE_INDEX
from foundry.data import build_finetuning_dataloader, load_tokenizer
from foundry.data.chat import render_plain_chat
from foundry.errors import ConfigError, DataError

SEQ = 32


def write_rows(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def build(tokenizer: Any, path: Path, **dataset: Any) -> Any:
    return build_finetuning_dataloader(
        tokenizer=tokenizer, device_batch_size=dataset.pop("batch_size", 1), dataset={
            "hf_name": str(path), "max_seq_len": dataset.pop("max_seq_len", SEQ), **dataset
        },
    )  # fmt: skip


def ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_finetuning_is_registered_as_a_dataloader() -> None:
    assert registry.dataloaders.get("finetuning") is build_finetuning_dataloader


def test_response_only_labels_mask_exactly_the_prompt_tokens(tmp_path: Path, tiny_tokenizer: Any) -> None:
    path = write_rows(tmp_path / "train.jsonl", [{"prompt": "The quick fox", "response": " jumps over"}])
    batch = next(iter(build(tiny_tokenizer, path)))
    prompt, response = ids(tiny_tokenizer, "The quick fox"), ids(tiny_tokenizer, " jumps over")
    example = prompt + response + [tiny_tokenizer.eos_token_id]
    expected_labels = [IGNORE_INDEX] * len(prompt) + response + [tiny_tokenizer.eos_token_id]
    expected_labels += [IGNORE_INDEX] * (SEQ - len(example))
    assert batch["input_ids"][0, : len(example)].tolist() == example
    assert batch["labels"][0].tolist() == expected_labels
    assert batch["attention_mask"][0].sum().item() == len(example)


def test_target_prompts_all_trains_on_the_prompt_but_not_the_first_token(tmp_path: Path, tiny_tokenizer: Any) -> None:
    path = write_rows(tmp_path / "train.jsonl", [{"prompt": "The quick fox", "response": " jumps"}])
    batch = next(iter(build(tiny_tokenizer, path, target_prompts="all")))
    used = int(batch["attention_mask"][0].sum())
    assert batch["labels"][0, 0].item() == IGNORE_INDEX  # nothing predicts an example's first token
    assert batch["labels"][0, 1:used].tolist() == batch["input_ids"][0, 1:used].tolist()


@pytest.mark.parametrize(("target_responses", "first_answer_trained"), [("last", False), ("all", True)])
def test_target_responses_picks_which_chat_answers_are_trained(
    tmp_path: Path, tiny_tokenizer: Any, target_responses: str, first_answer_trained: bool
) -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "one"},
        {"role": "user", "content": "More"},
        {"role": "assistant", "content": "two"},
    ]
    path = write_rows(tmp_path / "train.jsonl", [{"messages": messages}])
    batch = next(iter(build(tiny_tokenizer, path, target_responses=target_responses, max_seq_len=128)))
    trained = tiny_tokenizer.decode([t for t in batch["labels"][0].tolist() if t != IGNORE_INDEX])
    assert trained.startswith("one") == first_answer_trained
    assert "two" in trained


def test_chat_rows_use_the_tokenizers_chat_template(tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_tokenizer_dir))
    tokenizer.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    path = write_rows(tmp_path / "train.jsonl", [{"messages": [{"role": "user", "content": "Hi"}, {
        "role": "assistant", "content": "Hello"}]}])  # fmt: skip
    batch = next(iter(build(tokenizer, path)))
    used = int(batch["attention_mask"][0].sum())
    assert tokenizer.decode(batch["input_ids"][0, :used]) == "[user]Hi[assistant]Hello" + tokenizer.eos_token
    trained = [t for t in batch["labels"][0].tolist() if t != IGNORE_INDEX]
    assert tokenizer.decode(trained) == "Hello" + tokenizer.eos_token


def test_chat_rows_without_a_template_use_the_plain_template(tmp_path: Path, tiny_tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    path = write_rows(tmp_path / "train.jsonl", [{"messages": messages}])
    batch = next(iter(build(tiny_tokenizer, path, max_seq_len=128)))
    used = int(batch["attention_mask"][0].sum())
    assert tiny_tokenizer.decode(batch["input_ids"][0, :used]) == render_plain_chat(messages, False) + "<|endoftext|>"


def test_truncation_and_drops_are_counted(tmp_path: Path, tiny_tokenizer: Any) -> None:
    long_text = " word" * 40
    rows = [
        {"prompt": "Short", "response": " fine"},
        {"prompt": "Short", "response": long_text},  # truncated, still has targets
        {"prompt": long_text, "response": " late"},  # the prompt fills max_seq_len: nothing to train on
        {"prompt": "Short", "response": "  "},  # empty response
    ]
    loader = build(tiny_tokenizer, write_rows(tmp_path / "train.jsonl", rows))
    counts = loader.counts
    assert (counts.rows, counts.kept, counts.truncated) == (4, 2, 1)
    assert (counts.dropped_no_targets, counts.dropped_empty, counts.dropped_too_long) == (1, 1, 0)


def test_truncation_drop_counts_examples_that_do_not_fit(tmp_path: Path, tiny_tokenizer: Any) -> None:
    rows = [{"prompt": "Short", "response": " fine"}, {"prompt": "Short", "response": " word" * 40}]
    loader = build(tiny_tokenizer, write_rows(tmp_path / "train.jsonl", rows), truncation="drop")
    assert (loader.counts.kept, loader.counts.dropped_too_long, loader.counts.truncated) == (1, 1, 0)


def test_truncation_keep_end_keeps_the_response_of_a_long_prompt(tmp_path: Path, tiny_tokenizer: Any) -> None:
    rows = [{"prompt": " word" * 40, "response": " late"}]
    batch = next(iter(build(tiny_tokenizer, write_rows(tmp_path / "train.jsonl", rows), truncation="keep_end")))
    trained = [t for t in batch["labels"][0].tolist() if t != IGNORE_INDEX]
    assert trained == [*ids(tiny_tokenizer, " late"), tiny_tokenizer.eos_token_id]
    assert batch["attention_mask"][0].all()


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt": "a", "response": ', r"not valid JSON"),
        ('{"question": "a", "response": "b"}', r"a row needs 'prompt' and 'response'.*'question'"),
        ('{"prompt": "a", "response": 3}', r"'response' must be a string, got int"),
        ('{"messages": [{"role": "user", "content": "a"}]}', r"'messages' must be a list of at least two"),
        ('{"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}', r".*role 'bot'"),
    ],
)  # fmt: skip
def test_malformed_rows_name_the_file_and_line(tmp_path: Path, tiny_tokenizer: Any, line: str, message: str) -> None:
    path = tmp_path / "train.jsonl"
    path.write_text('{"prompt": "ok", "response": "fine"}\n' + line + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=rf"{path.name}:2: {message}"):
        build(tiny_tokenizer, path)


def test_hub_dataset_names_are_refused_with_an_export_recipe(tiny_tokenizer: Any) -> None:
    with pytest.raises(ConfigError, match=r"'mosaicml/dolly_hhrlhf', a Hugging Face Hub dataset.*to_json"):
        build(tiny_tokenizer, Path("mosaicml/dolly_hhrlhf"), split="train")


@pytest.mark.parametrize("ratio", [0.5, "fast"])
def test_packing_ratio_below_one_or_unknown_is_refused(tmp_path: Path, tiny_tokenizer: Any, ratio: Any) -> None:
    path = write_rows(tmp_path / "train.jsonl", [{"prompt": "a", "response": "b"}])
    with pytest.raises(ConfigError, match=r"'train_loader\.dataset\.packing_ratio' is .*a number >= 1.*'auto'"):
        build(tiny_tokenizer, path, packing_ratio=ratio)


def test_llm_foundry_json_form_reads_the_split_file(tmp_path: Path, tiny_tokenizer: Any) -> None:
    write_rows(tmp_path / "train.jsonl", [{"prompt": "a", "response": "b"}] * 3)
    write_rows(tmp_path / "test.jsonl", [{"prompt": "a", "response": "b"}] * 2)
    loader = build_finetuning_dataloader(
        tokenizer=tiny_tokenizer, device_batch_size=1, dataset={
            "hf_name": "json", "hf_kwargs": {"data_dir": str(tmp_path)}, "split": "test", "max_seq_len": SEQ,
        },
    )  # fmt: skip
    assert loader.counts.rows == 2


def test_mds_prompt_response_columns_are_read(tmp_path: Path, tiny_tokenizer: Any) -> None:
    from streaming import MDSWriter

    with MDSWriter(out=str(tmp_path / "train"), columns={"prompt": "str", "response": "str"}) as writer:
        for index in range(3):
            writer.write({"prompt": f"Question {index}", "response": " answer"})
    loader = build_finetuning_dataloader(
        tokenizer=tiny_tokenizer, device_batch_size=3, dataset={
            "local": str(tmp_path), "split": "train", "max_seq_len": SEQ,
        },
    )  # fmt: skip
    batch = next(iter(loader))
    assert [tiny_tokenizer.decode(row[row != IGNORE_INDEX]) for row in batch["labels"]] == [" answer<|endoftext|>"] * 3
    texts = [tiny_tokenizer.decode(row[mask.bool()]) for row, mask in zip(batch["input_ids"], batch["attention_mask"])]
    assert texts == [f"Question {index} answer<|endoftext|>" for index in range(3)]


def test_mds_pretokenized_turns_are_read_and_bad_ones_named(tmp_path: Path, tiny_tokenizer: Any) -> None:
    from streaming import MDSWriter

    with MDSWriter(out=str(tmp_path / "train"), columns={"turns": "json"}) as writer:
        writer.write({"turns": [{"input_ids": [5, 6, 7], "labels": [8, 9]}]})
        writer.write({"turns": [{"input_ids": [5, 6]}]})
    with MDSWriter(out=str(tmp_path / "val"), columns={"turns": "json"}) as writer:
        writer.write({"turns": [{"input_ids": [5, 6, 7], "labels": [8, 9]}]})
    dataset = {"local": str(tmp_path), "split": "val", "max_seq_len": SEQ}
    batch = next(iter(build_finetuning_dataloader(tokenizer=tiny_tokenizer, device_batch_size=1, dataset=dataset)))
    eos = tiny_tokenizer.eos_token_id
    assert batch["input_ids"][0, :6].tolist() == [5, 6, 7, 8, 9, eos]
    assert batch["labels"][0, :6].tolist() == [IGNORE_INDEX] * 3 + [8, 9, eos]
    dataset["split"] = "train"
    with pytest.raises(DataError, match=r"\(split 'train'\) sample 1: 'turns' must be a list of \{input_ids, labels\}"):
        build_finetuning_dataloader(tokenizer=tiny_tokenizer, device_batch_size=1, dataset=dataset)


@pytest.mark.parametrize(
    ("preprocessing_fn", "row"),
    [
        ({"prompt": "question", "response": "answer"}, {"question": "Hi", "answer": " there"}),
        ("builtins:dict", {"prompt": "Hi", "response": " there"}),  # an import path, called on each row
    ],
)
def test_preprocessing_fn_maps_rows_before_reading_them(
    tmp_path: Path, tiny_tokenizer: Any, preprocessing_fn: Any, row: dict[str, str]
) -> None:
    path = write_rows(tmp_path / "train.jsonl", [row])
    batch = next(iter(build(tiny_tokenizer, path, preprocessing_fn=preprocessing_fn)))
    trained = [t for t in batch["labels"][0].tolist() if t != IGNORE_INDEX]
    assert trained == [*ids(tiny_tokenizer, " there"), tiny_tokenizer.eos_token_id]


def test_unimportable_preprocessing_fn_is_named(tmp_path: Path, tiny_tokenizer: Any) -> None:
    path = write_rows(tmp_path / "train.jsonl", [{"prompt": "a", "response": "b"}])
    with pytest.raises(ConfigError, match=r"'train_loader\.dataset\.preprocessing_fn' is 'my\.module:fn'.*import"):
        build(tiny_tokenizer, path, preprocessing_fn="my.module:fn")


def test_tensor_parallel_ranks_load_the_same_rows(tmp_path: Path, tiny_tokenizer: Any, monkeypatch) -> None:
    path = write_rows(tmp_path / "rows.jsonl", [{"prompt": f"q{i}", "response": f"a{i}"} for i in range(8)])

    def first_batches(rank: int, world_size: int, replication: int) -> list[list[list[int]]]:
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(world_size))
        loader = build_finetuning_dataloader(
            tokenizer=tiny_tokenizer, device_batch_size=2, replication=replication,
            dataset={"hf_name": str(path), "max_seq_len": SEQ, "shuffle": False},
        )  # fmt: skip
        return [batch["input_ids"].tolist() for batch in loader]

    # 4 ranks, tensor-parallel pairs: ranks 0 and 1 load what rank 0 of 2 loads, ranks 2 and 3 what rank 1 does
    assert first_batches(0, 4, 2) == first_batches(1, 4, 2) == first_batches(0, 2, 1)
    assert first_batches(2, 4, 2) == first_batches(3, 4, 2) == first_batches(1, 2, 1)
    assert first_batches(0, 2, 1) != first_batches(1, 2, 1)
