"""A static key/value cache for decoding one token at a time without re-running the prefix.

The idea is gpt-fast's (``pytorch-labs/gpt-fast``, ``KVCache``): every layer's keys and values live
in buffers preallocated once for ``max_len`` tokens; a forward writes its tokens at columns
``[length, length + new)`` and attends over all ``max_len`` columns, the ones not written yet hidden
by the causal mask. Shapes stay fixed from step to step (no ``torch.cat``), which is what
``torch.compile`` and CUDA graphs want.

Rows are left-padded, so every row's next token lands in the same column and one ``length`` serves
the batch; ``key_padding_mask`` marks the padding. ``MPTTransformer.forward(..., cache=...)`` uses it.

``length`` is a host int until ``keep_length_on_device``; from then on it is a 0-d device tensor that
each forward advances in place, so a decode step reads no host value and its kernels can be captured
once in a CUDA graph and replayed (``foundry/models/generation.py``).
"""

from __future__ import annotations

import torch

from foundry.errors import FoundryError


class LayerKVCache:
    """One layer's keys and values, each (batch, kv_heads, max_len, head_dim).

    The buffers are allocated at the first write, in the keys' dtype, device and head count: autocast
    and FSDP's mixed precision decide those, not whoever made the cache.
    """

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (batch, kv_heads, new, head_dim) at columns ``start ..``; return the whole buffers.

        ``start`` is an int, or a 0-d device tensor (the columns are then indexed on the device).
        """
        if self.keys is None or self.values is None:
            shape = (k.shape[0], k.shape[1], self.max_len, k.shape[3])
            self.keys, self.values = k.new_zeros(shape), v.new_zeros(shape)
        if isinstance(start, torch.Tensor):
            columns = start + torch.arange(k.shape[2], device=k.device)
            self.keys.index_copy_(2, columns, k)
            self.values.index_copy_(2, columns, v)
        else:
            self.keys[:, :, start : start + k.shape[2]] = k
            self.values[:, :, start : start + k.shape[2]] = v
        return self.keys, self.values


class KVCache:
    """The keys and values of every layer for a batch of up to ``max_len`` tokens per row.

    Make one per batch with ``model.new_kv_cache(max_len)``, pass it to each forward (the prompts,
    then one token per row per step) and read ``length`` for how many columns are filled.
    """

    def __init__(self, n_layers: int, max_len: int) -> None:
        self.max_len = max_len
        self.layers = [LayerKVCache(max_len) for _ in range(n_layers)]
        self.length: int | torch.Tensor = 0
        # (batch, max_len) bool, True = a real token; columns not yet written are True and causally hidden.
        self.key_padding_mask: torch.Tensor | None = None

    def add_tokens(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Record which of the next tokens are padding (attention_mask 0); return ``key_padding_mask``."""
        batch, new_len = input_ids.shape
        if isinstance(self.length, torch.Tensor):  # a decode step: its caller keeps count (no host sync here)
            if attention_mask is not None:
                raise FoundryError(
                    "A KV cache whose length is kept on the device takes new tokens without an attention_mask "
                    "(decode steps); pass the padded prompts before keep_length_on_device()."
                )
            return self.key_padding_mask
        end = self.length + new_len
        if end > self.max_len:
            raise FoundryError(
                f"A forward adds {new_len} tokens to a KV cache holding {self.length} of {self.max_len}; "
                f"make the cache with max_len >= prompt length + tokens to generate."
            )
        if self.key_padding_mask is None:
            self.key_padding_mask = torch.ones(batch, self.max_len, dtype=torch.bool, device=input_ids.device)
        elif self.key_padding_mask.shape[0] != batch:
            raise FoundryError(
                f"A forward of {batch} rows reuses a KV cache made for {self.key_padding_mask.shape[0]}; "
                f"make a new cache per batch."
            )
        if attention_mask is not None:
            self.key_padding_mask[:, self.length : end] = attention_mask.bool()
        return self.key_padding_mask

    def advance(self, new_len: int) -> None:
        """Count ``new_len`` more filled columns (in place on the device once ``length`` lives there)."""
        if isinstance(self.length, torch.Tensor):
            self.length.add_(new_len)
        else:
            self.length += new_len

    def keep_length_on_device(self, device: torch.device) -> None:
        """Hold ``length`` as a 0-d tensor on ``device`` from now on (after the prompts)."""
        if self.key_padding_mask is None:
            raise FoundryError("keep_length_on_device() needs the prompts in the cache first.")
        self.length = torch.tensor(int(self.length), dtype=torch.long, device=device)
