"""Policy-gradient, KL and SFT losses.

Conventions
-----------
* All losses are quantities to **minimise**. The policy-gradient per-token loss
  is ``max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high))`` with
  ``ratio = exp(logprobs - old_logprobs)``; positive advantage pushes log-prob up.
* ``mask`` marks the tokens that are trained on (policy-generated tokens). Tool
  observations / prompt / padding have mask 0, contribute nothing and receive
  exactly zero gradient.
* Each function returns ``(loss, metrics)``: ``loss`` a 0-dim tensor with grad,
  ``metrics`` a dict of Python floats.

Adding a policy loss: write a pure function with signature
``fn(logprobs, old_logprobs, advantages, mask, **kwargs) -> (loss, metrics)``
and decorate it with ``@register_policy_loss("name")``.
"""

from __future__ import annotations

import inspect
from typing import Callable, Iterable

import torch

from mentorrl.algos.logprobs import masked_mean, masked_sum
from mentorrl.config.names import POLICY_LOSSES

__all__ = [
    "AGG_MODES",
    "KL_KINDS",
    "POLICY_LOSSES",
    "register_policy_loss",
    "get_policy_loss",
    "unaccepted_arguments",
    "aggregate_loss",
    "clipped_policy_loss",
    "masked_importance_policy_loss",
    "clipped_value_loss",
    "kl_penalty",
    "grpo_loss",
    "sft_loss",
    "weighted_nll",
]

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
KL_KINDS = ("k1", "k2", "k3")

# log-ratios are clamped to this range before exp() (as verl does) so one
# badly off-policy token cannot overflow the ratio to inf.
_LOG_RATIO_CLAMP = 20.0


def register_policy_loss(name: str, replace: bool = False):
    """Decorator: register a policy loss under ``name`` (a taken name is an error unless ``replace``); a
    config picks it by name (``grpo.loss``)."""
    return POLICY_LOSSES.register(name, replace=replace)


def get_policy_loss(name: str) -> Callable:
    return POLICY_LOSSES.get(name)


def unaccepted_arguments(fn: Callable, names: Iterable[str]) -> list[str]:
    """The keyword arguments of ``names`` that loss ``fn`` does not take (none when it takes ``**kwargs``)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return []
    taken = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return [n for n in names if n not in taken]


def aggregate_loss(loss_tok: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean") -> torch.Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar over masked tokens.

    Modes:
        ``token-mean``: sum over all masked tokens / number of masked tokens in
            the batch (0 if there are none).
        ``seq-mean-token-mean``: per-sequence mean over its masked tokens, then
            mean over all ``B`` sequences.
        ``seq-mean-token-sum``: per-sequence sum over its masked tokens, then
            mean over all ``B`` sequences.

    A sequence with no masked tokens contributes 0 to the sequence mean (the
    denominator is still ``B``); nothing becomes NaN.
    """
    if mode == "token-mean":
        return masked_mean(loss_tok, mask)
    if mode == "seq-mean-token-mean":
        return masked_mean(loss_tok, mask, dim=-1).mean()
    if mode == "seq-mean-token-sum":
        return masked_sum(loss_tok, mask, dim=-1).mean()
    raise ValueError(f"unknown loss aggregation mode {mode!r}; valid: {list(AGG_MODES)}")


