"""PNG plots of a run's metrics (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_rl_curves(
    records: list[dict[str, Any]], out: str | Path, evals: dict[str, float] | None = None, name: str = "GRPO"
) -> Path:
    """Reward mean (± std band) and task success per step of one RL stage (``name`` on the axes);
    held-out points if given."""
    stage = records[0].get("stage", "grpo") if records else "grpo"
    steps = [r["step"] for r in records]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    if records:
        ax1.plot(steps, [r["reward_mean"] for r in records], label="reward mean", color="tab:blue")
        mean = [r["reward_mean"] for r in records]
        std = [r["reward_std"] for r in records]
        ax1.fill_between(
            steps,
            [m - s for m, s in zip(mean, std)],
            [m + s for m, s in zip(mean, std)],
            alpha=0.15,
            color="tab:blue",
            label="± std",
        )
        ax2.plot(steps, [r["task_success"] for r in records], label="train rollout success", color="tab:green")
        checks = [r for r in records if "heldout_success" in r]
        if checks:
            ax2.plot(
                [r["step"] for r in checks],
                [r["heldout_success"] for r in checks],
                "o--",
                color="tab:red",
                label="held-out (gap monitor)",
            )
    ax1.set_xlabel(f"{name} step")
    ax1.set_ylabel("reward")
    ax1.set_title("Reward per step")
    ax1.legend()
    if evals:
        last = steps[-1] if steps else 1
        for label, v in evals.items():  # every stage before the RL stage is plotted at step 0
            ax2.scatter([last if label == stage else 0], [v], marker="D", s=50, label=f"held-out ({label})")
    ax2.set_ylim(0, 1.02)
    ax2.set_xlabel(f"{name} step")
    ax2.set_ylabel("task success")
    ax2.set_title("Task success")
    ax2.legend(loc="upper right")
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_step_metrics(records: list[dict[str, Any]], out: str | Path, name: str = "GRPO") -> Path:
    """The per-step rollout metrics of one stage (see :func:`mentorrl.train.stage_helpers.rollout_metrics`)
    in six panels: tool calls per trajectory and the malformed-call rate; finish-reason shares
    (stacked); turns; policy tokens per trajectory; rollout vs update seconds; CPU utilisation."""
    steps = [r["step"] for r in records]

    def col(key: str) -> list[float]:
        return [float(r.get(key) or 0.0) for r in records]

    fig, axes = plt.subplots(2, 3, figsize=(15, 7))
    ax = axes[0][0]
    ax.plot(steps, col("tool_calls_per_traj"), color="tab:blue", label="tool calls / trajectory")
    ax.set_ylabel("calls")
    twin = ax.twinx()
    twin.plot(steps, col("malformed_call_rate"), color="tab:red", linestyle="--", label="malformed-call rate")
    twin.set_ylim(0, 1.02)
    twin.set_ylabel("malformed share")
    ax.legend(handles=ax.get_lines() + twin.get_lines(), loc="upper left", fontsize=8)
    ax.set_title("Tool calls")
    ax = axes[0][1]
    reasons = [
        ("answer", "answer"),
        ("max_turns", "turn limit"),
        ("max_tokens", "context budget"),
        ("length", "turn cut (max_new_tokens)"),
    ]
    ax.stackplot(steps, *[col(f"finish_{k}") for k, _ in reasons], labels=[lbl for _, lbl in reasons], alpha=0.8)
    ax.set_ylim(0, 1.0)
    ax.legend(loc="lower left", fontsize=8)
    ax.set_title("Finish reasons (share of trajectories)")
    axes[0][2].plot(steps, col("mean_turns"), color="tab:purple")
    axes[0][2].set_title("Turns per trajectory")
    axes[1][0].plot(steps, col("mean_policy_tokens"), color="tab:brown")
    axes[1][0].set_title("Policy tokens per trajectory")
    ax = axes[1][1]
    ax.plot(steps, col("rollout_s"), label="rollout", color="tab:green")
    ax.plot(steps, col("update_s"), label="update", color="tab:orange")
    ax.plot(steps, col("step_s"), label="whole step", color="tab:gray", linestyle=":")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=8)
    ax.set_title("Seconds per step")
    ax = axes[1][2]
    ax.plot(steps, col("cpu_util"), label="whole step", color="tab:gray")
    if any("rollout_cpu_util" in r for r in records):
        ax.plot(steps, col("rollout_cpu_util"), label="rollout", color="tab:green")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=8)
    cores = int(records[-1].get("cpu_cores", 0)) if records else 0
    ax.set_title(f"CPU utilisation (share of {cores} cores)" if cores else "CPU utilisation")
    for ax in axes.flat:
        ax.set_xlabel(f"{name} step")
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
