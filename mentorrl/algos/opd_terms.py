"""On-policy distillation's terms, as composable pure functions registered by name.

The OPD stage (:mod:`mentorrl.train.recipes.opd`) reads one ordered list from its config,
``opd.terms`` (each entry ``{name: ..., its own settings}``, one schema per term in
:mod:`mentorrl.config`), and runs each entry by its name. Token and advantage terms are the pure
functions registered here; loss terms (``topk``, ``rlsd_topk``, ``sequence_fallback``) update the
learner and are registered in the stage.

* **token terms** reshape the per-token distillation advantage ``A_kl`` (a 1-D tensor per
  trajectory, ``None`` for one no teacher could score), in list order:
  ``fn(kl, x, p) -> (kl, metrics)``.

  =====================  ===============================================================
  ``until_first_error``  keep ``A_kl`` only up to the first failed tool call
  ``step_weights``       MOPD's failure-aware per-token weights (tool errors, low reward,
                         an unsure student)
  ``center``             subtract the batch mean over the tokens it covers (a baseline)
  ``short``              ShortOPD: keep only the tokens with the largest gap
  =====================  ===============================================================

* **advantage terms** each add a per-token advantage to the clipped policy-gradient loss (which
  runs when at least one is configured): ``fn(kl, x, p) -> (per-trajectory tensors, metrics)``:
  ``sampled_kl`` (``coef * A_kl``), ``reward_weighted`` (weighted MLE with ``softmax(R / T)``
  weights over each task's group), ``rlsd_selected`` (RLSD's self-distillation weights of verified
  trajectories), ``env_advantage`` (``coef *`` the group-relative environment advantage).
  :func:`token_advantages` sums them.

``p`` is the term's own config entry (its settings) and ``x`` a mapping of the inputs the stage
computed. Every registration declares the inputs its function reads (``needs``), and the stage
computes only the inputs that the configured terms need (the student-entropy forward pass, for
example, only for ``step_weights``). The inputs (:data:`INPUTS`):

================== ==============================================================================
``masks``          per trajectory its loss mask (float, 1 on policy tokens)
``first_error``    per trajectory 1 up to its first failed tool call, then 0
``gaps``           per trajectory ``|A_kl|`` on the tokens distilled (after ``until_first_error``
                   when it is configured), before any weighting; ``None`` where ``A_kl`` is
``tool_errors``    per trajectory the policy tokens of turns whose tool call failed
``student_entropy`` per trajectory the student's per-token entropy (one forward pass)
``rewards``        ``[tasks, G]`` sanitised rewards
``success``        ``[B]`` whether the verifier passed each trajectory
``lengths``        ``[B]`` policy tokens per trajectory
``seed``           the step's seed for the terms' own draws (RLSD's exploration split)
================== ==============================================================================

A new variant is one registered function with its ``needs``, plus its schema in the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from mentorrl.algos.advantages import get_advantage_estimator
from mentorrl.algos.distill import distill_weights, exploration_split, reward_weights, select_large_gap, step_weights
from mentorrl.config.registry import Registry

KL = list[torch.Tensor | None]
Inputs = Mapping[str, Any]
INPUTS = ("masks", "first_error", "gaps", "tool_errors", "student_entropy", "rewards", "success", "lengths", "seed")


@dataclass(frozen=True)
class Term:
    """A registered term: its function and the inputs (:data:`INPUTS`) it reads."""

    fn: Callable[..., Any]
    needs: tuple[str, ...] = ()


TOKEN_TERMS: Registry[Term] = Registry("OPD token term")
ADVANTAGE_TERMS: Registry[Term] = Registry("OPD advantage term")


def _register(table: Registry[Term], name: str, needs: tuple[str, ...], replace: bool):
    unknown = set(needs) - set(INPUTS)
    if unknown:
        raise ValueError(f"term {name!r} needs unknown inputs {sorted(unknown)} (known: {INPUTS})")

    def deco(fn):
        table.register(name, Term(fn, tuple(needs)), replace=replace)
        return fn

    return deco


def token_term(name: str, needs: tuple[str, ...] = (), replace: bool = False):
    """Register ``fn(kl, x, p) -> (kl, metrics)`` as token term ``name``, reading ``needs`` (a taken name is
    an error unless ``replace``)."""
    return _register(TOKEN_TERMS, name, needs, replace)


def advantage_term(name: str, needs: tuple[str, ...] = (), replace: bool = False):
    """Register ``fn(kl, x, p) -> (per-trajectory advantages, metrics)`` as advantage term ``name``."""
    return _register(ADVANTAGE_TERMS, name, needs, replace)


def needed_inputs(names: Sequence[str], *extra: Mapping[str, Term]) -> tuple[str, ...]:
    """The inputs the named terms read (looked up here and in ``extra`` registries), in :data:`INPUTS` order."""
    tables = (TOKEN_TERMS, ADVANTAGE_TERMS, *extra)
    wanted = {i for n in names for t in tables if n in t for i in t[n].needs}
    return tuple(i for i in INPUTS if i in wanted)


# ----------------------------------------------------------------- token terms -----
@token_term("until_first_error", needs=("first_error",))
def until_first_error_term(kl: KL, x: Inputs, p: Any = None) -> tuple[KL, dict[str, float]]:
    return [k * fe if k is not None else None for k, fe in zip(kl, x["first_error"])], {}


@token_term("step_weights", needs=("masks", "tool_errors", "rewards", "student_entropy"))
def step_weights_term(kl: KL, x: Inputs, p: Any) -> tuple[KL, dict[str, float]]:
    """``A_kl`` times MOPD's failure-aware weights (:func:`mentorrl.algos.distill.step_weights`)."""
    rewards = x["rewards"].reshape(-1)
    out: KL = []
    for i, k in enumerate(kl):
        if k is None:
            out.append(None)
            continue
        w = step_weights(
            x["masks"][i][None],
            x["tool_errors"][i][None],
            torch.tensor([float(rewards[i]) < p.low_reward]),
            x["student_entropy"][i][None],
            p.tool_error_boost,
            p.low_reward_boost,
            p.entropy_threshold,
            p.entropy_boost,
        )[0]
        out.append(k * w.float())
    return out, {}


