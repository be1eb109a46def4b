"""No secret from the config or the environment reaches metrics files or checkpoints."""

from __future__ import annotations

from pathlib import Path

from helpers import TinyLM, token_batches

from foundry.trainer import Trainer

FAKE_KEY = "local-0123456789abcdef0123456789abcdef"


def test_secrets_stay_out_of_metrics_and_checkpoints(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    config = {"loggers": {"wandb": {"api_key": "in-the-yaml-secret"}}, "notes": f"key {FAKE_KEY}", "tokenizer": "t"}
    trainer = Trainer(
        model=TinyLM(), train_dataloader=token_batches(2, batch_size=2), max_duration="2ba", log_to_console=False,
        run_folder=str(tmp_path / "run"), save_folder=str(tmp_path / "ckpt"), save_interval="2ba", config=config,
    )  # fmt: skip
    trainer.fit()
    written = [path.read_text(errors="ignore") for path in tmp_path.rglob("*") if path.is_file()]
    assert written and not any(FAKE_KEY in text or "in-the-yaml-secret" in text for text in written)
    assert any('"tokenizer": "t"' in text for text in written)  # ordinary keys are kept
