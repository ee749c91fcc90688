"""Recorded episodes of an agent that runs outside mentorrl (``mentorrl serve`` in recording mode).

An agent in its own harness calls an OpenAI-compatible endpoint; every chat completion it gets is
recorded token in / token out by :meth:`Recorder.record_completion`: the exact prompt ids the server
rendered (template and tools included), the sampled ids (the stop token included, as a rollout
records it), their behaviour log-probs and the policy version. Completions are grouped into
**episodes** by a client-supplied id and tagged with a task id; the harness later attaches a reward
(:meth:`Recorder.set_reward`).

**Segments.** An episode's tokens are one segment as long as every new prompt *extends* what the
segment holds so far (the previous prompt + the sampled ids): a faithful client re-sends the
conversation with the policy's turn as the server returned it, and the contract's rendering then
gives exactly the previous ids, the sampled turn (ending with its stop token, as in a rollout,
where the observation starts with the newline after it) and the new messages. The one allowed
difference is the template's own turn closing (:meth:`Recorder.close_ids`): a turn that ended
without the closing token (a stop string, the token budget, the tokenizer's eos) may be closed by
the template's closing token; it is recorded with loss mask 0 in place of the policy's eos (the
learner then sees what the policy saw next, and never trains on a token it did not sample).
Anything else (an edited, truncated or re-templated history) is a **divergence**: it is counted by
kind (``truncated``: the new prompt is a strict prefix of what was recorded; ``retokenized``: the
same text, other tokens; ``edited``: anything else) and starts a new segment, so tokens the policy
did not produce are never mixed into one trajectory. Each segment becomes one trajectory carrying
its episode's reward.

Storage is SQLite (parameterised SQL only) with bounded sizes: episodes per database, completions
and tokens per episode, reward details' size. Thread-safe (one lock).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

DIVERGENCE_KINDS = ("truncated", "retokenized", "edited")
COUNTERS = (
    "completions",
    "episodes_opened",
    "rewards",
    "refused",
    "closing_token_replaced",
    *(f"diverged_{k}" for k in DIVERGENCE_KINDS),
)
MAX_DETAILS_BYTES = 16_384
ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:")
MAX_ID_CHARS = 128

_SCHEMA = """
CREATE TABLE IF NOT EXISTS episodes (
    id TEXT PRIMARY KEY, task_id TEXT NOT NULL, status TEXT NOT NULL, reward REAL, details TEXT,
    completions INTEGER NOT NULL DEFAULT 0, tokens INTEGER NOT NULL DEFAULT 0, created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS segments (
    episode_id TEXT NOT NULL, idx INTEGER NOT NULL, token_ids TEXT NOT NULL, loss_mask TEXT NOT NULL,
    logprobs TEXT NOT NULL, versions TEXT NOT NULL, turns INTEGER NOT NULL, PRIMARY KEY (episode_id, idx)
);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""


class RecordError(ValueError):
    """A completion or reward the recorder refuses; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class RecordedSegment:
    """One contiguous span of an episode the policy's tokens extend: token ids, loss mask (1 where
    the policy sampled the token), behaviour log-probs (0.0 elsewhere) and each completion's policy version."""

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: int = 0

    def add(self, ids: Sequence[int], policy: bool, logprobs: Sequence[float] | None = None) -> None:
        self.token_ids += list(ids)
        self.loss_mask += [1 if policy else 0] * len(ids)
        self.logprobs += [float(x) for x in logprobs] if logprobs is not None else [0.0] * len(ids)

    def spans(self) -> list[tuple[str, int, int]]:
        """``(role, start, end)`` runs: the first is the prompt, then policy and observation turns."""
        out: list[tuple[str, int, int]] = []
        start = 0
        for i in range(1, len(self.loss_mask) + 1):
            if i == len(self.loss_mask) or self.loss_mask[i] != self.loss_mask[start]:
                role = "policy" if self.loss_mask[start] else ("prompt" if not out else "observation")
                out.append((role, start, i))
                start = i
        return out


@dataclass
class RecordedEpisode:
    id: str
    task_id: str
    status: str  # open | closed
    reward: float | None
    details: dict[str, Any] | None
    completions: int
    segments: list[RecordedSegment]


