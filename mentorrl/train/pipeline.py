"""Recipes composed from stages: the demo (SFT -> eval -> GRPO -> eval) and any ``recipe`` list,
each stage run through the registry (:mod:`mentorrl.train.registry`), on a base model from
:mod:`mentorrl.train.models_init`. :func:`train` is what ``mentorrl train`` runs: :func:`run_recipe`
(preflight, distributed set-up, the workspace), then :func:`run_stages` (each stage on the loop,
:mod:`mentorrl.train.loop`, and its evaluation), then the report.

Before the first step a recipe runs its preflight: the run directory, the files the stages will
read, and the prompt length against the episode's token budget are checked, so a bad setting is a
:class:`~mentorrl.config.ConfigError` naming the field, not a crash after SFT."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from rich.table import Table

from mentorrl.config import ConfigError, RunConfig
from mentorrl.core.lifetime import frozen_heap
from mentorrl.eval.plots import plot_rl_curves, plot_step_metrics
from mentorrl.models.build import load_policy
from mentorrl.models.device import PrecisionChoice, choose_dtype, learner_placement, pin_choice, placement_problems
from mentorrl.models.hub import checkpoint_problem
from mentorrl.train.distributed import current as current_dp
from mentorrl.train.distributed import setup_distributed, shutdown_distributed
from mentorrl.train.models_init import adapt_policy, base_model_dir, build_config, build_tiny_model  # noqa: F401  (public here too)
from mentorrl.train.registry import get_stage, rl_stage_names, run_stage_by_name
from mentorrl.train.report import STEP_METRICS_PLOT, build_report, write_report
from mentorrl.train.stage_processes import UnitGate
from mentorrl.train.workspace import Workspace, evaluate, open_workspace

PREFLIGHT_TRAIN_TASKS = 64  # train tasks whose prompts are rendered by the preflight (plus every eval task)


def _checkpoint_fields(cfg: RunConfig) -> list[tuple[str, str]]:
    """(field, path) of every Hugging Face checkpoint the recipe's stages will load."""
    out: list[tuple[str, str]] = []
    if cfg.model.path is not None:
        out.append(("model.path", cfg.model.path))
    for stage in dict.fromkeys(cfg.recipe):  # each stage's own (StageSpec.needs)
        out += get_stage(stage).checkpoints(getattr(cfg, stage, None))
    return out


def preflight_config(cfg: RunConfig) -> None:
    """What can be checked without a model, before anything is written: every device and dtype
    setting can be honoured on this machine, the run directory can be one, every checkpoint the
    stages load is one (a directory, or a hub id in the local cache: nothing is downloaded), and the
    GRPO hard-pool state loads.

    Raises :class:`ConfigError` naming the field."""
    for field, why in placement_problems(cfg):
        raise ConfigError(f"{field}: {why}")
    run_dir = Path(cfg.run_dir)
    for p in (run_dir, *run_dir.parents):
        if p.exists() and not p.is_dir():
            raise ConfigError(f"run_dir {run_dir}: {p} is an existing file, not a directory")
    for name, path in _checkpoint_fields(cfg):
        problem = checkpoint_problem(name, path)  # a directory, or a hub id already in the local cache
        if problem is not None:
            raise ConfigError(problem)
    if "grpo" in cfg.recipe and cfg.grpo.hard_pool_state:
        from mentorrl.train.recipes.grpo import load_hard_pool

        try:
            load_hard_pool(cfg.grpo)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"grpo.hard_pool_state {cfg.grpo.hard_pool_state}: cannot be loaded ({e})") from None
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"run_dir {run_dir}: cannot be created ({e.strerror or e})") from None
    if not os.access(run_dir, os.W_OK | os.X_OK):
        raise ConfigError(f"run_dir {run_dir}: not writable")


def longest_prompt(ws: Workspace, tasks) -> tuple[int, str]:
    """(tokens, task id) of the longest prompt among ``tasks``, rendered with the run's tokenizer."""
    env = ws.make_env()
    try:
        return max(((len(ws.contract.prompt_ids(env.reset(t))), t.id) for t in tasks), default=(0, ""))
    finally:
        env.close()


