"""Ranks started with different configs are refused at start, naming the first key that differs."""

from __future__ import annotations

import pytest

from foundry.distributed import check_same_config, get_rank
from foundry.errors import ConfigError


def refusal(resolved_by_rank: list[dict]) -> str | None:
    """``check_same_config`` on this rank's config: its refusal, or None when the ranks agree."""
    try:
        check_same_config(resolved_by_rank[get_rank()])
    except ConfigError as error:
        return str(error)
    return None


def test_ranks_with_the_same_config_go_on(ranks):
    config = {"model": {"d_model": 32}, "max_duration": "6ba"}
    assert ranks.run(2, refusal, [config, dict(config)]) == [None, None]


def test_a_rank_with_another_value_is_refused_on_every_rank_naming_the_first_key_and_both_values(ranks):
    rank0 = {"model": {"d_model": 32, "n_layers": 2}, "max_duration": "6ba"}
    rank1 = {"model": {"d_model": 32, "n_layers": 4}, "max_duration": "8ba"}
    messages = ranks.run(2, refusal, [rank0, rank1])
    assert messages[0] == messages[1]
    assert "the first key that differs is 'model.n_layers' (rank 0 (node 0): 2; rank 1 (node 0): 4)" in messages[0]


def test_a_key_only_one_rank_has_is_a_difference(ranks):
    messages = ranks.run(2, refusal, [{"a": 1}, {"a": 1, "b": {"c": True}}])
    assert "'b.c' (rank 0 (node 0): not set; rank 1 (node 0): true)" in messages[1]


@pytest.mark.parametrize("resolved", [{}, {"a": [1, 2]}])
def test_one_process_has_nothing_to_compare(resolved):
    check_same_config(resolved)
