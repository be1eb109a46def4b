"""The one helper that runs a function on N gloo ranks: ``ranks.run(world_size, fn, *args)``.

Two worker processes start once per test session (importing torch takes seconds) and are reused:
each call runs ``fn(*args, **kwargs)`` on the first ``world_size`` workers inside a fresh process group
(joined through ``foundry.distributed.init_process_group``, as torchrun's ranks do) and returns
the per-rank results. ``fn`` must be a module-level function of a test file; workers import that
file by path. A job runs in the calling test's environment and leaves nothing to the next: the environment,
torch's switches and dynamo's caches are put back as the worker had them (``helpers.ProcessState``).
"""

from __future__ import annotations

import importlib.util
import os
import queue
import traceback
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from helpers import ProcessState, RendezvousStore

NUM_WORKERS = 2
JOB_TIMEOUT_S = 120.0
COLLECTIVE_TIMEOUT_S = 60.0  # a rank whose peer died fails instead of waiting the default 10 minutes


class Ranks:
    """A pool of worker processes that run jobs as the ranks of a gloo process group."""

    def __init__(self, num_workers: int = NUM_WORKERS) -> None:
        context = mp.get_context("spawn")
        self.results = context.Queue()
        self.jobs = [context.Queue() for _ in range(num_workers)]
        self.workers = [
            context.Process(target=_worker_loop, args=(jobs, self.results), daemon=True) for jobs in self.jobs
        ]
        for worker in self.workers:
            worker.start()

    def run(
        self, world_size: int, fn: Callable[..., Any], *args: Any, env: dict[str, str] | None = None, **kwargs: Any
    ) -> list:
        """``fn(*args, **kwargs)`` on ranks ``0..world_size-1``; returns their results in rank order.

        The job sees the calling test's environment, as a subprocess would, and ``env`` on top (e.g.
        ``LOCAL_WORLD_SIZE=1``: one rank per node, each its node's ``LOCAL_RANK`` 0).
        """
        rendezvous = RendezvousStore()  # one per job: its keys start empty
        job_env = {
            **os.environ, **rendezvous.env, "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
            "CUDA_VISIBLE_DEVICES": "",  # gloo ranks on the CPU, also on a machine with fewer GPUs than ranks
            **(env or {}),
        }  # fmt: skip
        ranks_per_node = int(job_env["LOCAL_WORLD_SIZE"])
        for rank in range(world_size):
            rank_env = {**job_env, "RANK": str(rank), "LOCAL_RANK": str(rank % ranks_per_node)}  # as torchrun numbers
            self.jobs[rank].put((fn.__code__.co_filename, fn.__name__, args, kwargs, rank_env))
        results: dict[int, Any] = {}
        errors = []
        for _ in range(world_size):
            try:
                rank, ok, value = self.results.get(timeout=JOB_TIMEOUT_S)
            except queue.Empty:
                self.close()
                raise TimeoutError(f"{fn.__name__} did not finish on {world_size} ranks in {JOB_TIMEOUT_S} s") from None
            results[rank] = value
            if not ok:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            raise RuntimeError(f"{fn.__name__} failed on {world_size} ranks:\n" + "\n".join(errors))
        return [results[rank] for rank in range(world_size)]

    def close(self) -> None:
        for jobs in self.jobs:
            jobs.put(None)
        for worker in self.workers:
            worker.join(timeout=10)
            if worker.is_alive():
                worker.kill()


def _worker_loop(jobs: Any, results: Any) -> None:
    torch.set_num_threads(1)  # as torchrun does: ranks sharing few cores must not oversubscribe them
    modules: dict[str, ModuleType] = {}
    while (job := jobs.get()) is not None:
        path, name, args, kwargs, env = job
        state = ProcessState()  # put back after the job, with a fresh dynamo
        os.environ.clear()  # the job's environment alone, not what the test that started this worker had
        os.environ.update(env)
        try:
            fn = getattr(_import(path, modules), name)
            ok, value = True, _run_in_group(fn, args, kwargs)
        except BaseException:
            ok, value = False, traceback.format_exc()
        if left := state.restore():
            ok, value = False, f"{name} left behind {'; '.join(left)}" + ("" if ok else f"\n{value}")
        results.put((int(env["RANK"]), ok, value))


def _run_in_group(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
    from foundry.distributed import destroy_process_group, init_process_group

    init_process_group(timeout_s=COLLECTIVE_TIMEOUT_S)
    try:
        return fn(*args, **kwargs)
    finally:
        destroy_process_group()


def _import(path: str, modules: dict[str, ModuleType]) -> ModuleType:
    if path not in modules:
        spec = importlib.util.spec_from_file_location(f"_distributed_job_{len(modules)}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        modules[path] = module
    return modules[path]


@pytest.fixture(scope="session")
def ranks() -> Iterator[Ranks]:
    pool = Ranks()
    yield pool
    pool.close()
