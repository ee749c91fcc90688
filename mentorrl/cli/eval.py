"""`mentorrl eval` (agent evaluation on named sets) and `mentorrl gate` (regression gate).

Wire them into the main app with ``register(app)``.

``--set`` takes both evaluation sets and configuration overrides: a value that names a set
(``golden``, ``hidden``, ``heldout``, ``novel_wording``, ``regression:PATH``, ``production:PATH``) selects it,
anything else must be a ``key.sub=value`` override of the run config, as in every other
command.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any, Optional, Sequence

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from mentorrl.cli_common import console, err, load_run_config, quiet_transformers
from mentorrl.eval.agent import AgentReport, GroupMetrics, agent_metrics
from mentorrl.eval.gate import GATED_KINDS, GateConfig, GateDecision, GateError, gate_decision, set_results
from mentorrl.eval.judge import attach_judgements, judge_names, make_judge
from mentorrl.eval.sets import (
    AgentEvalConfig,
    EvalSet,
    EvalSetSpec,
    load_eval_set,
    looks_like_set,
    rollout_samples,
    tasks_from_trajectories,
)
from mentorrl.models.gguf import is_gguf_source
from mentorrl.trajectory import Trajectory, write_jsonl

SUMMARY_NAME = "eval_summary.json"


# ------------------------------------------------------------ option parsing ------
def parse_set_options(values: Sequence[str], option: str = "--on") -> list[EvalSetSpec]:
    """``--on`` values -> evaluation sets (golden, hidden, heldout, novel_wording, regression:PATH, production:PATH)."""
    specs: list[EvalSetSpec] = []
    for v in values:
        if not looks_like_set(v):
            raise ValueError(
                f"{option} {v!r} is not an evaluation set; use golden, hidden, heldout, novel_wording, "
                "regression:PATH or production:PATH (config overrides go in --set key=value)"
            )
        specs.append(EvalSetSpec.parse(v))
    return specs


def parse_ks(text: str | None) -> list[int] | None:
    """``"1,2,4"`` -> ``[1, 2, 4]``."""
    if text is None:
        return None
    try:
        ks = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise ValueError(f"--k must be a comma-separated list of integers, not {text!r}") from None
    if not ks or any(k < 1 for k in ks):
        raise ValueError(f"--k values must be integers >= 1, not {text!r}")
    return ks


def agent_eval_config(cfg: Any, specs: list[EvalSetSpec], **options: Any) -> AgentEvalConfig:
    """The run config's agent-eval section (when it has one) with the command-line options applied.

    ``options`` whose value is None are left as configured; temperature and batch size
    default to the run config's ``eval`` section.
    """
    base = getattr(cfg, "agent_eval", None)
    data = (
        base.model_dump()
        if isinstance(base, AgentEvalConfig)
        else {"temperature": cfg.eval.temperature, "batch_size": cfg.eval.batch_size, "stratify": cfg.eval.stratify}
    )
    if specs:
        data["sets"] = [s.model_dump() for s in specs]
    data.update({k: v for k, v in options.items() if v is not None})
    return AgentEvalConfig.model_validate(data)


# ------------------------------------------------------------ evaluation ------
def _safe(name: str) -> str:
    return re.sub(r"[^\w.-]+", "-", name).strip("-") or "set"


def set_fingerprint(eset: EvalSet, ecfg: AgentEvalConfig, sampling: dict[str, Any]) -> str:
    """Identity of what was evaluated: the tasks (ids, seeds, prompts), samples, seed, batch and sampling.

    Two evaluations with the same fingerprint rolled out the same tasks with the same
    sampling seeds, so their success rates are comparable checkpoint against checkpoint.
    """
    if eset.recorded is not None:
        return eset.task_fingerprint()
    h = hashlib.sha256(eset.task_fingerprint().encode())
    h.update(json.dumps([ecfg.samples_per_task, eset.seed, ecfg.batch_size, sampling], sort_keys=True).encode())
    return h.hexdigest()[:16]


def set_record(
    eset: EvalSet, report: AgentReport, ecfg: AgentEvalConfig, sampling: dict[str, Any], trajectories_file: str
) -> dict[str, Any]:
    """One set's entry in the evaluation summary JSON."""
    return {
        "kind": eset.kind,
        "source": eset.source,
        "seed": eset.seed,
        "n_tasks": report.overall.n_tasks,
        "samples_per_task": ecfg.samples_per_task if eset.recorded is None else report.overall.samples_per_task,
        "recorded": eset.recorded is not None,
        "fingerprint": set_fingerprint(eset, ecfg, sampling),
        "sampling": sampling if eset.recorded is None else None,
        "trajectories": trajectories_file,
        "metrics": report.model_dump(mode="json"),
    }


