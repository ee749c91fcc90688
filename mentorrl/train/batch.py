"""Learner-side views of trajectories: padded tensors and recomputed log-probabilities.

The learner works only on ``Trajectory.token_ids``; nothing here renders or tokenises text.
Tensors are aligned to token positions: ``logprobs[b, t]`` is the log-probability of
``token_ids[b, t]`` given the tokens before it (0 at t = 0, which is never a policy token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from mentorrl.algos.logprobs import entropy_from_logits, gather_token_logprobs
from mentorrl.trajectory import Trajectory


@dataclass
class TokenBatch:
    input_ids: torch.Tensor  # [B, T] right-padded
    attention_mask: torch.Tensor  # [B, T]
    loss_mask: torch.Tensor  # [B, T] float, 1 on policy tokens
    old_logprobs: torch.Tensor  # [B, T] behaviour log-probs (0 off-policy-token)

    def to(self, device) -> "TokenBatch":
        return TokenBatch(*(t.to(device) for t in (self.input_ids, self.attention_mask, self.loss_mask, self.old_logprobs)))


def collate(trajs: Sequence[Trajectory], pad_id: int) -> TokenBatch:
    T = max(len(t.token_ids) for t in trajs)
    B = len(trajs)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    attn = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.float32)
    old = torch.zeros(B, T, dtype=torch.float32)
    for b, t in enumerate(trajs):
        n = len(t.token_ids)
        ids[b, :n] = torch.tensor(t.token_ids)
        attn[b, :n] = 1
        mask[b, :n] = torch.tensor(t.loss_mask, dtype=torch.float32)
        old[b, :n] = torch.tensor(t.logprobs, dtype=torch.float32)
    return TokenBatch(ids, attn, mask, old)


def shared_prefix_len(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> int:
    """Length of the token prefix every row shares (all rows real there)."""
    same = (input_ids == input_ids[:1]).all(0) & attention_mask.bool().all(0)
    return int(same.long().cumprod(0).sum())


def _logits(model, batch: TokenBatch, min_shared: int = 32) -> torch.Tensor:
    """Next-token logits for positions 0..T-2, [B, T-1, V].

    When every row starts with the same prompt (the system turn), the prefix runs once at
    batch size 1 and its KV cache is broadcast to all rows; gradients flow back through the
    broadcast, so the result and its gradient equal the plain full-batch forward.
    """
    ids, attn = batch.input_ids, batch.attention_mask
    B, T = ids.shape
    P = shared_prefix_len(ids, attn) if B > 1 else 0
    P = min(P, T - 1)
    if P < min_shared:
        return model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1]
    from mentorrl.rollout.engine import _cache_kwarg, _expand_batch, _make_cache

    cache, kw = _make_cache(model), _cache_kwarg(model)
    head = model(input_ids=ids[:1, :P], use_cache=True, **{kw: cache}).logits  # [1, P, V]
    if not _expand_batch(cache, B, copy=False):
        return model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1]
    pos = torch.arange(P, T, device=ids.device)[None].expand(B, T - P)
    tail = model(input_ids=ids[:, P:], attention_mask=attn, position_ids=pos, use_cache=True, **{kw: cache}).logits
    return torch.cat([head.expand(B, -1, -1), tail[:, :-1]], dim=1)


def forward_logprobs(model, batch: TokenBatch, temperature: float = 1.0, with_entropy: bool = False):
    """Per-token log-probs (and optionally entropies) aligned to token positions, [B, T]."""
    logits = _logits(model, batch)
    targets = batch.input_ids[:, 1:]
    t = temperature if temperature > 0 else 1.0
    lp = gather_token_logprobs(logits, targets, temperature=t)
    zero = torch.zeros_like(lp[:, :1])
    logprobs = torch.cat([zero, lp], dim=1)
    if not with_entropy:
        return logprobs, None
    ent = entropy_from_logits(logits.detach(), temperature=t)
    return logprobs, torch.cat([zero, ent], dim=1)
