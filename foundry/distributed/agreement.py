"""Every rank of a job trains the same config: a node started with another YAML, override or environment variable
is refused at start, naming the first key that differs, instead of training something no one asked for.

Each rank hashes its resolved config (every key counts, per-machine paths too: a data folder must have the same
path on every node) and the ranks compare hashes in one all-gather; only when they differ do they gather a hash
per key, to find the first key that differs, and its values.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping
from typing import Any

from foundry.distributed.env import all_gather_object, get_world_size
from foundry.distributed.process_group import rank_nodes
from foundry.errors import ConfigError


def check_same_config(resolved: Mapping[str, Any]) -> None:
    """Raise ConfigError on every rank unless all ranks hold the same ``resolved`` config (a no-op on one rank)."""
    if get_world_size() == 1:
        return
    flat = dict(_flatten(resolved))
    if len(set(all_gather_object(_digest(flat)))) == 1:
        return
    per_key = all_gather_object({key: _digest(value) for key, value in flat.items()})
    keys = list(dict.fromkeys(key for digests in per_key for key in digests))  # rank 0's order, then others'
    key = next(key for key in keys if len({digests.get(key) for digests in per_key}) > 1)
    values = all_gather_object(json.dumps(flat[key], default=str)[:80] if key in flat else "not set")
    by_value: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        by_value.setdefault(value, []).append(rank)
    nodes = rank_nodes()
    sides = "; ".join(f"{_where(ranks, nodes)}: {value}" for value, ranks in by_value.items())
    raise ConfigError(
        f"The nodes of this job were started with different configs; the first key that differs is '{key}' ({sides}). "
        "Start every node with the same YAML, overrides and environment variables, then relaunch."
    )


def _flatten(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(key.path, value)`` for each leaf of nested mappings, in their order."""
    if isinstance(value, Mapping) and value:
        for key, item in value.items():
            yield from _flatten(item, f"{prefix}.{key}" if prefix else str(key))
    else:
        yield prefix, value


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def _where(ranks: list[int], nodes: list[int]) -> str:
    """``ranks 0, 1 (node 0)``: the ranks, and the machines they run on."""
    on = sorted({nodes[rank] for rank in ranks}) if len(nodes) > max(ranks) else []
    node_text = f" (node{'s' if len(on) > 1 else ''} {', '.join(map(str, on))})" if on else ""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}{node_text}"
