"""Load foundry's Hugging Face exports with transformers and torch alone, as a user of the Hub would.

Run as ``python hf_reload.py MANIFEST RESULTS`` by tests/convert/test_export_yamls.py: one process loads every
export in the manifest, so the cost of importing transformers is paid once. It never imports foundry (the
results say whether anything did). For each export: the class transformers picked, the largest logit
difference relative to the largest logit foundry computed (on a plain batch, and on the real tokens of a
left-padded one), and the tokens ``generate`` gave for left-padded
prompts (greedy, with the KV cache).
"""

from __future__ import annotations

import inspect
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
    padded = model(input_ids=inputs["input_ids"], attention_mask=inputs["mask"], **positions(model, inputs["mask"]))
    real = inputs["mask"].bool()
    prompts, mask = inputs["prompts"], inputs["prompt_mask"]
    generated = model.generate(
        input_ids=prompts, attention_mask=mask, max_new_tokens=inputs["new_tokens"], do_sample=False,
        pad_token_id=int(inputs["pad_token_id"]),
    )  # fmt: skip
    return {
        "class": type(model).__name__,
        "relative_gap": relative_gap(logits, expected),
        "padded_relative_gap": relative_gap(padded.logits[real], inputs["padded_logits"][real]),
        "new_tokens": generated[:, prompts.shape[1] :].tolist(),
    }


def relative_gap(logits: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference, relative to the largest expected logit."""
    return ((logits - expected).abs().max() / expected.abs().max()).item()


def positions(model: torch.nn.Module, mask: torch.Tensor) -> dict:
    """Each token's position after its row's left padding, for the classes that take ``position_ids`` (as
    ``generate`` passes them); foundry's own code derives them from the mask itself."""
    if "position_ids" not in inspect.signature(model.forward).parameters:
        return {}
    return {"position_ids": (mask.long().cumsum(-1) - 1).clamp(min=0)}


def main(manifest: str, results: str) -> None:
    entries = json.loads(Path(manifest).read_text())
    out = {name: reload(entry) for name, entry in entries.items()}
    out["_imported_foundry"] = any(name == "foundry" or name.startswith("foundry.") for name in sys.modules)
    Path(results).write_text(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
