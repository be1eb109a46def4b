"""``foundry convert from-hf`` of a sharded checkpoint, read a file and a layer at a time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import repo_pythonpath
from transformers import LlamaConfig, LlamaForCausalLM

from foundry.convert.commands import from_hf_model

SHARD_MB = 3  # one layer of the wide checkpoint below is 2.6 MB: about one layer a file


def sharded_llama(folder: Path, n_layers: int, width: int = 256) -> Path:
    """A random fp32 Llama saved as files of about ``SHARD_MB`` each (``model.safetensors.index.json``)."""
    config = LlamaConfig(
        vocab_size=512, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=n_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder, max_shard_size=f"{SHARD_MB}MB")
    return folder


def test_a_sharded_checkpoint_imports_as_the_unsharded_one(tmp_path: Path) -> None:
    """The same weights whether transformers wrote one file or many, layers split across files included."""
    sharded = sharded_llama(tmp_path / "sharded", n_layers=3, width=64)
    whole = tmp_path / "whole"
    LlamaForCausalLM.from_pretrained(sharded).save_pretrained(whole)
    assert len(list(sharded.glob("*.safetensors"))) == 1  # a small model fits one file: shard it harder
    LlamaForCausalLM.from_pretrained(whole).save_pretrained(sharded, max_shard_size="20KB")
    assert len(list(sharded.glob("*.safetensors"))) > 3
    got, want = from_hf_model(sharded)[0].state_dict(), from_hf_model(whole)[0].state_dict()
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)


_MEASURE = """
import gc, json, sys
from pathlib import Path
from foundry.checkpoint.hf_weights import layers_of_folder
from foundry.convert.commands import from_hf_model

def status(key):
    line = next(line for line in open('/proc/self/status') if line.startswith(key + ':'))
    return int(line.split()[1]) * 1024

def peak_from_here():
    gc.collect()
    open('/proc/self/clear_refs', 'w').write('5')  # VmHWM starts again from VmRSS
    return status('VmRSS')

from_hf_model(Path(sys.argv[1]))  # imports and first-use allocations, outside the measurements
before = peak_from_here()
for layer in layers_of_folder(Path(sys.argv[2])):
    del layer
reading = status('VmHWM') - before
before = peak_from_here()
model, _ = from_hf_model(Path(sys.argv[2]))
storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in model.state_dict().values()}
model_bytes = sum(storages.values())
importing = status('VmHWM') - before - model_bytes
print(json.dumps({'reading': reading, 'import_over_model': importing, 'model': model_bytes}))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="measures peak memory through Linux's /proc")
@pytest.mark.slow  # launches processes and waits out a timeout: 6-14 s
def test_reading_and_importing_hold_about_one_file_not_the_checkpoint(tmp_path: Path) -> None:
    """A 40-file checkpoint read a layer at a time needs host memory for about one file; imported, about one file
    beyond the model itself: never a second copy of the checkpoint (transformers' model, or every file at once)."""
    small = sharded_llama(tmp_path / "small", n_layers=1, width=64)
    big = sharded_llama(tmp_path / "big", n_layers=40)
    shard_bytes = max(path.stat().st_size for path in big.glob("*.safetensors"))
    env = {**os.environ, "PYTHONPATH": repo_pythonpath()}
    run = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(small), str(big)], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    measured = json.loads(run.stdout.strip().splitlines()[-1])
    assert measured["model"] > 30 * shard_bytes
    assert measured["reading"] < 3 * shard_bytes, measured
    assert measured["import_over_model"] < 4 * shard_bytes, measured
