"""From teacher signals to per-token OPD advantages, as small pure functions over a batch.

* :func:`teacher_weights`: MOPD's per-trajectory teacher weights (routing x confidence x
  success history), ``[B, M]``.
* :func:`kl_advantages`: the distillation advantage of every student token, from one or
  several teachers. Teachers that share the student's tokenizer share its chunks (one per
  policy token), and their target is the weighted **mixture** ``log sum_m w_m p_m(chunk)``;
  teachers with their own tokenizers chunk differently, so their advantages are averaged
  with the same weights.
* :func:`tool_error_tokens`: the policy tokens of turns whose tool call failed (MOPD's
  failure-aware step weights).
* :func:`group_reward_weights`: reward-weighted distillation's ``softmax(R / T)`` over each group.
* :class:`GapShare`: ShortOPD's per-family share of drawn tasks rolled out, from the measured gap.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch

from mentorrl.algos.distill import reward_weights
from mentorrl.opd.mopd import confidence_weights, routing_weights, success_weights
from mentorrl.opd.signals import ChunkSignal, chunk_advantages
from mentorrl.trajectory import Trajectory


def teacher_weights(
    families: Sequence[str],
    names: Sequence[str],
    signals: Sequence[Sequence[ChunkSignal | None]],
    routes: Mapping[str, Mapping[str, float]],
    confidence_temperature: float | None = None,
    history: Mapping[str, tuple[int, int]] | None = None,
) -> torch.Tensor:
    """``[B, M]`` weights over teachers for each trajectory, rows summing to 1 over the teachers
    whose signal exists (a teacher that could not score a trajectory gets 0 there)."""
    B, M = len(families), len(names)
    parts = [routing_weights(families, names, routes)]
    if confidence_temperature is not None:  # mean log-prob per chunk on each trajectory, per teacher
        scores = torch.full((M, B, 1), -1e4, dtype=torch.float64)
        for m in range(M):
            for b in range(B):
                s = signals[m][b]
                if s is not None and s.num_chunks:
                    scores[m, b, 0] = s.teacher_lp.mean()
        parts.append(confidence_weights(scores, torch.ones(B, 1), confidence_temperature))
    if history is not None:
        parts.append(success_weights(history, names)[None].expand(B, M))
    present = torch.tensor([[signals[m][b] is not None for m in range(M)] for b in range(B)], dtype=torch.float64)
    w = torch.ones(B, M, dtype=torch.float64)
    for p in parts:
        w = w * p
    w = w * present
    total = w.sum(-1, keepdim=True)
    return torch.where(total > 0, w / total.clamp(min=1e-300), torch.zeros_like(w))


def kl_advantages(
    trajs: Sequence[Trajectory],
    signals: Sequence[Sequence[ChunkSignal | None]],
    weights: torch.Tensor,
    shared_chunks: Sequence[bool],
) -> list[torch.Tensor | None]:
    """Per trajectory, the distillation advantage of each token ``[T]`` (None when no teacher scored it).

    ``shared_chunks[m]``: teacher ``m`` shares the student's tokenizer (one chunk per policy token)."""
    out: list[torch.Tensor | None] = []
    for b, t in enumerate(trajs):
        student = torch.tensor(t.logprobs)
        ms = [m for m in range(len(signals)) if signals[m][b] is not None and weights[b, m] > 0]
        if not ms:
            out.append(None)
            continue
        same = [m for m in ms if shared_chunks[m]]
        adv = torch.zeros(len(t.token_ids))
        if same:  # the weighted mixture of the same-tokenizer teachers, over the shared chunks
            w_same = weights[b, same]
            lps = torch.stack([signals[m][b].teacher_lp for m in same])
            mix = torch.logsumexp(lps + torch.log(w_same / w_same.sum())[:, None], dim=0)
            adv += float(w_same.sum()) * chunk_advantages(signals[same[0]][b], student, mix)
        for m in ms:
            if not shared_chunks[m]:
                adv += float(weights[b, m]) * chunk_advantages(signals[m][b], student)
        out.append(adv)
    return out


def tool_error_tokens(traj: Trajectory) -> torch.Tensor:
    """``[T]`` bool: the policy tokens of every turn whose tool call failed (``ToolCall.turn`` is 1-based)."""
    failed = {c.turn for c in traj.tool_calls if not c.ok}
    out = torch.zeros(len(traj.token_ids), dtype=torch.bool)
    policy = [s for s in traj.segments if s.role == "policy"]
    for k, seg in enumerate(policy, start=1):
        if k in failed:
            out[seg.start : seg.end] = True
    return out


def until_first_error(traj: Trajectory) -> torch.Tensor:
    """``[T]`` float: 1 on the policy tokens up to and including the first turn whose tool call failed,
    0 after it. The states after a failed call are off the teacher's support (its demonstrations
    hold no errors), where its preferences are least reliable."""
    out = torch.tensor(traj.loss_mask, dtype=torch.float32)
    failed = sorted(c.turn for c in traj.tool_calls if not c.ok)
    if failed:
        policy = [s for s in traj.segments if s.role == "policy"]
        if failed[0] <= len(policy):
            out[policy[failed[0] - 1].end :] = 0.0
    return out


def group_reward_weights(rewards: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[n_tasks, G]`` rewards -> weights ``softmax(R / T)`` per group, scaled by ``G`` so they average 1."""
    return reward_weights(rewards, temperature) * rewards.shape[-1]


class GapShare:
    """ShortOPD's adaptive rollout budget, spent as whole episodes: each task family's share of its drawn tasks that
    are rolled out grows with its measured teacher-student gap (an exponential moving average of the mean per-token
    |advantage|). A family the student already matches gets few rollouts; no episode is ever cut short (a cut
    episode never reaches its final answer, and would teach the student to stop mid-task).

    ``share = min_share + (1 - min_share) * min(1, gap / full_gap)``; a family not yet measured gets 1 (its gap is
    unknown, so nothing is left out)."""

    def __init__(self, min_share: float, full_gap: float, ema: float):
        if not 0 < min_share <= 1:
            raise ValueError(f"need 0 < min_share <= 1, got {min_share}")
        self.min_share, self.full_gap, self.ema = min_share, full_gap, ema
        self.gap: dict[str, float] = {}

    def share(self, family: str) -> float:
        g = self.gap.get(family)
        if g is None:
            return 1.0
        return self.min_share + (1.0 - self.min_share) * min(1.0, g / self.full_gap)

    def select(self, tasks: list, rng) -> list:
        """The tasks rolled out this step: each kept with its family's share (``rng``: the step's seeded draw, one
        number per task in order), at least one (the task of the largest share, the first among equals)."""
        shares = [self.share(t.family) for t in tasks]
        kept = [t for t, s in zip(tasks, shares) if rng.random() < s]
        if not kept and tasks:
            kept = [tasks[max(range(len(tasks)), key=lambda i: (shares[i], -i))]]
        return kept

    def observe(self, family: str, gap: float) -> None:
        if not math.isfinite(gap):
            return
        old = self.gap.get(family)
        self.gap[family] = gap if old is None else (1 - self.ema) * old + self.ema * gap

    def state_dict(self) -> dict[str, Any]:
        return {"gap": dict(self.gap)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.gap = dict(state.get("gap", {}))


__all__ = [
    "GapShare",
    "group_reward_weights",
    "until_first_error",
    "kl_advantages",
    "teacher_weights",
    "tool_error_tokens",
]
