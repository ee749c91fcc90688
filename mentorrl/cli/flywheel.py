"""`mentorrl flywheel`: review queue, failure attribution and routing, hard-task pool, corrections.

The lead wires it into the main CLI with ``register(app)``. :func:`run_flywheel` does the work
and can be called from Python.

Files written to ``--out``:

* ``review_queue.jsonl``      trajectories chosen for human review, with reasons
* ``attributions.jsonl``      one primary failure type and evidence per failed trajectory
* ``failure_report.json``     failure-type distribution (overall, per family), routing table,
                              trajectory ids per method, task recovery, corrections summary
* ``hard_pool.json``          :class:`~mentorrl.flywheel.hard_pool.HardTaskPool` state (reward-fix
                              failures excluded) for a later GRPO run
* ``corrections_sft.jsonl``   verified corrected trajectories (with ``--model`` and recovered tasks)
* ``preference_pairs.jsonl``  (chosen = corrected, rejected = failed) pairs (same condition)
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console

from mentorrl.core import trace
from mentorrl.envs.base import Task
from mentorrl.flywheel.attribution import PRECEDENCE, Attribution, AttributionConfig, attribute, failure_distribution
from mentorrl.flywheel.corrections import (
    build_corrections,
    contract_for_trajectory,
    expert_reference_calls,
    find_tasks,
    load_tasks_jsonl,
    write_pairs_jsonl,
)
from mentorrl.flywheel.hard_pool import HardTaskPool
from mentorrl.flywheel.review import ReviewConfig, build_review_queue, reason_kind, write_review_queue
from mentorrl.flywheel.routing import RoutingTable, TrainingMethod, routing_rich_table, routing_rows
from mentorrl.trajectory import Trajectory, read_jsonl, write_jsonl


def run_flywheel(
    trajectories: list[Trajectory],
    out: Path,
    *,
    review: ReviewConfig | None = None,
    routing: RoutingTable | None = None,
    attribution: AttributionConfig | None = None,
    env_entry: Any = None,
    tasks: dict[str, Task] | None = None,
    tokenizer: Any = None,
    console: Console | None = None,
) -> dict[str, Any]:
    """Run every flywheel step on ``trajectories`` and write the files into ``out``.

    ``env_entry``: the environment's registry entry (for references and corrections);
    ``tasks``: tasks by id (default: regenerated with :func:`find_tasks`); ``tokenizer``:
    needed for corrected trajectories and preference pairs. Returns the failure report.
    """
    console = console or Console()
    review, routing, attribution = (
        review or ReviewConfig(),
        routing or RoutingTable(),
        attribution or AttributionConfig(),
    )
    out.mkdir(parents=True, exist_ok=True)

    queue = build_review_queue(trajectories, review)
    write_review_queue(out / "review_queue.jsonl", queue)

    failed = [t for t in trajectories if not trace.is_success(t)]
    if tasks is None:
        tasks = find_tasks(env_entry, {t.task_id for t in failed}) if env_entry is not None else {}
    references = expert_references(env_entry, failed, tasks)

    pairs_in = attribute_failures(failed, references, attribution)
    atts = [a for _, a in pairs_in]
    write_attributions(out / "attributions.jsonl", atts)
    dist = failure_distribution(atts)
    by_method = routing.route(atts)

    pool = hard_task_pool(trajectories, by_method)
    (out / "hard_pool.json").write_text(json.dumps(pool.state_dict(), indent=2))

    corrections = write_corrections(out, pairs_in, failed, tasks, env_entry, tokenizer, routing)

    missing = sorted({t.task_id for t in failed} - set(tasks))
    report = {
        "n_trajectories": len(trajectories),
        "n_failed": len(failed),
        "review_queue": {"n": len(queue), "reasons": dict(Counter(reason_kind(r) for e in queue for r in e.reasons))},
        "precedence": [ft.value for ft in PRECEDENCE],
        "distribution": dist.model_dump(),
        "routing": routing_rows(dist, routing),
        "routes": {ft.value: m.value for ft, m in routing.routes.items()},
        "by_method": {m.value: [a.trajectory_id for a in v] for m, v in by_method.items()},
        "tasks": {
            "recovered": len(set(tasks) & {t.task_id for t in failed}),
            "missing": missing,
            "with_reference": sum(r is not None for r in references.values()),
        },
        "hard_pool": {"tasks": len(pool), "top": pool.hard_task_ids()[:10]},
        "corrections": corrections,
    }
    (out / "failure_report.json").write_text(json.dumps(report, indent=2))

    console.print(routing_rich_table(dist, routing))
    console.print(f"review queue: {len(queue)} of {len(trajectories)} trajectories -> {out / 'review_queue.jsonl'}")
    console.print(f"hard-task pool: {len(pool)} tasks -> {out / 'hard_pool.json'}")
    print_corrections(console, corrections, missing)
    return report


def expert_references(env_entry: Any, failed: list[Trajectory], tasks: dict[str, Task]) -> dict[str, Any]:
    """The expert's reference calls for each failed trajectory's task that was recovered (none without
    an environment entry)."""
    references: dict[str, Any] = {}
    if env_entry is not None:
        expert = env_entry.make_expert()
        for tid in sorted({t.task_id for t in failed} & set(tasks)):
            references[tid] = expert_reference_calls(env_entry.make_env, expert, tasks[tid])
    return references


def attribute_failures(
    failed: list[Trajectory], references: dict[str, Any], attribution: AttributionConfig
) -> list[tuple[Trajectory, Attribution]]:
    """Each failed trajectory with its attribution (one primary failure type and its evidence)."""
    pairs: list[tuple[Trajectory, Attribution]] = []
    for t in failed:
        att = attribute(t, references.get(t.task_id), attribution)
        if att is not None:  # always, as t failed
            pairs.append((t, att))
    return pairs


def write_attributions(path: Path, atts: list[Attribution]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for a in atts:
            f.write(a.model_dump_json() + "\n")


def hard_task_pool(trajectories: list[Trajectory], by_method: dict[TrainingMethod, list[Attribution]]) -> HardTaskPool:
    """The hard-task pool of ``trajectories``; reward-fix cases stay out of training."""
    hack_ids = {a.trajectory_id for a in by_method[TrainingMethod.REWARD_FIX]}
    pool = HardTaskPool()
    pool.update(t for t in trajectories if t.id not in hack_ids)
    return pool


def write_corrections(
    out: Path,
    pairs_in: list[tuple[Trajectory, Attribution]],
    failed: list[Trajectory],
    tasks: dict[str, Task],
    env_entry: Any,
    tokenizer: Any,
    routing: RoutingTable,
) -> dict[str, Any]:
    """Write the verified corrected trajectories and the preference pairs into ``out``; returns their
    summary, or ``{"skipped": why}`` when they cannot be built."""
    if tokenizer is None:
        return {"skipped": "no --model given (a tokenizer is needed to build corrected trajectories)"}
    if env_entry is None or not tasks or not pairs_in:
        return {"skipped": "no failed trajectory with a recoverable task"}
    fingerprint = Counter(t.contract_fingerprint for t in failed).most_common(1)[0][0]
    sample = next(t for t in failed if t.contract_fingerprint == fingerprint)
    probe = env_entry.make_env()
    try:
        contract = contract_for_trajectory(tokenizer, probe, sample)
    finally:
        probe.close()
    if contract is None:
        return {"skipped": "no prompt format with this tokenizer reproduces the trajectories' contract fingerprint"}
    corr = build_corrections(pairs_in, tasks, contract, env_entry.make_env, env_entry.make_expert(), routing)
    write_jsonl(out / "corrections_sft.jsonl", corr.sft)
    write_pairs_jsonl(out / "preference_pairs.jsonl", corr.pairs)
    return corr.summary()


def print_corrections(console: Console, corrections: dict[str, Any], missing: list[str]) -> None:
    if corrections and "skipped" not in corrections:
        console.print(
            f"corrections: {corrections['sft']} SFT trajectories, {corrections['pairs']} "
            f"preference pairs, {corrections['discarded']} discarded"
        )
    elif corrections:
        console.print(f"corrections skipped: {corrections['skipped']}")
    if missing:
        console.print(f"{len(missing)} failed task(s) could not be recovered (pass --tasks FILE)")


def flywheel_command(
    trajectories: Path = typer.Argument(..., exists=True, dir_okay=False, help="trajectories JSONL"),
    out: Path = typer.Option(..., "--out", "-o", help="output directory"),
    seed: int = typer.Option(0, "--seed", help="seed of the review sampler"),
    budget: int = typer.Option(50, "--budget", min=0, help="review queue size (mandatory items may exceed it)"),
    per_bucket_min: int = typer.Option(2, "--per-bucket-min", min=0, help="review items per stratum"),
    tasks_file: Optional[Path] = typer.Option(
        None, "--tasks", exists=True, dir_okay=False, help="tasks JSONL (default: regenerate tasks from their ids)"
    ),
    model: Optional[Path] = typer.Option(
        None,
        "--model",
        exists=True,
        file_okay=False,
        help="checkpoint or tokenizer directory: build corrections and preference pairs",
    ),
    route: list[str] = typer.Option([], "--route", help="override a route: --route TOOL_SELECTION=preference_or_rl"),
) -> None:
    """Bad-case flywheel: review queue, failure types with routing, hard-task pool and corrections."""
    from mentorrl.cli_common import err

    try:
        trajs = list(read_jsonl(trajectories))
        routing = RoutingTable.with_overrides(route)
        tasks = load_tasks_jsonl(tasks_file) if tasks_file is not None else None
    except ValueError as e:
        err.print(f"[red]{e}[/red]")
        raise typer.Exit(2)
    if not trajs:
        err.print(f"[red]{trajectories}: no trajectories[/red]")
        raise typer.Exit(2)

    from mentorrl.envs import get_env

    env_name = Counter(t.env_name for t in trajs).most_common(1)[0][0]
    try:
        entry = get_env(env_name)
    except ValueError as e:
        err.print(f"[yellow]{e}: no task recovery, references or corrections[/yellow]")
        entry = None

    tokenizer = None
    if model is not None:
        import transformers
        from transformers import AutoTokenizer

        transformers.utils.logging.set_verbosity_error()
        tokenizer = AutoTokenizer.from_pretrained(model)

    run_flywheel(
        trajs,
        out,
        review=ReviewConfig(seed=seed, budget=budget, per_bucket_min=per_bucket_min),
        routing=routing,
        env_entry=entry,
        tasks=tasks,
        tokenizer=tokenizer,
    )


def register(app: typer.Typer) -> None:
    """Add ``flywheel`` to a Typer app."""
    app.command("flywheel")(flywheel_command)


__all__ = ["flywheel_command", "register", "run_flywheel"]
