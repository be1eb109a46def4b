"""The reused ranks of ``ranks.run`` (tests/distributed/conftest.py): a job leaves nothing to the next."""

from __future__ import annotations

import os

import torch


def leave_the_environment_and_compile(name: str) -> None:
    os.environ[name] = "left by a job"
    torch.compile(lambda x: x + 1, backend="eager")(torch.ones(1))


def environment_and_compiled_code() -> tuple[dict[str, str | None], int]:
    names = ("FOUNDRY_CACHE_DIR", "FOUNDRY_TEST_JOB_ENV")
    return {name: os.environ.get(name) for name in names}, len(torch._dynamo.eval_frame.cached_backends)


def test_a_job_leaves_neither_its_environment_nor_dynamos_caches_to_the_next(ranks) -> None:
    ranks.run(2, leave_the_environment_and_compile, "FOUNDRY_CACHE_DIR", env={"FOUNDRY_TEST_JOB_ENV": "job"})
    environment, cached_backends = ranks.run(2, environment_and_compiled_code)[1]
    assert environment == {"FOUNDRY_CACHE_DIR": None, "FOUNDRY_TEST_JOB_ENV": None}
    assert cached_backends == 0
