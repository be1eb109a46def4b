"""The Python API is a first-class way in: a checkpoint any Trainer writes reopens everywhere foundry reads one.

The README's example, at test size: data from ``foundry data convert``, a model built by hand, a
Trainer whose run (metrics, throughput, checkpoints) is one folder, then ``foundry.load_model``,
``foundry.generate``, ``foundry eval`` and ``foundry convert to-hf`` on its checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import quickstart_corpus

import foundry
from foundry import Trainer
from foundry.algorithms import GradientClipping
from foundry.callbacks import SpeedMonitor
from foundry.checkpoint import latest_checkpoint
from foundry.cli import main
from foundry.data import build_text_dataloader, load_tokenizer
from foundry.errors import CheckpointError
from foundry.models import LlamaCausalLM, MPTCausalLM
from foundry.optim import CosineWithWarmupScheduler, DecoupledAdamW

SEQ_LEN = 32
RUN = Path("runs") / "demo"  # the README's run folder (run_folder's default, runs/{run_name}), under the test's cwd
ROWS = [{"context": f"The module {i}", "continuation": " is"} for i in range(4)]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return quickstart_corpus(tmp_path_factory, SEQ_LEN)


@pytest.fixture
def loaders(data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)  # the README's relative run folder lands in the test's own folder
    tokenizer = load_tokenizer(str(data / "tokenizer"))
    made = [
        build_text_dataloader(
            device_batch_size=4,
            dataset={"local": str(data), "split": split, "max_seq_len": SEQ_LEN, "shuffle": split == "train"},
            tokenizer=tokenizer,
        )
        for split in ("train", "val")
    ]
    yield tokenizer, made
    for loader in made:
        loader.dataset.close()


def readme_example(
    model: torch.nn.Module, loaders, trainer_class: type = Trainer, name_tokenizer: bool = True
) -> Trainer:
    """The README's training example (tokenizer named explicitly, as it shows, unless ``name_tokenizer`` is off),
    writing its run to ``RUN`` in the current folder."""
    tokenizer, (train_loader, eval_loader) = loaders
    trainer = trainer_class(
        model=model,
        train_dataloader=train_loader,
        eval_dataloader=eval_loader,
        tokenizer=tokenizer if name_tokenizer else None,
        max_duration="2ba",
        optimizers=lambda params: DecoupledAdamW(params, lr=3e-3),
        schedulers=CosineWithWarmupScheduler(t_warmup="1ba", alpha_f=0.1),
        algorithms=[GradientClipping(clipping_type="norm", clipping_threshold=1.0)],
        callbacks=[SpeedMonitor(window_size=2)],
        device_train_microbatch_size=2,
        run_name="demo",
        save_folder="runs/{run_name}/checkpoints",
        save_interval="2ba",
        precision="fp32",
        device="cpu",  # the checkpoint is compared with the model load_model rebuilds on the CPU
        eval_subset_num_batches=1,
        log_to_console=False,
    )
    trainer.fit()
    return trainer


def tiny_mpt() -> MPTCausalLM:
    """The README's model at test size: Hugging Face MPT's settings, so that to-hf can write it."""
    return MPTCausalLM(
        d_model=32, n_heads=2, n_layers=2, max_seq_len=SEQ_LEN, vocab_size=512,
        learned_pos_emb=False, no_bias=True, attn_config={"alibi": True},
    )  # fmt: skip


def eval_loss_of(model: torch.nn.Module, batch: dict) -> float:
    model.eval()
    with torch.no_grad():
        return float(model.loss(model(batch), batch))


def test_the_readme_example_keeps_its_run_in_one_folder_with_throughput_and_reopens_everywhere(
    loaders, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    trainer = readme_example(tiny_mpt(), loaders)
    rows = [json.loads(line) for line in (tmp_path / RUN / "metrics.jsonl").read_text().splitlines()]
    assert any(row.get("throughput/tokens_per_sec", 0) > 0 for row in rows)  # the speed monitor's
    assert latest_checkpoint(tmp_path / RUN / "checkpoints").name == "ep0-ba2"  # beside the metrics
    batch = next(iter(loaders[1][1]))
    trained_loss = eval_loss_of(trainer.state.model, batch)

    model, tokenizer = foundry.load_model("runs/demo/checkpoints")
    assert isinstance(model, MPTCausalLM) and len(tokenizer) == len(loaders[0])
    assert eval_loss_of(model, batch) == pytest.approx(trained_loss, abs=1e-5)
    assert isinstance(foundry.generate(model, tokenizer, 'The "if" statement', max_new_tokens=4), str)

    tasks = tmp_path / "tasks.yaml"
    (tmp_path / "lm.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    tasks.write_text(
        f"icl_tasks:\n- label: lm\n  dataset_uri: {tmp_path / 'lm.jsonl'}\n  icl_task_type: language_modeling\n"
    )
    assert main(["eval", "--model", str(RUN / "checkpoints"), "--tasks", str(tasks), "--seq-len", str(SEQ_LEN)]) == 0
    assert "lm" in capsys.readouterr().out

    assert main(["convert", "to-hf", str(RUN / "checkpoints"), str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "mpt"


class MyTrainer(Trainer):
    """A subclass that changes nothing about checkpoints."""

    def eval(self) -> dict:
        return super().eval()


def test_a_trainer_subclass_and_a_llama_built_by_hand_write_checkpoints_that_reopen(loaders, tmp_path: Path) -> None:
    model = LlamaCausalLM(
        d_model=32, n_heads=2, n_layers=2, max_seq_len=SEQ_LEN, vocab_size=512, ffn_hidden_size=64, kv_n_heads=2
    )
    readme_example(model, loaders, trainer_class=MyTrainer)
    reopened, _ = foundry.load_model(str(tmp_path / RUN / "checkpoints"))
    assert isinstance(reopened, LlamaCausalLM)
    assert torch.equal(reopened.state_dict()["lm_head.weight"], model.state_dict()["lm_head.weight"].cpu())


def test_a_checkpoint_records_the_models_registered_name_and_config(loaders, tmp_path: Path) -> None:
    readme_example(tiny_mpt(), loaders, name_tokenizer=False)  # the text loader's tokenizer
    (checkpoint,) = (tmp_path / RUN / "checkpoints").glob("ep*-ba*")
    meta = json.loads((checkpoint / "meta.json").read_text())
    assert meta["config"] is None  # no YAML: the model and tokenizer describe themselves
    assert meta["model"]["name"] == "mpt_causal_lm" and meta["model"]["d_model"] == 32
    assert Path(meta["tokenizer"]["name"]).is_dir()


class Unregistered(MPTCausalLM):
    """A model class nobody registered: its checkpoints cannot say how to rebuild it."""


def test_an_unregistered_models_checkpoint_names_the_fix(loaders, tmp_path: Path) -> None:
    readme_example(Unregistered(d_model=32, n_heads=2, n_layers=2, max_seq_len=SEQ_LEN, vocab_size=512), loaders)
    with pytest.raises(CheckpointError, match=r"registry\.models\.register"):
        foundry.load_model(str(tmp_path / RUN / "checkpoints"))
