"""A results file that a multi-run bench grows one finished arm at a time (``methods_seeds.py --results``).

Each line is one finished (arm, seed): its own held-out success, interval and violations, the per-task outcomes of
its final evaluation (``bits``, in the evaluation's task order, with a fingerprint of the task ids), what produced it
(the arm's fingerprint: its config file's text and overrides), its seconds and the commit. A line is appended, flushed
and fsynced the moment its arm finishes, so a killed bench loses at most the arm that was running; a rerun skips every
(arm, seed) whose line has the same fingerprint, and the file alone (committed, no run directory) is enough to pair an
arm with its baseline on the same tasks (:func:`paired_bits`) and to print the table (``bench/methods_table.py``).

A line that is not a JSON object with the keys below is refused with its line number: a corrupt file is never
silently half-read."""

from __future__ import annotations

import hashlib
import json
import os
import random
import statistics
import subprocess
from dataclasses import dataclass
from pathlib import Path

KEYS = ("arm", "seed", "fingerprint", "success", "ci95", "violations", "n")
MAX_LINE = 1 << 20  # bytes: a line holds at most a few thousand task outcomes


def fingerprint(*parts: str) -> str:
    """A short stable digest of what defines an arm (its config text, its overrides)."""
    return hashlib.blake2b("\x1f".join(parts).encode(), digest_size=8).hexdigest()


def outcome_rows(jsonl: Path) -> list[tuple[str, float]]:
    """(task id, 1.0 / 0.0: the verifier's success) per trajectory of an evaluation (``eval_*.jsonl``), in its
    order. The one reader of per-task outcomes that every bench shares."""
    rows = []
    for line in jsonl.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows.append((str(row["task_id"]), 1.0 if (row.get("reward") or {}).get("success") else 0.0))
    return rows


def task_outcomes(jsonl: Path) -> dict[str, float]:
    """task id -> outcome (:func:`outcome_rows`), in the evaluation's order; an evaluation that rolled a task out
    more than once is refused (pairing by task needs one outcome a task)."""
    rows = outcome_rows(jsonl)
    out = dict(rows)
    if len(out) != len(rows):
        raise ValueError(f"{jsonl} holds {len(rows) - len(out)} repeated task ids: pairing by task needs one a task")
    return out


def outcome_bits(rows) -> tuple[str, str]:
    """(fingerprint of the task ids in order, "0"/"1" per task) of ``(task id, outcome)`` pairs."""
    rows = list(rows)
    return fingerprint(*(t for t, _ in rows)), "".join("1" if v else "0" for _, v in rows)


def task_bits(jsonl: Path) -> tuple[str, str] | None:
    """:func:`outcome_bits` of an evaluation's trajectories (every row, in order); None when the file is absent."""
    return outcome_bits(outcome_rows(jsonl)) if jsonl.exists() else None


def paired_outcomes(a: dict[str, float], b: dict[str, float], reps: int = 10_000, seed: int = 0) -> dict:
    """``b`` minus ``a`` in points over the tasks both hold (:func:`task_outcomes`), paired bootstrap 95% interval."""
    ids = sorted(set(a) & set(b))
    if not ids:
        raise ValueError("the two evaluations share no task")
    return paired_bootstrap([b[t] - a[t] for t in ids], reps, seed)


def paired_bits(base: str, arm: str, reps: int = 10_000, seed: int = 0) -> dict:
    """``arm`` minus ``base`` in points over the same tasks (equal-length outcome strings), with a paired bootstrap
    95% interval: tasks are resampled with replacement, both arms' outcomes on a task kept together."""
    if len(base) != len(arm) or not base:
        raise ValueError(f"paired outcomes need the same non-empty task list ({len(base)} against {len(arm)})")
    d = [int(b) - int(a) for a, b in zip(base, arm)]
    return paired_bootstrap(d, reps, seed)


def paired_bootstrap(d: list[float], reps: int = 10_000, seed: int = 0) -> dict:
    """Mean of the per-task differences ``d`` in points, with a bootstrap 95% interval (percentile)."""
    rng, n = random.Random(seed), len(d)
    boots = sorted(sum(d[rng.randrange(n)] for _ in range(n)) / n for _ in range(reps))
    return {"n": n, "diff": 100 * sum(d) / n, "ci95": [100 * boots[int(0.025 * reps)], 100 * boots[int(0.975 * reps)]]}


