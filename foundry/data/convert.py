"""``foundry data convert``: text files → train/val MDS datasets that foundry and LLM Foundry both read.

Inputs: ``.txt`` files (each file is one document), ``.jsonl`` files (one document per row, in its
``text`` field), or folders of those (searched recursively, in sorted order). No inputs means the
builtin corpus (Python's help topics).

Output, with the columns of LLM Foundry's converters::

    out/train/, out/val/   MDS datasets; column `tokens` (ndarray:int32) with --concat-tokens N,
                           else column `text` (str)
    out/tokenizer/         the BPE tokenizer trained on the train split, when --concat-tokens is given
                           without --tokenizer

The split is by text: val holds the last ``eval_fraction`` of all characters (cut at a line break
where the document has one), so even a single large file (one document) gets both splits.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tqdm import tqdm

from foundry.data.corpus import builtin_corpus_documents, builtin_instruction_rows
from foundry.data.jsonl import read_jsonl
from foundry.data.mds import import_streaming
from foundry.data.tokenizer import load_tokenizer, train_bpe_tokenizer
from foundry.errors import ConfigError, DataError, did_you_mean

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SUFFIXES = (".txt", ".jsonl")
SHARD_HASH = "xxh3_64"


@dataclass(frozen=True)
class SplitSummary:
    """What one split holds; ``tokens`` is None for a raw-text dataset."""

    documents: int
    samples: int
    tokens: int | None


@dataclass(frozen=True)
class ConversionSummary:
    out_dir: Path
    column: str  # "tokens" or "text"
    splits: dict[str, SplitSummary] = field(default_factory=dict)
    tokenizer_path: str | None = None

    def __str__(self) -> str:
        lines = [f"Wrote MDS dataset '{self.out_dir}' (column '{self.column}'):"]
        for name, split in self.splits.items():
            tokens = f", {split.tokens:,} tokens" if split.tokens is not None else ""
            lines.append(f"  {name}: {split.documents:,} documents -> {split.samples:,} samples{tokens}")
        if self.tokenizer_path:
            lines.append(f"  tokenizer: {self.tokenizer_path}  (set tokenizer.name to this path)")
        return "\n".join(lines)


def convert_to_mds(
    inputs: Sequence[Path] | None,
    out_dir: Path,
    *,
    tokenizer: str | None = None,
    max_seq_len: int | None = None,
    concat_tokens: bool = True,
    eval_fraction: float = 0.05,
    vocab_size: int = 8192,
    compression: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> ConversionSummary:
    """Convert documents to ``out_dir/{train,val}`` MDS datasets, atomically.

    Everything is written to a hidden folder beside ``out_dir`` and renamed into place at the end,
    so an interrupted conversion never leaves a dataset that looks complete.

    Args:
        inputs: .txt/.jsonl files or folders; None converts the builtin corpus.
        tokenizer: tokenizer directory (or Hub id) for ``concat_tokens``; None trains a BPE one.
        max_seq_len: tokens per sample with ``concat_tokens``.
        concat_tokens: tokenize, join documents with eos, and cut exactly ``max_seq_len``-token
            samples (the remainder is dropped); otherwise store each document as raw ``text``.
        eval_fraction: share of the text (by characters) that goes to ``val``; 0 writes no val split.
        vocab_size: vocabulary of the trained tokenizer.
        compression: MDS shard compression (e.g. 'zstd'), or None.
    """
    _check_options(tokenizer, max_seq_len, concat_tokens, eval_fraction, compression)
    out_dir = Path(out_dir)
    _check_out_dir(out_dir, overwrite)
    documents = builtin_corpus_documents() if inputs is None else read_documents(inputs)
    if not documents:
        names = ", ".join(str(path) for path in (inputs or [])[:3])
        raise DataError(
            f"The inputs ({names}{', ...' if len(inputs or []) > 3 else ''}) hold no text: every file is empty or "
            'whitespace (a .jsonl needs rows with a non-empty "text" field), so there is nothing to convert and '
            "no dataset was written. Pass files that hold documents."
        )
    train_documents, val_documents = split_documents(documents, eval_fraction)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    partial_dir = _fresh_sibling(out_dir, "partial")
    try:
        summary = _write_dataset(
            partial_dir,
            out_dir,
            {"train": train_documents, "val": val_documents},
            tokenizer,
            max_seq_len if concat_tokens else None,
            vocab_size,
            compression,
            progress,
        )
        _publish(partial_dir, out_dir, overwrite)
    except BaseException:  # KeyboardInterrupt too: never leave the partial folder behind
        shutil.rmtree(partial_dir, ignore_errors=True)
        raise
    return summary


def read_documents(inputs: Sequence[Path]) -> list[str]:
    """Documents of ``inputs`` in order: a .txt file is one document, a .jsonl row's ``text`` is one."""
    documents = []
    for path in _input_files(inputs):
        documents.extend(_read_jsonl(path) if path.suffix == ".jsonl" else [_read_text(path)])
    return [document for document in documents if document.strip()]


