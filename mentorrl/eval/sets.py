"""Evaluation sets: golden, hidden, held-out, regression and production samples.

- **golden**: a curated coverage set from the task source's ``golden`` split (for orders:
  every family's normal case and every adversarial kind); checks core capability.
- **hidden**: the task source's ``hidden`` split, never trained on (:func:`assert_trainable`
  refuses it); checks over-fitting to the training distribution.
- **heldout**: the task source's ``heldout`` split (what training-time evaluation uses).
- **novel_wording**: the task source's ``novel_wording`` stress split (for orders: requests
  worded with words training never uses, e.g. "void", "invoice"); evaluation-only like
  ``hidden``, and reported beside the headline, never as it.
- **regression**: a tasks JSONL file (:func:`write_tasks_jsonl`), e.g. bad cases fixed
  once that must stay fixed; compared checkpoint against checkpoint by the regression gate.
- **production**: recorded trajectories (a trajectory JSONL file); metrics are computed on
  them as recorded, nothing is rolled out again.

A set is named on the command line as ``golden``, ``hidden``, ``heldout``, ``novel_wording``,
``regression:PATH`` or ``production:PATH`` (:meth:`EvalSetSpec.parse`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from mentorrl.contract import IM_END, IM_START
from mentorrl.core.splits import HIDDEN_SPLITS, HiddenSetError, assert_trainable_splits
from mentorrl.envs.base import Task, TaskSource, draw_tasks
from mentorrl.trajectory import Trajectory, read_jsonl

if TYPE_CHECKING:
    from mentorrl.rollout import Rollout

SetKind = Literal["golden", "hidden", "heldout", "novel_wording", "regression", "production"]
# drawn from the task source's split of that name
GENERATED_KINDS: tuple[str, ...] = ("golden", "hidden", "heldout", "novel_wording")
FILE_KINDS: tuple[str, ...] = ("regression", "production")  # read from a file
DEFAULT_NUM_TASKS = 100


# ------------------------------------------------------------ hidden-set guard ------
def assert_trainable(tasks: Iterable[Task]) -> None:
    """Refuse a task list that contains evaluation-only tasks (``hidden``, ``novel_wording``; call it
    before every training stage)."""
    bad = [t for t in tasks if t.split in HIDDEN_SPLITS]
    if bad:
        split = "hidden" if any(t.split == "hidden" for t in bad) else bad[0].split
        example = next(t.id for t in bad if t.split == split)
        what = "the hidden evaluation set" if split == "hidden" else f"the {split} stress set (evaluation-only)"
        raise HiddenSetError(
            f"refusing to train on {len(bad)} {split}-set task(s) (e.g. {example}): {what} is never used for training"
        )


# ------------------------------------------------------------ tasks JSONL ------
_TASK_FIELDS = tuple(f.name for f in fields(Task))
_TASK_REQUIRED = ("id", "family", "split", "prompt", "seed")


def task_to_dict(task: Task) -> dict[str, Any]:
    return asdict(task)


def task_from_dict(data: Any) -> Task:
    """A :class:`Task` from its JSON object; a missing, unknown or ill-typed field is a ValueError."""
    if not isinstance(data, dict):
        raise ValueError(f"a task must be a JSON object, not {type(data).__name__}")
    unknown = sorted(set(data) - set(_TASK_FIELDS))
    missing = [k for k in _TASK_REQUIRED if k not in data]
    if unknown or missing:
        raise ValueError(f"task fields: missing {missing}, unknown {unknown}")
    for k in ("id", "family", "split", "prompt", "difficulty"):
        if k in data and not isinstance(data[k], str):
            raise ValueError(f"task field {k!r} must be a string")
    if not isinstance(data["seed"], int) or isinstance(data["seed"], bool):
        raise ValueError("task field 'seed' must be an integer")
    if not isinstance(data.get("reference", {}), dict):
        raise ValueError("task field 'reference' must be an object")
    return Task(**data)


def write_tasks_jsonl(path: str | Path, tasks: Iterable[Task]) -> int:
    """Write one task per line (the reference included: the file is for evaluation only)."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for t in tasks:
            f.write(json.dumps(task_to_dict(t), ensure_ascii=False, sort_keys=True) + "\n")
            n += 1
    return n


def read_tasks_jsonl(path: str | Path) -> list[Task]:
    out: list[Task] = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(task_from_dict(json.loads(line)))
            except ValueError as e:  # json.JSONDecodeError is a ValueError
                raise ValueError(f"{path}:{i}: not a valid task: {e}") from e
    ids = [t.id for t in out]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ValueError(f"{path}: task id {dup!r} appears more than once")
    return out


