"""A new environment, end to end: a shared notebook kept in SQLite, two tools, a task source,
a verifier that reads the database, and a scripted expert. Registered as ``notes``.

Run it: ``python docs/examples/notes_env.py`` plays the expert and a cheating policy on three tasks.
"""

from __future__ import annotations

import random
import sqlite3
from typing import Any, Iterator

from mentorrl.envs import EnvEntry, get_env, register_env
from mentorrl.envs.base import Action, FinalAnswer, Task, Tool, ToolAction, ToolError, ToolRegistry, ToolResult, Verdict

KEYS = ["groceries", "meeting", "wifi", "birthday", "parking"]
WORDS = ["blue", "tuesday", "seven", "window", "orchard", "copper"]


def seeded_db(seed: int) -> sqlite3.Connection:
    """The episode's initial state: every key holds a word chosen by ``seed``."""
    rng = random.Random(seed)
    conn = sqlite3.connect(":memory:", check_same_thread=False)  # tools run in a worker thread
    conn.execute("CREATE TABLE notes (key TEXT PRIMARY KEY, body TEXT NOT NULL)")
    conn.executemany("INSERT INTO notes VALUES (?, ?)", [(k, rng.choice(WORDS)) for k in KEYS])
    return conn


class NotesEnv:
    """One episode at a time (the :class:`~mentorrl.envs.base.Environment` protocol)."""

    name = "notes"
    version = "1.0"
    system_prompt = "You keep the user's notes. Use the tools, then answer in one sentence."

    def __init__(self, tool_timeout_s: float = 5.0, **_: Any):
        self.conn: sqlite3.Connection | None = None
        self.task: Task | None = None
        self.read: set[str] = set()  # keys this episode looked up: the evidence an answer may use
        self.registry = ToolRegistry(
            [
                Tool(
                    "get_note",
                    "read a note",
                    {
                        "type": "object",
                        "properties": {"key": {"type": "string"}},
                        "required": ["key"],
                        "additionalProperties": False,
                    },
                    self._get,
                ),
                Tool(
                    "set_note",
                    "overwrite a note",
                    {
                        "type": "object",
                        "properties": {"key": {"type": "string"}, "body": {"type": "string"}},
                        "required": ["key", "body"],
                        "additionalProperties": False,
                    },
                    self._set,
                ),
            ],
            timeout_s=tool_timeout_s,
        )

    def _row(self, key: str) -> str:
        row = self.conn.execute("SELECT body FROM notes WHERE key = ?", (key,)).fetchone()
        if row is None:
            raise ToolError(f"no note called {key!r}")  # an error observation, not a crash
        return row[0]

    def _get(self, key: str) -> dict[str, str]:
        self.read.add(key)
        return {"key": key, "body": self._row(key)}

    def _set(self, key: str, body: str) -> dict[str, bool]:
        self._row(key)
        self.conn.execute("UPDATE notes SET body = ? WHERE key = ?", (body, key))
        return {"ok": True}

    def reset(self, task: Task) -> str:
        self.close_db()
        self.conn, self.task, self.read = seeded_db(task.seed), task, set()
        return task.prompt

    def step(self, name: Any, arguments: Any) -> ToolResult:
        return self.registry.call(name, arguments)

    def verify(self, final_answer: str | None) -> Verdict:
        """Judge the database, never the claim; an answer counts only after its lookup."""
        ref, key = self.task.reference, self.task.reference["key"]
        expected = dict(seeded_db(self.task.seed).execute("SELECT key, body FROM notes").fetchall())
        if ref["kind"] == "set":
            expected[key] = ref["body"]
        actual = dict(self.conn.execute("SELECT key, body FROM notes").fetchall())
        violations = [f"changed {k}" for k in actual if actual[k] != expected[k] and k != key]
        success = actual == expected
        if ref["kind"] == "read":
            success = success and key in self.read and expected[key] in (final_answer or "").lower()
        return Verdict(success=success and not violations, violations=violations)

    def close_db(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.conn = None

    def close(self) -> None:
        self.registry.close()
        self.close_db()


class NotesTasks:
    """The task source: seeded, split-aware (held-out tasks use other seeds)."""

    def tasks(self, split: str, n: int, seed: int) -> list[Task]:
        rng = random.Random(f"{split}:{seed}")
        out = []
        for i in range(n):
            key, kind, db_seed = rng.choice(KEYS), rng.choice(["read", "set"]), rng.randrange(10**6)
            current = seeded_db(db_seed).execute("SELECT body FROM notes WHERE key = ?", (key,)).fetchone()[0]
            body = rng.choice([w for w in WORDS if w != current])  # a change task always changes something
            prompt = f"What does my {key} note say?" if kind == "read" else f"Change my {key} note to '{body}'."
            out.append(
                Task(
                    id=f"notes-{split}-{seed}-{i}",
                    family=kind,
                    split=split,
                    prompt=prompt,
                    seed=db_seed,
                    reference={"kind": kind, "key": key, "body": body},
                )
            )
        return out


class NotesExpert:
    """A scripted expert: yields actions and receives each tool result through ``send``."""

    def act(self, task: Task) -> Iterator[Action]:
        ref = task.reference
        if ref["kind"] == "read":
            result = yield ToolAction("get_note", {"key": ref["key"]})
            yield FinalAnswer(f"Your {ref['key']} note says {result.content['body']}.")
        else:
            yield ToolAction("set_note", {"key": ref["key"], "body": ref["body"]})
            yield FinalAnswer(f"Done: your {ref['key']} note now says {ref['body']}.")


def register() -> None:
    """Make ``env.name: notes`` work in any recipe (call once, e.g. from your package's import)."""
    try:
        get_env("notes")
    except ValueError:
        register_env("notes", lambda: EnvEntry(NotesEnv, NotesTasks, NotesExpert))


if __name__ == "__main__":
    from transformers import AutoTokenizer

    from mentorrl.contract import contract_for_env
    from mentorrl.models.shipped import SHIPPED_ROOT
    from mentorrl.rollout.episode import run_scripted_episode, run_text_turns

    register()
    entry = get_env("notes")
    tokenizer = AutoTokenizer.from_pretrained(SHIPPED_ROOT / "orders-tiny")  # any tokenizer with ChatML tokens
    env = entry.make_env()
    contract = contract_for_env(tokenizer, env)
    for task in entry.make_tasks().tasks("train", 3, seed=0):
        honest = run_scripted_episode(contract, env, task, entry.make_expert())
        cheat = run_text_turns(contract, env, task, ["Done, all taken care of."])
        print(f"{task.prompt:40s} expert {honest.reward.total:+.2f}  claim-only {cheat.reward.total:+.2f}")