def split_documents(documents: Sequence[str], eval_fraction: float) -> tuple[list[str], list[str]]:
    """Train gets the first ``1 - eval_fraction`` of the characters, val the rest.

    The document that straddles the boundary is cut after its last line break before the boundary
    (or at the boundary itself when it has none there).
    """
    train_chars = round(sum(map(len, documents)) * (1 - eval_fraction))
    train, val = [], []
    seen_chars = 0
    for document in documents:
        cut = min(max(train_chars - seen_chars, 0), len(document))
        if 0 < cut < len(document):
            newline = document.rfind("\n", 0, cut)
            cut = cut if newline == -1 else newline + 1
        train.extend([document[:cut]] if cut > 0 else [])
        val.extend([document[cut:]] if cut < len(document) else [])
        seen_chars += len(document)
    return train, val


def _write_dataset(
    partial_dir: Path,
    out_dir: Path,
    documents_by_split: dict[str, list[str]],
    tokenizer_name: str | None,
    max_seq_len: int | None,
    vocab_size: int,
    compression: str | None,
    progress: bool,
) -> ConversionSummary:
    column = "text" if max_seq_len is None else "tokens"
    tokenizer, tokenizer_path = None, None
    if column == "tokens" and tokenizer_name is None:
        tokenizer = train_bpe_tokenizer(documents_by_split["train"], vocab_size, partial_dir / "tokenizer")
        tokenizer_path = str(out_dir / "tokenizer")
    elif column == "tokens":
        tokenizer, tokenizer_path = load_tokenizer(tokenizer_name), tokenizer_name
    splits = {}
    for name, docs in documents_by_split.items():
        if not docs:
            continue
        samples = _progress(docs, name, progress)
        if tokenizer is not None:
            samples = _token_samples(samples, tokenizer, max_seq_len)
        splits[name] = _write_split(partial_dir / name, column, len(docs), samples, max_seq_len, compression)
    return ConversionSummary(out_dir, column, splits, tokenizer_path)


def _write_split(
    split_dir: Path,
    column: str,
    num_documents: int,
    samples: Iterable[str | np.ndarray],
    max_seq_len: int | None,
    compression: str | None,
) -> SplitSummary:
    writer_class = import_streaming("foundry data convert").MDSWriter
    column_type = "ndarray:int32" if column == "tokens" else "str"
    num_samples = 0
    # Each shard's checksum goes into index.json; the text loader checks it the first time it reads the shard.
    writer = writer_class(
        out=str(split_dir), columns={column: column_type}, compression=compression, hashes=[SHARD_HASH]
    )
    with writer:
        for sample in samples:
            writer.write({column: sample})
            num_samples += 1
    if num_samples == 0:
        raise DataError(
            f"The {split_dir.name} split would hold no samples: its {num_documents} document(s) have fewer than "
            f"{max_seq_len} tokens. Add more text, lower --concat-tokens, or change --eval-fraction."
        )
    tokens = num_samples * max_seq_len if max_seq_len is not None else None
    return SplitSummary(documents=num_documents, samples=num_samples, tokens=tokens)