def pooled_bits(pairs: list[tuple[str, str, str]], reps: int = 10_000, seed: int = 0) -> dict:
    """``arm`` minus ``base`` over several seeds' ``(task fingerprint, base bits, arm bits)``, with a paired bootstrap
    clustered by task: seeds evaluated on the same task list (the same fingerprint; every seed's held-out set is
    drawn with ``eval.seed``) have each task's differences averaged, and the tasks are resampled, so a task every
    seed gains is one observation, not one per seed. Seeds on other task lists add their tasks (distinct draws).
    ``tasks``: the tasks resampled; ``pairs``: the (seed, task) pairs."""
    if not pairs:
        raise ValueError("nothing to pool")
    by_tasks: dict[str, list[tuple[str, str]]] = {}
    for fp, base, arm in pairs:
        if len(base) != len(arm) or not base:
            raise ValueError(f"paired outcomes need the same non-empty task list ({len(base)} against {len(arm)})")
        by_tasks.setdefault(fp, []).append((base, arm))
    d: list[float] = []
    for runs in by_tasks.values():
        if len({len(b) for b, _ in runs}) != 1:
            raise ValueError("runs with one task fingerprint hold different task counts")
        per_run = [[int(y) - int(x) for x, y in zip(b, a)] for b, a in runs]
        d += [sum(col) / len(runs) for col in zip(*per_run)]
    return {**paired_bootstrap(d, reps, seed), "tasks": len(d), "pairs": sum(len(b) for _, b, _ in pairs)}


def pairable(a: dict | None, b: dict | None) -> bool:
    """Both records hold per-task outcomes of one evaluation's tasks (the same task fingerprint)."""
    return bool(a and b and a.get("bits") and b.get("bits") and a.get("tasks") == b.get("tasks"))


def commit() -> str | None:
    """The checkout's short commit, or None outside a git checkout."""
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


@dataclass
class ArmStore:
    """The results file: its lines in order, appended to as arms finish."""

    path: Path
    lines: list[dict]

    @classmethod
    def open(cls, path: Path) -> "ArmStore":
        lines: list[dict] = []
        if path.exists():
            for i, raw in enumerate(path.read_text().splitlines(), 1):
                if not raw.strip():
                    continue
                try:
                    row = json.loads(raw) if len(raw) <= MAX_LINE else None
                except json.JSONDecodeError:
                    row = None
                if not isinstance(row, dict) or any(k not in row for k in KEYS):
                    raise SystemExit(f"{path}:{i}: not a finished-arm record (a JSON object with {', '.join(KEYS)})")
                lines.append(row)
        return cls(path, lines)

    def find(self, arm: str, seed: int, fp: str | None = None) -> dict | None:
        """The last line for (arm, seed), with fingerprint ``fp`` when given."""
        hits = [
            r for r in self.lines if r["arm"] == arm and r["seed"] == seed and (fp is None or r["fingerprint"] == fp)
        ]
        return hits[-1] if hits else None

    def append(self, row: dict) -> None:
        missing = [k for k in KEYS if k not in row]
        if missing:
            raise ValueError(f"an arm's record needs {', '.join(missing)}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(row, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.lines.append(row)

    def estimate_s(self, arm: str, default_s: float) -> float:
        """Seconds one seed of ``arm`` is expected to take: the median of its recorded runs, else ``default_s``."""
        done = [r["seconds"] for r in self.lines if r["arm"] == arm and r.get("seconds")]
        return statistics.median(done) if done else default_s

    def paired(self, arm: str, base: str, seed: int) -> dict | None:
        """``arm`` minus ``base`` at ``seed`` on the same tasks (:func:`paired_bits`), or None when either has no
        per-task outcomes or they were evaluated on different tasks."""
        a, b = self.find(arm, seed), self.find(base, seed)
        return paired_bits(b["bits"], a["bits"]) if pairable(a, b) else None