def _token_advantages(advantages: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    return advantages.to(like.dtype).expand_as(like)


def _masked_extreme(x: torch.Tensor, mask: torch.Tensor, largest: bool) -> float:
    keep = mask != 0
    if not bool(keep.any()):
        return 1.0
    return (x[keep].max() if largest else x[keep].min()).item()


def _token_ratio(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log_ratio, ratio)`` of current to behaviour log-probs, per token.

    Masked-out positions get log-ratio 0 (ratio 1) via where(), so junk there (even NaN
    behaviour log-probs) cannot reach the loss or the gradient; log-ratios are clamped
    before exp() so one badly off-policy token cannot overflow.
    """
    log_ratio = torch.where(mask != 0, logprobs - old_logprobs.detach(), torch.zeros_like(logprobs))
    log_ratio = log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return log_ratio, torch.exp(log_ratio)


@register_policy_loss("clipped")
def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    agg: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO/GRPO clipped surrogate with asymmetric clip range (DAPO clip-higher).

    Args:
        logprobs: ``[B, T]`` current-policy log-probs (requires grad).
        old_logprobs: ``[B, T]`` behaviour-policy log-probs (treated as constants).
        advantages: ``[B]`` (per sequence) or ``[B, T]`` (per token).
        mask: ``[B, T]`` 1 on trained tokens.
        eps_low, eps_high: ratio is clipped to ``[1 - eps_low, 1 + eps_high]``.
        agg: see :func:`aggregate_loss`.

    Returns ``(loss, metrics)`` with metrics (over masked tokens):
        pg_loss, clip_frac (share of tokens where the clipped branch is strictly
        larger, i.e. the gradient is cut), ratio_mean, ratio_max, ratio_min
        (1.0 when there are no masked tokens), approx_kl (mean of old - new).
    """
    log_ratio, ratio = _token_ratio(logprobs, old_logprobs, mask)
    adv = _token_advantages(advantages.detach(), ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss_tok = torch.maximum(unclipped, clipped)
    loss = aggregate_loss(loss_tok, mask, agg)

    with torch.no_grad():
        r = ratio.detach()
        metrics = {
            "pg_loss": loss.detach().item(),
            "clip_frac": masked_mean((clipped > unclipped).float(), mask).item(),
            "ratio_mean": masked_mean(r, mask).item() if bool((mask != 0).any()) else 1.0,
            "ratio_max": _masked_extreme(r, mask, largest=True),
            "ratio_min": _masked_extreme(r, mask, largest=False),
            "approx_kl": masked_mean(-log_ratio.detach(), mask).item(),
        }
    return loss, metrics


@register_policy_loss("masked_is")
def masked_importance_policy_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    agg: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level double-sided importance *masking* (SAO): ``-A * r`` where ``r`` is in range, else nothing.

    ``r = pi_theta / pi_behaviour`` per token, from the log-probs recorded at rollout. A token
    whose ratio lies outside ``[1 - eps_low, 1 + eps_high]`` -- on either side, whatever the
    sign of its advantage -- is dropped from the gradient instead of being clipped: a stale or
    mismatched token teaches nothing rather than a clipped constant. The aggregation still
    counts every policy token (``mask``), so masking lowers the step size instead of
    re-weighting the surviving tokens.

    Returns ``(loss, metrics)``: masked_frac, ratio mean/min/max and p05/p50/p95 over policy tokens.
    """
    keep = mask != 0
    log_ratio, ratio = _token_ratio(logprobs, behaviour_logprobs, mask)
    inside = (ratio >= 1.0 - eps_low) & (ratio <= 1.0 + eps_high)
    adv = _token_advantages(advantages.detach(), ratio)
    loss_tok = torch.where(inside & keep, -adv * ratio, torch.zeros_like(ratio))
    loss = aggregate_loss(loss_tok, mask, agg)

    with torch.no_grad():
        r = ratio.detach()[keep]
        # quantile needs q in the input's dtype and on its device (float64 log-probs crashed here)
        q = (
            torch.quantile(r.float(), torch.tensor([0.05, 0.5, 0.95], device=r.device)).tolist()
            if r.numel()
            else [1.0, 1.0, 1.0]
        )
        metrics = {
            "pg_loss": loss.detach().item(),
            "masked_frac": masked_mean((~inside).float(), mask).item(),
            "ratio_mean": r.mean().item() if r.numel() else 1.0,
            "ratio_max": _masked_extreme(ratio.detach(), mask, largest=True),
            "ratio_min": _masked_extreme(ratio.detach(), mask, largest=False),
            "ratio_p05": q[0],
            "ratio_p50": q[1],
            "ratio_p95": q[2],
            "approx_kl": masked_mean(-log_ratio.detach(), mask).item(),
        }
    return loss, metrics


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None = 0.2,
    agg: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO value loss ``0.5 * max((V - R)^2, (V_clip - R)^2)`` with ``V_clip = V_old + clip(V - V_old, +-clip)``.

    ``clip=None`` gives the plain squared error. Only policy tokens (``mask``) count.
    Returns ``(loss, metrics)``: value_loss, value_clip_frac and explained_variance.
    """
    keep = mask != 0
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    # select before computing: junk off the mask (NaN / inf values or returns) must not reach the
    # loss, nor its gradient through 0 * NaN in the backward pass
    values = torch.where(keep, values, zero)
    old = torch.where(keep, old_values.detach().to(values.dtype), zero)
    ret = torch.where(keep, returns.detach().to(values.dtype), zero)
    err = (values - ret) ** 2
    if clip is None:
        loss_tok, clipped = 0.5 * err, torch.zeros_like(err, dtype=torch.bool)
    else:
        v_clip = old + (values - old).clamp(-clip, clip)
        err_clip = (v_clip - ret) ** 2
        loss_tok, clipped = 0.5 * torch.maximum(err, err_clip), err_clip > err
    loss = aggregate_loss(loss_tok, mask, agg)
    with torch.no_grad():
        resid, target = (ret - values.detach())[keep], ret[keep]
        var = target.var(unbiased=False) if target.numel() > 1 else torch.tensor(0.0)
        ev = (1.0 - resid.var(unbiased=False) / var).item() if var > 1e-12 else 0.0
        metrics = {
            "value_loss": loss.detach().item(),
            "value_clip_frac": masked_mean(clipped.float(), mask).item(),
            "explained_variance": ev,
        }
    return loss, metrics


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimator of KL(pi || ref) from samples of pi. Returns ``[B, T]``.

    With ``d = logprobs - ref_logprobs``:
        k1 = d                       (unbiased, can be negative)
        k2 = 0.5 * d**2              (biased, non-negative)
        k3 = exp(-d) + d - 1         (= exp(ref - logp) - (ref - logp) - 1;
                                      unbiased, non-negative; Schulman 2020)
    ``ref_logprobs`` is treated as a constant.
    """
    d = logprobs - ref_logprobs.detach()
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d.square()
    if kind == "k3":
        neg = (-d).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        return torch.exp(neg) - neg - 1.0
    raise ValueError(f"unknown KL estimator {kind!r}; valid: {list(KL_KINDS)}")


@register_policy_loss("grpo")
def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    agg: str = "token-mean",
    kl_kind: str = "k3",
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO loss: clipped surrogate + ``kl_coef * KL(pi || ref)``.

    The KL term is the per-token :func:`kl_penalty` aggregated with the same
    ``agg`` mode. It is computed (and reported as ``kl``) whenever
    ``ref_logprobs`` is given; ``kl_coef > 0`` without ``ref_logprobs`` is an error.
    Metrics: everything from :func:`clipped_policy_loss` plus ``kl`` and ``loss``.
    """
    if kl_coef != 0.0 and ref_logprobs is None:
        raise ValueError("kl_coef != 0 requires ref_logprobs")
    pg, metrics = clipped_policy_loss(
        logprobs, old_logprobs, advantages, mask, eps_low=eps_low, eps_high=eps_high, agg=agg
    )
    loss = pg
    kl_val = 0.0
    if ref_logprobs is not None:
        keep = mask != 0
        zero = torch.zeros_like(logprobs)
        kl_tok = kl_penalty(
            torch.where(keep, logprobs, zero),
            torch.where(keep, ref_logprobs.detach().to(logprobs.dtype), zero),
            kl_kind,
        )
        kl = aggregate_loss(kl_tok, mask, agg)
        kl_val = kl.detach().item()
        if kl_coef != 0.0:
            loss = loss + kl_coef * kl
    metrics["kl"] = kl_val
    metrics["loss"] = loss.detach().item()
    return loss, metrics


def weighted_nll(logprobs: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum_b weights[b] * sum_t -logprobs[b, t] * mask[b, t]``: each row's summed negative
    log-likelihood of its masked tokens, weighted per row (a row of weight 0 adds nothing, not even
    a NaN from a masked-out position). ``weights`` [B]; the caller normalises (e.g. by token count)."""
    nll = torch.where(mask != 0, -logprobs, torch.zeros_like(logprobs)).sum(dim=-1)
    return (torch.where(weights != 0, nll, torch.zeros_like(nll)) * weights.to(nll.dtype)).sum()


def sft_loss(
    logprobs: torch.Tensor, mask: torch.Tensor, agg: str = "token-mean"
) -> tuple[torch.Tensor, dict[str, float]]:
    """Negative log-likelihood of the masked tokens, aggregated with ``agg``.

    Metrics: ``loss``, ``nll_token_mean`` (token-mean NLL regardless of ``agg``),
    ``num_tokens`` (number of masked tokens).
    """
    loss = aggregate_loss(-logprobs, mask, agg)
    with torch.no_grad():
        metrics = {
            "loss": loss.detach().item(),
            "nll_token_mean": masked_mean(-logprobs.detach(), mask).item(),
            "num_tokens": float((mask != 0).sum().item()),
        }
    return loss, metrics
