"""A new policy loss: the clipped surrogate on a *sequence-level* importance ratio (GSPO-style).

The per-token clipped loss (``clipped``) clips each token's ratio; this one clips the geometric
mean of a sequence's token ratios, so one trajectory is kept or cut as a whole. It is a pure
function on tensors, registered under a name; the learner calls it by that name.

Run it: ``python docs/examples/seq_clipped_loss.py`` checks it against hand-computed values.
"""

from __future__ import annotations

import torch

from mentorrl.algos.logprobs import masked_mean
from mentorrl.algos.losses import register_policy_loss


@register_policy_loss("seq_clipped")
def sequence_clipped_loss(
    logprobs: torch.Tensor,  # [B, T] current policy, requires grad
    old_logprobs: torch.Tensor,  # [B, T] behaviour policy (constants)
    advantages: torch.Tensor,  # [B] one advantage per sequence
    mask: torch.Tensor,  # [B, T] 1 on the policy's own tokens
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
    agg: str = "seq-mean-token-mean",  # a mean over sequences: the learner weights micro-batches by sequences
) -> tuple[torch.Tensor, dict[str, float]]:
    m = mask.float()
    n = m.sum(-1)
    has = (n > 0).float()  # a sequence with no policy tokens contributes nothing
    log_ratio = ((logprobs - old_logprobs.detach()) * m).sum(-1) / n.clamp_min(1.0)
    ratio = log_ratio.clamp(-20.0, 20.0).exp()  # [B]
    adv = advantages.detach()
    unclipped, clipped = -adv * ratio, -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    per_seq = torch.maximum(unclipped, clipped)
    loss = (per_seq * has).sum() / has.sum().clamp_min(1.0)
    with torch.no_grad():
        metrics = {
            "pg_loss": float(loss),
            "clip_frac": float(((clipped > unclipped).float() * has).sum() / has.sum().clamp_min(1.0)),
            "ratio_mean": float((ratio * has).sum() / has.sum().clamp_min(1.0)),
            "approx_kl": float(masked_mean(-(logprobs - old_logprobs).detach(), mask)),
        }
    return loss, metrics


def check() -> None:
    """Closed-form checks: on-policy the loss is -mean(A); masked tokens get exactly zero gradient;
    a sequence whose ratio left the clip range gets no gradient when clipping binds."""
    torch.manual_seed(0)
    old = torch.randn(3, 5)
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.float32)
    adv = torch.tensor([1.0, -2.0, 5.0])
    new = old.clone().requires_grad_(True)
    loss, metrics = sequence_clipped_loss(new, old, adv, mask)
    assert abs(loss.item() - (-(1.0 - 2.0) / 2)) < 1e-6, loss.item()  # the empty third sequence is left out
    loss.backward()
    assert torch.all(new.grad[mask == 0] == 0)
    assert abs(float(new.grad[0, 1]) - (-1.0 / 3 / 2)) < 1e-6  # d/dlogp of -A*r/|S| at r=1, averaged over 2 seqs
    pushed = (old + 0.1 * mask).requires_grad_(True)  # ratio e^0.1 on both: above 1 + eps_high
    loss, metrics = sequence_clipped_loss(pushed, old, torch.tensor([1.0, 1.0, 0.0]), mask)
    loss.backward()
    assert metrics["clip_frac"] == 1.0 and torch.all(pushed.grad == 0)


if __name__ == "__main__":
    check()
    print("seq_clipped: closed-form checks pass")
