"""Which of LLM Foundry's train YAMLs ``foundry train`` runs, and what a user changes: one list for the tests
(tests/test_llm_foundry_yamls.py runs each) and for the table in docs/LLM_FOUNDRY.md (written from it by
``python benchmarks/llm_foundry_table.py``; a test fails when the two differ).

Every YAML gets its paths changed (data, tokenizer, Hugging Face model directory, ICL task files) and, on a
CPU, its sizes shrunk (model width and depth, sequence length, batch sizes, 2 batches). ``changes`` lists what
else a user must change, and why; ``refusal`` is what foundry says, at once, when the YAML is run as it is.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Compat:
    yaml: str  # under LLM Foundry's scripts/train/yamls/
    changes: tuple[str, ...] = ()  # key=value overrides beyond paths and sizes
    why: str = ""  # what the changes are for, or why foundry refuses the YAML
    refusal: str = ""  # a regular expression of the error the YAML gives as it is ("" = it runs as it is)

    @property
    def runs(self) -> bool:
        """False: refused whatever is changed (a feature foundry chooses not to have)."""
        return not self.refusal or bool(self.changes)


NO_PACKING = ("train_loader.dataset.packing_ratio=null", "eval_loader.dataset.packing_ratio=null")
PACKING_WHY = (
    "`packing_ratio` with `hf_causal_lm` is refused: a Hugging Face model cannot keep packed examples from "
    "attending to each other (LLM Foundry lets them); without packing the run works"
)

YAMLS = [
    Compat("pretrain/gpt-neo-125m.yaml"),
    Compat("pretrain/gpt-neo-125m_eval.yaml"),
    Compat("pretrain/gpt2-small.yaml"),
    Compat("pretrain/hf-llama-3.1-8B.yaml"),
    Compat("pretrain/mpt-125m.yaml"),
    Compat("pretrain/mpt-13b.yaml"),
    Compat("pretrain/mpt-1b.yaml"),
    Compat("pretrain/mpt-30b.yaml"),
    Compat("pretrain/mpt-350m.yaml"),
    Compat("pretrain/mpt-3b.yaml"),
    Compat("pretrain/mpt-70b.yaml"),
    Compat("pretrain/mpt-760m.yaml"),
    Compat("pretrain/mpt-7b.yaml"),
    Compat("pretrain/mpt-small-cpu.yaml"),
    Compat("pretrain/opt-3b.yaml"),
    Compat("pretrain/testing-moe.yaml"),
    Compat("pretrain/testing.yaml"),
    Compat("finetune/1b_local_data_sft.yaml"),
    Compat("finetune/7b_dolly_sft.yaml"),
    Compat("finetune/dbrx-full-ft.yaml", NO_PACKING, PACKING_WHY, r"packing_ratio' is 'auto'.*hf_causal_lm"),
    Compat("finetune/dbrx-lora-ft.yaml", NO_PACKING, PACKING_WHY, r"packing_ratio' is 'auto'.*hf_causal_lm"),
    Compat("finetune/gpt2-arc-easy-cpu-streaming-dataset.yaml"),
    Compat("finetune/llama-3-8b_domain_adapt.yaml"),
    Compat("finetune/mpt-30b-instruct.yaml", NO_PACKING, PACKING_WHY, r"packing_ratio' is 9.*hf_causal_lm"),
    Compat("finetune/mpt-7b_dolly_sft.yaml"),
    Compat(
        "finetune/t5-small_dolly_sft.yaml",
        why="T5 is an encoder-decoder model (`hf_t5`, `decoder_only_format: false`); foundry trains decoder-only "
        "language models",
        refusal=r"decoder_only_format: false' formats data for encoder-decoder models",
    ),
]


def markdown_table(entries: list[Compat] = YAMLS) -> str:
    """The table of docs/LLM_FOUNDRY.md."""
    lines = ["| YAML | runs | what to change besides paths |", "|---|---|---|"]
    for entry in entries:
        if not entry.runs:
            verdict, note = "no: refused at once", entry.why
        elif entry.changes:
            verdict, note = "yes, with a change", f"{', '.join(f'`{c}`' for c in entry.changes)}: {entry.why}"
        else:
            verdict, note = "yes", "nothing"
        lines.append(f"| `{entry.yaml}` | {verdict} | {note} |")
    return "\n".join(lines) + "\n"
