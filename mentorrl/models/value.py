"""Critic for PPO / SAO: a value head on a causal LM's decoder.

``ValueModel(backbone)`` takes the decoder of a causal LM (a copy of the policy's, for a
separate critic) and adds a linear head ``hidden -> 1``, initialised to zero so a fresh
critic predicts 0 everywhere. :func:`forward_values` returns values aligned to token
positions like the learner's log-probs: ``values[b, t]`` estimates the return from the state
in which token ``t`` is generated (the decoder's hidden state at ``t - 1``); 0 at ``t = 0``.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mentorrl.train.batch import TokenBatch, _next_token_states


class ValueModel(torch.nn.Module):
    def __init__(self, decoder: torch.nn.Module, hidden_size: int):
        super().__init__()
        self.decoder = decoder
        self.head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    @classmethod
    def from_policy(cls, policy) -> "ValueModel":
        """A separate critic: a copy of the policy's decoder (its own weights) plus a zero head."""
        decoder = copy.deepcopy(policy.get_decoder())
        for p in decoder.parameters():
            p.requires_grad_(True)
        return cls(decoder, policy.config.hidden_size).to(next(policy.parameters()).device)

    def save(self, path: str | Path) -> None:
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}, str(path))

    def load(self, path: str | Path) -> None:
        self.load_state_dict(load_file(str(path)))


def forward_values(critic: ValueModel, batch: TokenBatch) -> torch.Tensor:
    """Values ``[B, T]`` aligned to token positions (exact on policy tokens, 0 at t = 0)."""
    hidden = _next_token_states(critic.decoder, batch, "last_hidden_state")  # [B, T-1, H]
    v = critic.head(hidden).squeeze(-1)
    return torch.cat([torch.zeros_like(v[:, :1]), v], dim=1)
