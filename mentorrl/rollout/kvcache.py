"""KV-cache helpers shared by the rollout engine and the learner.

They work on Hugging Face ``DynamicCache`` objects and degrade gracefully (return
False/None) for cache types whose layers they cannot edit.
"""

from __future__ import annotations

import inspect

import torch

from mentorrl.rollout.adapters import base_module


def common_prefix_len(seqs: list[list[int]]) -> int:
    """Length of the token prefix every sequence in ``seqs`` (at least one) shares: what a shared
    prefill (the engine) or a prefix-tree pack (the learner) computes once."""
    first = seqs[0]
    n = min(len(x) for x in seqs)
    for other in seqs[1:]:
        k = 0
        while k < n and other[k] == first[k]:
            k += 1
        n = k
    return n


def cache_kwarg(model) -> str:
    """transformers >= 5.2x calls the cache argument ``cache``; earlier releases ``past_key_values``
    (a ``peft`` wrapper passes it on to the model it wraps, whose signature decides)."""
    return "cache" if "cache" in inspect.signature(base_module(model).forward).parameters else "past_key_values"


def make_cache(model):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older transformers
        return DynamicCache()


def _cache_layers(cache) -> list | None:
    layers = getattr(cache, "layers", None)
    if not layers or not all(hasattr(l, "keys") and hasattr(l, "values") for l in layers):
        return None
    return layers


def expand_batch(cache, batch: int, copy: bool = True) -> bool:
    """Broadcast a batch-1 cache to ``batch`` rows (shared prompt prefix). False if unsupported.

    ``copy=False`` keeps a broadcast view (differentiable, used by the learner)."""
    layers = _cache_layers(cache)
    if layers is None:
        return False
    for layer in layers:
        k = layer.keys.expand(batch, *layer.keys.shape[1:])
        v = layer.values.expand(batch, *layer.values.shape[1:])
        layer.keys, layer.values = (k.contiguous(), v.contiguous()) if copy else (k, v)
    return True


def compact(cache, attn: torch.Tensor) -> torch.Tensor | None:
    """Squeeze the pad holes out of the cache: each row's real entries, in order, right-aligned.

    Keys carry their rotary position already, so moving them in the cache changes nothing
    a query sees. Returns the new attention mask, or None if the cache type is unsupported.
    """
    layers = _cache_layers(cache)
    if layers is None:
        return None
    width = int(attn.sum(1).max())
    # pads first, then reals in order; the last ``width`` columns (none when no row has a real entry)
    idx = torch.sort(attn, dim=1, stable=True).indices[:, attn.shape[1] - width :]
    for layer in layers:
        B, H, _, D = layer.keys.shape
        gi = idx[:, None, :, None].expand(B, H, width, D)
        layer.keys = layer.keys.gather(2, gi)
        layer.values = layer.values.gather(2, gi)
    return attn.gather(1, idx)


def add_rows(cache, n: int) -> bool:
    """Append ``n`` empty rows (all-zero keys/values over the current width) to the batch.

    New rows see none of the existing columns: the caller gives them attention-mask zeros
    there, so they start like a fresh sequence. False if the cache type is unsupported."""
    if n <= 0:
        return True
    layers = _cache_layers(cache)
    if layers is None:
        return False
    for layer in layers:
        k, v = layer.keys, layer.values
        layer.keys = torch.cat([k, k.new_zeros(n, *k.shape[1:])], dim=0)
        layer.values = torch.cat([v, v.new_zeros(n, *v.shape[1:])], dim=0)
    return True