def check_id(value: str, what: str) -> str:
    """``value`` if it is a usable id (1-128 characters of ``[A-Za-z0-9-_.:]``); else a 400."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ID_CHARS or not set(value) <= ID_CHARS:
        raise RecordError(400, f"{what}: 1-{MAX_ID_CHARS} characters of letters, digits and -_.:")
    return value


def extension(
    tip: Sequence[int], prompt: Sequence[int], close_id: int | None, stop_ids: Sequence[int]
) -> tuple[list[int], bool] | None:
    """How ``prompt`` extends a segment ending in ``tip``: ``(new ids after tip, closing replaced)``,
    or None when it does not. ``closing replaced``: the policy's last turn ended in another stop
    token than the template's closing one (or none), and the template wrote ``close_id`` there."""
    n = len(tip)
    if len(prompt) >= n and list(prompt[:n]) == list(tip):
        return list(prompt[n:]), False
    if close_id is None or not tip:
        return None
    head = list(tip[:-1]) if tip[-1] in stop_ids and tip[-1] != close_id else list(tip)
    k = len(head)
    if len(prompt) > k and list(prompt[:k]) == head and prompt[k] == close_id:
        return list(prompt[k:]), True
    return None


def divergence_kind(tip: Sequence[int], prompt: Sequence[int], decode: Callable[[list[int]], str] | None) -> str:
    """Why ``prompt`` does not extend ``tip``: ``truncated``, ``retokenized`` or ``edited``."""
    if len(prompt) < len(tip) and list(tip[: len(prompt)]) == list(prompt):
        return "truncated"
    if decode is not None and decode(list(prompt)).startswith(decode(list(tip))):
        return "retokenized"
    return "edited"


