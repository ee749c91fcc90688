"""On-policy distillation objectives as pure functions (groundwork for white-box OPD).

All divergences compare the student's and the teacher's next-token distributions at the
same positions of a *student* trajectory. Shapes: logits ``[B, T, V]``, mask ``[B, T]`` (1 on
policy tokens: prompt and tool-observation positions never count).

Directions, stated once because they are easy to swap:

* ``reverse``: KL(student || teacher) = sum_v p_s(v) (log p_s(v) - log p_t(v)). Mode seeking;
  what on-policy distillation minimises along the student's own samples.
* ``forward``: KL(teacher || student) = sum_v p_t(v) (log p_t(v) - log p_s(v)). Mass covering.
* ``jsd``: the generalised Jensen-Shannon divergence of GKD,
  beta * KL(teacher || m) + (1 - beta) * KL(student || m) with m = beta * p_t + (1 - beta) * p_s.
  At the endpoints, where m equals one side and the formula vanishes identically, it is the KL
  there, as in TRL's ``generalized_jsd_loss``: beta = 0 is ``forward`` KL(teacher || student),
  beta = 1 is ``reverse`` KL(student || teacher) (the limit of the formula is 0, so these are
  discontinuous by definition, never a silent zero loss).

Tokens of probability 0 on either side (logit -inf, e.g. banned tokens) add 0 and get zero
gradient, never 0 * -inf = NaN; a token the teacher gives probability 0 and the student does not
makes KL(student || teacher) infinite, as it is.

``temperature`` divides both sides' logits before the softmax. ``top_k`` restricts both
distributions to the teacher's k most likely tokens at each position and renormalises them
there (the usual "top-k" distillation when only the teacher's top-k log-probs are kept).
"""

from __future__ import annotations

import math
import random

import torch

DIVERGENCES = ("reverse", "forward", "jsd")


def _log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float32 at least; float64 stays
    return torch.log_softmax(x / temperature, dim=-1)