def _token_samples(
    documents: Iterable[str], tokenizer: PreTrainedTokenizerBase, max_seq_len: int
) -> Iterator[np.ndarray]:
    """Documents tokenized, each followed by eos, cut into samples of exactly ``max_seq_len`` tokens."""
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise DataError("The tokenizer has no eos token to separate documents; use one that defines eos_token.")
    buffer: list[int] = []
    for document in documents:
        buffer.extend(tokenizer(document, add_special_tokens=False)["input_ids"])
        buffer.append(eos_id)
        start = 0  # slice once per document: deleting from a long buffer per sample is quadratic
        while len(buffer) - start >= max_seq_len:
            yield np.asarray(buffer[start : start + max_seq_len], dtype=np.int32)
            start += max_seq_len
        buffer = buffer[start:]


def _progress(items: Iterable, split: str, enabled: bool) -> Iterable:
    return tqdm(items, desc=f"{split} documents", unit="doc", disable=not enabled)


def _input_files(inputs: Sequence[Path]) -> list[Path]:
    files = []
    for path in map(Path, inputs):
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
            if not found:
                raise DataError(f"Input folder '{path}' holds no {' or '.join(SUFFIXES)} files.")
            files.extend(found)
        elif path.is_file():
            if path.suffix not in SUFFIXES:
                raise DataError(f"Input '{path}' is not a .txt or .jsonl file; convert it to one of those first.")
            files.append(path)
        else:
            raise DataError(f"Input '{path}' does not exist. Pass .txt/.jsonl files or folders of them.")
    return files


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise DataError(f"'{path}' is not UTF-8 text ({error.reason} at byte {error.start}).") from error


def _read_jsonl(path: Path) -> list[str]:
    texts = []
    for location, row in read_jsonl(path, 'with a "text" field'):
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            found = f"keys {sorted(row)}" if isinstance(row, dict) else type(row).__name__
            raise DataError(f'{location}: expected an object with a string "text" field, got {found}.')
        texts.append(row["text"])
    return texts


def _check_options(
    tokenizer: str | None, max_seq_len: int | None, concat_tokens: bool, eval_fraction: float, compression: str | None
) -> None:
    if concat_tokens and (max_seq_len is None or max_seq_len < 1):
        raise ConfigError(f"Concatenating tokens needs a positive max_seq_len (--concat-tokens N), got {max_seq_len}.")
    if not concat_tokens and tokenizer is not None:
        raise ConfigError("A tokenizer is used only with --concat-tokens N; raw-text datasets are tokenized at load.")
    if not 0 <= eval_fraction < 1:
        raise ConfigError(f"eval_fraction is {eval_fraction}; it must be in [0, 1), e.g. 0.05.")
    if compression is not None:
        import_streaming("foundry data convert --compression")
        from streaming.base.compression import get_compressions

        if compression not in get_compressions():
            raise ConfigError(
                f"Unknown compression '{compression}'.{did_you_mean(compression, get_compressions())} "
                f"Use e.g. 'zstd', 'gz' or 'br', or leave it unset."
            )


def _check_out_dir(out_dir: Path, overwrite: bool) -> None:
    if out_dir.is_file():
        raise DataError(f"Output '{out_dir}' is a file; pass a folder path to --out.")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise DataError(f"Output folder '{out_dir}' already exists and is not empty. Pass --overwrite to replace it.")


def _publish(partial_dir: Path, out_dir: Path, overwrite: bool) -> None:
    """Move the finished dataset into place; an old one is removed only after the new one is in."""
    _check_out_dir(out_dir, overwrite)  # again: another process may have written it meanwhile
    if out_dir.is_dir() and not any(out_dir.iterdir()):
        out_dir.rmdir()
    if not out_dir.exists():
        os.replace(partial_dir, out_dir)
        return
    old_dir = _fresh_sibling(out_dir, "old")
    os.replace(out_dir, old_dir / out_dir.name)
    os.replace(partial_dir, out_dir)
    shutil.rmtree(old_dir, ignore_errors=True)


