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
  naming it; a checkpoint written before marks existed keeps the buffer and says so.
"""

from __future__ import annotations

from typing import Any, Callable

from mentorrl.replay.buffer import ReplayBuffer


class BufferCheckpoints:
    def __init__(self, buffer: ReplayBuffer, keep: int, stage: str, say: Callable[[str], None]):
        self.buffer, self.keep, self.stage, self.say = buffer, keep, stage, say
        self.marks: list[int] = []  # high-water of the last ``keep`` checkpoints
        self.restored = False  # persisted state already matches a restored checkpoint

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

    def restore(self, saved: dict[str, Any]) -> None:
        if saved.get("replay") is not None:
            dropped = self.buffer.rollback(saved["replay"])  # ReplayBufferError (file named) if it was replaced
            self.say(
                f"[yellow]{self.stage}: replay buffer rolled back to the checkpoint "
                f"({dropped} entries of discarded steps dropped)[/yellow]"
            )
        else:
            self.say(
                f"[red]{self.stage}: this checkpoint predates replay-buffer marks; the buffer is kept as it "
                "is (entries of discarded steps may remain)[/red]"
            )
        self.marks = list(saved.get("replay_marks", []))
        self.restored = True


__all__ = ["BufferCheckpoints"]
