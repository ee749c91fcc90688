"""τ²-bench's task files as typed records, and the checks that a clone and a domain are usable.

A clone has ``data/tau2/domains/<domain>/`` (``tasks.json``, ``split_tasks.json``, and the files the
domain's code opens: ``db.json`` and ``policy.md``; telecom: ``db.toml``, ``user_db.toml`` and its
policies) and ``src/tau2/domains/<domain>/``. ``env.task_set`` picks the task file from an allow-list
(:data:`TASK_SETS`: ``tasks.json``, telecom's ``tasks_small.json`` / ``tasks_full.json``), never a path
from the config or the clone; its splits are upstream's ``split_<stem>.json`` beside it when the clone
has one, else the domain's ``split_tasks.json`` (upstream's ``small`` and ``full`` splits of telecom
list the ids of those task sets). The records keep
the fields the adapter reads (the scenario, the initial state, the evaluation criteria); others
are ignored. Every failure here is a :class:`~mentorrl.config.ConfigError` naming the ``env.``
field to fix, raised before the first step.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mentorrl.config.base import ConfigError

MAX_TASK_FILE_BYTES = 64 * 1024 * 1024
MAX_TASKS = 10_000
TASK_SETS = {"tasks": "tasks.json", "small": "tasks_small.json", "full": "tasks_full.json"}  # env.task_set
REWARD_TYPES = ("DB", "ENV_ASSERTION", "COMMUNICATE", "NL_ASSERTION", "ACTION")


class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Instructions(_Loose):
    reason_for_call: str = ""
    known_info: str | None = None
    unknown_info: str | None = None
    task_instructions: str | None = None
    domain: str | None = None


class UserScenario(_Loose):
    persona: str | None = None
    instructions: Instructions | str = ""


class GoldAction(_Loose):
    action_id: str = ""
    requestor: Literal["assistant", "user"] = "assistant"
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    compare_args: list[str] | None = None


class EnvAssertion(_Loose):
    env_type: Literal["assistant", "user"] = "assistant"
    func_name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    assert_value: bool = True
    message: str | None = None


class Criteria(_Loose):
    actions: list[GoldAction] | None = None
    env_assertions: list[EnvAssertion] | None = None
    communicate_info: list[str] | None = None
    nl_assertions: list[str] | None = None
    reward_basis: list[Literal["DB", "ENV_ASSERTION", "COMMUNICATE", "NL_ASSERTION", "ACTION"]] = Field(
        default_factory=lambda: ["DB", "COMMUNICATE"]
    )

    @property
    def needs_judge(self) -> bool:
        """NL_ASSERTION gates the reward and there are assertions to judge (none: the component is 1)."""
        return "NL_ASSERTION" in self.reward_basis and bool(self.nl_assertions)


class Tau2Task(_Loose):
    id: str
    user_scenario: UserScenario
    ticket: str | None = None  # the task as a ticket, for solo mode
    initial_state: dict[str, Any] | None = None
    evaluation_criteria: Criteria | None = None

    @property
    def user_acts(self) -> bool:
        """Does a gold action belong to the user (telecom: only solo mode can play it)?"""
        crit = self.evaluation_criteria
        return crit is not None and any(a.requestor == "user" for a in crit.actions or [])


@dataclass(frozen=True)
class Tau2Settings:
    """The resolved ``env:`` section of a tau2 run (hashable: it keys the per-process caches)."""

    clone: Path
    domain: str
    split: str
    python: str
    user: str = "scripted"
    user_client: str | None = None  # a ClientConfig as JSON
    judge: str | None = None  # a ClientConfig as JSON
    exclude_hackable: bool = True
    max_user_turns: int = 10
    solo: bool = False
    task_set: str = "tasks"

    @property
    def data_dir(self) -> Path:
        return self.clone / "data" / "tau2" / "domains" / self.domain

    @property
    def task_file(self) -> str:
        return TASK_SETS[self.task_set]  # a KeyError for a name off the allow-list

    @property
    def split_file(self) -> str:
        """Upstream's rule (``split_<stem>.json`` beside the task file), else the domain's split_tasks.json."""
        own = "split_" + self.task_file
        return own if (self.data_dir / own).is_file() else "split_tasks.json"


def domains_in(clone: Path) -> list[str]:
    root = clone / "data" / "tau2" / "domains"
    return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def task_sets_in(data: Path) -> list[str]:
    return [name for name, file in TASK_SETS.items() if (data / file).is_file()]


def check_clone(path: str | None, domain: str | None, task_set: str = "tasks") -> tuple[Path, str]:
    """The clone's root and the domain, checked: a ConfigError naming ``env.path`` / ``env.domain`` /
    ``env.task_set``."""
    if not path:
        raise ConfigError("env.path: environment 'tau2' reads your clone of tau2-bench: set env.path to its root")
    clone = Path(path).expanduser().resolve()
    if not clone.is_dir():
        raise ConfigError(f"env.path: {path!r} is not a directory")
    if not (clone / "data" / "tau2" / "domains").is_dir() or not (clone / "src" / "tau2").is_dir():
        raise ConfigError(f"env.path: {path!r} is not a tau2-bench clone (no data/tau2/domains/ and src/tau2/ in it)")
    known = domains_in(clone)
    if not domain:
        raise ConfigError(f"env.domain: set the domain; the clone has {', '.join(known) or 'none'}")
    if not domain.isidentifier() or domain not in known or not (clone / "src" / "tau2" / "domains" / domain).is_dir():
        raise ConfigError(f"env.domain: no domain {domain!r} in {clone} (data and code); it has {', '.join(known)}")
    data = clone / "data" / "tau2" / "domains" / domain
    if task_set not in TASK_SETS:
        raise ConfigError(f"env.task_set: {task_set!r} is not one of {', '.join(TASK_SETS)}")
    name = TASK_SETS[task_set]  # what the adapter reads itself; the domain's own files (db.json or db.toml,
    if not (data / name).is_file():  # policy.md or telecom's policies) are its to open: see handshake
        field = "env.task_set" if task_set != "tasks" else "env.path"
        have = ", ".join(task_sets_in(data)) or "none"
        raise ConfigError(
            f"{field}: the clone has no data/tau2/domains/{domain}/{name} (env.task_set: {task_set}); "
            f"the task sets it has: {have}"
        )
    if not (data / "split_tasks.json").is_file():
        raise ConfigError(f"env.path: the clone has no data/tau2/domains/{domain}/split_tasks.json")
    return clone, domain


def default_python(clone: Path) -> str:
    venv = clone / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else (shutil.which("python3.12") or "python3.12")


def _read_json(path: Path, what: str) -> Any:
    if path.stat().st_size > MAX_TASK_FILE_BYTES:
        raise ConfigError(f"env.path: {what} is over {MAX_TASK_FILE_BYTES} bytes")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"env.path: {what} is not valid JSON: {e}") from None


def load_tasks(settings: Tau2Settings) -> dict[str, Tau2Task]:
    """Every task of the domain, by id (a ConfigError naming env.path for a malformed file)."""
    what = f"{settings.domain}/{settings.task_file}"
    rows = _read_json(settings.data_dir / settings.task_file, what)
    if not isinstance(rows, list) or len(rows) > MAX_TASKS:
        raise ConfigError(f"env.path: {what} must be a list of at most {MAX_TASKS} tasks")
    out: dict[str, Tau2Task] = {}
    for i, row in enumerate(rows):
        try:
            task = Tau2Task.model_validate(row)
        except ValidationError as e:
            raise ConfigError(f"env.path: {what} task #{i}: {str(e)[:400]}") from None
        out[task.id] = task
    return out


def task_ids(settings: Tau2Settings) -> set[str]:
    """The ids of the task file, unvalidated otherwise (the split check before the first step)."""
    rows = _read_json(settings.data_dir / settings.task_file, f"{settings.domain}/{settings.task_file}")
    return {str(r["id"]) for r in rows if isinstance(r, dict) and "id" in r} if isinstance(rows, list) else set()


def load_splits(settings: Tau2Settings) -> dict[str, list[str]]:
    what = f"{settings.domain}/{settings.split_file}"
    raw = _read_json(settings.data_dir / settings.split_file, what)
    if not isinstance(raw, dict) or not all(
        isinstance(v, list) and all(isinstance(x, str) for x in v) for v in raw.values()
    ):
        raise ConfigError(f"env.path: {what} must map split names to lists of task ids")
    return {str(k): list(v) for k, v in raw.items()}


__all__ = [
    "Criteria",
    "EnvAssertion",
    "GoldAction",
    "Instructions",
    "MAX_TASK_FILE_BYTES",
    "REWARD_TYPES",
    "TASK_SETS",
    "Tau2Settings",
    "Tau2Task",
    "UserScenario",
    "check_clone",
    "default_python",
    "domains_in",
    "load_splits",
    "load_tasks",
    "task_ids",
    "task_sets_in",
]
