"""The teacher protocol and its capability ladder, and a local Hugging Face teacher.

A teacher declares what it can give; a recipe states what it needs and :func:`require` fails
with a message naming both lists. The ladder, from the richest signal down:

* ``token_logprobs``: the teacher's log-prob of each token the student sampled;
* ``topk_logprobs``: the teacher's top-k next-token distribution at each student position;
* ``sampling``: the teacher can generate (corrections, demonstrations);
* ``ranking``: it can order candidate trajectories;
* ``scoring``: it can give a trajectory a scalar score;
* ``step_critique``: per-step scores or a correct next action;
* ``action_ranking``: it can order candidate tool calls at a state.

White-box teachers (local weights) give the first two in **one forward pass per student
trajectory** (:class:`HFTeacher`); API-only teachers give the lower rungs.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from enum import Enum
from typing import Iterable, Protocol, Sequence, runtime_checkable

import torch

from mentorrl.trajectory import Trajectory


class Capability(str, Enum):
    TOKEN_LOGPROBS = "token_logprobs"
    TOPK_LOGPROBS = "topk_logprobs"
    SAMPLING = "sampling"
    RANKING = "ranking"
    SCORING = "scoring"
    STEP_CRITIQUE = "step_critique"
    ACTION_RANKING = "action_ranking"


class MissingCapability(ValueError):
    """A recipe needs a signal its teacher cannot give."""


@runtime_checkable
class Teacher(Protocol):
    name: str
    capabilities: frozenset[Capability]


def require(teacher: Teacher, needed: Iterable[Capability | str], recipe: str) -> None:
    """Raise :class:`MissingCapability` unless ``teacher`` declares every capability ``recipe`` needs."""
    want = [Capability(c) for c in needed]
    missing = [c.value for c in want if c not in teacher.capabilities]
    if missing:
        have = ", ".join(sorted(c.value for c in teacher.capabilities)) or "nothing"
        raise MissingCapability(
            f"recipe {recipe!r} needs teacher {teacher.name!r} to provide {', '.join(missing)}; it provides {have}"
        )


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of a tokenizer's vocabulary and special tokens: equal fingerprints read token ids the same way."""
    vocab = sorted(tokenizer.get_vocab().items())
    special = sorted(str(t) for t in getattr(tokenizer, "all_special_tokens", []))
    return hashlib.sha256(json.dumps([vocab, special]).encode()).hexdigest()[:16]


@dataclass
class TeacherSignal:
    """What a white-box teacher says about one student trajectory, aligned to its ``token_ids``.

    ``token_logprobs[t]``: the teacher's log-prob of token ``t`` given tokens ``< t`` (0 off policy
    tokens). ``topk_ids`` / ``topk_logprobs``: ``[T, k]`` teacher top-k at the positions that
    predict each token (rows off policy tokens are 0), when asked for; ``topk_mask`` marks the
    positions that have one when not every policy token does (a cross-tokenizer teacher)."""

    token_logprobs: torch.Tensor
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None
    topk_mask: torch.Tensor | None = None  # [T] bool: positions with a top-k target (None: every policy token)


class HFTeacher:
    """A local causal LM as a teacher: token and top-k log-probs over student trajectories.

    The teacher reads the student's token ids directly, so it must share the student's
    tokenizer (:meth:`check_tokenizer`); a teacher with another tokenizer goes through
    :mod:`mentorrl.opd.align` instead."""

    capabilities = frozenset({Capability.TOKEN_LOGPROBS, Capability.TOPK_LOGPROBS, Capability.SAMPLING})

    def __init__(self, model, tokenizer, name: str = "hf-teacher", temperature: float = 1.0):
        """Takes ``model`` over: it is frozen in place (pass a copy to keep training the original)."""
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tokenizer, self.name, self.temperature = tokenizer, name, temperature
        self.fingerprint = tokenizer_fingerprint(tokenizer)

    @classmethod
    def from_pretrained(cls, path, name: str | None = None, temperature: float = 1.0) -> "HFTeacher":
        from mentorrl.models.build import load_policy

        tokenizer, model = load_policy(path)
        return cls(model, tokenizer, name or str(path), temperature)

    def check_tokenizer(self, student_tokenizer) -> None:
        if tokenizer_fingerprint(student_tokenizer) != self.fingerprint:
            raise ValueError(
                f"teacher {self.name!r} has another tokenizer than the student: same-tokenizer OPD "
                "cannot read the student's token ids; use cross-tokenizer alignment (mentorrl.opd.align)"
            )

    @torch.no_grad()
    def score(self, traj: Trajectory, top_k: int | None = None) -> TeacherSignal:
        """One forward pass over the trajectory's tokens."""
        device = next(self.model.parameters()).device
        ids = torch.tensor([traj.token_ids], device=device)
        lp = torch.log_softmax(self.model(input_ids=ids).logits[0, :-1].float() / self.temperature, dim=-1)
        mask = torch.tensor(traj.loss_mask[1:], device=device, dtype=torch.bool)
        tok = lp.gather(-1, ids[0, 1:, None]).squeeze(-1)
        token_logprobs = torch.cat([tok.new_zeros(1), torch.where(mask, tok, torch.zeros_like(tok))]).cpu()
        if top_k is None:
            return TeacherSignal(token_logprobs)
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        vals, idx = lp.topk(min(top_k, lp.shape[-1]), dim=-1)
        keep = mask[:, None]
        vals = torch.cat([vals.new_zeros(1, vals.shape[1]), torch.where(keep, vals, torch.zeros_like(vals))]).cpu()
        idx = torch.cat([idx.new_zeros(1, idx.shape[1]), torch.where(keep, idx, torch.zeros_like(idx))]).cpu()
        return TeacherSignal(token_logprobs, idx, vals)

    def score_batch(self, trajs: Sequence[Trajectory], top_k: int | None = None) -> list[TeacherSignal]:
        return [self.score(t, top_k) for t in trajs]


__all__ = [
    "Capability",
    "HFTeacher",
    "MissingCapability",
    "Teacher",
    "TeacherSignal",
    "require",
    "tokenizer_fingerprint",
]