# ------------------------------------------------------------ config models ------
class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EvalSetSpec(_Model):
    """One evaluation set: a generated split (golden/hidden/heldout/novel_wording) or a file (regression/production)."""

    kind: SetKind
    path: str | None = Field(None, description="tasks JSONL (regression) or trajectory JSONL (production)")
    num_tasks: int | None = Field(
        None, ge=1, description="generated sets: tasks drawn; null: AgentEvalConfig.num_tasks"
    )
    seed: int | None = Field(None, description="generated sets: task seed; null: AgentEvalConfig.seed")
    name: str | None = Field(None, description="label in reports; default: the kind, or kind:FILE_STEM")

    @model_validator(mode="after")
    def _path_matches_kind(self) -> "EvalSetSpec":
        if self.kind in FILE_KINDS and not self.path:
            raise ValueError(f"a {self.kind} set needs a path ({self.kind}:PATH)")
        if self.kind in GENERATED_KINDS and self.path is not None:
            raise ValueError(f"a {self.kind} set is generated from the task source and takes no path")
        return self

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        return f"{self.kind}:{Path(self.path).stem}" if self.path else self.kind

    @classmethod
    def parse(cls, text: str) -> "EvalSetSpec":
        """``golden`` | ``hidden`` | ``heldout`` | ``novel_wording`` | ``regression:PATH`` | ``production:PATH``."""
        kind, sep, path = text.partition(":")
        kinds = GENERATED_KINDS + FILE_KINDS
        if kind not in kinds:
            raise ValueError(
                f"unknown evaluation set {text!r}; use one of {', '.join(GENERATED_KINDS)}, "
                "regression:PATH or production:PATH"
            )
        return cls(kind=kind, path=path if sep else None)  # type: ignore[arg-type]


def looks_like_set(text: str) -> bool:
    """Does a command-line value name an evaluation set (rather than a ``key=value`` override)?"""
    kind, sep, _ = text.partition(":")
    return (kind in GENERATED_KINDS and not sep) or (kind in FILE_KINDS and bool(sep))


class AgentEvalConfig(_Model):
    """Agent evaluation: which sets, how many samples per task, which pass@k / pass^k, which judge."""

    sets: list[EvalSetSpec] = Field(default_factory=lambda: [EvalSetSpec(kind="golden"), EvalSetSpec(kind="hidden")])
    samples_per_task: int = Field(1, ge=1, description="rollouts per task, each with its own sampling seed")
    k: list[int] = Field(default_factory=lambda: [1], description="k of pass@k and pass^k (k > samples is skipped)")
    judge: str | None = Field("transcript", description="registered judge name, or null / 'none' for no judge")
    judge_threshold: float = Field(0.5, ge=0.0, le=1.0, description="judge says success when success_prob >= this")
    num_tasks: int | None = Field(
        None, ge=1, description=f"tasks per generated set; null: golden's full coverage set, else {DEFAULT_NUM_TASKS}"
    )
    seed: int = Field(0, description="task seed of generated sets and the sampling seed of rollouts")
    temperature: float | None = Field(None, ge=0, description="null: the contract's sampling temperature")
    batch_size: int = Field(100, ge=1, description="trajectories decoded together")
    stratify: bool = Field(False, description="generated sets (not golden) drawn with each stratum's exact share")

    @field_validator("k")
    @classmethod
    def _positive_ks(cls, ks: list[int]) -> list[int]:
        if not ks or any(k < 1 for k in ks):
            raise ValueError(f"k must be a non-empty list of integers >= 1, got {ks}")
        return sorted(set(ks))

    @model_validator(mode="after")
    def _unique_labels(self) -> "AgentEvalConfig":
        labels = [s.label for s in self.sets]
        dup = sorted({x for x in labels if labels.count(x) > 1})
        if dup:
            raise ValueError(f"evaluation set names must be unique; repeated: {dup} (give them a name)")
        return self


# ------------------------------------------------------------ loading sets ------
@dataclass
class EvalSet:
    """A resolved set: tasks to roll out, or recorded trajectories (production)."""

    name: str
    kind: str
    seed: int
    tasks: list[Task] = field(default_factory=list)
    recorded: list[Trajectory] | None = None  # production samples, as recorded
    source: str = ""  # where it came from (split name or file path)

    def task_fingerprint(self) -> str:
        """Identity of the set's content: task ids, seeds and prompts (or recorded trajectory ids)."""
        h = hashlib.sha256()
        if self.recorded is not None:
            for t in self.recorded:
                h.update(f"{t.id}\n".encode())
        for t in self.tasks:
            h.update(json.dumps([t.id, t.seed, t.prompt]).encode())
        return h.hexdigest()[:16]