@token_term("center")
def center_term(kl: KL, x: Inputs | None = None, p: Any = None) -> tuple[KL, dict[str, float]]:
    """Subtract the batch mean of the distillation advantage over the tokens it covers (a baseline).

    The sampled-token advantages ``log p_t - log p_s`` average to minus the reverse KL, so without
    a baseline nearly every sampled token is pushed down and its probability flows to tokens nobody
    sampled; the mean carries no information about which tokens to prefer."""
    vals = [k[k != 0] for k in kl if k is not None]
    if not vals or sum(v.numel() for v in vals) == 0:
        return kl, {}
    mean = float(torch.cat(vals).mean())
    return [torch.where(k != 0, k - mean, k) if k is not None else None for k in kl], {}


@token_term("short", needs=("masks", "gaps"))
def short_term(kl: KL, x: Inputs, p: Any) -> tuple[KL, dict[str, float]]:
    """Keep the distillation advantage only on the selected large-gap tokens (``p.threshold`` or
    ``p.top_frac``); logs the share kept."""
    masks, gaps = x["masks"], x["gaps"]
    have = [i for i in range(len(kl)) if kl[i] is not None]
    if not have:
        return kl, {"distilled_token_share": 0.0}
    T = max(len(masks[i]) for i in have)
    gap = torch.zeros(len(have), T)
    mask = torch.zeros(len(have), T)
    for r, i in enumerate(have):
        gap[r, : len(masks[i])] = gaps[i]
        mask[r, : len(masks[i])] = masks[i]
    keep = select_large_gap(gap, mask, threshold=p.threshold, top_frac=p.top_frac)
    out = list(kl)
    for r, i in enumerate(have):
        out[i] = kl[i] * keep[r, : len(masks[i])].float()
    return out, {"distilled_token_share": float(keep.sum()) / max(float(mask.sum()), 1.0)}


