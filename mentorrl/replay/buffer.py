"""A persistent, prioritised replay buffer of trajectories, plus hybrid batches and segment replay.

Storage is one SQLite file (stdlib ``sqlite3``) in WAL mode, so a buffer survives a restart:
reopening the same path gives back the same entries, hard-task marks and rejection counts.
Each entry holds the trajectory's JSON (:meth:`Trajectory.to_json`) plus indexed columns used
for sampling and bookkeeping::

    entries(seq INTEGER PRIMARY KEY AUTOINCREMENT,   -- insertion sequence, never reused
            traj_id TEXT UNIQUE, task_id, family, category, reward, success,
            policy_version, num_policy_tokens, inserted_at, json)
    hard_tasks(task_id PRIMARY KEY)
    rejections(reason PRIMARY KEY, count)
    evicted(<the entries columns>, evicted_by)   -- rows evicted recently, until no checkpoint needs them
    meta(key PRIMARY KEY, value)                 -- buffer_id: a random id fixed when the file is created

Rollback (crash safety): :meth:`ReplayBuffer.mark` is the buffer's state in a few numbers (its id,
the high-water ``seq`` and the rejection counts); a training checkpoint stores it, and on resume
:meth:`ReplayBuffer.rollback` restores that state in one transaction: entries inserted after the
mark are deleted, entries they evicted come back from ``evicted``, and the counts are restored;
:meth:`ReplayBuffer.drop_ahead` then deletes any entry from a policy version above the restored
learner's (whoever wrote it, and whenever).
A file that is not a replay buffer, belongs to another buffer, or is behind the mark raises
:class:`ReplayBufferError` naming the file. :meth:`ReplayBuffer.forget_evicted` drops evicted
rows no retained checkpoint can roll back to. Hard-task marks are not rolled back.

Concurrency: every thread gets its own connection (WAL lets readers run beside a writer).
Writes open with ``BEGIN IMMEDIATE`` and are additionally serialised by an in-process lock;
an insert and the capacity eviction it causes commit in one transaction. A sample reads the
candidate rows and their JSON inside one read transaction, i.e. from one consistent snapshot,
so it never sees a half-written insert or a row evicted mid-sample. All SQL is parameterised.

Durability: ``synchronous=NORMAL`` (the WAL default recommendation): a committed entry survives
a crash of the process; the last few commits may be lost on power failure.
"""

from __future__ import annotations

import math
import random
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from mentorrl.config.replay import CATEGORIES, ReplayConfig
from mentorrl.trajectory import Segment, Trajectory

Category = Literal["success", "failure", "hard"]

# Reasons ``add`` can give for not admitting a trajectory.
REJECT_DUPLICATE = "duplicate"
REJECT_LOW_REWARD = "low_reward"
REJECT_TOO_LONG = "too_long"
REJECT_LOW_ADVANTAGE = "low_advantage"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    traj_id TEXT NOT NULL UNIQUE,
    task_id TEXT NOT NULL,
    family TEXT NOT NULL,
    category TEXT NOT NULL CHECK (category IN ('success', 'failure', 'hard')),
    reward REAL NOT NULL,
    success INTEGER NOT NULL,
    policy_version INTEGER NOT NULL,
    num_policy_tokens INTEGER NOT NULL,
    inserted_at REAL NOT NULL,
    json TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS entries_task ON entries(task_id);
