"""A new advantage estimator: centred ranks within each group (scale-free GRPO advantages).

GRPO's default divides group-centred rewards by the group's standard deviation, so one outlier reward
sets the scale of every other member's advantage. This estimator uses each response's rank in its
group instead: the best gets +1, the worst -1, the rest evenly between, ties share their mean rank. It is
a pure function on a ``[G, K]`` reward tensor (``G`` tasks, ``K`` samples each), registered under a
name; a recipe picks it with ``grpo.advantage: rank``.

Run it: ``python docs/examples/rank_advantage.py`` checks it against hand-computed values.
"""

from __future__ import annotations

import torch

from mentorrl.algos.advantages import register_advantage


@register_advantage("rank")
def rank_advantages(rewards: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """``[G, K]`` rewards -> ``[G, K]`` advantages in [-1, 1]; a group whose rewards are all equal (or of one
    member) gets exactly 0. ``normalize_std`` / ``eps`` are the stage's arguments to every estimator."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [G, K], got shape {tuple(rewards.shape)}")
    r = rewards.float()
    k = r.shape[1]
    if k <= 1:
        return torch.zeros_like(r)
    below = (r.unsqueeze(2) > r.unsqueeze(1)).float().sum(2)  # members each one beats
    ties = (r.unsqueeze(2) == r.unsqueeze(1)).float().sum(2) - 1  # members it ties with (not itself)
    rank = below + ties / 2  # 0 .. k-1, ties sharing their mean rank
    return 2 * rank / (k - 1) - 1  # mean ranks sum to 0 + ... + k-1, so each group's advantages sum to 0


def check() -> None:
    adv = rank_advantages(torch.tensor([[0.0, 1.0, 0.5, 2.0], [1.0, 1.0, 1.0, 1.0], [3.0, 3.0, 0.0, 1.0]]))
    want = torch.tensor([[-1.0, 1 / 3, -1 / 3, 1.0], [0.0, 0.0, 0.0, 0.0], [2 / 3, 2 / 3, -1.0, -1 / 3]])
    assert torch.allclose(adv, want, atol=1e-6), adv
    assert torch.allclose(adv.sum(1), torch.zeros(3), atol=1e-6)  # each group's advantages balance
    assert torch.equal(rank_advantages(torch.tensor([[5.0]])), torch.zeros(1, 1))
    # scale-free: any increasing transform of the rewards gives the same advantages
    r = torch.tensor([[0.2, 1.5, -3.0, 0.7]])
    assert torch.allclose(rank_advantages(r), rank_advantages(torch.exp(r) * 100), atol=1e-6)


if __name__ == "__main__":
    check()
    print("rank advantages: ok")
