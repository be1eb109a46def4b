"""Several machines rehearsed on one: launchers of `foundry train --nnodes 2` meet at 127.0.0.1, train as one
launcher of the same world size does, and say why when they cannot start or lose a node.

The runs read a JSONL finetuning set (no streaming: its shared memory is host-wide, and two launchers on one
host would share it as two machines never do).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from helpers import repo_pythonpath

from foundry.checkpoint import latest_checkpoint
from foundry.data import builtin_corpus_documents, train_bpe_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("instructions")
    train_bpe_tokenizer(builtin_corpus_documents()[:2], vocab_size=280, out_dir=folder / "tokenizer")
    rows = [{"prompt": f"Q{index}:", "response": " yes" * (1 + index % 5)} for index in range(64)]
    (folder / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return folder


def overrides(folder: Path, data: Path, *more: str) -> list[str]:
    """The quickstart model, tiny, on the JSONL set: FULL_SHARD, a checkpoint every 2 batches."""
    loader = (
        f"{{name: finetuning, dataset: {{hf_name: {data}, split: train, max_seq_len: 32, shuffle: true, "
        "shuffle_seed: 17, packing_ratio: 2, decoder_only_format: true}, drop_last: true, num_workers: 0}"
    )
    return [
        f"variables.data_local={data}", f"train_loader={loader}", "eval_loader=null", "eval_first=false",
        "model.d_model=32", "model.n_layers=2", "model.max_seq_len=32", "model.vocab_size=320",
        "variables.max_seq_len=32", "global_train_batch_size=4", "device_train_microbatch_size=1",
        "console_log_interval=1ba", "callbacks={}", "max_duration=4ba", "save_interval=2ba", "autoresume=true",
        "device=cpu", "fsdp_config={sharding_strategy: FULL_SHARD}", f"run_folder={folder / 'run'}",
        f"save_folder={folder / 'ckpt'}", *more,
    ]  # fmt: skip


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start(options: Sequence[str], settings: Sequence[str]) -> subprocess.Popen:
    """``python -m foundry train OPTIONS quickstart.yaml SETTINGS``, its output captured."""
    env = {**os.environ, "PYTHONPATH": repo_pythonpath(), "CUDA_VISIBLE_DEVICES": ""}
    command = [sys.executable, "-m", "foundry", "train", *options, str(REPO_ROOT / "yamls" / "quickstart.yaml")]
    return subprocess.Popen([*command, *settings], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def start_nodes(nproc: int, settings_per_node: Sequence[Sequence[str]], *options: str) -> list[subprocess.Popen]:
    """One launcher of ``nproc`` ranks per entry of ``settings_per_node``, meeting at a free port of 127.0.0.1."""
    endpoint = f"127.0.0.1:{free_port()}"
    node = ["--nproc", str(nproc), "--nnodes", str(len(settings_per_node)), "--rdzv-endpoint", endpoint, *options]
    return [start([*node, "--node-rank", str(rank)], settings) for rank, settings in enumerate(settings_per_node)]


def finish(launchers: Sequence[subprocess.Popen]) -> list[tuple[int, str]]:
    """Each launcher's exit code and output."""
    return [(launcher.wait(TIMEOUT_S), launcher.stdout.read()) for launcher in launchers]


