"""The τ²-bench task source: a domain's tasks by split, with the ones the run cannot score fairly left out.

mentorrl's ``train`` split is the benchmark split ``env.split`` names (default ``train``); ``heldout``
and ``hidden`` (evaluation only: the training guard refuses it) are the benchmark's ``test``; each
benchmark split is also there under its own name (``train``, ``test``, ``base``, ...). Left out, and
counted in :attr:`Tau2Tasks.report`:

* everywhere: tasks of the task file (``env.task_set``) that no split lists (``in_no_split``: a split
  file written for another task set); and (:func:`left_out_reason`) without ``env.judge``, tasks whose reward needs the
  NL_ASSERTION judge (scoring them 0 or 1 without one would be a wrong reward either way); outside
  solo mode, tasks with a gold action the user takes (no user here has tools); in solo mode, tasks
  without a ticket;
* from ``train`` only, with ``env.exclude_hackable`` (the default): tasks where an audit attack
  (:func:`.audit.tau2_attacks`) earns the full benchmark reward (:func:`.audit.screen_tasks`).
  Evaluation splits keep them, so figures stay comparable with the benchmark's.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Iterable

from mentorrl.config.base import ConfigError
from mentorrl.envs.adapters.common import AdapterTasks
from mentorrl.envs.base import Task

from .audit import screen_tasks, tau2_attacks
from .env import DomainSpec, Tau2Env
from .records import Tau2Settings, Tau2Task, load_splits, load_tasks, task_ids
from .users import opening_message


def _row(record: Tau2Task, settings: Tau2Settings) -> tuple[str, dict[str, Any]]:
    prompt = (record.ticket or "") if settings.solo else opening_message(record.user_scenario)
    return prompt, {"tau2": record.model_dump(mode="json"), "tau2_id": record.id, "family": settings.domain}


def check_split(settings: Tau2Settings, ids: Iterable[str] | None = None) -> dict[str, list[str]]:
    """The splits, each kept to the ids of the task set (``ids``; None: read them when ``env.task_set`` is
    not the default); a ConfigError naming ``env.split`` for a split the domain lacks, or one that lists
    no task of a non-default task set."""
    splits = load_splits(settings)
    if settings.split not in splits:
        raise ConfigError(f"env.split: {settings.domain} has no split {settings.split!r}; it has {', '.join(splits)}")
    if ids is None and settings.task_set == "tasks":
        return splits
    known = set(ids) if ids is not None else task_ids(settings)
    splits = {name: [i for i in members if i in known] for name, members in splits.items()}
    if settings.task_set != "tasks" and not splits[settings.split]:
        have = [name for name, members in splits.items() if members]
        raise ConfigError(
            f"env.split: no task of {settings.domain}/{settings.task_file} (env.task_set: {settings.task_set}) "
            f"is in split {settings.split!r}; the splits that list its tasks: {', '.join(have) or 'none'}"
        )
    return splits


def left_out_reason(record: Tau2Task, settings: Tau2Settings) -> str | None:
    """Why this run cannot score the task fairly (None: it can)."""
    crit = record.evaluation_criteria
    if settings.judge is None and crit is not None and crit.needs_judge:
        return "nl_assertion"
    if settings.solo and not record.ticket:
        return "no_ticket"
    if not settings.solo and record.user_acts:
        return "user_actions"
    return None


def screen(settings: Tau2Settings, make_env: Any, records: list[Tau2Task]) -> dict[str, list[str]]:
    """Benchmark task id -> the attacks that win it (see :func:`.audit.screen_tasks`)."""
    probe = []
    for r in records:
        prompt, ref = _row(r, settings)
        probe.append(
            Task(id=f"screen-{r.id}", family=settings.domain, split="train", prompt=prompt, seed=0, reference=ref)
        )
    env = make_env()
    try:
        return screen_tasks(env, probe, tau2_attacks())
    finally:
        env.close()


class Tau2Tasks(AdapterTasks):
    """The task source (see the module docstring); ``make_env`` plays the screen's attacks."""

    def __init__(self, settings: Tau2Settings, make_env: Any):
        records = load_tasks(settings)
        splits = check_split(settings, records)
        listed = {i for members in splits.values() for i in members}
        reasons = {
            i: left_out_reason(r, settings) or (None if i in listed else "in_no_split") for i, r in records.items()
        }
        left_out: dict[str, list[str]] = {}
        for i, why in reasons.items():
            if why is not None:
                left_out.setdefault(why, []).append(i)
        by_split = {name: [records[i] for i in ids if i in records and not reasons[i]] for name, ids in splits.items()}
        train = by_split[settings.split]
        hackable = screen(settings, make_env, train) if settings.exclude_hackable and train else {}
        rows = {name: [_row(r, settings) for r in recs] for name, recs in by_split.items()}
        rows["train"] = [_row(r, settings) for r in train if r.id not in hackable]
        rows["heldout"] = rows["hidden"] = rows.get("test", [])  # hidden: evaluation only, never trained on
        super().__init__("tau2", rows)
        in_split = set(splits[settings.split])
        self.report = {
            "domain": settings.domain,
            "task_set": settings.task_set,
            "split": settings.split,
            "tasks_in_split": len(splits[settings.split]),
            "refused_nl_assertion": [i for i in left_out.get("nl_assertion", []) if i in in_split],
            "refused_nl_assertion_all_splits": left_out.get("nl_assertion", []),
            "left_out_all_splits": left_out,
            "hackable": hackable,
            "train_tasks": len(rows["train"]),
        }
        others = {k: len([i for i in v if i in in_split]) for k, v in left_out.items() if k != "nl_assertion"}
        unlisted = left_out.get("in_no_split", [])
        print(
            f"tau2 {settings.domain}/{settings.split} ({settings.task_file}): {len(rows['train'])} training tasks of "
            f"{len(in_split)}; left out: {len(self.report['refused_nl_assertion'])} needing the NL judge "
            f"(no env.judge), {len(hackable)} an audit attack wins ({', '.join(sorted(hackable)) or 'none'})"
            + "".join(f", {n} {k.replace('_', ' ')}" for k, n in others.items() if n)
            + (f" ({len(unlisted)} of {settings.task_file} in no split of {settings.split_file})" if unlisted else ""),
            file=sys.stderr,
            flush=True,
        )


@functools.lru_cache(maxsize=8)
def tasks_for(settings: Tau2Settings, spec: DomainSpec) -> Tau2Tasks:
    """The task source of a run, built (and screened) once per process."""
    return Tau2Tasks(settings, functools.partial(Tau2Env, settings, spec))


__all__ = ["Tau2Tasks", "check_split", "left_out_reason", "screen", "tasks_for"]