class Recorder:
    """Episodes of recorded completions in a SQLite database (see the module docstring).

    ``close_id``: the template's turn-closing token; ``stop_ids``: every stop token of the contract;
    ``decode``: ids -> text (to tell a re-tokenised history from an edited one), optional.
    ``auto_open``: accept completions for an episode id nobody opened (a standalone server);
    otherwise only :meth:`open_episode` ids are accepted (a training stage opens its own)."""

    def __init__(
        self,
        path: str | Path,
        *,
        close_id: int | None = None,
        stop_ids: Sequence[int] = (),
        decode: Callable[[list[int]], str] | None = None,
        auto_open: bool = False,
        max_episodes: int = 100_000,
        max_completions: int = 64,
        max_tokens: int = 65_536,
    ):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.close_id, self.stop_ids, self.decode = close_id, list(stop_ids), decode
        self.auto_open, self.max_episodes = auto_open, max_episodes
        self.max_completions, self.max_tokens = max_completions, max_tokens
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)

    # ---- episodes -------------------------------------------------------------------------------
    def open_episode(self, episode_id: str, task_id: str) -> None:
        """Expect episode ``episode_id`` of task ``task_id`` (a stage, before it launches the agent)."""
        check_id(episode_id, "episode id")
        check_id(task_id, "task id")
        with self._lock:
            self._insert_episode(episode_id, task_id)

    def _insert_episode(self, episode_id: str, task_id: str) -> None:
        (count,) = self._db.execute("SELECT COUNT(*) FROM episodes").fetchone()
        if count >= self.max_episodes:
            raise RecordError(507, f"the recorder holds its maximum of {self.max_episodes} episodes")
        self._db.execute(
            "INSERT INTO episodes (id, task_id, status, created) VALUES (?, ?, 'open', ?)",
            (episode_id, task_id, time.time()),
        )
        self._bump("episodes_opened")

    def close_episodes(self, episode_ids: Sequence[str]) -> None:
        """No more completions or rewards for these episodes (their round is over)."""
        with self._lock:
            self._db.executemany("UPDATE episodes SET status = 'closed' WHERE id = ?", [(e,) for e in episode_ids])

    def close_open(self) -> int:
        """Close every open episode (a resumed run's: the killed step is redone with new ids); how many."""
        with self._lock:
            return self._db.execute("UPDATE episodes SET status = 'closed' WHERE status = 'open'").rowcount

    def check_open(self, episode_id: str, task_id: str | None) -> None:
        """A :class:`RecordError` unless a completion for ``episode_id`` (of ``task_id``) may be recorded now."""
        with self._lock:
            row = self._db.execute("SELECT task_id, status FROM episodes WHERE id = ?", (episode_id,)).fetchone()
        if row is None and not self.auto_open:
            raise RecordError(404, f"unknown episode {episode_id!r}")
        if row is not None and row[1] != "open":
            raise RecordError(409, f"episode {episode_id!r} is closed")
        if row is not None and task_id is not None and task_id != row[0]:
            raise RecordError(409, f"episode {episode_id!r} belongs to task {row[0]!r}, not {task_id!r}")

    def _episode_row(self, episode_id: str, task_id: str | None, create: bool = True) -> tuple[str, str, int, int]:
        row = self._db.execute(
            "SELECT task_id, status, completions, tokens FROM episodes WHERE id = ?", (episode_id,)
        ).fetchone()
        if row is None:
            if not (self.auto_open and create):
                raise RecordError(404, f"unknown episode {episode_id!r}")
            self._insert_episode(
                episode_id, task_id or episode_id
            )  # a standalone server's: opened by its first request
            return task_id or episode_id, "open", 0, 0
        if row[1] != "open":
            raise RecordError(409, f"episode {episode_id!r} is closed")
        if task_id is not None and task_id != row[0]:
            raise RecordError(409, f"episode {episode_id!r} belongs to task {row[0]!r}, not {task_id!r}")
        return row

    # ---- completions ----------------------------------------------------------------------------
    def record_completion(
        self,
        episode_id: str,
        task_id: str | None,
        prompt_ids: Sequence[int],
        completion_ids: Sequence[int],
        logprobs: Sequence[float],
        policy_version: int,
    ) -> dict[str, Any]:
        """Record one completion; returns ``{"segment": i, "diverged": kind or None}``. A
        :class:`RecordError` for an unknown / closed episode, another task's id, or one over its bounds."""
        check_id(episode_id, "episode id")
        if task_id is not None:
            check_id(task_id, "task id")
        if len(completion_ids) != len(logprobs):
            raise ValueError("record_completion: one log-prob per sampled token")
        with self._lock:
            try:
                return self._record(
                    episode_id, task_id, list(prompt_ids), list(completion_ids), logprobs, policy_version
                )
            except RecordError:
                self._bump("refused")
                raise

    def _record(self, episode_id, task_id, prompt, completion, logprobs, version) -> dict[str, Any]:
        _, _, completions, tokens = self._episode_row(episode_id, task_id)
        if completions >= self.max_completions:
            raise RecordError(400, f"episode {episode_id!r} is over its {self.max_completions} completions")
        last = self._last_segment(episode_id)
        idx, seg, diverged = (last[0], last[1], None) if last else (0, None, None)
        before = len(seg.token_ids) if seg is not None else 0
        if seg is not None:
            ext = extension(seg.token_ids, prompt, self.close_id, self.stop_ids)
            if ext is None:
                diverged = divergence_kind(seg.token_ids, prompt, self.decode)
                self._bump(f"diverged_{diverged}")
                idx, seg, before = idx + 1, None, 0
            else:
                new, replaced = ext
                if replaced:  # the policy's own eos (if any) gives way to the template's closing token
                    if seg.token_ids[-1] in self.stop_ids and seg.token_ids[-1] != self.close_id:
                        for lst in (seg.token_ids, seg.loss_mask, seg.logprobs):
                            lst.pop()
                    self._bump("closing_token_replaced")
                seg.add(new, policy=False)
        if seg is None:
            seg = RecordedSegment()
            seg.add(prompt, policy=False)
        seg.add(completion, policy=True, logprobs=logprobs)
        seg.versions.append(int(version))
        seg.turns += 1
        total = tokens + len(seg.token_ids) - before  # the episode's tokens over all its segments
        if total > self.max_tokens:
            raise RecordError(400, f"episode {episode_id!r} is over its {self.max_tokens} tokens")
        self._save_segment(episode_id, idx, seg)
        self._db.execute(
            "UPDATE episodes SET completions = completions + 1, tokens = ? WHERE id = ?", (total, episode_id)
        )
        self._bump("completions")
        return {"segment": idx, "diverged": diverged}

    def _last_segment(self, episode_id: str) -> tuple[int, RecordedSegment] | None:
        row = self._db.execute(
            "SELECT idx, token_ids, loss_mask, logprobs, versions, turns FROM segments WHERE episode_id = ? "
            "ORDER BY idx DESC LIMIT 1",
            (episode_id,),
        ).fetchone()
        return None if row is None else (row[0], _segment(row[1:]))

    def _save_segment(self, episode_id: str, idx: int, seg: RecordedSegment) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO segments (episode_id, idx, token_ids, loss_mask, logprobs, versions, turns) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                episode_id,
                idx,
                json.dumps(seg.token_ids),
                json.dumps(seg.loss_mask),
                json.dumps(seg.logprobs),
                json.dumps(seg.versions),
                seg.turns,
            ),
        )

    # ---- rewards ----------------------------------------------------------------------------------
    def set_reward(self, episode_id: str, reward: float, details: dict[str, Any] | None = None) -> None:
        """Attach the harness's reward (a finite number) and optional verifier details (a JSON object
        of at most :data:`MAX_DETAILS_BYTES`); a later reward replaces an earlier one while the episode is open."""
        check_id(episode_id, "episode id")
        if not isinstance(reward, (int, float)) or isinstance(reward, bool) or reward != reward or abs(reward) > 1e6:
            raise RecordError(400, "reward: a finite number of at most 1e6 in size")
        text = None if details is None else json.dumps(details)
        if text is not None and (not isinstance(details, dict) or len(text.encode()) > MAX_DETAILS_BYTES):
            raise RecordError(400, f"details: a JSON object of at most {MAX_DETAILS_BYTES} bytes")
        with self._lock:
            self._episode_row(episode_id, None, create=False)
            self._db.execute(
                "UPDATE episodes SET reward = ?, details = ? WHERE id = ?", (float(reward), text, episode_id)
            )
            self._bump("rewards")

    # ---- reading ----------------------------------------------------------------------------------
    def episode(self, episode_id: str) -> RecordedEpisode | None:
        with self._lock:
            row = self._db.execute(
                "SELECT id, task_id, status, reward, details, completions FROM episodes WHERE id = ?", (episode_id,)
            ).fetchone()
            if row is None:
                return None
            segs = self._db.execute(
                "SELECT token_ids, loss_mask, logprobs, versions, turns FROM segments WHERE episode_id = ? "
                "ORDER BY idx",
                (episode_id,),
            ).fetchall()
        details = json.loads(row[4]) if row[4] else None
        return RecordedEpisode(row[0], row[1], row[2], row[3], details, row[5], [_segment(s) for s in segs])

    def rewards(self, episode_ids: Sequence[str]) -> dict[str, float]:
        """The rewards attached so far to ``episode_ids``."""
        with self._lock:
            out = {}
            for e in episode_ids:
                row = self._db.execute("SELECT reward FROM episodes WHERE id = ?", (e,)).fetchone()
                if row is not None and row[0] is not None:
                    out[e] = row[0]
            return out

    def counters(self) -> dict[str, int]:
        with self._lock:
            got = dict(self._db.execute("SELECT name, value FROM counters").fetchall())
        return {k: int(got.get(k, 0)) for k in COUNTERS}

    def _bump(self, name: str, by: int = 1) -> None:
        self._db.execute(
            "INSERT INTO counters (name, value) VALUES (?, ?) ON CONFLICT(name) DO UPDATE SET value = value + ?",
            (name, by, by),
        )

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _segment(row: Sequence[Any]) -> RecordedSegment:
    return RecordedSegment(json.loads(row[0]), json.loads(row[1]), json.loads(row[2]), json.loads(row[3]), row[4])


__all__ = [
    "COUNTERS",
    "DIVERGENCE_KINDS",
    "MAX_DETAILS_BYTES",
    "RecordError",
    "RecordedEpisode",
    "RecordedSegment",
    "Recorder",
    "check_id",
    "divergence_kind",
    "extension",
]
