"""``foundry convert from-composer``: a checkpoint written by Composer itself loads into foundry exactly, and
a hostile pickle in Composer's format is refused without running code.

The fixtures in ``tests/fixtures/composer/`` were written by Composer 0.32.1's own checkpointer
(``make_composer_checkpoint.py`` beside it), each after 3 batches of DecoupledAdamW: a tiny Llama in
``HuggingFaceModel`` (as LLM Foundry's ``hf_causal_lm`` saves it) and LLM Foundry 0.22's own
``ComposerMPTCausalLM`` (``mpt_causal_lm``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers import token_batches

from foundry.cli import main
from foundry.convert.composer import from_composer
from foundry.convert.composer_pickle import read_composer_checkpoint
from foundry.errors import CheckpointError
from foundry.models.build import build_model
from foundry.optim import CosineWithWarmupScheduler
from foundry.trainer import Trainer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "composer"
COMPOSER_CKPT = FIXTURES / "tiny_llama_composer.pt"


@pytest.mark.parametrize("name", ["tiny_llama_composer", "tiny_mpt_llmfoundry"])
def test_a_composer_checkpoint_loads_into_foundry_with_identical_logits(name: str) -> None:
    expected = torch.load(FIXTURES / f"{name}_logits.pt")
    model = from_composer(FIXTURES / f"{name}.pt").model.eval()
    with torch.no_grad():
        logits = model({"input_ids": expected["input_ids"]})
    # Bit-identical on the machine that wrote the fixture; another CPU or torch build may round the last bit apart.
    torch.testing.assert_close(logits, expected["logits"], rtol=1e-5, atol=1e-6)


def test_from_composer_with_the_optimizer_continues_the_run_at_its_batch(tmp_path, capsys) -> None:
    assert main(["convert", "from-composer", str(COMPOSER_CKPT), str(tmp_path / "ckpt"), "--with-optimizer"]) == 0
    assert "it continues at batch 3" in capsys.readouterr().out
    section = from_composer(COMPOSER_CKPT).section
    trainer = Trainer(
        build_model(section), token_batches(4, 2, vocab_size=64), max_duration="4ba", load_path=str(tmp_path / "ckpt"),
        schedulers=CosineWithWarmupScheduler(t_warmup="1ba"), run_folder=str(tmp_path / "run"), log_to_console=False,
        device="cpu",
    )  # fmt: skip
    assert trainer.state.timestamp.batch == 3
    composer_state = read_composer_checkpoint(COMPOSER_CKPT)["state"]["optimizers"]["DecoupledAdamW"]["state"]
    q_moment = composer_state["model.model.layers.0.self_attn.q_proj.weight"]["exp_avg"]
    (optimizer,) = trainer.state.optimizers
    wqkv = dict(trainer.state.model.named_parameters())["transformer.blocks.0.attn.Wqkv.weight"]
    assert torch.equal(optimizer.state[wqkv]["exp_avg"][: q_moment.shape[0]], q_moment)  # q rows of the fused qkv
    trainer.fit()
    assert trainer.state.timestamp.batch == 4


class _RunsCode:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_hostile_pickle_in_composer_format_is_refused_without_running_code(tmp_path) -> None:
    payload = _RunsCode()
    payload.marker = tmp_path / "ran"
    torch.save({"state": {"model": {"w": torch.zeros(1)}, "callbacks": payload}, "rng": []}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match=r"Refusing to load .*evil.pt: it names (posix|os)\.system"):
        read_composer_checkpoint(tmp_path / "evil.pt")
    assert not payload.marker.exists()


def test_a_composer_checkpoint_of_another_architecture_is_refused_naming_it(tmp_path) -> None:
    checkpoint = read_composer_checkpoint(COMPOSER_CKPT)
    config = checkpoint["state"]["integrations"]["huggingface"]["model"]["config"]
    config["content"]["model_type"], config["class"] = "opt", "transformers.OPTForCausalLM"
    torch.save(checkpoint, tmp_path / "gpt2.pt")
    with pytest.raises(CheckpointError, match=r"holds a transformers.OPTForCausalLM model.*Llama, MPT and GPT-2"):
        from_composer(tmp_path / "gpt2.pt")


def test_load_path_at_a_composer_file_says_how_to_convert_it(tmp_path) -> None:
    with pytest.raises(CheckpointError, match=r"Composer \(LLM Foundry\) checkpoint: convert it with `foundry convert"):
        Trainer(build_model(from_composer(COMPOSER_CKPT).section), load_path=str(COMPOSER_CKPT), device="cpu",
                run_folder=str(tmp_path / "run"), log_to_console=False)  # fmt: skip


def test_an_llm_foundry_mpt_feature_foundry_lacks_is_refused_naming_it(tmp_path) -> None:
    checkpoint = read_composer_checkpoint(FIXTURES / "tiny_mpt_llmfoundry.pt")
    config = checkpoint["state"]["integrations"]["huggingface"]["model"]["config"]["content"]
    config["attn_config"]["attn_temperature_tuning"] = {"attn_scale": 0.5, "floor_scale": 8192}
    torch.save(checkpoint, tmp_path / "tuned.pt")
    with pytest.raises(CheckpointError, match=r"sets 'attn_config.attn_temperature_tuning' to .*does not implement"):
        from_composer(tmp_path / "tuned.pt")
