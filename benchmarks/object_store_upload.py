"""What an object-store save_folder costs training: the same run saved locally and to S3 (moto's server on localhost).

Prints JSON: fit seconds with save_folder local and s3://, the checkpoint size, and the seconds to upload
and to download one checkpoint. moto is an in-process Python server on the loopback interface: its
transfer rates say nothing about a real store's; the fit times show what the background upload adds.
Run: python benchmarks/object_store_upload.py (needs boto3 and moto[server]).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import boto3
import torch

from foundry.checkpoint.object_store import ObjectStore
from foundry.models import MPTCausalLM
from foundry.trainer import Trainer

MODEL = {"d_model": 256, "n_heads": 4, "n_layers": 4, "vocab_size": 4096, "max_seq_len": 64}
NUM_BATCHES, SAVE_INTERVAL = 12, "4ba"


def fit_seconds(save_folder: str, work: Path) -> float:
    torch.manual_seed(0)
    batches = [{"input_ids": torch.randint(0, 4096, (4, 64), generator=torch.Generator().manual_seed(i))} for i in
               range(NUM_BATCHES)]  # fmt: skip
    trainer = Trainer(model=MPTCausalLM(**MODEL), train_dataloader=batches, max_duration=f"{NUM_BATCHES}ba",
                      save_folder=save_folder, save_interval=SAVE_INTERVAL, device="cpu",
                      run_folder=str(work / "run"), log_to_console=False)  # fmt: skip
    start = time.perf_counter()
    trainer.fit()  # returns once every checkpoint is uploaded
    return time.perf_counter() - start


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_for(host: str, port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as probe:
            if probe.connect_ex((host, port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"moto's server did not start on {host}:{port}")


def main() -> None:
    work = Path(tempfile.mkdtemp())
    # A process of its own, as a real store is: in this one, its request handling would compete with training.
    host, port = "127.0.0.1", _free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", host, "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    _wait_for(host, port)
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      S3_ENDPOINT_URL=f"http://{host}:{port}", FOUNDRY_CACHE_DIR=str(work / "cache"))  # fmt: skip
    boto3.client("s3", endpoint_url=os.environ["S3_ENDPOINT_URL"]).create_bucket(Bucket="bench")
    fit_seconds(str(work / "warm-up"), work)  # the first fit pays for imports and allocator warm-up
    local_runs = [fit_seconds(str(work / f"local-{trial}"), work) for trial in range(2)]
    s3_runs = [fit_seconds(f"s3://bench/run-{trial}", work) for trial in range(2)]
    local_s, s3_s = min(local_runs), min(s3_runs)
    checkpoint = work / "local-0" / f"ep0-ba{NUM_BATCHES}"
    files = [path for path in checkpoint.iterdir() if path.is_file()]
    size_mb = sum(path.stat().st_size for path in files) / 1e6
    store = ObjectStore("s3://bench/copy")
    start = time.perf_counter()
    for path in files:
        store.upload(path, f"ckpt/{path.name}")
    upload_s = time.perf_counter() - start
    start = time.perf_counter()
    for path in files:
        store.download(f"ckpt/{path.name}", work / "downloaded" / path.name)
    download_s = time.perf_counter() - start
    server.terminate()
    server.wait()
    result = {"batches": NUM_BATCHES, "save_interval": SAVE_INTERVAL, "checkpoint_mb": round(size_mb, 1)}
    result |= {"fit_local_s (best of 2)": round(local_s, 2), "fit_s3_s (best of 2)": round(s3_s, 2)}
    result |= {"upload_one_checkpoint_s": round(upload_s, 2), "download_one_checkpoint_s": round(download_s, 2)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