def evaluate_checkpoint(
    model_dir: Path, cfg: Any, ecfg: AgentEvalConfig, out_dir: Path, show_progress: bool = True
) -> dict[str, Any]:
    """Roll out (or read) every set, judge, compute agent metrics; write the summary and trajectories.

    Returns the summary written to ``out_dir/eval_summary.json``.
    """
    from mentorrl.core.lifetime import frozen_heap
    from mentorrl.models.build import load_policy
    from mentorrl.models.device import rollout_placement
    from mentorrl.train.progress import count_progress
    from mentorrl.train.workspace import open_workspace

    judge = make_judge(ecfg.judge)
    ws = open_workspace(cfg.model_copy(update={"run_dir": str(out_dir)}), show_progress=show_progress)
    place = rollout_placement(cfg)  # evaluation only decodes: load straight onto the rollout's device and dtype
    tokenizer, model = load_policy(model_dir, dtype=place.dtype, device=place.device)
    ws.bind_tokenizer(tokenizer)
    rollout = ws.rollout.with_temperature(ecfg.temperature)
    sampling = rollout.contract.sampling_dict()
    source = ws.env_entry.make_tasks()
    summary: dict[str, Any] = {
        "model": str(model_dir),
        "env": cfg.env.name,
        "config": ecfg.model_dump(mode="json"),
        "sets": {},
    }
    with frozen_heap():  # the loaded modules live as long as the evaluation: out of the collector's scans
        for spec in ecfg.sets:
            eset = load_eval_set(spec, source, ecfg)
            if eset.recorded is not None:
                trajs: list[Trajectory] = eset.recorded
                tasks = tasks_from_trajectories(trajs, lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
            else:
                tasks = eset.tasks
                with count_progress(ws, f"eval {eset.name}", len(tasks) * ecfg.samples_per_task) as advance:
                    trajs = rollout_samples(
                        model,
                        rollout,
                        tasks,
                        ecfg.samples_per_task,
                        seed=eset.seed,
                        batch_size=ecfg.batch_size,
                        on_batch=advance,
                    )
            if judge is not None:  # recorded verdicts are kept; only unjudged trajectories are judged
                attach_judgements(judge, tasks, [t for t in trajs if t.judge is None])
            report = agent_metrics(trajs, ecfg.k, ecfg.judge_threshold)
            traj_file = f"trajectories-{_safe(eset.name)}.jsonl"
            write_jsonl(out_dir / traj_file, trajs)
            summary["sets"][eset.name] = set_record(eset, report, ecfg, sampling, traj_file)
    if judge is not None and callable(getattr(judge, "metrics", None)):  # the LLM judge: calls, skips, cache
        summary["judge_stats"] = judge.metrics()
    (out_dir / SUMMARY_NAME).write_text(json.dumps(summary, indent=2))
    ws.close()
    return summary


# ------------------------------------------------------------ tables ------
def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _p(x: float | None) -> str:
    """A share as a bare percentage (the column header says %)."""
    return "-" if x is None else f"{100 * x:.1f}"


def _sections(report: AgentReport) -> list[list[tuple[str, GroupMetrics]]]:
    return [[("overall", report.overall)], list(report.by_family.items()), list(report.by_difficulty.items())]


def _table(title: str, cols: list[str]) -> Table:
    t = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left", collapse_padding=True)
    for c in cols:
        t.add_column(c, justify="left" if c == "group" else "right", no_wrap=True)
    return t


def _fill(t: Table, report: AgentReport, row) -> Table:
    for i, section in enumerate(_sections(report)):
        if i:
            t.add_section()
        for label, m in section:
            t.add_row(label, *row(m))
    return t


def outcome_table(name: str, report: AgentReport, ks: Sequence[int]) -> Table:
    """Success with its interval, pass@k and pass^k (all in %), overall / per family / per difficulty."""
    shown = [k for k in ks if k in report.overall.pass_at_k and k != 1]
    cols = ["group", "n", "success", "95% CI", *[f"pass@{k}" for k in shown], *[f"pass^{k}" for k in shown]]

    def row(m: GroupMetrics) -> list[str]:
        lo, hi = m.success_ci95
        return [
            str(m.n),
            _p(m.success),
            f"{_p(lo)}-{_p(hi)}",
            *[_p(m.pass_at_k.get(k)) for k in shown],
            *[_p(m.pass_hat_k.get(k)) for k in shown],
        ]

    return _fill(_table(f"{name}: outcome (%; success = pass@1)", cols), report, row)


def safety_table(name: str, report: AgentReport) -> Table:
    """Hard-constraint violations and, when a judge ran, its agreement with the verifier."""
    judged = report.overall.judge is not None
    cols = ["group", "violations"] + (["judge agrees", "kappa", "judge yes, verifier no"] if judged else [])

    def row(m: GroupMetrics) -> list[str]:
        out = [_p(m.violation_rate)]
        if judged:
            j = m.judge
            out += (
                ["-", "-", "-"]
                if j is None
                else [_p(j.agreement), "-" if j.kappa is None else f"{j.kappa:.2f}", str(j.judge_pass_verifier_fail)]
            )
        return out

    return _fill(_table(f"{name}: safety and judge (%)", cols), report, row)


def tool_table(name: str, report: AgentReport) -> Table:
    """Tool use: success, invalid calls, loops and recovery after a tool error."""
    cols = ["group", "calls", "tool ok", "invalid", "loops", "with error", "recovered"]

    def row(m: GroupMetrics) -> list[str]:
        return [
            str(m.tool_calls),
            _p(m.tool_success),
            _p(m.invalid_call_rate),
            _p(m.loop_rate),
            str(m.n_with_error),
            _p(m.recovery_rate),
        ]

    return _fill(_table(f"{name}: tool use (%; recovered = share of episodes with an error)", cols), report, row)


def cost_table(name: str, report: AgentReport) -> Table:
    """Mean steps, tokens and latency per episode."""
    cols = ["group", "steps", "tokens", "policy tokens", "latency s"]

    def row(m: GroupMetrics) -> list[str]:
        return [
            f"{m.mean_steps:.2f}",
            f"{m.mean_total_tokens:.0f}",
            f"{m.mean_policy_tokens:.0f}",
            f"{m.mean_latency_s:.1f}",
        ]

    return _fill(_table(f"{name}: cost (means per episode)", cols), report, row)


def print_summary(summary: dict[str, Any], out: Console = console) -> None:
    ks = summary["config"]["k"]
    for name, s in summary["sets"].items():
        report = AgentReport.model_validate(s["metrics"])
        out.print(outcome_table(name, report, ks))
        out.print(safety_table(name, report))
        out.print(tool_table(name, report))
        out.print(cost_table(name, report))
    stats = summary.get("judge_stats", {})
    if stats.get("judge_skipped"):
        out.print(
            f"judge: no verdict for {stats['judge_skipped']} of {stats.get('judge_calls', '?')} trajectories "
            "(failed or invalid replies); they are left out of the judge agreement"
        )


def gate_table(decision: GateDecision) -> Table:
    t = Table(title="Regression gate")
    for c in ("set", "baseline", "new", "change", "tolerance", "verdict"):
        t.add_column(c, justify="left" if c in ("set", "verdict") else "right")
    for c in decision.comparisons:
        delta = "n/a" if c.delta is None else f"{100 * c.delta:+.1f} pts"
        t.add_row(
            c.name,
            _pct(c.baseline),
            _pct(c.new),
            delta,
            f"{100 * c.tolerance:.1f} pts",
            "[green]pass[/green]" if c.passed else "[red]fail[/red]",
        )
    return t


# ------------------------------------------------------------ commands ------
ConfigOpt = typer.Option(None, "--config", "-c", exists=True, dir_okay=False, help="YAML recipe (default: demo)")
SetOpt = typer.Option([], "--set", help="override a config field: --set sampling.temperature=0 (repeatable)")
OnOpt = typer.Option(
    [],
    "--on",
    help="evaluation set: golden | hidden | heldout | novel_wording (stress set: unseen words) | "
    "regression:PATH | production:PATH (repeatable)",
)


def _fail(msg: str) -> typer.Exit:
    err.print(f"[red]{escape(msg)}[/red]")
    return typer.Exit(2)


def eval_command(
    model_dir: Path = typer.Argument(
        ..., help="HF checkpoint directory, or a .gguf file / short name (smollm2) to import first"
    ),
    on: list[str] = OnOpt,
    set_: list[str] = SetOpt,
    samples: Optional[int] = typer.Option(None, "--samples", min=1, help="samples per task (default 1)"),
    k: Optional[str] = typer.Option(None, "--k", help="k of pass@k and pass^k, e.g. 1,2,4 (k > samples is skipped)"),
    judge: Optional[str] = typer.Option(None, "--judge", help=f"judge: {', '.join(judge_names())} or none"),
    num_tasks: Optional[int] = typer.Option(
        None, "--num-tasks", min=1, help="tasks per generated set (default: golden's full set, else 100)"
    ),
    seed: Optional[int] = typer.Option(None, "--seed", help="task and sampling seed (default 0)"),
    config: Optional[Path] = ConfigOpt,
    out: Optional[Path] = typer.Option(None, "--out", help="output directory (default runs/eval-MODEL_DIR_NAME)"),
) -> None:
    """Evaluate a checkpoint on golden / hidden / held-out / novel_wording / regression sets or recorded production
    samples.

    Prints success with a 95% interval, pass@k and pass^k, tool success, invalid calls, loops,
    recovery, violations, cost and judge agreement, overall, per family and per difficulty;
    writes OUT/eval_summary.json and one trajectory JSONL per set."""
    quiet_transformers()
    if not model_dir.is_dir() and not is_gguf_source(model_dir):  # a GGUF source is imported by load_policy
        raise _fail(f"MODEL_DIR {model_dir} is not a directory (nor a .gguf file)")
    out_dir = out or Path("runs") / f"eval-{model_dir.name}"
    try:
        specs, overrides = parse_set_options(on), list(set_)
        cfg = load_run_config(config, overrides, str(out_dir))
        ecfg = agent_eval_config(
            cfg, specs, samples_per_task=samples, k=parse_ks(k), judge=judge, num_tasks=num_tasks, seed=seed
        )
        summary = evaluate_checkpoint(model_dir, cfg, ecfg, out_dir)
    except (ValueError, OSError) as e:  # pydantic.ValidationError is a ValueError
        raise _fail(str(e)) from None
    print_summary(summary)
    console.print(f"wrote {out_dir / SUMMARY_NAME}")


def _read_summary(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise GateError(f"cannot read evaluation summary {path}: {e}") from None
    set_results(data, str(path))  # validates the shape
    return data


def _parse_set_tolerances(values: Sequence[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for v in values:
        name, sep, tol = v.rpartition("=")
        try:
            if not sep or not name:
                raise ValueError
            out[name] = float(tol)
        except ValueError:
            raise GateError(f"--set-tolerance {v!r} must look like NAME=TOLERANCE, e.g. golden=0.05") from None
    return out


def _evaluate_sides(
    to_eval: dict[str, Path],
    summaries: dict[str, dict[str, Any]],
    on: list[str],
    overrides: list[str],
    config: Optional[Path],
    root: Path,
    *,
    samples: Optional[int],
    num_tasks: Optional[int],
    seed: Optional[int],
) -> None:
    """Evaluate the gate's checkpoint sides (``to_eval``) into ``summaries``: on the sets, seeds and samples
    of the summary given for the other side when there is one, else on golden plus the ``--on`` sets."""
    quiet_transformers()
    specs = parse_set_options(on)
    bad = [s.label for s in specs if s.kind != "regression"]
    if bad:
        raise GateError(f"the gate evaluates golden plus regression:PATH sets; not {bad}")
    if specs and summaries:
        raise GateError("with a summary on one side, the sets come from that summary; drop --on regression:...")
    cfg = load_run_config(config, overrides, str(root))
    recorded = next(iter(summaries.values()), None)
    if recorded is not None:  # the other side fixes sets, seeds and samples; only gated sets are rolled out
        ecfg = AgentEvalConfig.model_validate(recorded["config"])
        ecfg = AgentEvalConfig.model_validate(
            {**ecfg.model_dump(), "judge": "none", "sets": [s.model_dump() for s in ecfg.sets if s.kind in GATED_KINDS]}
        )
    else:
        ecfg = agent_eval_config(
            cfg,
            [EvalSetSpec(kind="golden"), *specs],
            samples_per_task=samples,
            num_tasks=num_tasks,
            seed=seed,
            judge="none",
        )
    for side, model_dir in to_eval.items():
        console.rule(f"{side}: {model_dir}")
        summaries[side] = evaluate_checkpoint(model_dir, cfg, ecfg, root / side)


def gate_command(
    new: Optional[Path] = typer.Argument(None, help="new checkpoint directory (or use --new-summary)"),
    baseline: Optional[Path] = typer.Option(None, "--baseline", help="baseline checkpoint directory"),
    new_summary: Optional[Path] = typer.Option(
        None, "--new-summary", dir_okay=False, help="eval_summary.json of the new checkpoint, instead of evaluating"
    ),
    baseline_summary: Optional[Path] = typer.Option(
        None, "--baseline-summary", dir_okay=False, help="eval_summary.json of the baseline, instead of evaluating"
    ),
    on: list[str] = typer.Option([], "--on", help="regression:PATH set to gate on besides golden (repeatable)"),
    set_: list[str] = SetOpt,
    tolerance: float = typer.Option(
        0.02, "--tolerance", min=0.0, max=1.0, help="largest allowed absolute drop in success (0.02 = 2 points)"
    ),
    set_tolerance: list[str] = typer.Option([], "--set-tolerance", help="NAME=TOL per-set tolerance; repeatable"),
    samples: Optional[int] = typer.Option(None, "--samples", min=1, help="samples per task"),
    num_tasks: Optional[int] = typer.Option(None, "--num-tasks", min=1, help="golden tasks (default: full set)"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    config: Optional[Path] = ConfigOpt,
    out: Optional[Path] = typer.Option(None, "--out", help="output directory (default runs/gate-NEW_NAME)"),
) -> None:
    """Accept (exit 0) or reject (exit 1) a new checkpoint against a baseline on the golden and regression sets.

    Each side is a checkpoint to evaluate or a summary written by `mentorrl eval`. When one
    side is a summary, the other is evaluated with that summary's sets, seed and samples, so
    both see the same tasks with the same seeds."""
    if (new is None) == (new_summary is None) or (baseline is None) == (baseline_summary is None):
        raise _fail("give the new side as NEW or --new-summary, and the baseline as --baseline or --baseline-summary")
    try:
        per_set = _parse_set_tolerances(set_tolerance)
        GateConfig(tolerance=tolerance, per_set=per_set)  # validates the ranges
        summaries: dict[str, dict[str, Any]] = {}
        if new_summary is not None:
            summaries["new"] = _read_summary(new_summary)
        if baseline_summary is not None:
            summaries["baseline"] = _read_summary(baseline_summary)
        to_eval = {side: d for side, d in (("new", new), ("baseline", baseline)) if d is not None}
        if to_eval:
            root = out or Path("runs") / f"gate-{(new or new_summary).name}"  # type: ignore[union-attr]
            _evaluate_sides(
                to_eval, summaries, on, list(set_), config, root, samples=samples, num_tasks=num_tasks, seed=seed
            )
        decision = gate_decision(
            set_results(summaries["new"], "new"),
            set_results(summaries["baseline"], "baseline"),
            tolerance=tolerance,
            per_set=per_set,
        )
    except (ValueError, OSError) as e:  # GateError and pydantic.ValidationError are ValueErrors
        raise _fail(str(e)) from None
    console.print(gate_table(decision))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "gate.json").write_text(decision.model_dump_json(indent=2))
    if decision.accepted:
        console.print(f"[green]{escape(decision.summary())}[/green]")
        return
    console.print(f"[red]{escape(decision.summary())}[/red]")
    raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add the ``eval`` and ``gate`` commands to ``app``."""
    app.command("eval")(eval_command)
    app.command("gate")(gate_command)


__all__ = [
    "agent_eval_config",
    "evaluate_checkpoint",
    "eval_command",
    "gate_command",
    "gate_table",
    "outcome_table",
    "parse_ks",
    "print_summary",
    "cost_table",
    "safety_table",
    "tool_table",
    "register",
    "set_fingerprint",
    "parse_set_options",
]
