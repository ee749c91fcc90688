"""Multi-teacher OPD (MOPD) weighting as pure functions (used by the OPD stage, ``opd.mopd``).

Per-teacher weights for each student trajectory come from three sources, multiplied and
renormalised over teachers (:func:`combine`):

* static routing by task family (:func:`routing_weights`), or routes measured by the verifier:
  each teacher's own success on every family, before the first step (:func:`competence_routes`);
* teacher confidence on the trajectory: a softmax over teachers of their mean token log-prob
  (or negative mean entropy) on its policy tokens (:func:`confidence_weights`);
* each teacher's verified success history: the posterior mean of a Beta prior updated with its
  verified successes and attempts (:func:`success_weights`).

For teachers that share the student's tokenizer the target is the weighted mixture
distribution (:func:`mixture_log_probs`). :func:`step_weights` raises the distillation weight
of individual tokens at tool errors, in low-reward trajectories and where the student is unsure.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from mentorrl.algos.distill import step_weights  # the pure weights live with the other OPD math (re-exported)


def routing_weights(
    families: Sequence[str], teachers: Sequence[str], routes: Mapping[str, Mapping[str, float]]
) -> torch.Tensor:
    """``[B, M]``: ``routes[family][teacher]`` (missing teachers 0), normalised; a family without a
    route (or whose route gives these teachers nothing) spreads evenly over all teachers."""
    out = torch.full((len(families), len(teachers)), 1.0 / len(teachers), dtype=torch.float64)
    for b, fam in enumerate(families):
        route = routes.get(fam)
        if not route:
            continue
        unknown = set(route) - set(teachers)
        if unknown:
            raise ValueError(f"route for {fam!r} names unknown teachers {sorted(unknown)}")
        row = torch.tensor([float(route.get(t, 0.0)) for t in teachers], dtype=torch.float64)
        if (row < 0).any():
            raise ValueError(f"route for {fam!r} has a negative weight")
        if row.sum() > 0:
            out[b] = row / row.sum()
    return out


def competence_routes(
    successes: Mapping[str, Mapping[str, tuple[int, int]]],
    mode: str = "soft",
    prior: tuple[float, float] = (1.0, 1.0),
) -> dict[str, dict[str, float]]:
    """Routes (for :func:`routing_weights`) from each teacher's own verified success per task family:
    ``successes[family][teacher] = (successes, attempts)`` of the teacher's rollouts on that family.

    ``soft``: the Beta(``prior``) posterior means ``(s + a) / (n + a + b)``, normalised per family;
    ``hard``: all weight on the teacher with the highest posterior mean (ties split evenly). A teacher
    with no attempts has the prior mean. A family with no teachers is left out (:func:`routing_weights`
    spreads an unrouted family evenly). Counts outside ``0 <= s <= n`` raise ValueError."""
    if mode not in ("soft", "hard"):
        raise ValueError(f"mode must be soft or hard, got {mode!r}")
    a, b = prior
    if not (a > 0 and b > 0):
        raise ValueError(f"prior must be positive, got {prior}")
    out: dict[str, dict[str, float]] = {}
    for fam, per_teacher in successes.items():
        means = {}
        for t, (s, n) in per_teacher.items():
            if not 0 <= s <= n:
                raise ValueError(f"family {fam!r}, teacher {t!r}: successes {s} must lie in [0, attempts {n}]")
            means[t] = (s + a) / (n + a + b)
        if not means:
            continue
        if mode == "hard":
            best = max(means.values())
            top = [t for t, m in means.items() if m == best]
            out[fam] = {t: (1.0 / len(top) if t in top else 0.0) for t in means}
        else:
            total = sum(means.values())
            out[fam] = {t: m / total for t, m in means.items()}
    return out


def confidence_weights(teacher_scores: torch.Tensor, mask: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``[B, M]``: softmax over teachers of their mean per-token score on each trajectory's policy tokens.

    ``teacher_scores`` is ``[M, B, T]``: token log-probs (higher = more confident) or negated entropies."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    m = mask.to(teacher_scores.dtype)[None]
    mean = (teacher_scores * m).sum(-1) / m.sum(-1).clamp(min=1.0)  # [M, B]
    return torch.softmax(mean.double().T / temperature, dim=-1)


def success_weights(
    history: Mapping[str, tuple[int, int]], teachers: Sequence[str], prior: tuple[float, float] = (1.0, 1.0)
) -> torch.Tensor:
    """``[M]``: Beta(prior) posterior mean success of each teacher from ``history[teacher] =
    (verified successes, attempts)``, normalised over teachers. No history: the prior mean."""
    a, b = prior
    vals = []
    for t in teachers:
        s, n = history.get(t, (0, 0))
        if not 0 <= s <= n:
            raise ValueError(f"teacher {t!r}: successes {s} must lie in [0, attempts {n}]")
        vals.append((s + a) / (n + a + b))
    w = torch.tensor(vals, dtype=torch.float64)
    return w / w.sum()


def combine(*weights: torch.Tensor) -> torch.Tensor:
    """Product of per-teacher weights (``[B, M]`` or ``[M]``, broadcast), renormalised over teachers."""
    out = weights[0].double()
    for w in weights[1:]:
        out = out * w.double()
    total = out.sum(-1, keepdim=True)
    if (total <= 0).any():
        raise ValueError("every teacher got weight 0 for some trajectory")
    return out / total


def mixture_log_probs(teacher_logits: torch.Tensor, weights: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log of the weighted mixture ``sum_m w[b, m] * p_m`` of same-tokenizer teachers: ``[B, T, V]``.

    ``teacher_logits`` is ``[M, B, T, V]``; ``weights`` ``[B, M]`` sums to 1 over teachers."""
    lp = torch.log_softmax(teacher_logits.double() / temperature, dim=-1)
    logw = torch.log(weights.double().clamp(min=1e-300)).T[:, :, None, None]  # [M, B, 1, 1]
    return torch.logsumexp(lp + logw, dim=0)


__all__ = [
    "combine",
    "competence_routes",
    "confidence_weights",
    "mixture_log_probs",
    "routing_weights",
    "step_weights",
    "success_weights",
]
