"""The TRL DPO fixture (tests/fixtures/dpo) agrees with itself, without TRL installed.

TRL's numbers were taken from its fused LM head on padded batches; here a plain transformers forward of
each unpadded sequence recomputes them from the stored weights and the recorded token ids. The two differ
only by fp32 rounding: up to a few 1e-6 on these models, whose logits reach about 12 (ulp 1e-6), which is
why the sums are compared within 5e-6 rather than at the 1e-5 a foundry parity test uses.
"""

from __future__ import annotations

import pytest
import torch
from fixtures.dpo import trl_reference as fixture

from foundry.convert.commands import from_hf_model

LOGP_TOLERANCE = 5e-6  # fp32 rounding between TRL's fused head on padded batches and a plain unpadded forward
LOGP_KEYS = ("policy_chosen", "policy_rejected", "reference_chosen", "reference_rejected")
pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_tokenizer_gives_the_ids_trl_trained_on() -> None:
    tokenizer = fixture.load_tokenizer()
    for pair, ids in zip(fixture.preference_pairs(), fixture.trl_outputs()["tokenization"], strict=True):
        prompt_ids = tokenizer(pair["prompt"])["input_ids"]
        assert prompt_ids == ids["prompt_ids"] and prompt_ids[0] == tokenizer.bos_token_id
        for key in ("chosen", "rejected"):
            full = tokenizer(pair["prompt"] + pair[key] + tokenizer.eos_token)["input_ids"]
            assert full == prompt_ids + ids[f"{key}_ids"] and full[-1] == tokenizer.eos_token_id


@pytest.mark.parametrize("name", fixture.MODEL_NAMES)
def test_a_plain_forward_gives_trls_initial_log_probabilities(name: str) -> None:
    model, initial = fixture.load_model(name), fixture.trl_outputs()["models"][name]["initial"]
    with torch.no_grad():
        for index, ids in enumerate(fixture.trl_outputs()["tokenization"]):
            for key in ("chosen", "rejected"):
                token_logps = fixture.completion_token_logps(model, ids["prompt_ids"], ids[f"{key}_ids"])
                assert token_logps.tolist() == pytest.approx(initial[f"{key}_token_logps"][index], abs=LOGP_TOLERANCE)
                for role in ("policy", "reference"):  # the reference is the initial model too
                    recorded = initial[f"{role}_{key}_logps"][index]
                    assert token_logps.sum().item() == pytest.approx(recorded, abs=LOGP_TOLERANCE)


@pytest.mark.parametrize("name", fixture.MODEL_NAMES)
def test_each_recorded_loss_follows_from_the_recorded_log_probabilities(name: str) -> None:
    beta, records = fixture.trl_outputs()["settings"]["beta"], fixture.trl_outputs()["models"][name]
    for record in [records["initial"], *records["steps"]]:
        logps = {key: torch.tensor(record[f"{key}_logps"], dtype=torch.float64) for key in LOGP_KEYS}
        losses = fixture.dpo_losses(*(logps[key] for key in LOGP_KEYS), beta=beta)
        assert losses.tolist() == pytest.approx(record["losses"], abs=1e-6)
    for step in records["steps"]:
        assert step["loss"] == pytest.approx(sum(step["losses"]) / len(step["losses"]), abs=1e-6)
        chosen_log_ratios = torch.tensor(step["policy_chosen_logps"]) - torch.tensor(step["reference_chosen_logps"])
        assert step["logged"]["rewards/chosen"] == pytest.approx(beta * chosen_log_ratios.mean().item(), abs=1e-6)
        assert step["logged"]["logps/rejected"] == pytest.approx(sum(step["policy_rejected_logps"]) / 2, abs=1e-6)
    assert records["losses"] == [step["loss"] for step in records["steps"]]
    assert records["losses"][0] == pytest.approx(torch.log(torch.tensor(2.0)).item(), abs=1e-7)  # policy = reference


@pytest.mark.parametrize("name", fixture.MODEL_NAMES)
def test_a_plain_torch_replay_of_the_ten_steps_gives_trls_losses(name: str) -> None:
    assert fixture.replay_losses(name) == pytest.approx(fixture.trl_outputs()["models"][name]["losses"], abs=1e-5)


def test_the_mpt_folder_imports_as_the_foundry_mpt_it_was_exported_from() -> None:
    _, section = from_hf_model(fixture.FIXTURE_DIR / "mpt_as_llama")
    assert section["name"] == "mpt_causal_lm" and section["attn_config"]["rope_impl"] == "hf"
    assert section["tie_word_embeddings"] and section["attn_config"]["attn_type"] == "multihead_attention"
