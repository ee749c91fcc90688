"""On-policy distillation's advantage terms, as composable pure functions selected by name.

The OPD stage (:mod:`mentorrl.train.recipes.opd`) turns its config into two ordered lists of
term names and applies them; each term is a pure function of tensors, registered here:

* **token terms** reshape the per-token distillation advantage ``A_kl`` (a 1-D tensor per
  trajectory, ``None`` for one no teacher could score): ``fn(kl, inputs) -> (kl, metrics)``.

  ==================  ===============================================================
  ``until_first_error``  keep ``A_kl`` only up to the first failed tool call
  ``step_weights``       MOPD's failure-aware per-token weights (tool errors, low reward,
                         an unsure student), precomputed in ``inputs.step_weights``
  ``center``             subtract the batch mean over the tokens it covers (a baseline)
  ``short``              ShortOPD: keep only the tokens with the largest gap
  ==================  ===============================================================

* **sequence terms** give one scalar per trajectory, summed into the advantage on every policy
  token: ``fn(inputs) -> [B]`` (``reward_weighted``: weighted MLE with ``softmax(R / T)`` weights
  over each task's group; ``rlsd_selected``: RLSD's self-distillation weights of verified
  trajectories).

:func:`token_advantages` combines them: ``(reward_coef * A_env + sum of sequence terms) * mask
+ kl_coef * A_kl``. A new variant is one more registered function plus its name in the stage's
selection.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from mentorrl.algos.distill import reward_weights, select_large_gap

KL = list[torch.Tensor | None]


@dataclass
class TermInputs:
    """What the terms read: per trajectory the loss mask (float), and what the selected terms need."""

    masks: list[torch.Tensor]
    first_error: list[torch.Tensor] | None = None  # until_first_error: 1 up to the first failed call
    step_weights: list[torch.Tensor | None] | None = None  # step_weights: MOPD's token weights
    gaps: KL | None = None  # short: |A_kl| before any weighting
    short_threshold: float | None = None
    short_top_frac: float | None = None
    rewards: torch.Tensor | None = None  # reward_weighted: [tasks, G] sanitised rewards
    reward_weighted_coef: float = 1.0
    reward_weighted_temperature: float = 1.0
    rlsd_weights: torch.Tensor | None = None  # rlsd_selected: [B]
    rlsd_coef: float = 0.5


TOKEN_TERMS: dict[str, Callable[[KL, TermInputs], tuple[KL, dict[str, float]]]] = {}
SEQUENCE_TERMS: dict[str, Callable[[TermInputs], torch.Tensor]] = {}


def token_term(name: str):
    def deco(fn):
        TOKEN_TERMS[name] = fn
        return fn
    return deco


def sequence_term(name: str):
    def deco(fn):
        SEQUENCE_TERMS[name] = fn
        return fn
    return deco


@token_term("until_first_error")
def until_first_error_term(kl: KL, x: TermInputs) -> tuple[KL, dict[str, float]]:
    return [k * fe if k is not None else None for k, fe in zip(kl, x.first_error)], {}


@token_term("step_weights")
def step_weights_term(kl: KL, x: TermInputs) -> tuple[KL, dict[str, float]]:
    return [k * w.float() if k is not None else None for k, w in zip(kl, x.step_weights)], {}


@token_term("center")
def center_term(kl: KL, x: TermInputs | None = None) -> tuple[KL, dict[str, float]]:
    """Subtract the batch mean of the distillation advantage over the tokens it covers (a baseline).

    The sampled-token advantages ``log p_t - log p_s`` average to minus the reverse KL, so without
    a baseline nearly every sampled token is pushed down and its probability flows to tokens nobody
    sampled; the mean carries no information about which tokens to prefer."""
    vals = [k[k != 0] for k in kl if k is not None]
    if not vals or sum(v.numel() for v in vals) == 0:
        return kl, {}
    mean = float(torch.cat(vals).mean())
    return [torch.where(k != 0, k - mean, k) if k is not None else None for k in kl], {}


@token_term("short")
def short_term(kl: KL, x: TermInputs) -> tuple[KL, dict[str, float]]:
    """Keep the distillation advantage only on the selected large-gap tokens; logs the share kept."""
    have = [i for i in range(len(kl)) if kl[i] is not None]
    if not have:
        return kl, {"distilled_token_share": 0.0}
    T = max(len(x.masks[i]) for i in have)
    gap = torch.zeros(len(have), T)
    mask = torch.zeros(len(have), T)
    for r, i in enumerate(have):
        gap[r, : len(x.masks[i])] = x.gaps[i]
        mask[r, : len(x.masks[i])] = x.masks[i]
    keep = select_large_gap(gap, mask, threshold=x.short_threshold, top_frac=x.short_top_frac)
    out = list(kl)
    for r, i in enumerate(have):
        out[i] = kl[i] * keep[r, : len(x.masks[i])].float()
    return out, {"distilled_token_share": float(keep.sum()) / max(float(mask.sum()), 1.0)}


@sequence_term("reward_weighted")
def reward_weighted_term(x: TermInputs) -> torch.Tensor:
    """``coef * G * softmax(R / T)`` over each task's group of ``G`` samples (weights average 1)."""
    w = reward_weights(x.rewards, x.reward_weighted_temperature) * x.rewards.shape[-1]
    return x.reward_weighted_coef * w.reshape(-1)


@sequence_term("rlsd_selected")
def rlsd_selected_term(x: TermInputs) -> torch.Tensor:
    return x.rlsd_coef * x.rlsd_weights.float()


def apply_token_terms(names: list[str], kl: KL, x: TermInputs) -> tuple[KL, dict[str, float]]:
    """``kl`` through the named token terms in order, with their metrics."""
    metrics: dict[str, float] = {}
    for name in names:
        kl, m = TOKEN_TERMS[name](kl, x)
        metrics.update(m)
    return kl, metrics


def sequence_advantage(names: list[str], x: TermInputs, n: int) -> torch.Tensor:
    """The sum of the named sequence terms, ``[n]`` (zeros when none is selected)."""
    extra = torch.zeros(n)
    for name in names:
        extra += SEQUENCE_TERMS[name](x)
    return extra


def token_advantages(masks: list[torch.Tensor], env_adv: torch.Tensor, reward_coef: float, extra: torch.Tensor,
                     kl: KL | None, kl_coef: float) -> list[torch.Tensor]:
    """Per trajectory ``(reward_coef * A_env + extra) * mask``, plus ``kl_coef * A_kl`` where ``kl`` is
    given and the trajectory has one."""
    out = []
    for i, mask in enumerate(masks):
        a = (reward_coef * float(env_adv[i]) + float(extra[i])) * mask
        if kl is not None and kl[i] is not None:
            a = a + kl_coef * kl[i]
        out.append(a)
    return out


__all__ = ["SEQUENCE_TERMS", "TOKEN_TERMS", "TermInputs", "apply_token_terms", "center_term", "reward_weighted_term",
           "rlsd_selected_term", "sequence_advantage", "sequence_term", "short_term", "step_weights_term",
           "token_advantages", "token_term", "until_first_error_term"]
