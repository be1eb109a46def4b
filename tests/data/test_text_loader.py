from __future__ import annotations

import multiprocessing
import multiprocessing.synchronize
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from streaming import MDSWriter

from foundry import registry
from foundry.batches import IGNORE_INDEX
from foundry.data import build_text_dataloader
from foundry.errors import ConfigError, DataError

SEQ = 8


def write_tokens(local: Path, num_samples: int, split: str = "train", seq: int = SEQ) -> None:
    """Sample i holds tokens [i*seq, (i+1)*seq), so order and content are easy to check."""
    with MDSWriter(out=str(local / split), columns={"tokens": "ndarray:int32"}) as writer:
        for i in range(num_samples):
            writer.write({"tokens": np.arange(i * seq, (i + 1) * seq, dtype=np.int32)})


def token_dataset(local: Path, **overrides) -> dict:
    return {"local": str(local), "split": "train", "max_seq_len": SEQ, "shuffle": False, **overrides}


def test_text_is_registered_as_a_dataloader() -> None:
    assert registry.dataloaders.get("text") is build_text_dataloader


def test_tokens_are_read_back_in_order(tmp_path: Path, make_loader) -> None:
    write_tokens(tmp_path, 6)
    batches = list(make_loader(dataset=token_dataset(tmp_path), device_batch_size=2))
    assert [set(batch) for batch in batches] == [{"input_ids"}] * 3
    assert torch.equal(torch.cat([batch["input_ids"] for batch in batches]).flatten(), torch.arange(6 * SEQ))
    assert batches[0]["input_ids"].dtype == torch.int64


def test_max_seq_len_truncates_stored_samples(tmp_path: Path, make_loader) -> None:
    write_tokens(tmp_path, 2)
    (batch,) = make_loader(dataset=token_dataset(tmp_path, max_seq_len=3))
    assert batch["input_ids"].tolist() == [[0, 1, 2], [8, 9, 10]]


def test_max_seq_len_longer_than_stored_samples_is_explained(tmp_path: Path, make_loader) -> None:
    write_tokens(tmp_path, 2)
    with pytest.raises(ConfigError, match=r"'train_loader\.dataset\.max_seq_len' is 16.*hold 8 tokens"):
        make_loader(dataset=token_dataset(tmp_path, max_seq_len=16))


def test_legacy_int64_bytes_tokens_are_read(tmp_path: Path, make_loader) -> None:
    with MDSWriter(out=str(tmp_path / "train"), columns={"tokens": "bytes"}) as writer:
        writer.write({"tokens": np.arange(SEQ, dtype=np.int64).tobytes()})
    (batch,) = make_loader(dataset=token_dataset(tmp_path), device_batch_size=1)
    assert batch["input_ids"].tolist() == [list(range(SEQ))]


def test_text_column_is_tokenized_and_right_padded(tmp_path: Path, make_loader, tiny_tokenizer) -> None:
    texts = ["short", "a considerably longer text that needs truncation at max_seq_len tokens"]
    with MDSWriter(out=str(tmp_path / "train"), columns={"text": "str"}) as writer:
        for text in texts:
            writer.write({"text": text})
    (batch,) = make_loader(tokenizer=tiny_tokenizer, dataset=token_dataset(tmp_path))
    short_ids = tiny_tokenizer("short")["input_ids"]
    n = len(short_ids)
    assert batch["input_ids"][0, :n].tolist() == short_ids
    assert batch["attention_mask"].tolist() == [[1] * n + [0] * (SEQ - n), [1] * SEQ]
    assert batch["labels"][0].tolist() == short_ids + [IGNORE_INDEX] * (SEQ - n)
    assert torch.equal(batch["labels"][1], batch["input_ids"][1])
    assert batch["input_ids"][1].tolist() == tiny_tokenizer(texts[1])["input_ids"][:SEQ]


def test_text_column_without_tokenizer_is_explained(tmp_path: Path, make_loader) -> None:
    with MDSWriter(out=str(tmp_path / "train"), columns={"text": "str"}) as writer:
        writer.write({"text": "hello"})
    with pytest.raises(ConfigError, match="needs a tokenizer"):
        make_loader(dataset=token_dataset(tmp_path))


