"""Shared fixtures: fixed seeds, the shared data folder, and components driven by hand (a tiny State, a
logger that records what it is given, one event at a time)."""

from __future__ import annotations

import http.server
import logging
import random
import secrets
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import SHARED_DATA, FakeClock, ProcessState, TinyLM

from foundry.core import Algorithm, Callback, Event, Logger, LoggerDestination, State, Time
from foundry.models.base import FoundryModel


@pytest.fixture(autouse=True)
def _process_state_restored() -> Iterator[None]:
    """Each test leaves the process as it found it (environment, torch's switches, compiler configs, signal
    handlers) and dynamo fresh; a test that leaves a hook, a mode or a process group behind fails. About 0.1 ms.
    It is set up before any other function-scoped fixture (autouse ones come first, and ``_no_downloads``
    requests it), so it compares after their teardown, when a ``monkeypatch`` they used is undone."""
    state = ProcessState()
    yield
    if left := state.restore():
        pytest.fail(f"the test left behind {'; '.join(left)}", pytrace=False)


@pytest.fixture(autouse=True)
def _fixed_seeds() -> None:
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _no_downloads(_process_state_restored: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """No test reaches GitHub for ICL files: those that fetch use ``icl_server`` (a port nothing listens on here)."""
    monkeypatch.setenv("FOUNDRY_ICL_URL", "http://127.0.0.1:9")
    monkeypatch.delenv("FOUNDRY_ICL_DATA", raising=False)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data``; tests that use it skip cleanly when it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data folder {SHARED_DATA} is absent (FOUNDRY_SHARED_DATA names another)")
    return SHARED_DATA


@pytest.fixture
def icl_copy(shared_data: Path, tmp_path: Path) -> Path:
    """A folder laid out as LLM Foundry's ``scripts/eval`` (``local_data/``, ``yamls/``) over the shared ICL files."""
    folder = tmp_path / "llm-foundry-eval"
    folder.mkdir()
    (folder / "local_data").symlink_to(shared_data / "icl")
    (folder / "yamls").symlink_to(shared_data / "icl" / "reference")
    return folder


@dataclass
class ICLServer:
    url: str
    root: Path  # what it serves: a copy of LLM Foundry's scripts/eval folder
    requests: list[str]  # the paths asked for, in order


@pytest.fixture
def icl_server(icl_copy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ICLServer]:
    """An HTTP server on 127.0.0.1 serving ``icl_copy`` as LLM Foundry's repository would; foundry.icl_data is
    pointed at it (``FOUNDRY_ICL_URL``), with an empty cache (``FOUNDRY_CACHE_DIR``)."""
    requests: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, directory=str(icl_copy), **kwargs)

        def do_GET(self) -> None:
            requests.append(self.path)
            super().do_GET()

        def log_message(self, *args: Any) -> None:  # keep the test output clean
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("FOUNDRY_ICL_URL", url)
    monkeypatch.setenv("FOUNDRY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FOUNDRY_ICL_DATA", raising=False)
    try:
        yield ICLServer(url, icl_copy, requests)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny matrices: one thread is faster than two that wait on each other on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tiny_lm() -> TinyLM:
    return TinyLM()


@pytest.fixture
def clock() -> FakeClock:
    """A clock that moves only when the test sets ``clock.now``."""
    return FakeClock()


class RecordingDestination(LoggerDestination):
    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, float], int]] = []
        self.hyperparameters: dict[str, Any] = {}
        self.texts: list[str] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.calls.append((dict(metrics), step))

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        self.hyperparameters.update(hyperparameters)

    def log_text(self, text: str) -> None:
        self.texts.append(text)

    def last(self, key: str) -> float | None:
        """The most recent value logged under ``key``, or None if never logged."""
        values = [metrics[key] for metrics, _ in self.calls if key in metrics]
        return values[-1] if values else None


class FlopsModel(FoundryModel):
    """A model whose cost is known: ``flops_per_batch`` FLOPs for any batch."""

    def __init__(self, flops_per_batch: int = 0) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        self._flops_per_batch = flops_per_batch

    def flops_per_batch(self, batch: Mapping[str, Any]) -> int:
        return self._flops_per_batch


@pytest.fixture
def recorder() -> RecordingDestination:
    return RecordingDestination()


@pytest.fixture
def state() -> State:
    return State(model=FlopsModel(), max_duration=Time.parse("10ba"))


@pytest.fixture
def logger(state: State, recorder: RecordingDestination) -> Logger:
    return Logger(state, [recorder])


@pytest.fixture
def fire(state: State, logger: Logger) -> Callable[[Callback, Event], None]:
    """Run one event on one callback, or on one algorithm (when it matches the event)."""

    def run(component: Callback | Algorithm, event: Event) -> None:
        if isinstance(component, Algorithm):
            if component.match(event, state):
                component.apply(event, state, logger)
        else:
            component.run_event(event, state, logger)

    return run


@pytest.fixture
def train_batch(state: State, fire: Callable[[Callback, Event], None]) -> Callable[..., None]:
    """Advance the timestamp by one batch, then fire BATCH_END on ``callback``."""

    def run(callback: Callback, samples: int = 4, tokens: int = 32) -> None:
        state.batch = {"input_ids": torch.zeros(samples, tokens // samples, dtype=torch.long)}
        state.batch_num_samples, state.batch_num_tokens = samples, tokens
        state.timestamp = state.timestamp.after_batch(samples, tokens, duration_s=0.0)
        fire(callback, Event.BATCH_END)

    return run


@pytest.fixture
def host_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the tensor methods that read a value to the host (a device sync on GPU), as they are called."""
    reads: list[str] = []

    def counting(method: str) -> Callable[..., Any]:
        original = getattr(torch.Tensor, method)

        def read(tensor: torch.Tensor, *args: Any) -> Any:
            reads.append(method)
            return original(tensor, *args)

        return read

    for method in ("item", "tolist", "__bool__", "__float__"):
        monkeypatch.setattr(torch.Tensor, method, counting(method))
    return reads


@pytest.fixture
def flops_model() -> Callable[[int], FlopsModel]:
    """Build a model that costs the given FLOPs per batch."""
    return FlopsModel


# ------------------------------------------------------------------------------ object stores
@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A real S3-protocol server on localhost (moto's standalone server) for the session; skipped without moto."""
    pytest.importorskip("boto3")
    moto_server = pytest.importorskip("moto.server")
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_bucket(s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """``s3://<a new bucket>`` on the session's server; the environment points the SDKs at it with dummy
    credentials (inherited by subprocesses), and foundry's local copies go under ``tmp_path/cache``."""
    import boto3

    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": s3_endpoint,
        "S3_ENDPOINT_URL": s3_endpoint,  # what mosaicml-streaming reads
        "FOUNDRY_CACHE_DIR": str(tmp_path / "cache"),
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    bucket = f"bucket-{secrets.token_hex(6)}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    return f"s3://{bucket}"
