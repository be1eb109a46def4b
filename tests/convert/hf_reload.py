"""Load foundry's Hugging Face exports with transformers and torch alone, as a user of the Hub would.

Run as ``python hf_reload.py MANIFEST RESULTS`` by tests/convert/test_export_yamls.py: one process loads every
export in the manifest, so the cost of importing transformers is paid once. It never imports foundry (the
results say whether anything did). For each export: the class transformers picked, the largest logit
difference relative to the largest logit foundry computed, and the tokens ``generate`` gave for left-padded
prompts (greedy, with the KV cache).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


@torch.no_grad()
def reload(entry: dict) -> dict:
    model = AutoModelForCausalLM.from_pretrained(entry["dir"], trust_remote_code=entry["trust_remote_code"])
    model = model.float().eval()
    inputs = torch.load(entry["inputs"], weights_only=True)
    logits = model(input_ids=inputs["input_ids"]).logits
    expected = inputs["logits"]
    prompts, mask = inputs["prompts"], inputs["prompt_mask"]
    generated = model.generate(
        input_ids=prompts, attention_mask=mask, max_new_tokens=inputs["new_tokens"], do_sample=False,
        pad_token_id=int(inputs["pad_token_id"]),
    )  # fmt: skip
    return {
        "class": type(model).__name__,
        "relative_gap": ((logits - expected).abs().max() / expected.abs().max()).item(),
        "new_tokens": generated[:, prompts.shape[1] :].tolist(),
    }


def main(manifest: str, results: str) -> None:
    entries = json.loads(Path(manifest).read_text())
    out = {name: reload(entry) for name, entry in entries.items()}
    out["_imported_foundry"] = any(name == "foundry" or name.startswith("foundry.") for name in sys.modules)
    Path(results).write_text(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
