"""benchmarks/preference.py's reading of a row's metrics, with ``foundry train`` stood in for (no training)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
# By path, under its own name: a plain `import preference` finds tests/preference when that package ran first.
_spec = importlib.util.spec_from_file_location("preference_benchmark", BENCHMARKS / "preference.py")
preference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(preference)


def test_a_row_cut_off_mid_write_reports_the_batches_it_finished(tmp_path, monkeypatch) -> None:
    def cut_off_train(yaml, run_folder: Path, overrides, nproc, timeout_s):
        run_folder.mkdir(parents=True)
        rows = [{"step": step, "loss/train/total": 10.0 - step, "throughput/tokens_per_sec": 100.0 * step,
                 "memory/peak_allocated_mem": 5.0 + step} for step in range(1, 7)]  # fmt: skip
        (run_folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"step": 7, "lo')
        return None  # the time limit passed

    monkeypatch.setattr(preference, "foundry_train", cut_off_train)
    row = preference.measure("sft-1b", tmp_path, tmp_path, timeout_s=10, smoke=False)
    assert row["exit code"] is None and row["batches"] == 6 and row["loss first/last"] == [9.0, 4.0]
    assert row["tokens/s"] == 550 and row["peak GiB"] == 11.0  # the median of the windows after the 4 warm-up batches