def load_eval_set(spec: EvalSetSpec, source: TaskSource, cfg: AgentEvalConfig) -> EvalSet:
    """Resolve a spec against a task source (generated sets) or the file system (file sets)."""
    seed = spec.seed if spec.seed is not None else cfg.seed
    if spec.kind in GENERATED_KINDS:
        n = spec.num_tasks or cfg.num_tasks
        if n is None:
            n = getattr(source, "golden_size", DEFAULT_NUM_TASKS) if spec.kind == "golden" else DEFAULT_NUM_TASKS
        tasks = draw_tasks(source, spec.kind, n, seed, stratified=cfg.stratify)  # the source keeps golden curated
        return EvalSet(name=spec.label, kind=spec.kind, seed=seed, tasks=tasks, source=spec.kind)
    path = Path(spec.path or "")
    if not path.is_file():
        raise FileNotFoundError(f"{spec.kind} set: no such file {path}")
    if spec.kind == "regression":
        tasks = read_tasks_jsonl(path)
        if not tasks:
            raise ValueError(f"regression set {path} holds no tasks")
        return EvalSet(name=spec.label, kind=spec.kind, seed=seed, tasks=tasks, source=str(path))
    recorded = list(read_jsonl(path))
    if not recorded:
        raise ValueError(f"production set {path} holds no trajectories")
    return EvalSet(name=spec.label, kind=spec.kind, seed=seed, recorded=recorded, source=str(path))


# ------------------------------------------------------------ recorded prompts ------
def user_message(prompt_text: str) -> str:
    """The last user turn of a rendered ChatML prompt (the whole text if it has none)."""
    head = f"{IM_START}user\n"
    start = prompt_text.rfind(head)
    if start < 0:
        return prompt_text
    body = prompt_text[start + len(head) :]
    end = body.find(IM_END)
    return body if end < 0 else body[:end]


def tasks_from_trajectories(trajs: Sequence[Trajectory], decode: Callable[[list[int]], str]) -> list[Task]:
    """Stand-in tasks for recorded trajectories, for judges: the prompt is the user message
    decoded from the trajectory's prompt segment. They carry no reference and no seed, so
    they cannot be verified or rolled out again."""
    out: dict[str, Task] = {}
    for t in trajs:
        if t.task_id in out:
            continue
        seg = next((s for s in t.segments if s.role == "prompt"), None)
        prompt = user_message(decode(t.token_ids[seg.start : seg.end])) if seg is not None else ""
        out[t.task_id] = Task(
            id=t.task_id, family=t.family, split=t.split, prompt=prompt, seed=0, difficulty=t.difficulty
        )
    return list(out.values())


# ------------------------------------------------------------ rolling out a set ------
def rollout_samples(
    model: Any,
    rollout: "Rollout",
    tasks: Sequence[Task],
    samples_per_task: int,
    seed: int = 0,
    batch_size: int = 100,
    on_batch: Callable[[int], None] | None = None,
) -> list[Trajectory]:
    """K samples per task, task-major (``[t0 s0, t0 s1, ..., t1 s0, ...]``), rolled out with
    ``rollout`` (a :class:`mentorrl.rollout.Rollout`: contract, environments, reward weights, backend).

    Streamed (:meth:`mentorrl.rollout.Rollout.stream`: ``batch_size`` episodes in flight). Every sample
    draws from its own generator (seeded from ``seed`` and the sample's position in the set), so samples
    of one task differ, and the same (tasks, samples_per_task, seed) give the same draws for every
    checkpoint evaluated with them.
    """
    if samples_per_task < 1:
        raise ValueError(f"samples_per_task must be >= 1, not {samples_per_task}")
    expanded = [t for t in tasks for _ in range(samples_per_task)]
    return rollout.stream(model, expanded, seed=seed, slots=batch_size, on_batch=on_batch)


__all__ = [
    "AgentEvalConfig",
    "DEFAULT_NUM_TASKS",
    "EvalSet",
    "EvalSetSpec",
    "HiddenSetError",
    "assert_trainable",
    "assert_trainable_splits",
    "load_eval_set",
    "looks_like_set",
    "read_tasks_jsonl",
    "rollout_samples",
    "task_from_dict",
    "task_to_dict",
    "tasks_from_trajectories",
    "user_message",
    "write_tasks_jsonl",
]
