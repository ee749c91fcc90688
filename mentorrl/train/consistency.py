"""Train/rollout consistency: what the learner trains on must be what the policy did.

Per batch (pure checks over recorded trajectories):

* ``policy_version``: every trajectory's version <= the learner's current version;
* ``lengths``: token ids, log-probs and loss mask have equal lengths;
* ``observation_mask``: tool-return (and prompt) tokens have loss mask 0;
* ``env_version``: the environment name and version match the run's environment;
* ``contract``: the tokenizer / template / sampling fingerprint matches the run's contract.

Per step (metrics): the mean absolute gap between behaviour log-probs and the learner's
recomputed log-probs, a k3 estimate of KL(rollout || learner), and policy lag.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from mentorrl.algos.logprobs import masked_mean
from mentorrl.trajectory import Trajectory


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str = ""


def _first(bad: list[str], what: str) -> str:
    return f"{len(bad)} {what}, e.g. {bad[0]}" if bad else ""


def batch_checks(
    trajs: Sequence[Trajectory], current_version: int, env_name: str, env_version: str, fingerprint: str
) -> list[Check]:
    """The five per-batch checks; each lists how many trajectories fail and one example."""
    ahead = [f"{t.id} (v{t.policy_version} > v{current_version})" for t in trajs if t.policy_version > current_version]
    lengths = [t.id for t in trajs if not (len(t.token_ids) == len(t.logprobs) == len(t.loss_mask))]
    masks = []
    for t in trajs:
        for seg in t.segments:
            # prompt and tool-return tokens are never trained on; a policy turn may be masked out
            # (a replayed segment trains on one window of turns), so only 0s are checked
            if seg.role != "policy" and any(t.loss_mask[seg.start : seg.end]):
                masks.append(f"{t.id} ({seg.role} tokens {seg.start}-{seg.end} not all 0)")
                break
        else:
            covered = sum(s.end - s.start for s in t.segments)
            if t.segments and covered != len(t.token_ids):
                masks.append(f"{t.id} (segments cover {covered} of {len(t.token_ids)} tokens)")
    envs = [
        f"{t.id} ({t.env_name} {t.env_version})"
        for t in trajs
        if (t.env_name, t.env_version) != (env_name, env_version)
    ]
    prints = [f"{t.id} ({t.contract_fingerprint or 'none'})" for t in trajs if t.contract_fingerprint != fingerprint]
    return [
        Check("policy_version", not ahead, _first(ahead, "from a future policy")),
        Check("lengths", not lengths, _first(lengths, "with unequal token / log-prob / mask lengths")),
        Check("observation_mask", not masks, _first(masks, "with a wrong loss mask")),
        Check("env_version", not envs, _first(envs, f"not from {env_name} {env_version}")),
        Check("contract", not prints, _first(prints, f"with another contract fingerprint than {fingerprint}")),
    ]


def logprob_gap_metrics(behaviour: torch.Tensor, learner: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Mean |behaviour - learner| log-prob gap and a k3 estimate of KL(rollout || learner) over policy tokens."""
    keep = mask != 0
    diff = torch.where(keep, learner.detach() - behaviour.detach(), torch.zeros_like(learner))
    k3 = torch.exp(diff) - 1 - diff  # samples come from the rollout policy: E[r - 1 - log r], r = learner / rollout
    return {"logprob_abs_gap": masked_mean(diff.abs(), mask).item(), "train_rollout_kl": masked_mean(k3, mask).item()}


def policy_lag(trajs: Sequence[Trajectory], current_version: int) -> dict[str, float]:
    lags = [current_version - t.policy_version for t in trajs]
    if not lags:
        return {"policy_lag_mean": 0.0, "policy_lag_max": 0.0}
    return {"policy_lag_mean": sum(lags) / len(lags), "policy_lag_max": float(max(lags))}
