"""A Hugging Face folder loads as its own architecture: LLM Foundry's MPT export as foundry's MPT, with the
logits and ICL scores LLM Foundry gives it; any other folder with its own code only with trust_remote_code.

``tests/fixtures/llmfoundry/hf_export`` is what LLM Foundry 0.22's ``hf_checkpointer`` wrote (its config.json
names LLM Foundry's modeling code in ``auto_map``; the code files are left out, foundry never runs them);
``expected.json`` holds that model's logits under its own code and LLM Foundry's ICL scores of it
(``tests/fixtures/llmfoundry/make_llmfoundry_fixtures.py``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from foundry.cli import main
from foundry.errors import ConfigError
from foundry.eval import loading
from foundry.eval.evaluator import ICLEvaluator
from foundry.eval.task_config import ICLTaskConfig
from foundry.models import MPTCausalLM
from foundry.models.hf import HFCausalLM

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "llmfoundry"
EXPORT = FIXTURES / "hf_export"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text())


def test_llm_foundrys_mpt_export_loads_as_foundrys_mpt_with_llm_foundrys_logits():
    loaded = loading.load_model(EXPORT)
    assert isinstance(loaded.model, MPTCausalLM)
    assert loaded.model.config.learned_pos_emb and not loaded.model.config.no_bias
    expected = EXPECTED["export_logits"]
    with torch.no_grad():
        logits = loaded.model({"input_ids": torch.tensor(expected["input_ids"])})
    torch.testing.assert_close(logits, torch.tensor(expected["logits"]), rtol=1e-5, atol=1e-6)


@pytest.fixture
def tasks_yaml(tmp_path: Path) -> Path:
    """The ICL tasks LLM Foundry scored the export on, their files named by absolute path."""
    tasks = (FIXTURES / "icl_tasks.yaml").read_text().replace("dataset_uri: ", f"dataset_uri: {FIXTURES / 'icl'}/")
    (tmp_path / "tasks.yaml").write_text(tasks)
    return tmp_path / "tasks.yaml"


def test_an_llm_foundry_mpt_export_with_alibi_gqa_and_biases_loads_with_its_logits():
    loaded = loading.load_model(FIXTURES / "hf_export_alibi")
    config = loaded.model.config
    assert (config.attn_config.alibi, config.attn_config.attn_type, config.learned_pos_emb, config.no_bias) == (
        True, "grouped_query_attention", False, False
    )  # fmt: skip
    expected = EXPECTED["variant_export_logits"]
    with torch.no_grad():
        logits = loaded.model({"input_ids": torch.tensor(expected["input_ids"])})
    # foundry's grouped-query ALiBi attention sums in another order than LLM Foundry's: 2.4e-6 apart at most.
    torch.testing.assert_close(logits, torch.tensor(expected["logits"]), rtol=1e-5, atol=1e-5)


def test_foundry_eval_scores_llm_foundrys_export_as_llm_foundry_does(tmp_path, tasks_yaml):
    arguments = ["--tasks", str(tasks_yaml), "--precision", "fp32", "--device", "cpu"]
    arguments += ["--batch-size", "4", "--seq-len", "32", "--out", str(tmp_path / "out")]
    assert main(["eval", "--model", str(EXPORT), *arguments]) == 0
    (results,) = json.loads((tmp_path / "out" / "results.json").read_text())
    scores = {f"{task}/{metric}": value for task, row in results["results"].items() for metric, value in row.items()}
    expected = EXPECTED["scores"]["tokenizer"]
    assert {name: scores[name] for name in expected} == pytest.approx(expected, abs=1e-7)  # LLM Foundry's float32


@pytest.fixture
def other_custom_code(tmp_path: Path) -> Path:
    """The export, its config naming some other modeling code (model_type mpt, which transformers also knows)."""
    folder = tmp_path / "custom"
    shutil.copytree(EXPORT, folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_folder_with_other_custom_code_is_refused_without_trust_remote_code(other_custom_code):
    with pytest.raises(ConfigError, match=r"ships its own modeling code .*modeling_x.XForCausalLM.*trust-remote-code"):
        loading.load_model(other_custom_code)


def test_hf_causal_lm_refuses_custom_code_unless_the_yaml_trusts_it(other_custom_code):
    with pytest.raises(ConfigError, match=r"Set 'model.trust_remote_code: true'"):
        HFCausalLM(pretrained_model_name_or_path=str(other_custom_code))


def test_foundry_eval_trust_remote_code_flag_reaches_the_model(other_custom_code, monkeypatch, tasks_yaml):
    built = {}

    class Recorded(Exception):
        pass

    def record(**config):
        built.update(config)
        raise Recorded

    monkeypatch.setattr(loading, "HFCausalLM", record)
    with pytest.raises(Recorded):
        main(["eval", "--model", str(other_custom_code), "--tasks", str(tasks_yaml), "--trust-remote-code"])
    assert built["trust_remote_code"] is True


def test_with_bos_as_the_pad_token_foundry_attends_to_the_bos_that_llm_foundry_masks():
    """The documented difference (docs/EVAL.md): same ids, but LLM Foundry's mask hides a BOS that is also pad."""
    from transformers import AutoTokenizer

    recorded = EXPECTED["bos_as_padding_batch"]
    tokenizer = AutoTokenizer.from_pretrained(FIXTURES / "tokenizer_bos")
    assert tokenizer.pad_token_id is None and tokenizer.bos_token_id == tokenizer.eos_token_id == 0
    task = ICLTaskConfig(label="sums_mc", dataset_uri=str(FIXTURES / "icl" / "sums_mc.jsonl"),
                         icl_task_type="multiple_choice", num_fewshot=[0])  # fmt: skip
    (subtask,) = ICLEvaluator([task], tokenizer, seq_len=32, batch_size=4).subtasks
    ours = {tuple(context + continuation) for example in subtask.examples for context, continuation in example.requests}
    for ids, mask in zip(recorded["input_ids"], recorded["attention_mask"], strict=True):
        length = max(index for index, attended in enumerate(mask) if attended) + 1
        assert tuple(ids[:length]) in ours  # the same prompt, BOS first
        assert ids[0] == tokenizer.bos_token_id and mask[0] == 0  # which LLM Foundry hides from the model
    assert all("attention_mask" not in vars(batch) for batch in subtask.batches)  # foundry: every token attended
