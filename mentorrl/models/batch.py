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
from mentorrl.rollout.kvcache import cache_kwarg, expand_batch, make_cache
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


def _split_head(model):
    """(decoder, lm_head) when logits are a plain linear map of the decoder's last hidden state.

    Then the learner applies the head only where the loss mask is 1, instead of building
    [B, T, V] logits for every prompt and observation token. None for models whose logits
    need more (soft-capping, scaling), which take the full forward."""
    cfg = model.config
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None) not in (None, 1, 1.0):
        return None
    get_decoder = getattr(model, "get_decoder", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if get_decoder is None or head is None or not isinstance(head, torch.nn.Linear):
        return None
    decoder = get_decoder()
    return (decoder, head) if decoder is not None and decoder is not model else None


def _next_token_states(module, batch: TokenBatch, attr: str, min_shared: int = 32) -> torch.Tensor:
    """``module``'s output (``attr``: "logits" or "last_hidden_state") at positions 0..T-2, [B, T-1, *].

    When every row starts with the same prompt (the system turn), the prefix runs once at
    batch size 1 and its KV cache is broadcast to all rows; gradients flow back through the
    broadcast, so the result and its gradient equal the plain full-batch forward.
    """
    ids, attn = batch.input_ids, batch.attention_mask
    B, T = ids.shape
    P = min(shared_prefix_len(ids, attn) if B > 1 else 0, T - 1)
    if P >= min_shared:
        cache, kw = make_cache(module), cache_kwarg(module)
        head = getattr(module(input_ids=ids[:1, :P], use_cache=True, **{kw: cache}), attr)  # [1, P, *]
        if expand_batch(cache, B, copy=False):
            pos = torch.arange(P, T, device=ids.device)[None].expand(B, T - P)
            tail = getattr(module(input_ids=ids[:, P:], attention_mask=attn, position_ids=pos, use_cache=True, **{kw: cache}), attr)
            return torch.cat([head.expand(B, -1, -1), tail[:, :-1]], dim=1)
    return getattr(module(input_ids=ids, attention_mask=attn, use_cache=False), attr)[:, :-1]


def forward_logprobs(model, batch: TokenBatch, temperature: float = 1.0, with_entropy: bool = False):
    """Per-token log-probs (and optionally entropies) aligned to token positions, [B, T].

    Values are exact on loss-mask positions (the policy's tokens); elsewhere they are 0 when
    the model's head can be applied selectively, which is all the losses ever read.
    """
    targets = batch.input_ids[:, 1:]
    t = temperature if temperature > 0 else 1.0
    split = _split_head(model)
    if split is None:
        logits = _next_token_states(model, batch, "logits")
        lp = gather_token_logprobs(logits, targets, temperature=t)
        ent = entropy_from_logits(logits.detach(), temperature=t) if with_entropy else None
    else:
        decoder, head = split
        hidden = _next_token_states(decoder, batch, "last_hidden_state")
        sel = batch.loss_mask[:, 1:] > 0
        logits = head(hidden[sel])[None]  # [1, N, V]: only the policy's tokens
        lp = torch.zeros(targets.shape, dtype=torch.float32, device=targets.device)
        lp = lp.masked_scatter(sel, gather_token_logprobs(logits, targets[sel][None], temperature=t)[0])
        ent = None
        if with_entropy:
            ent = torch.zeros_like(lp).masked_scatter(sel, entropy_from_logits(logits.detach(), temperature=t)[0])
    zero = torch.zeros_like(lp[:, :1])
    logprobs = torch.cat([zero, lp], dim=1)
    return logprobs, (torch.cat([zero, ent], dim=1) if ent is not None else None)


def forward_selected_logprobs(model, batch: TokenBatch, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The student's full-vocabulary log-probs of the given candidate ``ids`` ``[B, T, k]`` at every
    position ``t`` (predicting token ``t`` from tokens ``< t``): ``[B, T, k]``, exact on loss-mask
    positions and 0 elsewhere. For top-k distillation against a teacher's top-k token ids."""
    t = temperature if temperature > 0 else 1.0
    sel = batch.loss_mask[:, 1:] > 0
    split = _split_head(model)
    if split is None:
        logits = _next_token_states(model, batch, "logits")[sel]
    else:
        decoder, head = split
        logits = head(_next_token_states(decoder, batch, "last_hidden_state")[sel])
    lp = torch.log_softmax(logits.float() / t, dim=-1).gather(-1, ids[:, 1:][sel].long())  # [N, k]
    out = torch.zeros(ids.shape, dtype=torch.float32, device=lp.device)
    out[:, 1:][sel] = lp
    return out
