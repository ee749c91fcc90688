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

from mentorrl.models.batch import TokenBatch, next_token_states
from mentorrl.rollout.adapters import is_adapter_key


class ValueModel(torch.nn.Module):
    def __init__(self, decoder: torch.nn.Module, hidden_size: int):
        super().__init__()
        self.decoder = decoder
        self.head = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    @classmethod
    def from_policy(cls, policy) -> "ValueModel":
        """A separate critic: a copy of the policy's decoder (its own weights) plus a zero head. A LoRA
        policy's copy keeps its base frozen: the critic trains its own copy of the adapters and the head."""
        decoder = copy.deepcopy(policy.get_decoder())
        adapted = any(is_adapter_key(n) for n, _ in decoder.named_parameters())
        for n, p in decoder.named_parameters():
            p.requires_grad_(not adapted or is_adapter_key(n))
        return cls(decoder, policy.config.hidden_size).to(next(policy.parameters()).device)

    @classmethod
    def from_pretrained_decoder(cls, model_dir: str | Path) -> "ValueModel":
        """A separate critic from any Hugging Face causal-LM checkpoint: its decoder plus a zero head (a
        directory with a checksum manifest is verified against it first)."""
        from transformers import AutoModelForCausalLM

        from mentorrl.core.checksums import verify_manifest
        from mentorrl.models.gguf import resolve_model_path

        model_dir = resolve_model_path(model_dir)  # a GGUF source: the checkpoint it is imported into
        if Path(model_dir).is_dir():
            verify_manifest(Path(model_dir))

        lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        return cls(lm.get_decoder(), lm.config.hidden_size)

    def save(self, path: str | Path) -> None:
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}, str(path))

    def load(self, path: str | Path) -> None:
        self.load_state_dict(load_file(str(path)))


def forward_values(critic: ValueModel, batch: TokenBatch) -> torch.Tensor:
    """Values ``[B, T]`` aligned to token positions (exact on policy tokens, 0 at t = 0)."""
    hidden = next_token_states(critic.decoder, batch, "last_hidden_state")  # [B, T-1, H]
    v = critic.head(hidden).squeeze(-1)
    return torch.cat([torch.zeros_like(v[:, :1]), v], dim=1)


def build_critic(policy, cfg) -> ValueModel:
    """The critic a :class:`~mentorrl.config.CriticConfig` asks for, on the policy's device.

    ``backbone="policy"``: a value head on a copy of the policy's decoder. ``"separate"``: the
    decoder of the checkpoint at ``cfg.path``, or a fresh small Qwen2 decoder of size ``cfg.spec``
    over the policy's vocabulary. A separate critic must read the policy's token ids, so its
    vocabulary must cover them.
    """
    device = next(policy.parameters()).device
    if cfg.backbone == "policy":
        return ValueModel.from_policy(policy)
    vocab = policy.config.vocab_size
    if cfg.path is not None:
        critic = ValueModel.from_pretrained_decoder(cfg.path)
        have = critic.decoder.get_input_embeddings().num_embeddings
        if have < vocab:
            raise ValueError(
                f"critic checkpoint {cfg.path} has {have} token embeddings; the policy's ids go up to {vocab}"
            )
        return critic.to(device)
    from mentorrl.models.build import build_model_for_vocab

    lm = build_model_for_vocab(vocab, cfg.spec, pad_token_id=policy.config.pad_token_id)
    return ValueModel(lm.get_decoder(), cfg.spec.hidden_size).to(device)