def test_missing_local_folder_names_path_split_and_fix(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(DataError, match="foundry data convert") as error:
        build_text_dataloader(tokenizer=None, device_batch_size=2, dataset=token_dataset(missing))
    assert str(missing) in str(error.value) and "split 'train'" in str(error.value)


def test_missing_split_lists_the_existing_splits(tmp_path: Path) -> None:
    write_tokens(tmp_path, 2, split="train")
    write_tokens(tmp_path, 2, split="val")
    with pytest.raises(DataError, match="Splits in .*: train, val"):
        build_text_dataloader(tokenizer=None, device_batch_size=2, dataset=token_dataset(tmp_path, split="test"))


def test_dataset_key_typo_suggests_the_right_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'eval_loader\.dataset\.shufle'.*Did you mean 'shuffle'"):
        build_text_dataloader(
            tokenizer=None, device_batch_size=2, dataset=token_dataset(tmp_path, shufle=True), key_path="eval_loader"
        )


def test_sequence_id_keys_are_rejected_with_reason(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="eos_token_id.*sequence_id"):
        build_text_dataloader(tokenizer=None, device_batch_size=2, dataset=token_dataset(tmp_path, eos_token_id=0))


def test_state_dict_resumes_mid_epoch(tmp_path: Path, make_loader) -> None:
    write_tokens(tmp_path, 12)
    dataset = token_dataset(tmp_path, shuffle=True, shuffle_seed=5)
    full_epoch = [batch["input_ids"] for batch in make_loader(dataset=dataset)]
    loader = make_loader(dataset=dataset)
    batches = iter(loader)
    first_two = [next(batches)["input_ids"] for _ in range(2)]
    state = loader.state_dict()
    resumed = make_loader(dataset=dataset)
    resumed.load_state_dict(state)
    rest = [batch["input_ids"] for batch in resumed]
    assert len(rest) == len(full_epoch) - 2
    assert all(torch.equal(a, b) for a, b in zip(first_two + rest, full_epoch, strict=True))


def test_state_after_a_full_epoch_resumes_at_the_next_epoch(tmp_path: Path, make_loader) -> None:
    write_tokens(tmp_path, 8)
    dataset = token_dataset(tmp_path, shuffle=True, shuffle_seed=5)
    loader = make_loader(dataset=dataset)
    list(loader)
    state = loader.state_dict()
    second_epoch = [batch["input_ids"] for batch in loader]
    resumed = make_loader(dataset=dataset)
    resumed.load_state_dict(state)
    resumed_epoch = [batch["input_ids"] for batch in resumed]
    assert all(torch.equal(a, b) for a, b in zip(resumed_epoch, second_epoch, strict=True))


def test_worker_process_yields_the_same_batches(tmp_path: Path, make_loader) -> None:
    write_tokens(tmp_path, 4)
    in_process = [batch["input_ids"] for batch in make_loader(dataset=token_dataset(tmp_path))]
    with_worker = [batch["input_ids"] for batch in make_loader(dataset=token_dataset(tmp_path), num_workers=1)]
    assert all(torch.equal(a, b) for a, b in zip(in_process, with_worker, strict=True))


def test_close_releases_shared_memory_and_lock_files(tmp_path: Path) -> None:
    write_tokens(tmp_path, 2)
    loader = build_text_dataloader(tokenizer=None, device_batch_size=2, dataset=token_dataset(tmp_path))
    list(loader)
    loader.load_state_dict(loader.state_dict())  # also allocates the resume block
    prefix = f"{loader.dataset._shm_prefix_int:06}_"
    assert any(name.startswith(prefix) for name in os.listdir("/dev/shm"))
    loader.dataset.close()
    assert not [name for name in os.listdir("/dev/shm") if name.startswith(prefix)]
    assert not [name for name in os.listdir(tempfile.gettempdir()) if name.startswith(prefix)]


def _read_first_batch(local: str, barrier: multiprocessing.synchronize.Barrier, results: multiprocessing.Queue) -> None:
    barrier.wait()  # every process builds its loader at the same instant, as runs launched together do
    try:
        loader = build_text_dataloader(dataset=token_dataset(Path(local)), tokenizer=None, device_batch_size=2)
        try:
            results.put(next(iter(loader))["input_ids"].shape[0])
        finally:
            loader.dataset.close()
    except BaseException as error:  # reported to the test: a traceback in a child would pass unnoticed
        results.put(f"{type(error).__name__}: {error}")


@pytest.mark.slow
def test_runs_that_start_at_once_on_one_folder_all_read_it(tmp_path: Path) -> None:
    write_tokens(tmp_path, num_samples=8)
    processes = 3  # more than this machine's 2 cores: they contend as a node's ranks do
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(processes), context.Queue()
    children = [
        context.Process(target=_read_first_batch, args=(str(tmp_path), barrier, results)) for _ in range(processes)
    ]
    for child in children:
        child.start()
    outcomes = [results.get(timeout=300) for _ in children]
    for child in children:
        child.join(timeout=60)
    assert outcomes == [2] * processes