def preflight_prompts(ws: Workspace) -> None:
    """Render the prompts the run will use (every evaluation task, a sample of training tasks) with
    the run's tokenizer; each must leave room in the episode's budget (:attr:`RolloutContract.max_total_tokens`:
    ``limits.max_total_tokens`` plus the system turn, at most the model's context).

    Raises :class:`ConfigError` naming the field (also for a split the environment does not have)."""
    cfg, contract = ws.cfg, ws.contract
    checks = [("train_split", cfg.train_split, lambda: ws.tasks(cfg.train_split, PREFLIGHT_TRAIN_TASKS, cfg.seed))]
    if cfg.eval.num_tasks > 0:
        checks.append(("eval.split", cfg.eval.split, lambda: ws.eval_tasks(cfg.eval.split, cfg.eval.num_tasks)))
    for field, split, draw in checks:
        try:
            tasks = draw()
        except ValueError as e:
            raise ConfigError(f"{field} {split!r}: {e}") from None
        tokens, task = longest_prompt(ws, tasks)
        if tokens >= contract.max_total_tokens:
            raise ConfigError(budget_problem(contract, tokens, f"the prompt of {split} task {task}"))


def budget_problem(contract: Any, tokens: int, what: str) -> str:
    """Why a prompt of ``tokens`` leaves no room for a turn under ``contract``'s budget."""
    limit, system = contract.limits.max_total_tokens, contract.system_tokens
    head = f"{what} is {tokens} tokens (the system turn's {system} included)"
    if contract.context_tokens is not None and limit + system > contract.context_tokens:
        return (
            f"limits.max_total_tokens={limit} leaves no room for a turn: {head}, and the model's context is "
            f"{contract.context_tokens} tokens; shorten the system prompt or tool descriptions "
            "(prompt.tool_descriptions=false) or use a model with a longer context"
        )
    return (
        f"limits.max_total_tokens={limit} leaves no room for a turn: {head}; set limits.max_total_tokens "
        f"above {tokens - system} (it counts everything but the system turn)"
    )


def _fmt_pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def before_after_table(rows: dict[str, dict[str, Any]]) -> Table:
    t = Table(title="Held-out evaluation")
    for col in ("checkpoint", "n", "task success", "95% CI", "tool success", "mean turns"):
        t.add_column(col, justify="right" if col != "checkpoint" else "left")
    for label, s in rows.items():
        lo, hi = s["success_ci95"]
        t.add_row(
            label,
            str(s["n"]),
            _fmt_pct(s["success"]),
            f"[{_fmt_pct(lo)}, {_fmt_pct(hi)}]",
            _fmt_pct(s["tool_success"]),
            f"{s['mean_turns']:.2f}",
        )
    return t


def stage_label(name: str) -> str:
    """A stage's short name in the evaluation table (its registered ``label``; the name when unregistered)."""
    try:
        return get_stage(name).label
    except ValueError:
        return name


def train(cfg: RunConfig, resume: bool = False, show_progress: bool = True) -> dict[str, Any]:
    """What ``mentorrl train`` and ``mentorrl demo`` run: the recipe (:func:`run_recipe`), in this
    process or, under ``distributed: {backend: ray, learner_actor: true}``, in a Ray actor
    (:mod:`mentorrl.train.learner_actor`). The walk from here to a stage's hooks is
    :mod:`mentorrl.train.loop`'s module doc."""
    if cfg.distributed.backend == "ray" and cfg.distributed.learner_actor:
        from mentorrl.train.learner_actor import run_in_learner_actor

        return run_in_learner_actor(run_recipe, cfg, resume=resume, show_progress=show_progress)
    if cfg.stage_processes:  # each stage and each evaluation in a fresh process, the run resumed there
        from mentorrl.train.stage_processes import run_in_stage_processes

        return run_in_stage_processes(run_recipe, cfg, resume=resume, show_progress=show_progress)
    return run_recipe(cfg, resume=resume, show_progress=show_progress)


