"""foundry's own modeling code for exports: self-contained, and chosen only where no built-in class is exact."""

from __future__ import annotations

import ast
import sys

import torch
from helpers import TINY_MPT

from foundry.convert import choose_export
from foundry.convert.foundry_mpt import CODE_FILE
from foundry.models import MPTCausalLM


def test_the_modeling_code_imports_only_torch_transformers_and_the_standard_library() -> None:
    tree = ast.parse(CODE_FILE.read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    roots = {name.split(".")[0] for name in imported}
    assert roots - set(sys.stdlib_module_names) - {"__future__"} == {"torch", "transformers"}


def test_the_choice_names_the_class_and_what_each_built_in_class_lacks() -> None:
    model = MPTCausalLM(**TINY_MPT, init_device="meta", attn_config={"attn_type": "multiquery_attention"})
    description = choose_export(model, "mpt_causal_lm").describe()
    assert description.startswith("FoundryMPTForCausalLM (foundry's modeling code, trust_remote_code=True)")
    for built_in in ("LlamaForCausalLM lacks", "MptForCausalLM lacks", "GPT2LMHeadModel lacks attn_config.attn_type"):
        assert built_in in description


def test_a_built_in_class_is_chosen_without_reasons() -> None:
    description = choose_export(MPTCausalLM(**TINY_MPT, init_device="meta"), "mpt_causal_lm").describe()
    assert description == "GPT2LMHeadModel (built into transformers)"


def test_load_model_reads_an_export_with_foundrys_code_as_foundrys_mpt_without_running_it(tmp_path) -> None:
    import foundry
    from foundry.convert.hf_export import export_hf_model, save_hf_folder

    model = MPTCausalLM(**TINY_MPT, attn_config={"attn_type": "grouped_query_attention", "kv_n_heads": 2}).eval()
    save_hf_folder(export_hf_model(model, "mpt_causal_lm").hf_model, tmp_path / "hf")
    (tmp_path / "hf" / CODE_FILE.name).write_text("raise SystemExit('the folder code ran')\n")
    loaded, tokenizer = foundry.load_model(tmp_path / "hf")
    assert isinstance(loaded, MPTCausalLM) and tokenizer is None
    assert all(torch.equal(loaded.state_dict()[name], tensor) for name, tensor in model.state_dict().items())