def _fresh_sibling(out_dir: Path, role: str) -> Path:
    """A new hidden folder beside ``out_dir`` (same filesystem, so renames are atomic).

    Not ``tempfile.mkdtemp``: its 0700 mode would follow the dataset into place.
    """
    path = out_dir.parent / f".{out_dir.name}.{role}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    path.mkdir()
    return path


def add_convert_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``foundry data convert`` (LLM Foundry's spellings are accepted too)."""
    parser.add_argument("inputs", nargs="*", type=Path, help=".txt/.jsonl files or folders of them")
    parser.add_argument("--builtin-corpus", action="store_true", help="convert Python's help topics (no download)")
    parser.add_argument(
        "--builtin-instructions",
        action="store_true",
        help="write prompt/response rows derived from the help topics to <out>/{train,val}.jsonl (for finetuning)",
    )
    parser.add_argument("--out", "--out-root", "--out_root", dest="out", type=Path, required=True, help="output folder")
    parser.add_argument(
        "--concat-tokens",
        "--concat_tokens",
        dest="concat_tokens",
        type=int,
        metavar="N",
        help="tokenize and cut into N-token samples (column 'tokens'); without it, store raw 'text'",
    )
    parser.add_argument("--tokenizer", help="tokenizer directory or Hub id; default: train a BPE tokenizer")
    parser.add_argument(
        "--vocab-size",
        "--vocab_size",
        dest="vocab_size",
        type=int,
        default=8192,
        help="vocabulary of the trained tokenizer (default: 8192)",
    )
    parser.add_argument(
        "--eval-fraction",
        "--eval_fraction",
        dest="eval_fraction",
        type=float,
        default=0.05,
        help="share of the text, from the end, that goes to val (default: 0.05; 0 = no val split)",
    )
    parser.add_argument("--compression", default=None, help="MDS shard compression, e.g. zstd (default: none)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="hide progress bars")


def run_convert(args: argparse.Namespace) -> int:
    """Run ``foundry data convert`` from parsed arguments; prints the summary and returns 0."""
    if args.builtin_instructions:
        if args.builtin_corpus or args.inputs:
            raise ConfigError("--builtin-instructions writes its own rows; pass it without inputs or --builtin-corpus.")
        print(write_builtin_instructions(args.out, args.eval_fraction, args.overwrite))
        return 0
    if args.builtin_corpus == bool(args.inputs):
        raise ConfigError("Pass input files/folders, --builtin-corpus or --builtin-instructions (exactly one of them).")
    summary = convert_to_mds(
        None if args.builtin_corpus else args.inputs,
        args.out,
        tokenizer=args.tokenizer,
        max_seq_len=args.concat_tokens,
        concat_tokens=args.concat_tokens is not None,
        eval_fraction=args.eval_fraction,
        vocab_size=args.vocab_size,
        compression=args.compression,
        overwrite=args.overwrite,
        progress=args.progress,
    )
    print(summary)
    return 0


def write_builtin_instructions(out_dir: Path, eval_fraction: float, overwrite: bool) -> str:
    """``<out>/train.jsonl`` and ``<out>/val.jsonl`` of ``builtin_instruction_rows()``; returns a summary line.

    Every ``round(1 / eval_fraction)``-th topic goes to val with both of its rows (rows come in topic pairs).
    """
    rows = builtin_instruction_rows()
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise ConfigError(f"{out_dir} already exists and is not empty; pass --overwrite to replace its files.")
    out_dir.mkdir(parents=True, exist_ok=True)
    every = round(1 / eval_fraction) if eval_fraction > 0 else len(rows) + 1
    is_val = [(index // 2 + 1) % every == 0 for index in range(len(rows))]
    splits = {
        "train": [row for row, held_out in zip(rows, is_val) if not held_out],
        "val": [row for row, held_out in zip(rows, is_val) if held_out],
    }
    for split, split_rows in splits.items():
        lines = "".join(json.dumps(row) + "\n" for row in split_rows)
        (out_dir / f"{split}.jsonl").write_text(lines, encoding="utf-8")
    return f"Wrote {len(splits['train'])} train and {len(splits['val'])} val prompt/response rows to {out_dir}."
