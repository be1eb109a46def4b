"""A run killed with SIGKILL in the middle of saving still resumes from its last complete checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from foundry.checkpoint import latest_checkpoint, load_checkpoint
from foundry.core import State, Time

REPO_ROOT = Path(__file__).resolve().parents[2]

# Saves forever; each checkpoint's weights all equal its batch number, so a load can be checked.
SAVE_LOOP = textwrap.dedent(
    """
    import sys
    import torch
    from foundry.checkpoint import save_checkpoint
    from foundry.core import State, Time

    model = torch.nn.Linear(1024, 2048, bias=False)  # 8 MiB: each save takes a while to write
    state = State(model=model, max_duration=Time.parse("100000ba"))
    while True:
        state.timestamp = state.timestamp.after_batch(samples=1, tokens=1, duration_s=0.0)
        with torch.no_grad():
            model.weight.fill_(state.timestamp.batch)
        save_checkpoint(sys.argv[1], state, num_to_keep=2)
        print(state.timestamp.batch, flush=True)
    """
)


def test_sigkill_during_save_leaves_a_loadable_latest_checkpoint(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-c", SAVE_LOOP, str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    try:
        first_saved = child.stdout.readline()  # blocks until the first checkpoint is complete
        assert first_saved.strip() == b"1", child.stderr.read().decode()
        os.kill(child.pid, signal.SIGKILL)  # the child is now inside its second save
    finally:
        child.kill()
        child.wait(timeout=30)
        child.stdout.close()
        child.stderr.close()

    latest = latest_checkpoint(tmp_path)
    assert latest is not None
    state = State(model=torch.nn.Linear(1024, 2048, bias=False), max_duration=Time.parse("1ba"))
    load_checkpoint(latest, state)
    assert state.timestamp.batch >= 1
    assert torch.all(state.model.weight == state.timestamp.batch)