CREATE INDEX IF NOT EXISTS entries_family ON entries(family);
CREATE INDEX IF NOT EXISTS entries_category ON entries(category);
CREATE INDEX IF NOT EXISTS entries_version ON entries(policy_version);
CREATE TABLE IF NOT EXISTS hard_tasks (task_id TEXT PRIMARY KEY);
CREATE TABLE IF NOT EXISTS rejections (reason TEXT PRIMARY KEY, count INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS evicted (
    seq INTEGER PRIMARY KEY,
    traj_id TEXT NOT NULL,
    task_id TEXT NOT NULL,
    family TEXT NOT NULL,
    category TEXT NOT NULL,
    reward REAL NOT NULL,
    success INTEGER NOT NULL,
    policy_version INTEGER NOT NULL,
    num_policy_tokens INTEGER NOT NULL,
    inserted_at REAL NOT NULL,
    json TEXT NOT NULL,
    evicted_by INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS evicted_by ON evicted(evicted_by);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
_ENTRY_COLUMNS = (
    "seq",
    "traj_id",
    "task_id",
    "family",
    "category",
    "reward",
    "success",
    "policy_version",
    "num_policy_tokens",
    "inserted_at",
    "json",
)
_COLS = ", ".join(_ENTRY_COLUMNS)
# The tables a replay buffer may hold; a file holding any other table is not one.
_OWN_TABLES = {"entries", "hard_tasks", "rejections", "evicted", "meta", "sqlite_sequence"}


class ReplayBufferError(ValueError):
    """A replay database that cannot be used: not a replay buffer, corrupt, another run's, or behind
    the checkpoint being resumed. The message names the file."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"replay buffer {path}: {reason}")
        self.path = path


@dataclass(frozen=True)
class AddResult:
    """What :meth:`ReplayBuffer.add` did. Truthy iff the trajectory was admitted."""

    admitted: bool
    reason: str | None = None  # why it was not admitted (one of the REJECT_* constants)
    category: str | None = None  # the category it was stored under, when admitted
    evicted: tuple[str, ...] = ()  # ids evicted to make room

    def __bool__(self) -> bool:
        return self.admitted


@dataclass(frozen=True)
class ReplayStats:
    size: int
    capacity: int
    by_category: dict[str, int]  # every category present, 0 when empty
    rejections: dict[str, int]  # reason -> count since the file was created
    hard_tasks: int


def _reward_of(traj: Trajectory) -> tuple[float, bool]:
    """``(reward.total, reward.success)``; a trajectory without a reward counts as (0.0, False)."""
    if traj.reward is None:
        return 0.0, False
    return float(traj.reward.total), bool(traj.reward.success)


class ReplayBuffer:
    """Persistent replay buffer; see the module docstring for storage and concurrency.

    Usage::

        with ReplayBuffer("run/replay.sqlite", ReplayConfig(capacity=5000)) as buf:
            res = buf.add(traj, advantage=adv)
            batch = buf.sample(32, current_version=step, rng=random.Random(0))
    """

    def __init__(self, path: str | Path, config: ReplayConfig | None = None):
        self.path = Path(path)
        self.config = config or ReplayConfig()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        self._conns: list[sqlite3.Connection] = []
        self._conns_lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._closed = False
        try:
            conn = self._conn()
            self._check_file(conn)
            with self._write_lock:
                conn.executescript(_SCHEMA)
                # A smaller capacity than the file was written with takes effect on open.
                conn.execute("BEGIN IMMEDIATE")
                try:
                    conn.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('buffer_id', ?)", (uuid.uuid4().hex,))
                    self._evict_over_capacity(conn)
                    conn.execute("COMMIT")
                except BaseException:
                    conn.execute("ROLLBACK")
                    raise
        except sqlite3.DatabaseError as e:  # "file is not a database", "database disk image is malformed", ...
            self.close()
            raise ReplayBufferError(self.path, f"not a usable SQLite replay database ({e})") from e
        except ReplayBufferError:
            self.close()
            raise

    def _check_file(self, conn: sqlite3.Connection) -> None:
        """Refuse a database that is not a replay buffer (other tables, or ``entries`` of another shape)."""
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        foreign = {t for t in tables - _OWN_TABLES if not t.startswith("sqlite_")}
        if foreign:
            raise ReplayBufferError(self.path, f"not a replay buffer (it holds tables {sorted(foreign)})")
        if "entries" in tables:
            cols = tuple(r[1] for r in conn.execute("PRAGMA table_info(entries)"))
            if cols != _ENTRY_COLUMNS:
                raise ReplayBufferError(self.path, f"not a replay buffer (entries has columns {list(cols)})")
        (ok,) = conn.execute("PRAGMA quick_check").fetchone()
        if ok != "ok":
            raise ReplayBufferError(self.path, f"corrupt database ({ok})")

    # -- connections ---------------------------------------------------------------------

    def _conn(self) -> sqlite3.Connection:
        if self._closed:
            raise RuntimeError(f"replay buffer {self.path} is closed")
        conn = getattr(self._local, "conn", None)
        if conn is None:
            # isolation_level=None: we issue BEGIN/COMMIT ourselves. Each connection is used by
            # the thread that made it; check_same_thread=False only so close() can close them all.
            conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA busy_timeout=30000")
            self._local.conn = conn
            with self._conns_lock:
                self._conns.append(conn)
        return conn

    def close(self) -> None:
        """Close every thread's connection. Idempotent."""
        self._closed = True
        with self._conns_lock:
            for c in self._conns:
                try:
                    c.close()
                except sqlite3.Error:
                    pass
            self._conns.clear()

    def __enter__(self) -> ReplayBuffer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _write(self, fn):
        """Run ``fn(conn)`` in one write transaction (serialised in-process and across processes)."""
        conn = self._conn()
        with self._write_lock:
            conn.execute("BEGIN IMMEDIATE")
            try:
                out = fn(conn)
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        return out

    def _read(self, fn):
        """Run ``fn(conn)`` inside one read transaction: every query sees the same snapshot."""
        conn = self._conn()
        conn.execute("BEGIN")
        try:
            return fn(conn)
        finally:
            conn.execute("COMMIT")

    # -- writing -------------------------------------------------------------------------

    def admission_check(self, traj: Trajectory, advantage: float | None = None) -> str | None:
        """The first admission filter ``traj`` fails (a REJECT_* reason), or None if it passes.

        Filters, in order: ``min_reward`` (reward.total below it), ``max_tokens`` (more policy
        tokens and not a success), ``advantage_threshold`` (only when ``advantage`` is given).
        Pure: touches no storage and counts nothing.
        """
        cfg = self.config
        reward, success = _reward_of(traj)
        if cfg.min_reward is not None and reward < cfg.min_reward:
            return REJECT_LOW_REWARD
        if cfg.max_tokens is not None and traj.num_policy_tokens > cfg.max_tokens and not success:
            return REJECT_TOO_LONG
        if cfg.advantage_threshold is not None and advantage is not None and abs(advantage) < cfg.advantage_threshold:
            return REJECT_LOW_ADVANTAGE
        return None

    def add(self, traj: Trajectory, advantage: float | None = None, category: Category | None = None) -> AddResult:
        """Admit ``traj`` unless a filter rejects it or its id is already stored.

        Category: ``category`` when given; else ``"hard"`` when its task id was marked hard;
        else ``"success"`` / ``"failure"`` from ``reward.success``. Inserting beyond capacity
        evicts the oldest entries in the same transaction. Every rejection, duplicates
        included, is counted by reason (see :meth:`stats`).
        """
        if category is not None and category not in CATEGORIES:
            raise ValueError(f"unknown category {category!r}; expected one of {list(CATEGORIES)}")
        reason = self.admission_check(traj, advantage)
        reward, success = _reward_of(traj)
        payload = traj.to_json()

        def txn(conn: sqlite3.Connection) -> AddResult:
            if reason is not None:
                self._count_rejection(conn, reason)
                return AddResult(False, reason)
            cat = category
            if cat is None:
                hard = conn.execute("SELECT 1 FROM hard_tasks WHERE task_id = ?", (traj.task_id,)).fetchone()
                cat = "hard" if hard else ("success" if success else "failure")
            cur = conn.execute(
                "INSERT INTO entries (traj_id, task_id, family, category, reward, success, policy_version,"
                " num_policy_tokens, inserted_at, json) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT(traj_id) DO NOTHING",
                (
                    traj.id,
                    traj.task_id,
                    traj.family,
                    cat,
                    reward,
                    int(success),
                    traj.policy_version,
                    traj.num_policy_tokens,
                    time.time(),
                    payload,
                ),
            )
            if cur.rowcount == 0:
                self._count_rejection(conn, REJECT_DUPLICATE)
                return AddResult(False, REJECT_DUPLICATE)
            return AddResult(True, None, cat, tuple(self._evict_over_capacity(conn)))

        return self._write(txn)

    @staticmethod
    def _count_rejection(conn: sqlite3.Connection, reason: str) -> None:
        conn.execute(
            "INSERT INTO rejections (reason, count) VALUES (?, 1) ON CONFLICT(reason) DO UPDATE SET count = count + 1",
            (reason,),
        )

    def _evict_over_capacity(self, conn: sqlite3.Connection) -> list[str]:
        (size,) = conn.execute("SELECT COUNT(*) FROM entries").fetchone()
        excess = size - self.config.capacity
        if excess <= 0:
            return []
        rows = conn.execute("SELECT seq, traj_id FROM entries ORDER BY seq LIMIT ?", (excess,)).fetchall()
        by = self._high_water(conn)  # kept in ``evicted`` so a rollback past this insert can restore them
        conn.executemany(
            f"INSERT OR REPLACE INTO evicted ({_COLS}, evicted_by) SELECT {_COLS}, ? FROM entries WHERE seq = ?",
            [(by, s) for s, _ in rows],
        )
        conn.executemany("DELETE FROM entries WHERE seq = ?", [(s,) for s, _ in rows])
        return [t for _, t in rows]

    # -- rollback (crash safety) ---------------------------------------------------------

    @staticmethod
    def _high_water(conn: sqlite3.Connection) -> int:
        row = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'entries'").fetchone()
        return int(row[0]) if row else 0

    def mark(self) -> dict:
        """The buffer's state as a checkpoint records it: ``{"buffer_id", "high_water", "rejections"}``."""

        def read(conn: sqlite3.Connection) -> dict:
            (bid,) = conn.execute("SELECT value FROM meta WHERE key = 'buffer_id'").fetchone()
            rej = dict(conn.execute("SELECT reason, count FROM rejections ORDER BY reason").fetchall())
            return {"buffer_id": bid, "high_water": self._high_water(conn), "rejections": rej}

        return self._read(read)

    def rollback(self, mark: Mapping | None) -> int:
        """Restore the state ``mark`` (from :meth:`mark`) recorded, in one transaction; ``None``:
        the empty buffer (a stage starting from scratch). Returns how many entries were dropped.

        Raises :class:`ReplayBufferError` when ``mark`` names another buffer, or the file's
        high-water is below the mark (it was replaced by an older copy): training cannot continue
        from that checkpoint with this file."""
        hw = 0 if mark is None else int(mark["high_water"])

        def txn(conn: sqlite3.Connection) -> int:
            if mark is not None:
                (bid,) = conn.execute("SELECT value FROM meta WHERE key = 'buffer_id'").fetchone()
                if bid != mark["buffer_id"]:
                    raise ReplayBufferError(
                        self.path,
                        f"is buffer {bid}, but the checkpoint was taken with buffer "
                        f"{mark['buffer_id']} (the file was replaced)",
                    )
                now = self._high_water(conn)
                if now < hw:
                    raise ReplayBufferError(
                        self.path,
                        f"ends at entry {now}, before the checkpoint's entry {hw} (replaced by an older copy)",
                    )
            dropped = conn.execute("DELETE FROM entries WHERE seq > ?", (hw,)).rowcount
            conn.execute(
                f"INSERT OR IGNORE INTO entries ({_COLS}) SELECT {_COLS} FROM evicted"
                " WHERE evicted_by > ? AND seq <= ?",
                (hw, hw),
            )
            conn.execute("DELETE FROM evicted WHERE evicted_by > ? OR seq > ?", (hw, hw))
            conn.execute("DELETE FROM rejections")
            rej = {} if mark is None else dict(mark.get("rejections", {}))
            conn.executemany("INSERT INTO rejections (reason, count) VALUES (?, ?)", sorted(rej.items()))
            self._evict_over_capacity(conn)
            return dropped

        return self._write(txn)

    def versions_ahead(self, version: int) -> dict[int, int]:
        """``{policy version: entries}`` for the stored entries from a policy version above ``version``."""
        rows = (
            self._conn()
            .execute(
                "SELECT policy_version, COUNT(*) FROM entries WHERE policy_version > ? GROUP BY policy_version"
                " ORDER BY policy_version",
                (version,),
            )
            .fetchall()
        )
        return {int(v): int(n) for v, n in rows}

    def drop_ahead(self, version: int) -> dict[int, int]:
        """Delete, in one transaction, every entry from a policy version above ``version`` (and every
        kept evicted copy of one, so no later rollback brings it back). Returns ``{policy version:
        entries dropped}``. Resume calls it with the restored learner's version: such an entry was
        sampled by a policy the resumed run does not have (see :mod:`mentorrl.replay.checkpointing`)."""

        def txn(conn: sqlite3.Connection) -> dict[int, int]:
            rows = conn.execute(
                "SELECT policy_version, COUNT(*) FROM entries WHERE policy_version > ? GROUP BY policy_version"
                " ORDER BY policy_version",
                (version,),
            ).fetchall()
            conn.execute("DELETE FROM entries WHERE policy_version > ?", (version,))
            conn.execute("DELETE FROM evicted WHERE policy_version > ?", (version,))
            return {int(v): int(n) for v, n in rows}

        return self._write(txn)

    def forget_evicted(self, up_to: int) -> int:
        """Drop the kept copies of entries evicted by inserts up to ``up_to`` (no rollback needs them)."""
        return self._write(lambda conn: conn.execute("DELETE FROM evicted WHERE evicted_by <= ?", (up_to,)).rowcount)

    def mark_hard(self, task_ids: Iterable[str]) -> int:
        """Mark task ids hard: stored entries of those tasks, and later ones, become ``"hard"``.

        Persistent. Returns how many stored entries were re-categorised.
        """
        ids = sorted(set(task_ids))

        def txn(conn: sqlite3.Connection) -> int:
            conn.executemany("INSERT OR IGNORE INTO hard_tasks (task_id) VALUES (?)", [(t,) for t in ids])
            n = 0
            for t in ids:
                n += conn.execute(
                    "UPDATE entries SET category = 'hard' WHERE task_id = ? AND category != 'hard'", (t,)
                ).rowcount
            return n

        return self._write(txn)

    def hard_tasks(self) -> set[str]:
        return {r[0] for r in self._conn().execute("SELECT task_id FROM hard_tasks")}

    # -- reading -------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._conn().execute("SELECT COUNT(*) FROM entries").fetchone()[0]

    def __contains__(self, traj_id: object) -> bool:
        return self._conn().execute("SELECT 1 FROM entries WHERE traj_id = ?", (traj_id,)).fetchone() is not None

    def get(self, traj_id: str) -> Trajectory | None:
        row = self._conn().execute("SELECT json FROM entries WHERE traj_id = ?", (traj_id,)).fetchone()
        return Trajectory.from_json(row[0]) if row else None

    def ids(self) -> list[str]:
        """Stored ids, oldest insertion first."""
        return [r[0] for r in self._conn().execute("SELECT traj_id FROM entries ORDER BY seq")]

    def trajectories(self) -> list[Trajectory]:
        """Every stored trajectory, oldest insertion first."""
        return [Trajectory.from_json(r[0]) for r in self._conn().execute("SELECT json FROM entries ORDER BY seq")]

    def category_of(self, traj_id: str) -> str | None:
        row = self._conn().execute("SELECT category FROM entries WHERE traj_id = ?", (traj_id,)).fetchone()
        return row[0] if row else None

    def entry_weight(self, category: str, policy_version: int, current_version: int | None) -> float:
        """Sampling weight: category weight x ``staleness_decay ** age``; 0.0 when too stale.

        ``age = current_version - policy_version`` (negative ages count as 0); with
        ``current_version=None`` staleness is ignored.
        """
        w = self.config.weight_of(category)
        if current_version is None:
            return w
        age = max(0, current_version - policy_version)
        if self.config.max_staleness is not None and age > self.config.max_staleness:
            return 0.0
        return w * self.config.staleness_decay**age

    def sample(
        self,
        n: int,
        current_version: int | None = None,
        rng: random.Random | None = None,
        replace: bool = False,
    ) -> list[Trajectory]:
        """Up to ``n`` trajectories drawn with probability proportional to :meth:`entry_weight`.

        Without replacement (default) the result holds distinct entries, at most as many as
        have a positive weight, in draw order (Efraimidis-Spirakis keys ``u ** (1 / w)``);
        with ``replace=True`` it holds exactly ``n`` draws when any entry has positive weight.
        Deterministic for a given stored state and ``rng`` state; ``rng`` defaults to
        ``random.Random(0)``. Reads one consistent snapshot.
        """
        if n <= 0:
            return []
        rng = rng if rng is not None else random.Random(0)

        def read(conn: sqlite3.Connection) -> list[Trajectory]:
            rows = conn.execute("SELECT seq, category, policy_version FROM entries ORDER BY seq").fetchall()
            cand = [(seq, self.entry_weight(cat, ver, current_version)) for seq, cat, ver in rows]
            cand = [(seq, w) for seq, w in cand if w > 0.0]
            if not cand:
                return []
            if replace:
                chosen = rng.choices([s for s, _ in cand], weights=[w for _, w in cand], k=n)
            else:
                keyed = [(rng.random() ** (1.0 / w), seq) for seq, w in cand]
                keyed.sort(key=lambda kv: (-kv[0], kv[1]))
                chosen = [seq for _, seq in keyed[:n]]
            payload: dict[int, str] = {}
            uniq = sorted(set(chosen))
            for i in range(0, len(uniq), 500):  # stay under SQLite's bound-parameter limit
                part = uniq[i : i + 500]
                marks = ",".join("?" * len(part))
                payload.update(conn.execute(f"SELECT seq, json FROM entries WHERE seq IN ({marks})", part).fetchall())
            return [Trajectory.from_json(payload[s]) for s in chosen]

        return self._read(read)

    def stats(self) -> ReplayStats:
        def read(conn: sqlite3.Connection) -> ReplayStats:
            by_cat = {c: 0 for c in CATEGORIES}
            by_cat.update(dict(conn.execute("SELECT category, COUNT(*) FROM entries GROUP BY category").fetchall()))
            rej = dict(conn.execute("SELECT reason, count FROM rejections ORDER BY reason").fetchall())
            (n_hard,) = conn.execute("SELECT COUNT(*) FROM hard_tasks").fetchone()
            return ReplayStats(sum(by_cat.values()), self.config.capacity, by_cat, rej, n_hard)

        return self._read(read)


# -- hybrid batches ----------------------------------------------------------------------

SOURCES: tuple[str, ...] = ("online", "expert", "replay")


@dataclass(frozen=True)
class BatchItem:
    source: str  # "online", "expert" or "replay"
    trajectory: Trajectory


def apportion(n: int, ratios: Mapping[str, float], order: Sequence[str] = SOURCES) -> dict[str, int]:
    """Split ``n`` into integer quotas proportional to ``ratios`` (largest-remainder method).

    Ratios are normalised by their sum; each source first gets ``floor(n * share)``, and the
    remaining units go one each to the largest fractional remainders, ties broken by position
    in ``order``. The quotas always sum to ``n`` (given a positive ratio).
    """
    unknown = set(ratios) - set(order)
    if unknown:
        raise ValueError(f"unknown sources {sorted(unknown)}; expected a subset of {list(order)}")
    if any(not (r >= 0.0 and math.isfinite(r)) for r in ratios.values()):
        raise ValueError(f"ratios must be finite and >= 0, got {dict(ratios)}")
    total = sum(ratios.values())
    if total <= 0.0:
        raise ValueError("at least one ratio must be positive")
    exact = {s: n * ratios.get(s, 0.0) / total for s in order}
    quota = {s: math.floor(exact[s]) for s in order}
    left = n - sum(quota.values())
    by_remainder = sorted(order, key=lambda s: (-(exact[s] - quota[s]), order.index(s)))
    for s in by_remainder[:left]:
        quota[s] += 1
    return quota


def hybrid_batch(
    online: list[Trajectory],
    expert: list[Trajectory],
    buffer: ReplayBuffer | None,
    ratios: Mapping[str, float],
    n: int,
    current_version: int | None,
    rng: random.Random,
) -> list[BatchItem]:
    """A batch of ``n`` items mixing online rollouts, expert demonstrations and replayed data.

    ``ratios`` maps ``"online"`` / ``"expert"`` / ``"replay"`` to non-negative weights (they need
    not sum to 1; a missing source counts as 0). Rounding: quotas come from :func:`apportion`
    (floor, then leftover units to the largest remainders, ties in the order online, expert,
    replay). When a source holds fewer items than its quota, the shortfall is filled by the
    other sources with a positive ratio, largest ratio first (same tie order); a source with
    ratio 0 is never used. So the batch has exactly ``n`` items whenever the positive-ratio
    sources together hold at least ``n``; otherwise it holds all they have.

    Online and expert items are drawn uniformly without replacement with ``rng``; replay items
    come from ``buffer.sample(..., current_version, rng)`` (distinct entries, prioritised and
    staleness-weighted). Items are returned grouped by source in the order online, expert,
    replay; shuffle them if the consumer cares about order.
    """
    if n <= 0:
        return []
    quota = apportion(n, ratios)
    active = [s for s in SOURCES if ratios.get(s, 0.0) > 0.0]
    replay_pool: list[Trajectory] = []
    if "replay" in active and buffer is not None:
        replay_pool = buffer.sample(n, current_version, rng)  # draw order = priority order
    avail = {"online": len(online), "expert": len(expert), "replay": len(replay_pool)}
    take = {s: min(quota[s], avail[s]) if s in active else 0 for s in SOURCES}
    short = n - sum(take.values())
    for s in sorted(active, key=lambda s: (-ratios[s], SOURCES.index(s))):
        if short <= 0:
            break
        extra = min(short, avail[s] - take[s])
        take[s] += extra
        short -= extra
    out = [BatchItem("online", t) for t in rng.sample(online, take["online"])]
    out += [BatchItem("expert", t) for t in rng.sample(expert, take["expert"])]
    out += [BatchItem("replay", t) for t in replay_pool[: take["replay"]]]
    return out


# -- segment replay ----------------------------------------------------------------------


def _policy_spans(traj: Trajectory) -> list[tuple[int, int]]:
    """``(start, end)`` of each policy turn: from ``segments``, else from runs of loss_mask 1."""
    spans = [(s.start, s.end) for s in traj.segments if s.role == "policy" and s.end > s.start]
    if spans or traj.segments:
        return sorted(spans)
    out, start = [], None
    for i, m in enumerate(traj.loss_mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def segment_replay(traj: Trajectory, turns_per_segment: int = 1, min_tokens: int = 0) -> list[Trajectory]:
    """Cut a long trajectory at turn boundaries into trainable windows over a shared prefix.

    Each new policy turn (a ``"policy"`` segment; without segments, a run of loss_mask 1)
    starts a segment; ``turns_per_segment`` consecutive policy turns form one window. Segment
    ``k`` keeps every token up to the end of its window's last policy turn (the prefix is
    context) but drops what follows; its ``loss_mask`` and ``logprobs`` are the original ones
    inside the window and 0 / 0.0 everywhere else, so only that window is trained on. Ids are
    ``<id>#seg<k>`` (k from 0); ``segments`` are clipped to the kept tokens. Reward, provenance
    and tool calls are copied unchanged (the reward stays the whole trajectory's).

    A trajectory with at most ``min_tokens`` tokens, or a single window, is returned as is
    (``[traj]``). Pure: ``traj`` is not modified.
    """
    if turns_per_segment < 1:
        raise ValueError("turns_per_segment must be >= 1")
    spans = _policy_spans(traj)
    if len(traj.token_ids) <= min_tokens or len(spans) <= turns_per_segment:
        return [traj]
    out = []
    for k, i in enumerate(range(0, len(spans), turns_per_segment)):
        group = spans[i : i + turns_per_segment]
        lo, hi = group[0][0], group[-1][1]
        mask = [m if lo <= j < hi else 0 for j, m in enumerate(traj.loss_mask[:hi])]
        logprobs = [lp if mask[j] else 0.0 for j, lp in enumerate(traj.logprobs[:hi])]
        segs = [Segment(role=s.role, start=s.start, end=min(s.end, hi)) for s in traj.segments if s.start < hi]
        out.append(
            traj.model_copy(
                update={
                    "id": f"{traj.id}#seg{k}",
                    "token_ids": list(traj.token_ids[:hi]),
                    "loss_mask": mask,
                    "logprobs": logprobs,
                    "segments": segs,
                }
            )
        )
    # model_copy skips validation; re-validate so a bad cut fails here, not in the learner.
    return [Trajectory.model_validate(t.model_dump()) for t in out]