def losses(folder: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss/train/total"] for row in rows if "loss/train/total" in row}


@pytest.mark.slow  # launches processes and waits out a timeout: 6-14 s
def test_a_launcher_alone_gives_up_naming_the_stage_the_endpoint_and_who_came(tmp_path, data):
    started = time.monotonic()
    endpoint = f"127.0.0.1:{free_port()}"
    options = ["--nproc", "1", "--nnodes", "2", "--rdzv-endpoint", endpoint, "--rdzv-timeout-s", "3"]
    [(code, output)] = finish([start(options, overrides(tmp_path, data))])
    assert code != 0, output[-3000:]
    assert f"error: rendezvous: 1 of 2 nodes arrived at {endpoint} " in output, output[-3000:]
    assert "within 3 s (--rdzv-timeout-s)" in output and "Traceback" not in output, output[-3000:]
    assert time.monotonic() - started < 60


@pytest.mark.slow  # launches processes and waits out a timeout: 6-14 s
def test_nodes_started_with_different_configs_are_refused_naming_the_key(tmp_path, data):
    node1 = overrides(tmp_path, data, "optimizer.lr=1e-3")
    for code, output in finish(start_nodes(1, [overrides(tmp_path, data), node1])):
        assert code == 2, output[-3000:]
        assert "different configs; the first key that differs is 'optimizer.lr' (rank 0 (node 0): 0.003; " in output
        assert "rank 1 (node 1): 0.001)" in output
    assert not (tmp_path / "ckpt").exists()  # refused before anything was written


@pytest.mark.slow  # three launchers start and train (about 25 s on 2 cores)
def test_two_launchers_of_one_rank_train_as_one_launcher_of_two_bit_for_bit(tmp_path, data):
    together = finish(start_nodes(1, [overrides(tmp_path / "nodes", data)] * 2))
    alone = finish([start(["--nproc", "2"], overrides(tmp_path / "one", data))])
    for code, output in together + alone:
        assert code == 0, output[-3000:]
    assert losses(tmp_path / "nodes") == losses(tmp_path / "one")
    assert sorted(losses(tmp_path / "one")) == [1, 2, 3, 4]


@pytest.mark.slow  # eight launchers start; four ranks share 2 cores (about 70 s)
def test_two_launchers_of_two_ranks_train_as_four_launchers_of_one_and_hybrid_shard_as_full_shard(tmp_path, data):
    hybrid = "fsdp_config={sharding_strategy: HYBRID_SHARD}"  # shard within each launcher's 2 ranks, replicate across
    for name, nproc, nodes, more in (("two", 2, 2, ()), ("four", 1, 4, ()), ("hybrid", 2, 2, (hybrid,))):
        for code, output in finish(start_nodes(nproc, [overrides(tmp_path / name, data, *more)] * nodes)):
            assert code == 0, output[-3000:]
    assert losses(tmp_path / "two") == losses(tmp_path / "four")
    assert sorted(losses(tmp_path / "two")) == [1, 2, 3, 4]
    assert losses(tmp_path / "hybrid") == pytest.approx(losses(tmp_path / "two"), abs=1e-6, rel=0)


@pytest.mark.slow  # two launchers train until a checkpoint, then one relaunch (about 30 s on 2 cores)
@pytest.mark.parametrize("lost_node", [1, 0], ids=["a-node", "the-node-hosting-the-rendezvous"])
def test_a_lost_node_stops_the_other_naming_its_ranks_and_one_node_resumes(tmp_path, data, lost_node):
    settings = overrides(tmp_path, data, "max_duration=2000ba")
    launchers = start_nodes(1, [settings] * 2)
    survivor, lost = launchers[1 - lost_node], launchers[lost_node]
    deadline = time.monotonic() + TIMEOUT_S
    while not (tmp_path / "ckpt" / "latest").exists() and time.monotonic() < deadline and survivor.poll() is None:
        time.sleep(0.5)
    assert (tmp_path / "ckpt" / "latest").exists(), survivor.stdout.read()[-3000:]
    lost_ranks = _children(lost.pid)
    os.kill(lost.pid, signal.SIGKILL)  # its ranks die with it (the kernel's parent-death signal)
    killed = time.monotonic()
    code, output = finish([survivor])[0]
    assert time.monotonic() - killed < 60
    assert lost_ranks and not any(_running(pid) for pid in lost_ranks)
    assert code == 1 and "Traceback" not in output, output[-3000:]
    died = re.search(rf"lost contact with the other ranks: rank \d \(node {lost_node}, on this machine\) died", output)
    assert died, output[-3000:]
    if lost_node == 0:  # the survivor's launcher lost the store too
        assert "error: rendezvous: no connection to the rendezvous store at 127.0.0.1:" in output, output[-3000:]

    reached = int(latest_checkpoint(tmp_path / "ckpt").name.rsplit("-ba", 1)[1])
    relaunched = finish([start(["--nproc", "1"], overrides(tmp_path, data, f"max_duration={reached + 2}ba"))])
    code, output = relaunched[0]
    assert code == 0, output[-3000:]
    assert f"[batch {reached + 1}/{reached + 2}]" in output, output[-3000:]


@pytest.mark.slow  # two launchers train, one hangs; the other waits for its silence (about 45 s on 2 cores)
def test_a_node_that_hangs_is_named_by_the_others_launcher_within_a_minute(tmp_path, data):
    """SIGSTOP keeps the hung node's connections open, so the collectives would wait ``dist_timeout`` (10 min)."""
    survivor, hung = start_nodes(1, [overrides(tmp_path, data, "max_duration=2000ba")] * 2)
    deadline = time.monotonic() + TIMEOUT_S
    while not (tmp_path / "ckpt" / "latest").exists() and time.monotonic() < deadline and survivor.poll() is None:
        time.sleep(0.5)
    machine = [hung.pid, *_children(hung.pid)]
    for pid in machine:
        os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        code, output = finish([survivor])[0]
        assert time.monotonic() - stopped < 60
    finally:
        os.kill(hung.pid, signal.SIGKILL)  # its ranks die with it
        hung.wait(TIMEOUT_S)
    assert code == 1 and "Traceback" not in output, output[-3000:]
    assert re.search(r"error: node lost: the launcher on \S+ \(torchrun's node \d, rank \d\) stopped answering the "
                     r"rendezvous at 127\.0\.0\.1:\d+ \d+ s ago", output), output[-3000:]  # fmt: skip


def _children(pid: int) -> list[int]:
    """The pids of ``pid``'s children (a launcher's ranks), read from /proc (Linux)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _running(pid: int) -> bool:
    """Whether ``pid`` runs: neither gone nor a zombie that nobody reaped yet (Linux)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False