def run_recipe(
    cfg: RunConfig, resume: bool = False, show_progress: bool = True, gate: UnitGate | None = None
) -> dict[str, Any]:
    """Run ``cfg.recipe`` (e.g. sft -> rft -> grpo), evaluating held-out success after every stage
    (unless ``eval.num_tasks`` is 0). A recipe of several evaluated stages ends with the change in
    held-out success from the first stage to the last; a one-stage recipe (or one without
    evaluation) ends with each stage's own numbers (:func:`stage_summary`).

    Writes ``report.json`` / ``report.md`` / ``report.html`` (evaluations, rollout budget, RFT rounds, reward
    audit, per-step rollout metrics) and, when an RL stage ran, ``curves.png`` and
    ``step_metrics.png``.

    Launched by torchrun with several ranks (``distributed.backend``, see
    :mod:`mentorrl.train.distributed`), every rank runs the stages' learners on its share of each
    batch; rank 0 alone builds the base model, audits the reward, evaluates and writes, and the
    result is returned on every rank.

    ``gate`` (:mod:`mentorrl.train.stage_processes`) is told the end of each unit of work (a stage, an
    evaluation) and may end the process there."""
    t0 = gate.started if gate is not None and gate.started is not None else time.time()  # the run's start
    preflight_config(cfg)
    owned = current_dp() is None
    dp = setup_distributed(cfg)
    try:
        with open_workspace(cfg, show_progress=show_progress, dp=dp) as ws:  # closing it frees its rollout engine
            return run_stages(ws, resume, t0, gate or UnitGate())
    finally:
        if dp is not None and owned:
            shutdown_distributed()


def report_precision(ws: Workspace, resume: bool = False) -> None:
    """``model.dtype: auto``: the dtype the start-up probe chose, and why, printed and written to
    RUN_DIR/precision.json (the rollout and teachers follow the learner unless they set their own).
    The probe is a timing, so the run decides once: rank 0 probes (a resumed run reuses the recorded
    choice instead) and every rank pins that choice (:func:`~mentorrl.models.device.pin_choice`)."""
    if ws.cfg.model.dtype != "auto":
        return
    device, path = learner_placement(ws.cfg).device, ws.run_dir / "precision.json"

    def decide() -> tuple[PrecisionChoice, bool]:
        if resume and path.exists():
            try:
                recorded = PrecisionChoice.from_dict(json.loads(path.read_text()))
                if recorded.device == str(device):
                    return recorded, True
            except ValueError:  # unreadable: probe again (and say so by the reason printed)
                pass
        return choose_dtype(device), False

    choice, kept = ws.on_main(decide)
    pin_choice(choice)
    how = "the run's recorded choice" if kept else choice.reason
    ws.console.print(f"model.dtype auto: {str(choice.dtype).removeprefix('torch.')} ({how})")
    if not kept:
        ws.on_main(lambda: path.write_text(json.dumps(choice.to_dict(), indent=1) + "\n"))


