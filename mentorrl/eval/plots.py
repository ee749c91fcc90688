"""PNG plots of a run's metrics (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_rl_curves(records: list[dict[str, Any]], out: str | Path, evals: dict[str, float] | None = None,
                   name: str = "GRPO") -> Path:
    """Reward mean (± std band) and task success per step of one RL stage (``name`` on the axes);
    held-out points if given."""
    stage = records[0].get("stage", "grpo") if records else "grpo"
    steps = [r["step"] for r in records]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    if records:
        ax1.plot(steps, [r["reward_mean"] for r in records], label="reward mean", color="tab:blue")
        mean = [r["reward_mean"] for r in records]
        std = [r["reward_std"] for r in records]
        ax1.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                         alpha=0.15, color="tab:blue", label="± std")
        ax2.plot(steps, [r["task_success"] for r in records], label="train rollout success", color="tab:green")
        checks = [r for r in records if "heldout_success" in r]
        if checks:
            ax2.plot([r["step"] for r in checks], [r["heldout_success"] for r in checks], "o--",
                     color="tab:red", label="held-out (gap monitor)")
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
