"""GRPO debug report: fix P tasks, draw N samples each, and read the signal before tuning anything.

The notes' debugging order is: is the reward right -> does sampling find positives -> do
groups have reward spread -> do advantages carry signal -> does the loss move the right
tokens -> only then hyper-parameters. :func:`probe_stats` measures one policy on fixed
tasks; :func:`diagnose` turns those numbers (and, optionally, a run's GRPO history from
``metrics.jsonl``) into findings with the notes' diagnosis and advice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from mentorrl.algos.advantages import group_reward_stats, grpo_advantages
from mentorrl.core.trace import invalid_calls
from mentorrl.trajectory import Trajectory


@dataclass(frozen=True)
class Finding:
    code: str
    severity: str  # "problem" | "warning" | "ok"
    diagnosis: str
    advice: str


def probe_stats(trajs: Sequence[Trajectory], group_size: int) -> dict[str, float]:
    """Statistics of ``P * N`` trajectories laid out task-major (N consecutive samples per task)."""
    if not trajs or len(trajs) % group_size:
        raise ValueError(f"need P * N trajectories with N={group_size}, got {len(trajs)}")
    r = torch.tensor([t.reward.total if t.reward else 0.0 for t in trajs], dtype=torch.float32).view(-1, group_size)
    succ = torch.tensor([bool(t.reward and t.reward.success) for t in trajs], dtype=torch.float32).view(-1, group_size)
    adv = grpo_advantages(r)
    calls = [c for t in trajs for c in t.tool_calls]
    stats = {f"reward_{k}": v for k, v in group_reward_stats(r).items()}
    stats.update(
        tasks=float(r.shape[0]),
        samples_per_task=float(group_size),
        success_rate=succ.mean().item(),
        tasks_with_success=(succ.max(dim=1).values > 0).float().mean().item(),
        advantage_std=adv.std(unbiased=False).item(),
        tool_success=sum(c.ok for c in calls) / len(calls) if calls else 1.0,
        invalid_call_rate=sum(invalid_calls(t) for t in trajs) / len(calls) if calls else 0.0,
        timeout_rate=sum(c.error_kind == "timeout" for c in calls) / len(calls) if calls else 0.0,
        truncation_rate=sum(t.finish_reason != "answer" for t in trajs) / len(trajs),
        violation_rate=sum(bool(t.reward and t.reward.violations) for t in trajs) / len(trajs),
    )
    return stats


def _window(xs: list[float], n: int, last: bool) -> float:
    part = xs[-n:] if last else xs[:n]
    return sum(part) / len(part)


def diagnose(
    stats: dict[str, float], history: Sequence[dict[str, Any]] | None = None, window: int = 5
) -> list[Finding]:
    """The notes' diagnosis table applied to probe statistics and, if given, GRPO step records."""
    success, zero_var = stats["success_rate"], stats["reward_zero_variance_group_share"]
    hist = [h for h in (history or []) if "reward_mean" in h]
    out = _signal_findings(success, zero_var) + _runtime_findings(stats)
    if len(hist) >= 2 * window:
        out += _history_findings(hist, window, zero_var)
    if not out:
        out.append(
            Finding(
                "healthy",
                "ok",
                "groups carry reward spread and the runtime works",
                "GRPO has signal; tune hyper-parameters only if progress stalls",
            )
        )
    return out


def _signal_findings(success: float, zero_var: float) -> list[Finding]:
    """Whether the probe's groups carry a reward spread GRPO can learn from."""
    out: list[Finding] = []
    if success < 0.01 and zero_var >= 0.8:
        out.append(
            Finding(
                "no_signal",
                "problem",
                "low reward and std ~ 0: almost every group is all-failure, GRPO gets no relative signal",
                "cold start first (SFT, `recipe: [sft, rft, grpo]`, distillation); shape the reward; "
                "sample more per task",
            )
        )
    elif success < 0.2 and zero_var < 0.8:
        out.append(
            Finding(
                "low_success_with_spread",
                "warning",
                "low reward with spread: the policy explores but rarely succeeds",
                "raise the positive share: RFT on verified successes, a difficulty band, larger groups",
            )
        )
    if 0.01 <= success <= 0.9 and zero_var >= 0.6:
        out.append(
            Finding(
                "polarized",
                "warning",
                f"{zero_var:.0%} of groups are all-success or all-failure although {success:.0%} of "
                "samples succeed: most tasks are always or never solved, and only the rest teach GRPO",
                "draw tasks from the 5-50% success band (the RFT difficulty filter), use the hard-task "
                "pool, or raise the group size",
            )
        )
    if success > 0.9 and zero_var >= 0.8:
        out.append(
            Finding(
                "saturated",
                "warning",
                "high reward with std ~ 0: the tasks are too easy to teach anything",
                "filter tasks by difficulty (keep 5-50% success) or add harder tasks",
            )
        )
    return out


