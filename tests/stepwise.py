"""Run a sequence through a KV cache in pieces, saying positions and cache columns explicitly."""

from __future__ import annotations

import torch

from aie_lessons.model import AttentionMetadata

def chunked_logits(model, ids: torch.Tensor, cache, bounds: list[int]) -> torch.Tensor:
    """Logits (1, S, vocab) of ids (1, S), fed through ``cache`` in chunks ending at ``bounds``.

    ``bounds=[7, 8, 9, ...]`` is a prefill of 7 then one token per step; ``[5, 10]`` two chunks.
    The caller owns progress, so each chunk is given its positions and its first cache column.
    """
    positions = torch.arange(ids.shape[1])[None]
    parts, start = [], 0
    for end in bounds:
        parts.append(model(ids[:, start:end], positions[:, start:end], AttentionMetadata(cache=cache, cache_start=start)))
        start = end
    return torch.cat(parts, dim=1)


def prefill_then_decode(model, ids: torch.Tensor, cache, prefill: int) -> torch.Tensor:
    """``chunked_logits`` with a prefill of ``prefill`` tokens, then one token per step."""
    return chunked_logits(model, ids, cache, [prefill, *range(prefill + 1, ids.shape[1] + 1)])
