"""Preference losses on agent trajectories, as pure functions: DPO (sigmoid), IPO and ORPO.

A preference pair is two trajectories of the same task, *chosen* and *rejected*. On a
multi-turn agent trajectory only the policy's own tokens carry log-probs that belong in the
loss (tool observations and the prompt are masked out), and the pair usually shares a prefix
(the prompt, often earlier turns): :func:`after_shared_prefix` keeps the tokens from the first
one where the pair differs, so that the shared part, which is the same text in both, is not
counted twice in a length-normalised log-prob (DPO / IPO). ORPO instead compares each side's
mean log-prob over its own whole completion (all its policy tokens), as the paper and TRL do, so
both sides are measured over the same kind of token set.

Inputs are token log-probs ``[B, T]`` with their masks (e.g. ``Trajectory.loss_mask``), reduced
by :func:`sequence_logprobs`; DPO and IPO also take the reference model's sequence log-probs,
precomputed once, so no reference model needs to be kept in memory during the update.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sequence_logprobs(token_logprobs: torch.Tensor, mask: torch.Tensor, average: bool = False) -> torch.Tensor:
    """``[B]``: the sum (or, with ``average``, the mean) of the masked token log-probs of each row.
    A row with no masked token is an error: it would compare nothing. Positions outside the mask
    are selected out (``where``, not a product), so -inf or NaN there (padding) cannot leak in, and
    their gradient is exactly 0."""
    keep = mask != 0
    counts = keep.sum(-1).to(token_logprobs.dtype)
    if bool((counts == 0).any()):
        raise ValueError("a sequence has no policy token in its mask; a preference pair must differ in policy tokens")
    total = torch.where(keep, token_logprobs, torch.zeros_like(token_logprobs)).sum(-1)
    return total / counts if average else total


def after_shared_prefix(
    chosen_ids: list[int], rejected_ids: list[int], chosen_mask: list[int], rejected_mask: list[int]
) -> tuple[list[int], list[int]]:
    """The two masks restricted to tokens at or after the first position where the ids differ."""
    n = 0
    for a, b in zip(chosen_ids, rejected_ids):
        if a != b:
            break
        n += 1
    if n == len(chosen_ids) == len(rejected_ids):
        raise ValueError("chosen and rejected are the same token sequence")
    return [0] * n + list(chosen_mask[n:]), [0] * n + list(rejected_mask[n:])


def _pair_metrics(chosen_reward: torch.Tensor, rejected_reward: torch.Tensor) -> dict[str, float]:
    with torch.no_grad():
        return {
            "chosen_reward": chosen_reward.mean().item(),
            "rejected_reward": rejected_reward.mean().item(),
            "reward_margin": (chosen_reward - rejected_reward).mean().item(),
            "reward_accuracy": (chosen_reward > rejected_reward).float().mean().item(),
        }


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DPO with the sigmoid loss (Rafailov et al.): ``-log sigmoid(beta * (Δ_chosen - Δ_rejected))``
    with ``Δ = log pi(y) - log pi_ref(y)`` per sequence, averaged over pairs. ``label_smoothing``
    ε mixes in the flipped label (conservative DPO): ``-(1-ε) log σ(z) - ε log σ(-z)``.
    The implicit rewards ``beta * Δ`` are reported per side, with their margin and accuracy."""
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must lie in [0, 0.5), got {label_smoothing}")
    chosen, rejected = beta * (policy_chosen - ref_chosen), beta * (policy_rejected - ref_rejected)
    z = chosen - rejected
    loss = (-(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)).mean()
    return loss, {"loss": loss.detach().item(), **_pair_metrics(chosen, rejected)}


def ipo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    tau: float = 0.1,
) -> tuple[torch.Tensor, dict[str, float]]:
    """IPO (Azar et al.): ``(Δ_chosen - Δ_rejected - 1 / (2 tau))^2`` averaged over pairs. It regresses
    the log-ratio margin to a fixed target instead of pushing it to infinity. Usually given
    per-token mean log-probs (``sequence_logprobs(..., average=True)``)."""
    if not tau > 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    chosen, rejected = policy_chosen - ref_chosen, policy_rejected - ref_rejected
    loss = ((chosen - rejected - 1.0 / (2.0 * tau)) ** 2).mean()
    return loss, {"loss": loss.detach().item(), **_pair_metrics(chosen, rejected)}


def _log_odds(mean_logprob: torch.Tensor) -> torch.Tensor:
    """``log(p / (1 - p))`` for ``p = exp(mean_logprob)``, stable near ``p = 1``."""
    return mean_logprob - torch.log(-torch.expm1(mean_logprob.clamp(max=-1e-7)))


def orpo_loss(
    chosen_token_logprobs: torch.Tensor,
    chosen_mask: torch.Tensor,
    rejected_token_logprobs: torch.Tensor,
    rejected_mask: torch.Tensor,
    lam: float = 0.1,
) -> tuple[torch.Tensor, dict[str, float]]:
    """ORPO (Hong et al.), reference-free: the chosen side's token-mean NLL plus
    ``lam * -log sigmoid(log odds(chosen) - log odds(rejected))``, where ``odds(y) = p / (1 - p)`` and
    ``p`` is the per-token geometric mean probability of ``y``'s masked tokens."""
    if not lam >= 0:
        raise ValueError(f"lam must be >= 0, got {lam}")
    lc = sequence_logprobs(chosen_token_logprobs, chosen_mask, average=True)
    lr = sequence_logprobs(rejected_token_logprobs, rejected_mask, average=True)
    ratio = _log_odds(lc) - _log_odds(lr)
    nll = -lc.mean()
    odds_term = -F.logsigmoid(ratio).mean()
    loss = nll + lam * odds_term
    with torch.no_grad():
        metrics = {
            "loss": loss.item(),
            "nll": nll.item(),
            "odds_ratio_loss": odds_term.item(),
            "log_odds_ratio": ratio.mean().item(),
            "reward_accuracy": (ratio > 0).float().mean().item(),
        }
    return loss, metrics


def soft_label_loss(
    student_scores: torch.Tensor, teacher_scores: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, dict[str, float]]:
    """Candidate-level soft labels: the cross-entropy from the teacher's ``softmax(scores / T)``
    over N candidates to the student's ``softmax`` over its own sequence log-probs of them.

    ``student_scores`` / ``teacher_scores``: ``[N]`` (one group) or ``[G, N]`` (groups of equal
    size), averaged over groups. The minimum is reached when the student's candidate
    probabilities, renormalised over the candidates, equal the teacher's weights; the loss minus
    the target's entropy is their KL (reported as ``soft_label_kl``)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if student_scores.shape != teacher_scores.shape or student_scores.shape[-1] < 2:
        raise ValueError(
            f"need matching [.., N>=2] scores, got {tuple(student_scores.shape)} and {tuple(teacher_scores.shape)}"
        )
    target = torch.softmax(teacher_scores.float() / temperature, dim=-1)
    logq = torch.log_softmax(student_scores.float(), dim=-1)
    ce = -(target * logq).sum(-1)
    loss = ce.mean()
    with torch.no_grad():
        ent = -(target * target.clamp_min(1e-30).log()).sum(-1)
        top = (logq.argmax(-1) == target.argmax(-1)).float().mean()
        metrics = {"loss": loss.item(), "soft_label_kl": (ce - ent).mean().item(), "top_agreement": top.item()}
    return loss, metrics


__all__ = ["after_shared_prefix", "dpo_loss", "ipo_loss", "orpo_loss", "sequence_logprobs", "soft_label_loss"]
