"""DPO against SFT throughput through `foundry train`, and a Llama-8B-shape LoRA DPO on two GPUs (docs/FINETUNING.md).

Here, once (text from the shared corpus, no tokenization; it writes jsonl files and copies the tokenizer):

    python benchmarks/preference.py prepare --corpus ../shared/data/corpus/wikitext-2/test.txt \
        --tokenizer ../shared/data/tokenizers/gpt-neox-20b --out data/preference-bench

then on the GPU machine, in one call (each row a `foundry train` run of random-initialised weights):

    python benchmarks/preference.py run --data data/preference-bench --out OUT [--rows sft-1b dpo-1b lora-dpo-8b]

Rows ``sft-1b`` and ``dpo-1b`` train yamls/finetune/mpt-1b-finetune.yaml on one GPU over the same tokens per step:
SFT on 32 rows of prompt + chosen, DPO on 16 pairs (32 rows: prompt + chosen and prompt + rejected, a frozen copy
as the reference). Every row is exactly ``max_seq_len`` tokens (each response is cut there), so neither run pads,
and tokens/s counts every row through the policy (for DPO, chosen and rejected). Row ``lora-dpo-8b`` trains
yamls/finetune/llama-8b-lora-dpo.yaml on two GPUs. Each row trains 12 batches; tokens/s is the median of the speed
monitor's rate over windows of 4 batches after the first 4 (the first holds the compile). Each row has its own
time limit (``ROW_TIMEOUT_S``): sft-1b and dpo-1b fit one call of under 560 s.

``run --smoke --data DATA`` checks the whole path on this CPU in a few minutes: the rows' YAMLs at tiny widths
(``peers_rows.SMOKE_FOUNDRY``), 1,024-token rows, the first pairs of DATA, a few batches each.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path

from bench_utils import environment, foundry_train, train_losses, write_results
from peers_rows import SMOKE_FOUNDRY, SMOKE_SETTINGS

from foundry.plotting import metrics_path, read_run

SEQ_LEN = 2048
CHUNK_CHARS = 12_000  # about 3,000 gpt-neox tokens: every prompt + response is cut at SEQ_LEN
PROMPT_CHARS = 2_000
PAIRS = 480
BATCHES, WARM_UP_BATCHES = 12, 4
ONE_GPU_1B = [
    "load_path=", "eval_loader=", f"max_duration={BATCHES}ba", "save_folder=", "console_log_interval=4ba",
    "model.attn_config.attn_uses_sequence_id=false", f"callbacks.speed_monitor={{window_size: {WARM_UP_BATCHES}}}",
]  # fmt: skip
# start-up (imports, tokenizing, building, compiling: about 1.5 min for sft-1b on an H200) plus 12 batches
ROW_TIMEOUT_S = {"sft-1b": 200, "dpo-1b": 320, "lora-dpo-8b": 540}
SMOKE_PAIRS = 24
SMOKE_SEQ_LEN = 1024  # above the prompts' ~640 tokens: a prompt is never cut
SMOKE_ROWS = {
    "sft-1b": [*SMOKE_FOUNDRY["mpt"], "global_train_batch_size=4", "device_train_microbatch_size=2"],
    "dpo-1b": [*SMOKE_FOUNDRY["mpt"], "global_train_batch_size=2", "device_train_microbatch_size=1"],
    "lora-dpo-8b": [*SMOKE_FOUNDRY["llama"], "global_train_batch_size=2", "device_train_microbatch_size=1"],
}


def prepare(corpus: list[Path], tokenizer: Path, out: Path) -> None:
    """``pairs.jsonl`` (prompt, chosen, rejected) and ``sft.jsonl`` (prompt, response=chosen) from ``corpus``."""
    text = " ".join(" ".join(path.read_text(encoding="utf-8").split()) for path in corpus)
    chunk = PROMPT_CHARS + 2 * CHUNK_CHARS
    rows = []
    for index in range(PAIRS):
        start = (index * chunk) % max(1, len(text) - chunk)
        piece = text[start : start + chunk]
        prompt, chosen, rejected = piece[:PROMPT_CHARS], piece[PROMPT_CHARS:-CHUNK_CHARS], piece[-CHUNK_CHARS:]
        rows.append({"prompt": prompt, "chosen": " " + chosen, "rejected": " " + rejected})
    out.mkdir(parents=True, exist_ok=True)
    (out / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    sft = [{"prompt": row["prompt"], "response": row["chosen"]} for row in rows]
    (out / "sft.jsonl").write_text("".join(json.dumps(row) + "\n" for row in sft))
    shutil.copytree(tokenizer, out / "tokenizer", dirs_exist_ok=True)


def row_overrides(name: str, data: Path, seq_len: int = SEQ_LEN) -> tuple[str, list[str], int]:
    """(YAML, overrides, ranks) of row ``name``."""
    tokenizer = f"variables.tokenizer_name={data / 'tokenizer'}"
    if name == "sft-1b":
        sft = f"train_loader.dataset={{hf_name: {data / 'sft.jsonl'}, max_seq_len: {seq_len}, shuffle: true}}"
        overrides = [*ONE_GPU_1B, tokenizer, sft, "global_train_batch_size=32", "device_train_microbatch_size=8"]
        return "yamls/finetune/mpt-1b-finetune.yaml", overrides, 1
    pairs = f"train_loader.dataset={{hf_name: {data / 'pairs.jsonl'}, max_seq_len: {seq_len}, shuffle: true}}"
    if name == "dpo-1b":
        dpo = ["train_loader.name=preference", pairs, "preference={beta: 0.1, reference: copy}"]
        overrides = [*ONE_GPU_1B, tokenizer, *dpo, "global_train_batch_size=16", "device_train_microbatch_size=4"]
        return "yamls/finetune/mpt-1b-finetune.yaml", overrides, 1
    if name == "lora-dpo-8b":
        overrides = [
            "load_path=",
            "save_folder=",
            "max_duration=12ba",
            tokenizer,
            f"variables.train_file={data}/pairs.jsonl",
        ]
        return "yamls/finetune/llama-8b-lora-dpo.yaml", overrides, 2
    raise SystemExit(f"unknown row {name!r}; rows: sft-1b, dpo-1b, lora-dpo-8b")


def smoke_data(data: Path, out: Path) -> Path:
    """The first ``SMOKE_PAIRS`` pairs of ``data`` (and its tokenizer), for ``--smoke``."""
    smoke = out / "smoke-data"
    smoke.mkdir(parents=True, exist_ok=True)
    for name in ("pairs.jsonl", "sft.jsonl"):
        lines = (data / name).read_text().splitlines(keepends=True)[:SMOKE_PAIRS]
        (smoke / name).write_text("".join(lines))
    shutil.copytree(data / "tokenizer", smoke / "tokenizer", dirs_exist_ok=True)
    return smoke


def measure(name: str, data: Path, out: Path, timeout_s: float | None, smoke: bool) -> dict:
    """Run row ``name`` through `foundry train` and read its speed and memory from metrics.jsonl."""
    yaml, overrides, ranks = row_overrides(name, data, SMOKE_SEQ_LEN if smoke else SEQ_LEN)
    if smoke:  # the later overrides win
        overrides += [*SMOKE_ROWS[name], *SMOKE_SETTINGS, f"variables.max_seq_len={SMOKE_SEQ_LEN}", "max_duration=6ba"]
    run_folder = out / name
    code = foundry_train(yaml, run_folder, overrides, nproc=ranks, timeout_s=timeout_s or ROW_TIMEOUT_S[name])
    # read_run: by step, a cut-off run's half-written last line skipped
    series = read_run(run_folder) if metrics_path(run_folder).is_file() else {}
    # windows after the warm-up batches (the first holds the compile)
    rates = [rate for step, rate in series.get("throughput/tokens_per_sec", []) if step > WARM_UP_BATCHES]
    peaks = [peak for _, peak in series.get("memory/peak_allocated_mem", [])]
    losses = list(train_losses(run_folder).values())
    return {
        "row": name, "exit code": code, "GPUs": ranks, "tokens/s": round(statistics.median(rates)) if rates else None,
        "tokens/s per GPU": round(statistics.median(rates) / ranks) if rates else None,
        "peak GiB": round(max(peaks), 1) if peaks else None, "batches": len(losses),
        "loss first/last": [round(losses[0], 4), round(losses[-1], 4)] if losses else None,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    prepare_parser = commands.add_parser("prepare")
    prepare_parser.add_argument("--corpus", type=Path, nargs="+", required=True, help="text files")
    prepare_parser.add_argument("--tokenizer", type=Path, required=True)
    prepare_parser.add_argument("--out", type=Path, required=True)
    run_parser = commands.add_parser("run")
    run_parser.add_argument("--data", type=Path, required=True)
    run_parser.add_argument("--out", type=Path, required=True)
    run_parser.add_argument("--rows", nargs="+", default=["sft-1b", "dpo-1b", "lora-dpo-8b"])
    run_parser.add_argument("--timeout-s", type=float, help="every row's time limit (default: ROW_TIMEOUT_S)")
    run_parser.add_argument("--smoke", action="store_true", help="tiny widths on this CPU: checks the path")
    args = parser.parse_args()
    if args.command == "prepare":
        prepare(args.corpus, args.tokenizer, args.out)
        return
    out = args.out.resolve()
    data = smoke_data(args.data.resolve(), out) if args.smoke else args.data.resolve()
    rows = [{**measure(name, data, out, args.timeout_s, args.smoke), **environment()} for name in args.rows]
    by_name = {row["row"]: row for row in rows}
    if by_name.get("sft-1b", {}).get("tokens/s") and by_name.get("dpo-1b", {}).get("tokens/s"):
        by_name["dpo-1b"]["DPO / SFT tokens/s"] = round(
            by_name["dpo-1b"]["tokens/s"] / by_name["sft-1b"]["tokens/s"], 3
        )
    write_results(out, "preference", rows)


if __name__ == "__main__":
    main()
