"""Keep a stage's replay buffer in step with its checkpoints (SAO, the self-evolving loop).

A stage that writes a :class:`~mentorrl.replay.buffer.ReplayBuffer` between checkpoints must,
on resume, see the buffer as it was when the restored checkpoint was written: entries of the
discarded steps gone, entries they evicted back. :class:`BufferCheckpoints` does the
bookkeeping once for every such stage:

* :meth:`start` (first step): when no checkpoint was restored, the stage starts from an empty
  buffer (a run directory reused without ``--resume`` must not replay an earlier attempt);
* :meth:`state` (at each checkpoint): the buffer's mark, plus the high-water marks of the
  last ``keep`` checkpoints, so evicted rows newer than the oldest retained checkpoint are kept
  and a rollback to any of them can restore them;
* :meth:`restore` (on resume): roll the buffer back to the checkpoint's mark in one
  transaction; a replaced buffer file raises :class:`~mentorrl.replay.buffer.ReplayBufferError`
  naming it; a checkpoint written before marks existed keeps the buffer and says so. Then the
  **version rule**: every entry from a policy version above the restored learner's is dropped.

The version rule is keyed on the restored policy version, not on the mark, so it holds for any
producer, whenever it wrote: an SAO step killed between its buffer write and the next
checkpoint, a checkpoint that predates marks, a producer that writes rollouts ahead of the
checkpoint it is taken with (one-step-off-policy overlap). The consistency gate
(:func:`mentorrl.train.consistency.batch_checks`) refuses to train on an entry from a future
policy; after the rule it is never offered one.

Why drop, not re-version (stamp the entry with the restored version): the importance correction
divides the learner's probability by the *behaviour* policy's, and the version is what says which
policy that was. An entry ahead of the restored learner was sampled by a policy of a discarded
future: the resumed run will never hold those weights (it trains from the checkpoint on other
data), so nothing it computes can match them. Its recorded log-probs are still the sampler's, but
stamped with the restored version it would pass as lag 0, i.e. on-policy: the staleness rule
(drop or down-weight by lag) and the replay's staleness decay, which bound how far the behaviour
policy may be from the learner for the clipped ratio to be trusted, would see no distance where
there may be several updates' worth, in a direction the resumed run may never take. And a
re-versioned entry would make the resumed run depend on where the kill landed; dropped, the run
continues from the checkpoint's state alone. What is lost is at most the entries written since
the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from mentorrl.replay.buffer import ReplayBuffer


@dataclass(frozen=True)
class ResumeDrops:
    """What :meth:`BufferCheckpoints.restore` removed from the buffer."""

    version: int  # the restored learner's policy version
    discarded: int  # entries of the discarded steps (inserted after the checkpoint's mark)
    # policy version -> entries above ``version`` the buffer held when the resume began (all dropped:
    # by the rollback when written after the checkpoint's mark, else by the version rule)
    ahead: dict[int, int] = field(default_factory=dict)
    by_version_rule: int = 0  # entries the version rule dropped (the mark did not cover them)

    @property
    def ahead_total(self) -> int:
        return sum(self.ahead.values())

    def metrics(self) -> dict[str, float]:
        """For the first step's record after the resume."""
        return {
            "replay_resume_discarded": float(self.discarded),
            "replay_resume_ahead_dropped": float(self.ahead_total),
        }


class BufferCheckpoints:
    def __init__(self, buffer: ReplayBuffer, keep: int, stage: str, say: Callable[[str], None]):
        self.buffer, self.keep, self.stage, self.say = buffer, keep, stage, say
        self.marks: list[int] = []  # high-water of the last ``keep`` checkpoints
        self.restored = False  # persisted state already matches a restored checkpoint
        self.drops: ResumeDrops | None = None  # what the last restore removed, until :meth:`take_metrics`

    def start(self) -> bool:
        """Empty the buffer unless a checkpoint was restored; True when it did (the stage starts fresh)."""
        if self.restored:
            return False
        self.buffer.rollback(None)
        self.restored = True
        return True

    def state(self) -> dict[str, Any]:
        mark = self.buffer.mark()
        if len(self.marks) >= self.keep:  # no retained checkpoint (nor this one) is older than that
            self.buffer.forget_evicted(self.marks[-self.keep])
        self.marks = (self.marks + [mark["high_water"]])[-self.keep :]
        return {"replay": mark, "replay_marks": list(self.marks)}

    def restore(self, saved: dict[str, Any], version: int) -> ResumeDrops:
        """Bring the buffer back to the checkpoint ``saved`` and drop every entry from a policy
        version above ``version`` (the restored learner's); counts and says what it dropped."""
        before = self.buffer.versions_ahead(version)
        discarded = 0
        if saved.get("replay") is not None:
            discarded = self.buffer.rollback(saved["replay"])  # ReplayBufferError (file named) if it was replaced
            self.say(
                f"[yellow]{self.stage}: replay buffer rolled back to the checkpoint "
                f"({discarded} entries of discarded steps dropped)[/yellow]"
            )
        else:
            self.say(
                f"[red]{self.stage}: this checkpoint predates replay-buffer marks; the buffer is kept as it "
                "is (entries of discarded steps may remain)[/red]"
            )
        by_rule = self.buffer.drop_ahead(version)
        self.drops = ResumeDrops(version, discarded, before, sum(by_rule.values()))
        if before or by_rule:
            per = ", ".join(f"{n} of v{v}" for v, n in before.items()) or "none stored"
            self.say(
                f"[yellow]{self.stage}: {self.drops.ahead_total} replay entries from policy versions ahead of the "
                f"restored learner (v{version}) dropped ({per}; {self.drops.by_version_rule} not covered by the "
                "checkpoint's mark)[/yellow]"
            )
        self.marks = list(saved.get("replay_marks", []))
        self.restored = True
        return self.drops

    def take_metrics(self) -> dict[str, float]:
        """The last restore's counts, once (for the first step's record after a resume); else ``{}``."""
        drops, self.drops = self.drops, None
        return drops.metrics() if drops is not None else {}


__all__ = ["BufferCheckpoints", "ResumeDrops"]