def run_stages(ws: Workspace, resume: bool, t0: float, gate: UnitGate | None = None) -> dict[str, Any]:
    """The recipe's stages in order on one policy: the base model (built, or ``model.path``), the
    preflight checks, then for each stage its registered runner (:func:`~mentorrl.train.registry.run_stage_by_name`:
    a :class:`~mentorrl.train.loop.Stage` on the loop, see :mod:`mentorrl.train.loop`) and the held-out
    evaluation after it; then the report (:func:`_finish_recipe`). ``gate`` is passed each unit's end
    (:func:`~mentorrl.train.stage_processes.recipe_units`, in that order); the preflight reward audit
    runs where ``gate.first``."""
    gate = gate or UnitGate()
    cfg, dp = ws.cfg, ws.dp
    con = ws.console
    con.rule("[bold]mentorrl " + " -> ".join(cfg.recipe))
    if dp is not None:
        con.print(f"data parallel: {dp.world_size} ranks ({dp.strategy.upper()}); rank 0 writes")
    report_precision(ws, resume)
    model_dir = ws.on_main(lambda: base_model_dir(ws))
    tokenizer, model = load_policy(model_dir, device=learner_placement(cfg).device)  # fp32 master weights
    ws.bind_tokenizer(tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    con.print(f"model: {model_dir} ({n_params / 1e6:.2f}M parameters, vocab {len(tokenizer)}), run dir: {ws.run_dir}")
    model = adapt_policy(ws, model, model_dir)
    preflight_prompts(ws)

    if cfg.audit.preflight and gate.first:
        ws.on_main(lambda: preflight_reward_audit(ws))

    rows: dict[str, dict[str, Any]] = {}
    evals: dict[str, dict[str, Any]] = {}
    other: dict[str, dict[str, Any]] = {}  # the final checkpoint on the final splits, on every rank as above
    done: list[str] = []
    with frozen_heap():  # the modules loaded so far live as long as the run: out of the collector's scans
        for stage in cfg.recipe:
            con.rule(get_stage(stage).title)
            run_stage_by_name(ws, stage, model, resume)
            gate.passed(stage)
            done.append(stage)
            if cfg.eval.num_tasks > 0:
                evals[stage] = evaluate(ws, model, stage, resume=resume)  # every rank: a launch's ranks share it
                rows[" + ".join(stage_label(s) for s in done)] = evals[stage]
                con.print(f"held-out success after {stage_label(stage)}: {_fmt_pct(evals[stage]['success'])}")
                gate.passed(f"eval {stage}")

        final = cfg.recipe[-1]
        for split in cfg.eval.final_splits if cfg.eval.num_tasks > 0 else []:
            other[split] = evaluate(ws, model, f"{final}_{split}", resume=resume, split=split)
            gate.passed(f"eval {final} on {split}")
    return ws.on_main(lambda: _finish_recipe(ws, rows, evals, other, t0))


def _finish_recipe(
    ws: Workspace,
    rows: dict[str, dict[str, Any]],
    evals: dict[str, dict[str, Any]],
    other: dict[str, dict[str, Any]],
    t0: float,
) -> dict[str, Any]:
    """After the stages and the final-split evaluations (``other``): the report, plots and the closing summary."""
    cfg, con = ws.cfg, ws.console
    if rows:
        con.print(before_after_table(rows))
    final = cfg.recipe[-1]
    for split, ev in other.items():
        note = " (stress set: words never used in training)" if split == "novel_wording" else ""
        con.print(f"{stage_label(final)} on {split}: {_fmt_pct(ev['success'])}{note}")
    records = ws.metrics.read()
    rl_at = max((i for i, s in enumerate(cfg.recipe) if s in rl_stage_names()), default=None)  # the last RL stage
    rl_stage = cfg.recipe[rl_at] if rl_at is not None else None
    pre_rl = cfg.recipe[rl_at - 1] if rl_at else None
    report = build_report(
        records,
        evals,
        cfg.audit,
        pre_rl_label=pre_rl,
        final_label=rl_stage,
        rl_stage=rl_stage or "grpo",
        other_splits=other,
    )
    if "step_metrics" in report:
        sm = report["step_metrics"]
        stage_records = [r for r in records if r.get("stage") == sm["stage"] and "tool_calls_per_traj" in r]
        plot_step_metrics(stage_records, ws.run_dir / STEP_METRICS_PLOT, stage_label(sm["stage"]))
        sm["plot"] = STEP_METRICS_PLOT
    json_path, md_path = write_report(ws.run_dir, report)
    _print_audit(con, report)
    result: dict[str, Any] = {"rows": rows, "report": str(json_path), "run_dir": str(ws.run_dir), "other_splits": other}
    if evals:
        result.update(before=evals[cfg.recipe[0]], after=evals[cfg.recipe[-1]])
    if rl_stage is not None:
        rl_records = [r for r in records if r.get("stage") == rl_stage]
        marks = {s: evals[s]["success"] for s in cfg.recipe if s in evals}
        result["plot"] = str(plot_rl_curves(rl_records, ws.run_dir / "curves.png", marks, stage_label(rl_stage)))
    if len(cfg.recipe) > 1 and evals:
        delta = evals[cfg.recipe[-1]]["success"] - evals[cfg.recipe[0]]["success"]
        con.print(
            f"{' -> '.join(cfg.recipe[1:])} changed held-out success by {100 * delta:+.1f} points "
            f"(after {cfg.recipe[0]}: {_fmt_pct(evals[cfg.recipe[0]]['success'])})"
        )
    else:  # one stage (nothing to compare it with), or no evaluation: each stage's own numbers
        for stage in dict.fromkeys(cfg.recipe):
            con.print(stage_summary(stage, [r for r in records if r.get("stage") == stage], evals.get(stage)))
    con.print(f"report: {md_path}; total time {time.time() - t0:.0f}s")
    return result


def stage_summary(stage: str, records: list[dict[str, Any]], ev: dict[str, Any] | None) -> str:
    """One line of a stage's own numbers: steps, its training loss / reward / success (first -> last
    logged step) and its held-out success with the 95% interval (or that evaluation was skipped)."""
    parts = [f"{stage}: {len(records)} steps"]
    for key, fmt in (("loss", "{:.3f}"), ("reward_mean", "{:.3f}"), ("task_success", "{:.1%}")):
        vals = [r[key] for r in records if isinstance(r.get(key), (int, float))]
        if vals:
            parts.append(f"{key.replace('_', ' ')} {fmt.format(vals[0])} -> {fmt.format(vals[-1])}")
    if ev is None:
        parts.append("held-out evaluation skipped (eval.num_tasks 0)")
    else:
        lo, hi = ev["success_ci95"]
        parts.append(f"held-out success {_fmt_pct(ev['success'])} [{_fmt_pct(lo)}, {_fmt_pct(hi)}] on {ev['n']} tasks")
    return ", ".join(parts)


class RewardAuditFailed(RuntimeError):
    """The run's reward pays an attack at least as well as honest work: training would optimise the hole."""


def audit_limits(run: Any) -> Any:
    """The preflight audit's episode limits: the run's, each at least the audit's own default (8 turns,
    4,096 tokens). The audit ranks the reward, so honest work must not be cut short by a run's small budget,
    and a run with a larger one (a τ² replay of 30 turns) gives the expert that room too."""
    from mentorrl.integrity.attacks import AttackAuditConfig

    base = AttackAuditConfig().limits
    return base.model_copy(
        update={
            "max_turns": max(run.max_turns, base.max_turns),
            "max_total_tokens": max(run.max_total_tokens, base.max_total_tokens),
        }
    )


def preflight_reward_audit(ws: Workspace) -> dict[str, Any] | None:
    """The notes' first debugging step, done before any training: does the reward rank every
    scripted attack below honest work (and below 0 when it breaks a hard constraint)?

    Runs the environment's reward-hacking suite with this run's reward weights and tokenizer,
    writes ``reward_audit.json`` (with the task source's ``report`` where it keeps one, e.g. the tau2
    tasks left out of training) and raises :class:`RewardAuditFailed` when an attack wins.
    Environments without a registered suite are skipped with a note.
    """
    from mentorrl.integrity.attacks import AttackAuditConfig, audit_env, get_attacks

    name = ws.cfg.env.name
    try:
        get_attacks(name)
    except ValueError:
        ws.console.print(f"[yellow]reward audit: no reward-hacking suite registered for {name!r}; skipped[/yellow]")
        return None
    config = AttackAuditConfig(weights=ws.cfg.reward, seed=ws.cfg.seed, limits=audit_limits(ws.cfg.limits))
    report = audit_env(name, ws.tokenizer, config, entry=ws.env_entry)
    data = report.to_dict()
    screen = getattr(ws.env_entry.make_tasks(), "report", None)  # e.g. tau2: the tasks left out, and why
    if isinstance(screen, dict):
        data["task_source"] = screen
    (ws.run_dir / "reward_audit.json").write_text(json.dumps(data, indent=2))
    failed = [f"{a.name}: {a.reason}" for a in report.attacks if not a.passed]
    if report.honest_failures:
        failed.append(
            f"the honest expert failed {len(report.honest_failures)} task(s), e.g. {report.honest_failures[0]}"
        )
    if report.honest_unfit:
        ws.console.print(
            f"[yellow]reward audit: the run's limits cut the honest expert short on {len(report.honest_unfit)} "
            f"task(s), e.g. {report.honest_unfit[0]} (not used as a baseline)[/yellow]"
        )
    if failed:
        raise RewardAuditFailed(
            "reward audit failed; refusing to train on a reward that pays for hacks:\n  "
            + "\n  ".join(failed)
            + "\n(set audit.preflight=false to train anyway)"
        )
    scored = [a for a in report.attacks if a.max_reward is not None and a.honest_min is not None]
    closest = min(scored, key=lambda a: a.honest_min - a.max_reward)
    ws.console.print(
        f"reward audit: {len(report.attacks)} attacks all score below honest work on the same tasks "
        f"(closest: {closest.name} {closest.max_reward:.2f} vs honest {closest.honest_min:.2f})"
    )
    return data


def _print_audit(con, report: dict[str, Any]) -> None:
    a = report["audit"]
    con.print(
        f"reward audit: {a['flagged_high_reward_failures']} high-reward failures flagged, "
        f"{a['rewards_clipped']} rewards clipped, {a['gap_warnings']} gap warnings"
    )
    e2e = a.get("end_to_end")
    if e2e and e2e["warning"]:
        con.print(
            f"[bold red]warning:[/bold red] training reward rose {e2e['reward_delta']:+.3f} while held-out "
            f"success changed {100 * e2e['success_delta']:+.1f} points -- check for reward hacking"
        )
