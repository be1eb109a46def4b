"""The one token stream every row of benchmarks/peers.py reads, prepared here and copied to the GPU machine.

    python benchmarks/peers.py prepare --corpus CORPUS/*.txt --tokenizer TOKENIZER_DIR --out data/peers

From the corpus tokenized with gpt-neox-20b into 2048-token samples (``foundry data convert``), in one order:

- ``mds/``: MDS shards (``tokens`` as int32), read by foundry and by LLM Foundry through StreamingDataset;
- ``mds-65536/``: the same train tokens in the same order cut into 65,536-token samples, for the long-context
  rows (``run`` builds it under its work folder from ``tokens.bin`` where a prepared folder lacks it);
- ``tokens.bin``: the same train samples as a flat uint16 array, read by the Hugging Face Trainer row;
- ``text/train.jsonl``: each of those samples decoded back to text, one ``{"text": ...}`` line each, which
  torchtitan's own loader tokenizes again with the same tokenizer (adding its BOS/EOS per line);
- ``tokenizer/``: the tokenizer directory, and ``llm-foundry/``: LLM Foundry's own YAMLs, because the
  machine that runs the rows sees only the repository.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

SEQ_LEN = 2048
LONG_SEQ_LENS = (65536,)
LLM_FOUNDRY_YAMLS = ("mpt-1b.yaml", "mpt-small-cpu.yaml")


def prepare(corpus: list[str], tokenizer_dir: str, samples: int, llm_foundry_yamls: Path, out: Path) -> dict:
    """Write the four forms of the token stream under ``out``; returns what was written (also ``manifest.json``)."""
    from default_path import build_data  # imports foundry: only where the data is made, not where rows read it

    out.mkdir(parents=True, exist_ok=True)
    shutil.copytree(tokenizer_dir, out / "tokenizer", dirs_exist_ok=True)
    build_data(corpus, str(out / "tokenizer"), samples, out / "mds")
    train = read_mds_tokens(out / "mds" / "train")  # (samples, SEQ_LEN)
    train.astype(np.uint16).tofile(out / "tokens.bin")
    write_text(train, out / "tokenizer", out / "text" / "train.jsonl")
    long_samples = {seq_len: write_long_samples(out / "tokens.bin", seq_len, out / f"mds-{seq_len}")
                    for seq_len in LONG_SEQ_LENS}  # fmt: skip
    (out / "llm-foundry").mkdir(exist_ok=True)
    for name in LLM_FOUNDRY_YAMLS:
        shutil.copy(llm_foundry_yamls / name, out / "llm-foundry" / name)
    manifest = {"samples": int(train.shape[0]), "seq_len": SEQ_LEN, "tokens": int(train.size),
                "long_samples": long_samples,
                "corpus": [Path(path).name for path in corpus], "tokenizer": Path(tokenizer_dir).name}  # fmt: skip
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


def read_mds_tokens(split_dir: Path) -> np.ndarray:
    """Every sample of an MDS split, in stored order, as one (samples, seq_len) int64 array."""
    from streaming import LocalDataset

    dataset = LocalDataset(local=str(split_dir))
    return np.stack([np.asarray(dataset[index]["tokens"], dtype=np.int64) for index in range(len(dataset))])


def read_token_file(path: Path, seq_len: int = SEQ_LEN) -> np.ndarray:
    """``tokens.bin`` as (samples, seq_len) uint16, memory-mapped."""
    flat = np.memmap(path, dtype=np.uint16, mode="r")
    return flat[: len(flat) // seq_len * seq_len].reshape(-1, seq_len)


def write_long_samples(tokens_path: Path, seq_len: int, out: Path) -> int:
    """``tokens.bin`` cut into ``seq_len``-token samples, as MDS under ``out/train``; returns how many.

    The 2048-token samples are consecutive pieces of one stream (documents joined by EOS), so joined again in
    their stored order they are that stream, and the long rows train on the tokens the 2048-token rows do.
    """
    from foundry.data.convert import SHARD_HASH
    from foundry.data.mds import import_streaming
    from foundry.errors import DataError

    samples = read_token_file(tokens_path, seq_len)  # (samples, seq_len)
    if len(samples) == 0:
        raise DataError(f"{tokens_path} holds fewer than {seq_len} tokens: run `peers.py prepare` with more --samples.")
    writer = import_streaming("benchmarks/peers.py").MDSWriter
    columns = {"tokens": "ndarray:int32"}
    with writer(out=str(out / "train"), columns=columns, hashes=[SHARD_HASH], exist_ok=True) as mds:
        for sample in samples:
            mds.write({"tokens": sample.astype(np.int32)})
    return len(samples)


def write_text(samples: np.ndarray, tokenizer_dir: Path, path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as file:
        for sample in samples:
            file.write(json.dumps({"text": tokenizer.decode(sample.tolist())}) + "\n")
