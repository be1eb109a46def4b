"""The data sections of a run: which tokenizer, and how a dataloader batches (LLM Foundry's loader keys).

The ``text`` and ``finetuning`` builders take these keys as keyword arguments with these defaults
(``LOADER_DEFAULTS``); the YAML's ``train_loader`` / ``eval_loader`` sections are ``LoaderConfig``s.
"""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any

from foundry.schema import doc, field_defaults


@dataclasses.dataclass(kw_only=True)
class TokenizerConfig:
    name: str = field(metadata=doc("Hugging Face tokenizer name or local folder"))
    kwargs: dict[str, Any] = field(default_factory=dict, metadata=doc("passed to the tokenizer's from_pretrained"))


@dataclasses.dataclass(kw_only=True)
class LoaderConfig:
    """A dataloader: ``name`` picks a registered builder; the other keys are its arguments."""

    name: str = field(metadata=doc("registered dataloader, e.g. text"))
    dataset: dict[str, Any] = field(
        default_factory=dict, metadata=doc("the dataset's own keys (local, split, max_seq_len...)")
    )
    label: str | None = field(default=None, metadata=doc("eval metrics are logged as metrics/<label>/..."))
    drop_last: bool = field(default=False, metadata=doc("drop the last incomplete batch"))
    num_workers: int = field(default=0, metadata=doc("dataloader worker processes"))
    pin_memory: bool = field(default=True, metadata=doc("page-locked host memory for faster copies to the GPU"))
    prefetch_factor: int | None = field(
        default=None, metadata=doc("batches each worker loads ahead (torch's default when None)")
    )
    persistent_workers: bool = field(
        default=False, metadata=doc("keep workers alive between epochs (needs num_workers > 0)")
    )
    timeout: float = field(default=0.0, metadata=doc("seconds to wait for a batch from a worker (0 = forever)"))


LOADER_DEFAULTS = field_defaults(LoaderConfig)