# -------------------------------------------------------------- advantage terms -----
def _per_token(scalars: torch.Tensor, masks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [float(s) * m for s, m in zip(scalars, masks)]


@advantage_term("sampled_kl")
def sampled_kl_term(kl: KL, x: Inputs, p: Any) -> tuple[KL, dict[str, float]]:
    """``coef * A_kl``: the sampled-token (chunk) reverse-KL estimate as a per-token advantage."""
    return [p.coef * k if k is not None else None for k in kl], {}


@advantage_term("reward_weighted", needs=("masks", "rewards"))
def reward_weighted_term(kl: KL, x: Inputs, p: Any) -> tuple[list[torch.Tensor], dict[str, float]]:
    """``coef * G * softmax(R / T)`` over each task's group of ``G`` samples (weights average 1)."""
    w = reward_weights(x["rewards"], p.temperature) * x["rewards"].shape[-1]
    return _per_token(p.coef * w.reshape(-1), x["masks"]), {}


def rlsd_weights(x: Inputs, p: Any) -> torch.Tensor:
    """RLSD's ``[B]`` distillation weights (:func:`mentorrl.algos.distill.distill_weights`): 0 for a
    trajectory the verifier failed or that the seeded exploration split keeps for RL only.
    Reads ``rewards``, ``success``, ``lengths`` and ``seed``."""
    n = len(x["success"])
    explore = torch.tensor(exploration_split(n, p.exploration_share, x["seed"]), dtype=torch.bool)
    return distill_weights(
        x["rewards"].reshape(-1), x["lengths"], x["success"] & ~explore, p.reward_temperature, p.length_power
    )


@advantage_term("rlsd_selected", needs=("masks", "rewards", "success", "lengths", "seed"))
def rlsd_selected_term(kl: KL, x: Inputs, p: Any) -> tuple[list[torch.Tensor], dict[str, float]]:
    """``coef * w`` on the sampled tokens of each trajectory RLSD distils (``w``: :func:`rlsd_weights`)."""
    w = rlsd_weights(x, p)
    return _per_token(p.coef * w.float(), x["masks"]), {"rlsd_distilled": float((w > 0).sum())}


@advantage_term("env_advantage", needs=("masks", "rewards"))
def env_advantage_term(kl: KL, x: Inputs, p: Any) -> tuple[list[torch.Tensor], dict[str, float]]:
    """``coef *`` the group-relative (GRPO, std-normalised) environment advantage (RL + beta*KL)."""
    adv = get_advantage_estimator("grpo")(x["rewards"], normalize_std=True).reshape(-1)
    return _per_token(p.coef * adv, x["masks"]), {}


# ---------------------------------------------------------------------- running -----
def apply_token_terms(terms: Sequence[Any], kl: KL, x: Inputs) -> tuple[KL, dict[str, float]]:
    """``kl`` through the token terms (config entries, by ``name``) in order, with their metrics."""
    metrics: dict[str, float] = {}
    for p in terms:
        kl, m = TOKEN_TERMS[p.name].fn(kl, x, p)
        metrics.update(m)
    return kl, metrics


def token_advantages(
    masks: Sequence[torch.Tensor], terms: Sequence[Any], kl: KL, x: Inputs
) -> tuple[list[torch.Tensor], dict[str, float]]:
    """Per trajectory the sum of the advantage terms (config entries, by ``name``), zero where none
    contributes, with their metrics."""
    out = [torch.zeros_like(m) for m in masks]
    metrics: dict[str, float] = {}
    for p in terms:
        parts, m = ADVANTAGE_TERMS[p.name].fn(kl, x, p)
        metrics.update(m)
        out = [a + part if part is not None else a for a, part in zip(out, parts)]
    return out, metrics


__all__ = [
    "ADVANTAGE_TERMS",
    "INPUTS",
    "TOKEN_TERMS",
    "Term",
    "advantage_term",
    "apply_token_terms",
    "center_term",
    "env_advantage_term",
    "needed_inputs",
    "reward_weighted_term",
    "rlsd_selected_term",
    "rlsd_weights",
    "sampled_kl_term",
    "short_term",
    "step_weights_term",
    "token_advantages",
    "token_term",
    "until_first_error_term",
]
