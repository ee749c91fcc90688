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


def forward_logprobs(model, batch: TokenBatch, temperature: float = 1.0, with_entropy: bool = False):
    """Per-token log-probs (and optionally entropies) aligned to token positions, [B, T]."""
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    logits = out.logits[:, :-1]
    targets = batch.input_ids[:, 1:]
    t = temperature if temperature > 0 else 1.0
    lp = gather_token_logprobs(logits, targets, temperature=t)
    zero = torch.zeros_like(lp[:, :1])
    logprobs = torch.cat([zero, lp], dim=1)
    if not with_entropy:
        return logprobs, None
    ent = entropy_from_logits(logits.detach(), temperature=t)
    return logprobs, torch.cat([zero, ent], dim=1)