def _runtime_findings(stats: dict[str, float]) -> list[Finding]:
    """Problems of the agent runtime: tool timeouts and errors, malformed calls, truncation, violations."""
    out: list[Finding] = []
    if stats.get("timeout_rate", 0.0) > 0.05:
        out.append(
            Finding(
                "tool_runtime",
                "problem",
                f"{stats['timeout_rate']:.0%} of tool calls time out: "
                "the low reward is an agent-runtime problem, not the policy loss",
                "check tool latency and timeouts (env.tool_timeout_s) and how results are written back",
            )
        )
    if stats["tool_success"] < 0.7:
        out.append(
            Finding(
                "tool_errors",
                "warning",
                f"tool success only {stats['tool_success']:.0%} "
                f"({stats['invalid_call_rate']:.0%} of calls invalid, the rest refused by the tools: "
                "wrong ids, arguments or order of steps)",
                "run `mentorrl flywheel` on these trajectories: ARGUMENT_ERROR / TOOL_SELECTION failures "
                "route to targeted SFT; also check the tool schemas the prompt shows",
            )
        )
    if stats["invalid_call_rate"] > 0.2:
        out.append(
            Finding(
                "invalid_calls",
                "problem",
                f"{stats['invalid_call_rate']:.0%} of calls are malformed, unknown or badly typed",
                "targeted SFT on the call format; check the template and tool schema",
            )
        )
    if stats["truncation_rate"] > 0.3:
        out.append(
            Finding(
                "truncation",
                "warning",
                f"{stats['truncation_rate']:.0%} of episodes hit a limit",
                "raise max_turns / max_new_tokens, or look for loops",
            )
        )
    if stats["violation_rate"] > 0.05:
        out.append(
            Finding(
                "violations",
                "problem",
                f"{stats['violation_rate']:.0%} of episodes break a hard constraint",
                "review them; run `mentorrl reward-audit` to confirm the reward punishes them",
            )
        )
    return out


def _history_findings(hist: Sequence[dict[str, Any]], window: int, zero_var: float) -> list[Finding]:
    """What GRPO's step records (at least ``2 * window`` with a reward) show: reward hacking, drift, a loss that
    moves while the reward does not."""
    out: list[Finding] = []
    rewards = [h["reward_mean"] for h in hist]
    succ_key = "heldout_success" if sum("heldout_success" in h for h in hist) >= 2 else "task_success"
    succs = [h[succ_key] for h in hist if succ_key in h]
    d_reward = _window(rewards, window, True) - _window(rewards, window, False)
    d_succ = (
        (succs[-1] - succs[0])
        if succ_key == "heldout_success"
        else _window(succs, window, True) - _window(succs, window, False)
    )
    peak = max(_window(rewards[i:], window, False) for i in range(len(rewards) - window + 1))
    if d_reward > 0.05 and d_succ <= 0.0:
        out.append(
            Finding(
                "reward_hacking",
                "problem",
                f"reward rose {d_reward:+.3f} while {succ_key.replace('_', ' ')} changed {d_succ:+.3f}",
                "the policy may exploit the reward: run `mentorrl reward-audit`, review flagged "
                "trajectories, verify from environment state",
            )
        )
    if peak - _window(rewards, window, True) > 0.2 and peak > _window(rewards, window, False) + 0.05:
        out.append(
            Finding(
                "policy_drift",
                "problem",
                "reward rose and then collapsed",
                "policy update too large: check KL, learning rate, grad norm, clip fraction",
            )
        )
    losses = [h.get("loss", 0.0) for h in hist]
    loss_spread = max(losses) - min(losses)
    if abs(d_reward) < 0.01 and loss_spread > 0.05 and zero_var < 0.8:
        out.append(
            Finding(
                "pipeline_bug",
                "warning",
                "the loss moves but the reward does not",
                "check advantages, the loss mask (policy tokens only) and that gradients reach the model",
            )
        )
    return out