def restrict_top_k(student_lp: torch.Tensor, teacher_lp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Both log-distributions restricted to the teacher's top-``k`` tokens and renormalised there: ``[..., k]``."""
    if k < 1:
        raise ValueError(f"top_k must be >= 1, got {k}")
    k = min(k, teacher_lp.shape[-1])
    idx = teacher_lp.topk(k, dim=-1).indices
    return renormalise(student_lp.gather(-1, idx)), renormalise(teacher_lp.gather(-1, idx))


def _kl(p_lp: torch.Tensor, q_lp: torch.Tensor) -> torch.Tensor:
    """KL(p || q) over the last axis from log-probabilities (0 * log 0 = 0).

    The log-ratio is selected (``where``) *before* the product, so where ``p`` is 0 and both sides
    are -inf neither the value nor the gradient meets -inf - -inf or 0 * -inf."""
    p = p_lp.exp()
    diff = torch.where(p > 0, p_lp - q_lp, torch.zeros((), dtype=p.dtype, device=p.device))
    return (p * diff).sum(-1)


def _mixture(t: torch.Tensor, s: torch.Tensor, beta: float) -> torch.Tensor:
    """``log(beta * p_t + (1 - beta) * p_s)``; -inf where both are -inf, with no NaN in the gradient
    (logsumexp's backward is NaN when all its inputs are -inf, so those entries skip it)."""
    both = torch.isneginf(t) & torch.isneginf(s)
    zero = torch.zeros((), dtype=t.dtype, device=t.device)
    a = torch.where(both, zero, t + math.log(beta))
    b = torch.where(both, zero, s + math.log(1.0 - beta))
    m = torch.logsumexp(torch.stack([a, b]), dim=0)
    return torch.where(both, torch.full((), -math.inf, dtype=t.dtype, device=t.device), m)


def token_divergence(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    kind: str = "reverse",
    beta: float = 0.5,
    temperature: float = 1.0,
    top_k: int | None = None,
) -> torch.Tensor:
    """Per-position divergence ``[B, T]`` between the student's and the teacher's next-token distributions."""
    s = _log_probs(student_logits, temperature)
    t = _log_probs(teacher_logits, temperature)
    if top_k is not None:
        s, t = restrict_top_k(s, t, top_k)
    return divergence_of(s, t, kind, beta)


def renormalise(log_probs: torch.Tensor) -> torch.Tensor:
    """Log-probs over a support (e.g. a teacher's top-k tokens) renormalised to sum to 1 there."""
    return log_probs - torch.logsumexp(log_probs, dim=-1, keepdim=True)


def with_tail(log_probs: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Log-probs over a support (e.g. a teacher's top-k) plus one bin for all remaining mass: ``[..., k + 1]``.

    Unlike :func:`renormalise`, mass a distribution puts outside the support stays visible, so a
    student cannot lower a top-k divergence by moving probability onto tokens the teacher never
    ranks (the "top-k + rest" form of top-k distillation)."""
    inside = torch.logsumexp(log_probs, dim=-1, keepdim=True).clamp(max=0.0)
    rest = torch.log((-torch.expm1(inside)).clamp(min=eps))
    return torch.cat([log_probs, rest], dim=-1)


def divergence_of(s: torch.Tensor, t: torch.Tensor, kind: str = "reverse", beta: float = 0.5) -> torch.Tensor:
    """The divergence between two normalised log-distributions over the last axis (student ``s``, teacher ``t``)."""
    if kind not in DIVERGENCES:
        raise ValueError(f"unknown divergence {kind!r}; expected one of {list(DIVERGENCES)}")
    if kind == "reverse":
        return _kl(s, t)
    if kind == "forward":
        return _kl(t, s)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"jsd beta must lie in [0, 1], got {beta}")
    if beta == 0.0:  # m = p_s: the formula is identically 0; GKD / TRL use KL(teacher || student) here
        return _kl(t, s)
    if beta == 1.0:  # m = p_t: likewise; KL(student || teacher)
        return _kl(s, t)
    m = _mixture(t, s, beta)
    return beta * _kl(t, m) + (1.0 - beta) * _kl(s, m)


def distill_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    kind: str = "reverse",
    beta: float = 0.5,
    temperature: float = 1.0,
    top_k: int | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean divergence over policy tokens (``mask``), optionally weighted per token (``weights`` ``[B, T]``).

    The teacher side carries no gradient. Logits off the mask are replaced by zeros before anything
    is computed, so NaN / inf there (padding) reach neither the loss nor the gradient. Returns
    ``(loss, {"distill_loss", "divergence_mean", "divergence_max"})``."""
    keep = (mask != 0).unsqueeze(-1)
    zero = torch.zeros((), dtype=student_logits.dtype, device=student_logits.device)
    student_logits = torch.where(keep, student_logits, zero)
    teacher_logits = torch.where(
        keep, teacher_logits.detach(), torch.zeros((), dtype=teacher_logits.dtype, device=teacher_logits.device)
    )
    div = token_divergence(student_logits, teacher_logits, kind, beta, temperature, top_k)
    return weighted_token_mean(div, mask, weights)


def weighted_token_mean(
    div: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """``sum(div * w) / sum(w)`` with ``w = mask * weights``, and the divergence's mean and max on policy tokens.
    Positions with ``w == 0`` are selected out, so a non-finite divergence or weight there cannot leak in."""
    keep = mask != 0
    zero = torch.zeros((), dtype=div.dtype, device=div.device)
    w = keep.to(div.dtype) if weights is None else torch.where(keep, weights.to(div.dtype), zero)
    loss = torch.where(w != 0, torch.where(w != 0, div, zero) * w, zero).sum() / w.sum().clamp(min=1e-8)
    d = div.detach()[mask != 0]
    return loss, {
        "distill_loss": loss.detach().item(),
        "divergence_mean": d.mean().item() if d.numel() else 0.0,
        "divergence_max": d.max().item() if d.numel() else 0.0,
    }


def sampled_reverse_kl_advantage(
    student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Per-token advantage ``log p_t(y) - log p_s(y)`` of the sampled tokens (0 off policy tokens), detached.

    Its negative is the one-sample estimate of KL(student || teacher) at that position, so a
    policy-gradient step with this advantage lowers the reverse KL along the student's own
    samples: the OPD signal used inside the clipped policy loss."""
    adv = (teacher_logprobs.detach() - student_logprobs.detach()).float()
    return torch.where(mask != 0, adv, torch.zeros_like(adv))


def mix_advantages(env_advantages: torch.Tensor, kl_advantages: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """RL + beta * KL: the environment's advantage plus ``kl_coef`` times the distillation advantage."""
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    return env_advantages + kl_coef * kl_advantages


def reward_weights(rewards: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Reward-weighted distillation: weights ``softmax(R / T)`` over the last axis (a group of samples)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return torch.softmax(rewards.float() / temperature, dim=-1)


def select_large_gap(
    gap: torch.Tensor, mask: torch.Tensor, threshold: float | None = None, top_frac: float | None = None
) -> torch.Tensor:
    """ShortOPD's token selection: policy tokens whose teacher-student gap exceeds ``threshold``, or
    the ``top_frac`` share of policy tokens with the largest gap (ties broken by position). Boolean ``[B, T]``."""
    if (threshold is None) == (top_frac is None):
        raise ValueError("give exactly one of threshold and top_frac")
    keep = mask != 0
    if threshold is not None:
        return keep & (gap > threshold)
    if not 0.0 <= top_frac <= 1.0:
        raise ValueError(f"top_frac must lie in [0, 1], got {top_frac}")
    n = int(keep.sum())
    k = math.ceil(top_frac * n)
    out = torch.zeros_like(keep)
    if k == 0:
        return out
    flat = torch.where(keep, gap.float(), torch.full_like(gap.float(), -math.inf)).flatten()
    order = torch.argsort(flat, descending=True, stable=True)[:k]
    out.view(-1)[order] = True
    return out


# ------------------------------------------ OPD token and trajectory weights -----
def step_weights(
    mask: torch.Tensor,
    tool_error_tokens: torch.Tensor | None = None,
    low_reward: torch.Tensor | None = None,
    student_entropy: torch.Tensor | None = None,
    tool_error_boost: float = 2.0,
    low_reward_boost: float = 1.5,
    entropy_threshold: float = 1.0,
    entropy_boost: float = 1.5,
) -> torch.Tensor:
    """Failure-aware per-token distillation weights ``[B, T]`` (0 off policy tokens, else >= 1).

    Boosts multiply: ``tool_error_tokens`` marks the policy tokens of turns whose tool call
    failed; ``low_reward`` ``[B]`` marks trajectories below the reward bar; tokens where the
    student's entropy exceeds ``entropy_threshold`` are uncertain steps."""
    w = mask.double().clone()
    if tool_error_tokens is not None:
        w = w * torch.where(tool_error_tokens.bool(), tool_error_boost, 1.0)
    if low_reward is not None:
        w = w * torch.where(low_reward.bool(), low_reward_boost, 1.0)[:, None]
    if student_entropy is not None:
        w = w * torch.where(student_entropy > entropy_threshold, entropy_boost, 1.0)
    return w


def distill_weights(
    rewards: torch.Tensor,
    lengths: torch.Tensor,
    passed: torch.Tensor,
    reward_temperature: float = 1.0,
    length_power: float = 0.0,
) -> torch.Tensor:
    """Per-trajectory distillation weights: 0 unless ``passed``; otherwise
    ``exp(R / T) * (length / mean length) ** -length_power``, scaled to mean 1 over the passed ones."""
    if not reward_temperature > 0:
        raise ValueError(f"reward_temperature must be > 0, got {reward_temperature}")
    if length_power < 0:
        raise ValueError(f"length_power must be >= 0, got {length_power}")
    passed = passed.bool()
    w = torch.zeros(rewards.shape, dtype=torch.float64)
    if not passed.any():
        return w
    r = rewards.double()[passed]
    lengths_p = lengths.double()[passed].clamp(min=1.0)
    raw = torch.exp((r - r.max()) / reward_temperature) * (lengths_p / lengths_p.mean()) ** (-length_power)
    w[passed] = raw / raw.mean()
    return w


def exploration_split(n: int, share: float, seed: int) -> list[bool]:
    """Which of ``n`` samples are exploration (RL only): ``round(share * n)`` of them, chosen by ``seed``."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"exploration share must lie in [0, 1], got {share}")
    k = round(share * n)
    chosen = set(random.Random(seed).sample(range(n), k))
    return [i in chosen for i in range(n)]


__all__ = [
    "DIVERGENCES",
    "distill_loss",
    "distill_weights",
    "divergence_of",
    "exploration_split",
    "renormalise",
    "with_tail",
    "weighted_token_mean",
    "mix_advantages",
    "restrict_top_k",
    "reward_weights",
    "sampled_reverse_kl_advantage",
    "select_large_gap",
    "step_weights",
    "token_divergence",
]
