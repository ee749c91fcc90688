"""The run report: evaluations, rollout budget per stage, RFT rounds, the reward audit and the
per-step rollout metrics (tool calls, malformed calls, finish reasons, turns, tokens, seconds,
CPU utilisation) of the RL stage, with their plot.

Built from ``metrics.jsonl`` and the evaluation summaries, so it can be rebuilt for any run
directory after the fact (``build_report``) and is written as ``report.json`` + ``report.md``, with
``report.html`` beside them: one self-contained page (inline CSS and SVG, no script, nothing fetched)
with the training curves, the reward breakdown over steps (from the trajectory samples), the
failure-type mix of each evaluation and the review queue's top cases (:func:`write_report_html`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from mentorrl.train.audit import AuditConfig
from mentorrl.train.registry import rl_stage_names


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def end_to_end_gap(
    rl: list[dict[str, Any]], before: float | None, after: float | None, audit: AuditConfig
) -> dict[str, Any] | None:
    """Training reward over the first vs the last window of an RL stage, against held-out success before vs after."""
    if not rl or before is None or after is None:
        return None
    w = audit.reward_window
    first = _mean([r["reward_mean"] for r in rl[:w]])
    last = _mean([r["reward_mean"] for r in rl[-w:]])
    d_reward, d_success = last - first, after - before
    warn = d_reward > audit.reward_rise and d_success <= audit.success_rise
    return {
        "reward_first_window": first,
        "reward_last_window": last,
        "reward_delta": d_reward,
        "heldout_before": before,
        "heldout_after": after,
        "success_delta": d_success,
        "warning": warn,
    }


def async_summary(sao: list[dict[str, Any]]) -> dict[str, Any] | None:
    """SAO's asynchronous bookkeeping over the stage: policy-lag histogram, stale data, masking, throughput."""
    if not sao:
        return None
    hist: dict[str, int] = {}
    for r in sao:
        for lag, n in (r.get("policy_lag_hist") or {}).items():
            hist[lag] = hist.get(lag, 0) + int(n)
    updated = [r for r in sao if r.get("actor_updated")]
    return {
        "policy_lag_hist": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
        "trajectories": int(sum(r.get("rollouts", 0) for r in sao)),
        "stale_dropped": int(sum(r.get("stale_dropped", 0) for r in sao)),
        "stale_downweighted": int(sum(r.get("stale_downweighted", 0) for r in sao)),
        "masked_frac_mean": _mean([r.get("masked_frac", 0.0) for r in updated]),
        "traj_per_s": sao[-1].get("traj_per_s"),
        "policy_version": sao[-1].get("policy_version"),
    }


RFT_ROUND_KEYS = (
    "step",
    "positive_task_rate",
    "trajectory_success_rate",
    "samples_to_success",
    "tasks_in_band",
    "selected",
    "dataset_size",
    "rollouts",
)
EVAL_KEYS = ("n", "success", "success_ci95", "mean_reward", "violation_rate", "tool_success", "mean_turns")


def _stage_totals(by_stage: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Steps, rollouts and seconds of each stage."""
    return {
        name: {
            "steps": len(rs),
            "rollouts": int(sum(r.get("rollouts", 0) for r in rs)),
            "seconds": sum(r.get("step_s", 0.0) for r in rs),
        }
        for name, rs in by_stage.items()
    }


def _audit_section(
    rl: list[dict[str, Any]],
    every_rl: list[dict[str, Any]],
    evals: dict[str, dict[str, Any]],
    audit: AuditConfig,
    pre_rl_label: str | None,
    final_label: str | None,
) -> dict[str, Any]:
    """The reward audit: debugger flags and clipped rewards over every RL stage, the gap checks
    of ``rl`` and its end-to-end gap between the ``pre_rl_label`` and ``final_label`` evaluations."""
    checks = [r for r in rl if "heldout_success" in r]
    return {
        "flagged_high_reward_failures": int(sum(r.get("reward_flagged", 0) for r in every_rl)),
        "rewards_clipped": int(sum(r.get("reward_clipped", 0) for r in every_rl)),
        "rewards_nonfinite": int(sum(r.get("reward_nonfinite", 0) for r in every_rl)),
        "gap_checks": [
            {
                "step": r["step"],
                "heldout_success": r["heldout_success"],
                "reward_mean": r.get("reward_mean"),
                "warning": bool(r.get("gap_warning")),
            }
            for r in checks
        ],
        "gap_warnings": int(sum(bool(r.get("gap_warning")) for r in checks)),
        "end_to_end": end_to_end_gap(
            rl,
            evals.get(pre_rl_label, {}).get("success") if pre_rl_label else None,
            evals.get(final_label, {}).get("success") if final_label else None,
            audit,
        ),
    }


def _step_metrics_stage(by_stage: dict[str, list[dict[str, Any]]], rl_stage: str) -> str | None:
    """``rl_stage`` if it ran, else the last stage that logged per-step rollout metrics."""
    if by_stage.get(rl_stage):
        return rl_stage
    return next((n for n in reversed(list(by_stage)) if any("tool_calls_per_traj" in r for r in by_stage[n])), None)


def build_report(
    records: list[dict[str, Any]],
    evals: dict[str, dict[str, Any]],
    audit: AuditConfig,
    pre_rl_label: str | None = None,
    final_label: str | None = None,
    rl_stage: str = "grpo",
    other_splits: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """``rl_stage``'s records feed the gap checks and the end-to-end gap; the reward audit
    counts cover every RL stage of the run. ``other_splits``: the final checkpoint's evaluations
    on other splits (hidden, the novel_wording stress set), reported beside the held-out ones."""
    by_stage: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_stage.setdefault(r.get("stage", "?"), []).append(r)
    rl = by_stage.get(rl_stage, [])
    every_rl = [r for name in rl_stage_names() for r in by_stage.get(name, [])]
    report: dict[str, Any] = {
        "evals": {k: {key: v.get(key) for key in EVAL_KEYS} for k, v in evals.items()},
        "other_splits": {k: {key: v.get(key) for key in EVAL_KEYS} for k, v in (other_splits or {}).items()},
        "stages": _stage_totals(by_stage),
        "rft_rounds": [{k: r.get(k) for k in RFT_ROUND_KEYS} for r in by_stage.get("rft", [])],
        "audit": _audit_section(rl, every_rl, evals, audit, pre_rl_label, final_label),
    }
    step_stage = _step_metrics_stage(by_stage, rl_stage)
    summary = step_metrics_summary(step_stage, by_stage.get(step_stage, [])) if step_stage else None
    if summary is not None:
        report["step_metrics"] = summary
    if "sao" in by_stage:
        report["async"] = async_summary(by_stage["sao"])
    if "opd" in by_stage:
        report["opd"] = opd_summary(by_stage["opd"])
    return report


STEP_METRICS = (
    "tool_calls_per_traj",
    "malformed_call_rate",
    "finish_answer",
    "finish_max_turns",
    "finish_max_tokens",
    "finish_length",
    "mean_turns",
    "mean_policy_tokens",
    "rollout_s",
    "update_s",
    "step_s",
    "cpu_util",
    "rollout_cpu_util",
)
STEP_METRIC_LABELS = {
    "tool_calls_per_traj": "tool calls per trajectory",
    "malformed_call_rate": "malformed-call rate",
    "finish_answer": "finished with an answer",
    "finish_max_turns": "finished at the turn limit",
    "finish_max_tokens": "finished at the context budget",
    "finish_length": "finished with a turn cut at max_new_tokens",
    "mean_turns": "turns",
    "mean_policy_tokens": "policy tokens per trajectory",
    "rollout_s": "rollout seconds",
    "update_s": "update seconds",
    "step_s": "step seconds",
    "cpu_util": "CPU utilisation (step)",
    "rollout_cpu_util": "CPU utilisation (rollout)",
}
STEP_METRICS_PLOT = "step_metrics.png"


def step_metrics_summary(stage: str, records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """First, last and mean of each per-step rollout metric of ``stage`` (those it logged);
    the run report shows them next to the plot (:func:`mentorrl.eval.plots.plot_step_metrics`)."""
    rows = [r for r in records if "tool_calls_per_traj" in r]
    if not rows:
        return None
    keys = [k for k in STEP_METRICS if any(isinstance(r.get(k), (int, float)) for r in rows)]

    def vals(k: str) -> list[float]:
        return [float(r[k]) for r in rows if isinstance(r.get(k), (int, float))]

    return {
        "stage": stage,
        "steps": len(rows),
        "cpu_cores": rows[-1].get("cpu_cores"),
        "first": {k: vals(k)[0] for k in keys},
        "last": {k: vals(k)[-1] for k in keys},
        "means": {k: _mean(vals(k)) for k in keys},
    }


def opd_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """What the OPD stage spent and distilled: student rollout tokens, teacher tokens read,
    alignment failures, the reverse-KL estimate at the start and end, the distilled share."""
    last = records[-1]
    shares = [r["distilled_token_share"] for r in records if "distilled_token_share" in r]
    return {
        "steps": len(records),
        "student_rollout_tokens": int(last.get("rollout_tokens_total", 0)),
        "teacher_tokens": int(last.get("teacher_tokens_total", 0)),
        "alignment_failures": int(sum(r.get("alignment_failures", 0) for r in records)),
        "reverse_kl_first": records[0].get("opd_reverse_kl"),
        "reverse_kl_last": last.get("opd_reverse_kl"),
        "distilled_token_share": sum(shares) / len(shares) if shares else None,
        "heldout_checks": [
            {
                "step": r["step"],
                "rollout_tokens": r.get("rollout_tokens_total"),
                "heldout_success": r["heldout_success"],
            }
            for r in records
            if "heldout_success" in r
        ],
    }


def _pct(x: Any) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _num(x: Any) -> str:
    return "-" if x is None else f"{x:g}"


def _eval_row(label: str, e: dict[str, Any]) -> str:
    """``| label | n | success | 95% CI | mean reward | violations |`` for one evaluation summary."""
    lo, hi = e.get("success_ci95") or (None, None)
    return (
        f"| {label} | {e.get('n')} | {_pct(e.get('success'))} | [{_pct(lo)}, {_pct(hi)}] | "
        f"{(e.get('mean_reward') or 0):.3f} | {_pct(e.get('violation_rate'))} |"
    )


STEP_METRICS_PCT = frozenset(
    {
        "malformed_call_rate",
        "finish_answer",
        "finish_max_turns",
        "finish_max_tokens",
        "finish_length",
        "cpu_util",
        "rollout_cpu_util",
    }
)


def _md_evals(report: dict[str, Any]) -> list[str]:
    """The held-out evaluations, then the final checkpoint's on other splits (if any)."""
    lines = [
        "# Run report",
        "",
        "## Held-out evaluation",
        "",
        "| checkpoint | n | success | 95% CI | mean reward | violations |",
        "|---|---|---|---|---|---|",
    ]
    for label, e in report["evals"].items():
        lines.append(_eval_row(label, e))
    if report.get("other_splits"):
        lines += [
            "",
            "## Final checkpoint on other splits",
            "",
            "`novel_wording` is a stress set worded with words training never uses; it is not the headline.",
            "",
            "| split | n | success | 95% CI | mean reward | violations |",
            "|---|---|---|---|---|---|",
        ]
        for split, e in report["other_splits"].items():
            lines.append(_eval_row(split, e))
    return lines


def _md_stages(report: dict[str, Any]) -> list[str]:
    """Steps, rollouts and seconds per stage, then the RFT rounds (if any)."""
    lines = ["", "## Stages", "", "| stage | steps | rollouts | seconds |", "|---|---|---|---|"]
    for name, s in report["stages"].items():
        lines.append(f"| {name} | {s['steps']} | {s['rollouts']} | {s['seconds']:.0f} |")
    if report["rft_rounds"]:
        lines += [
            "",
            "## RFT rounds",
            "",
            "| round | positive-task rate | trajectory success | samples to success | "
            "tasks in band | kept | set size |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in report["rft_rounds"]:
            sts = r.get("samples_to_success")
            cells = [_num(r.get(k)) for k in ("tasks_in_band", "selected", "dataset_size")]
            lines.append(
                f"| {r['step']} | {_pct(r.get('positive_task_rate'))} | {_pct(r.get('trajectory_success_rate'))} | "
                f"{'-' if sts is None else f'{sts:.2f}'} | " + " | ".join(cells) + " |"
            )
    return lines


def _md_audit(a: dict[str, Any]) -> list[str]:
    """The reward audit's counts and its end-to-end verdict (if there is one)."""
    lines = [
        "",
        "## Reward audit",
        "",
        f"- high-reward failures flagged by the reward debugger: {a['flagged_high_reward_failures']}",
        f"- rewards clipped before advantages: {a['rewards_clipped']} (non-finite: {a['rewards_nonfinite']})",
        f"- reward-success gap warnings during training: {a['gap_warnings']} of {len(a['gap_checks'])} checks",
    ]
    e2e = a.get("end_to_end")
    if e2e:
        verdict = (
            (
                "WARNING: reward rose while held-out success did not (reward hacking or overfitting "
                "to the training tasks)"
            )
            if e2e["warning"]
            else "consistent"
        )
        lines.append(
            f"- end to end: training reward {e2e['reward_first_window']:.3f} -> {e2e['reward_last_window']:.3f}, "
            f"held-out success {_pct(e2e['heldout_before'])} -> {_pct(e2e['heldout_after'])}: {verdict}"
        )
    return lines


def _step_metric_cell(k: str, v: float) -> str:
    return _pct(v) if k in STEP_METRICS_PCT else f"{v:.2f}"


def _md_step_metrics(sm: dict[str, Any]) -> list[str]:
    """The per-step rollout metrics: first, last and mean of each, with the plot (if written)."""
    cores = f" of {int(sm['cpu_cores'])} cores" if sm.get("cpu_cores") else ""
    lines = [
        "",
        "## Per-step rollout metrics",
        "",
        f"Stage `{sm['stage']}`, {sm['steps']} steps (`metrics.jsonl`; CPU utilisation is the share"
        f"{cores} the process kept busy).",
        "",
    ]
    if sm.get("plot"):
        lines += [f"![per-step rollout metrics]({sm['plot']})", ""]
    lines += ["| metric | first step | last step | mean |", "|---|---|---|---|"]
    lines += [
        f"| {STEP_METRIC_LABELS[k]} | {_step_metric_cell(k, sm['first'][k])} | "
        f"{_step_metric_cell(k, sm['last'][k])} | {_step_metric_cell(k, sm['means'][k])} |"
        for k in sm["means"]
    ]
    return lines


def _md_async(asy: dict[str, Any]) -> list[str]:
    """SAO's asynchronous bookkeeping."""
    lags = ", ".join(f"{k}: {v}" for k, v in asy["policy_lag_hist"].items())
    return [
        "",
        "## Asynchronous training (SAO)",
        "",
        f"- trajectories consumed: {asy['trajectories']} ({asy['traj_per_s'] or 0:.2f}/s), "
        f"stale dropped: {asy['stale_dropped']}, down-weighted: {asy['stale_downweighted']}",
        f"- policy lag histogram (versions: trajectories): {lags}",
        f"- mean share of policy tokens masked by the importance ratio: {_pct(asy['masked_frac_mean'])}",
        f"- final policy version: {_num(asy['policy_version'])}",
    ]


def _md_opd(opd: dict[str, Any]) -> list[str]:
    """What on-policy distillation spent and distilled, with its held-out checks (if any)."""
    kl0, kl1 = opd["reverse_kl_first"], opd["reverse_kl_last"]
    lines = [
        "",
        "## On-policy distillation",
        "",
        f"- student rollout tokens (policy tokens generated): {opd['student_rollout_tokens']}",
        f"- teacher tokens read: {opd['teacher_tokens']}; alignment failures: {opd['alignment_failures']}",
        f"- reverse KL(student || teacher) estimate per policy token: "
        f"{'-' if kl0 is None else f'{kl0:.3f}'} -> {'-' if kl1 is None else f'{kl1:.3f}'}",
    ]
    if opd["distilled_token_share"] is not None:
        lines.append(f"- ShortOPD: mean share of policy tokens distilled {_pct(opd['distilled_token_share'])}")
    if opd["heldout_checks"]:
        lines += ["", "| step | student rollout tokens | held-out success |", "|---|---|---|"]
        lines += [
            f"| {c['step']} | {_num(c['rollout_tokens'])} | {_pct(c['heldout_success'])} |"
            for c in opd["heldout_checks"]
        ]
    return lines


def report_markdown(report: dict[str, Any]) -> str:
    lines = _md_evals(report) + _md_stages(report) + _md_audit(report["audit"])
    if report.get("step_metrics"):
        lines += _md_step_metrics(report["step_metrics"])
    if report.get("async"):
        lines += _md_async(report["async"])
    if report.get("opd"):
        lines += _md_opd(report["opd"])
    return "\n".join(lines) + "\n"


def write_report(run_dir: Path, report: dict[str, Any]) -> tuple[Path, Path]:
    """``report.json`` and ``report.md`` (returned), and ``report.html`` beside them (:func:`write_report_html`)."""
    j, m = run_dir / "report.json", run_dir / "report.md"
    j.write_text(json.dumps(report, indent=2))
    m.write_text(report_markdown(report))
    try:
        write_report_html(run_dir, report)
    except Exception as e:  # the page is a view of the files above: its failure never costs the run its report
        import warnings

        warnings.warn(
            f"report.html not written ({type(e).__name__}: {e}); report.md and report.json are",
            RuntimeWarning,
            stacklevel=2,
        )
    return j, m


# ------------------------------------------------------------------ HTML report -----
# report.html: one self-contained page (inline CSS and SVG, no script, nothing fetched) beside report.md.
CURVE_METRICS = (
    "loss",
    "reward_mean",
    "task_success",
    "tool_success",
    "heldout_success",
    "violation_rate",
    "mean_turns",
    "malformed_call_rate",
    "kl",
    "step_s",
)
REWARD_TERMS = ("total", "task", "tool", "format", "runtime", "verbosity")
REVIEW_TOP = 10
_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")


def _esc(x: Any) -> str:
    import html

    return html.escape(str(x), quote=True)


def _fmt_tick(v: float) -> str:
    return f"{v:.3g}"


def svg_line_chart(
    title: str, series: dict[str, list[tuple[float, float]]], width: int = 420, height: int = 220
) -> str:
    """An inline SVG line chart of ``{name: [(x, y), ...]}`` (axes, min/max ticks, legend)."""
    pts = [p for s in series.values() for p in s]
    if not pts:
        return ""
    left, right, top, bottom = 48, 10, 34, 26
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        y0, y1 = y0 - (abs(y0) or 1) * 0.1, y1 + (abs(y1) or 1) * 0.1
    pw, ph = width - left - right, height - top - bottom

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        return top + (1 - (y - y0) / (y1 - y0)) * ph

    out = [
        f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{_esc(title)}">',
        f'<text x="{left}" y="13" class="title">{_esc(title)}</text>',
        f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" class="plot"/>',
    ]
    for v in (y0, (y0 + y1) / 2, y1):
        out.append(
            f'<line x1="{left}" x2="{left + pw}" y1="{sy(v):.1f}" y2="{sy(v):.1f}" class="grid"/>'
            f'<text x="{left - 4}" y="{sy(v) + 4:.1f}" class="tick" text-anchor="end">{_fmt_tick(v)}</text>'
        )
    for v, anchor in ((x0, "start"), (x1, "end")):
        out.append(f'<text x="{sx(v):.1f}" y="{height - 8}" class="tick" text-anchor="{anchor}">{_fmt_tick(v)}</text>')
    out.append(f'<text x="{left + pw / 2:.1f}" y="{height - 8}" class="tick" text-anchor="middle">step</text>')
    lx = left
    for i, (name, s) in enumerate(series.items()):
        color = _COLORS[i % len(_COLORS)]
        out.append(f'<text x="{lx}" y="27" class="legend" fill="{color}">&#9632; {_esc(name)}</text>')
        lx += 14 + 7 * len(str(name))
        if not s:
            continue
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in s)
        out.append(f'<polyline class="series" fill="none" stroke="{color}" stroke-width="1.8" points="{path}"/>')
        if len(s) <= 60:
            out += [
                f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.2" fill="{color}"><title>{_esc(name)} step '
                f"{x:g}: {y:.4g}</title></circle>"
                for x, y in s
            ]
    out.append("</svg>")
    return "".join(out)


def svg_stacked_bars(title: str, rows: dict[str, dict[str, int]], width: int = 640) -> str:
    """An inline SVG of one horizontal bar per row, split by category share (counts in the tooltips)."""
    rows = {k: v for k, v in rows.items() if sum(v.values()) > 0}
    if not rows:
        return ""
    cats = list(dict.fromkeys(c for v in rows.values() for c in v))
    left, bar, gap, top = 150, 22, 8, 22
    legend_lines = (len(cats) + 3) // 4
    height = top + len(rows) * (bar + gap) + 18 * legend_lines + 10
    pw = width - left - 10
    out = [
        f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{_esc(title)}">',
        f'<text x="0" y="13" class="title">{_esc(title)}</text>',
    ]
    for r, (label, counts) in enumerate(rows.items()):
        y = top + r * (bar + gap)
        total = sum(counts.values())
        out.append(
            f'<text x="{left - 6}" y="{y + bar / 2 + 4:.1f}" class="tick" text-anchor="end">{_esc(label)} '
            f"(n={total})</text>"
        )
        x = float(left)
        for c in cats:
            n = counts.get(c, 0)
            if not n:
                continue
            w = n / total * pw
            color = _COLORS[cats.index(c) % len(_COLORS)]
            out.append(
                f'<rect class="bar" x="{x:.1f}" y="{y}" width="{w:.1f}" height="{bar}" fill="{color}">'
                f"<title>{_esc(label)}: {_esc(c)} {n} ({100 * n / total:.0f}%)</title></rect>"
            )
            if w > 34:
                out.append(
                    f'<text x="{x + w / 2:.1f}" y="{y + bar / 2 + 4:.1f}" class="inbar" '
                    f'text-anchor="middle">{100 * n / total:.0f}%</text>'
                )
            x += w
    ly = top + len(rows) * (bar + gap) + 12
    for i, c in enumerate(cats):
        out.append(
            f'<text x="{left + (i % 4) * (pw / 4):.1f}" y="{ly + (i // 4) * 18}" class="legend" '
            f'fill="{_COLORS[i % len(_COLORS)]}">&#9632; {_esc(c)}</text>'
        )
    out.append("</svg>")
    return "".join(out)


def reward_breakdown_by_step(run_dir: Path) -> dict[str, dict[int, dict[str, float]]]:
    """Mean reward terms per step of each stage, from the trajectory samples (``samples/<stage>-step-N.jsonl``)."""
    import re

    from mentorrl.trajectory import read_jsonl

    out: dict[str, dict[int, dict[str, float]]] = {}
    samples = run_dir / "samples"
    if not samples.is_dir():
        return out
    for f in sorted(samples.glob("*-step-*.jsonl")):
        m = re.fullmatch(r"(.+)-step-(\d+)\.jsonl", f.name)
        if m is None:
            continue
        try:
            trajs = list(read_jsonl(f))
        except Exception:  # a torn or foreign file: the report shows what it can
            continue
        trajs = [t for t in trajs if t.reward is not None]
        if not trajs:
            continue
        terms = {
            "total": [t.reward.total for t in trajs],
            "task": [t.reward.task for t in trajs],
            "tool": [t.reward.tool for t in trajs],
            "format": [t.reward.format for t in trajs],
            "runtime": [t.reward.runtime for t in trajs],
        }
        verb = [t.reward.details.get("verbosity") for t in trajs]
        if all(isinstance(v, (int, float)) for v in verb):
            terms["verbosity"] = verb
        out.setdefault(m.group(1), {})[int(m.group(2))] = {k: float(sum(v) / len(v)) for k, v in terms.items()}
    return out


def failure_review(
    run_dir: Path,
    labels: list[str],
    review_label: str | None = None,
) -> tuple[dict[str, dict[str, int]], list[dict[str, Any]], str | None]:
    """The failure-type mix of each evaluation (``eval_<label>.jsonl``, attributed without expert
    references) and the review queue's top cases (highest risk first) of ``review_label`` (default:
    the last evaluation found)."""
    from mentorrl.flywheel.attribution import attribute
    from mentorrl.flywheel.review import build_review_queue
    from mentorrl.trajectory import read_jsonl

    mix: dict[str, dict[str, int]] = {}
    last: tuple[str, list] | None = None
    for label in labels:
        path = run_dir / f"eval_{label}.jsonl"
        if not path.exists():
            continue
        trajs = list(read_jsonl(path))
        counts: dict[str, int] = {}
        for t in trajs:
            a = attribute(t)
            key = "success" if a is None else a.failure_type.value
            counts[key] = counts.get(key, 0) + 1
        mix[label] = dict(sorted(counts.items(), key=lambda kv: (kv[0] != "success", -kv[1], kv[0])))
        if review_label is None or label == review_label or last is None:
            last = (label, trajs)  # the asked-for evaluation, else the last one found
    if last is None:
        return mix, [], None
    queue = sorted(build_review_queue(last[1]), key=lambda e: (-e.risk_score, e.trajectory_id))
    return mix, [e.model_dump() for e in queue[:REVIEW_TOP]], last[0]


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;max-width:1100px;color:#222;
padding:0 16px}
h1{font-size:1.6em}h2{font-size:1.25em;margin-top:1.8em;border-bottom:1px solid #ddd;padding-bottom:4px}
table{border-collapse:collapse;margin:8px 0;font-size:0.9em}td,th{border:1px solid #ddd;padding:4px 8px;
text-align:left;vertical-align:top}th{background:#f5f5f5}.charts{display:flex;flex-wrap:wrap;gap:12px}
svg.chart{background:#fff;border:1px solid #eee}svg .title{font-size:13px;font-weight:600}
svg .tick{font-size:10px;fill:#555}svg .legend{font-size:11px}svg .plot{fill:#fcfcfc;stroke:#ccc}
svg .grid{stroke:#eee}svg .inbar{font-size:10px;fill:#fff}.muted{color:#777}code{background:#f3f3f3;padding:0 3px}
td.answer{max-width:360px;white-space:pre-wrap;word-break:break-word}
"""


def _html_evaluation(report: dict[str, Any]) -> list[str]:
    p = ['<h2 id="evaluation">Held-out evaluation</h2>']
    evals = {**report.get("evals", {}), **{f"final on {k}": v for k, v in (report.get("other_splits") or {}).items()}}
    if evals:
        p.append(
            "<table><tr><th>checkpoint</th><th>n</th><th>success</th><th>95% CI</th><th>mean reward</th>"
            "<th>violations</th></tr>"
        )
        for label, e in evals.items():
            lo, hi = e.get("success_ci95") or (None, None)
            p.append(
                f"<tr><td>{_esc(label)}</td><td>{_esc(e.get('n'))}</td><td>{_pct(e.get('success'))}</td>"
                f"<td>[{_pct(lo)}, {_pct(hi)}]</td><td>{(e.get('mean_reward') or 0):.3f}</td>"
                f"<td>{_pct(e.get('violation_rate'))}</td></tr>"
            )
        p.append("</table>")
    else:
        p.append('<p class="muted">No evaluation in this run.</p>')
    if report.get("stages"):
        p.append("<table><tr><th>stage</th><th>steps</th><th>rollouts</th><th>seconds</th></tr>")
        p += [
            f"<tr><td>{_esc(n)}</td><td>{s['steps']}</td><td>{s['rollouts']}</td><td>{s['seconds']:.0f}</td></tr>"
            for n, s in report["stages"].items()
        ]
        p.append("</table>")
    return p


def _html_curves(records: list[dict[str, Any]]) -> list[str]:
    p = ['<h2 id="curves">Training curves</h2>']
    by_stage: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_stage.setdefault(str(r.get("stage", "?")), []).append(r)
    if not by_stage:
        p.append('<p class="muted">No step metrics (<code>metrics.jsonl</code> is empty).</p>')
    for stage, rs in by_stage.items():
        charts = []
        for k in CURVE_METRICS:
            s = [
                (float(r["step"]), float(r[k]))
                for r in rs
                if isinstance(r.get(k), (int, float))
                and not isinstance(r.get(k), bool)
                and isinstance(r.get("step"), int)
                and math.isfinite(r[k])
            ]
            if s:
                charts.append(svg_line_chart(k, {stage: s}))
        if charts:
            p.append(f'<h3>{_esc(stage)}</h3><div class="charts">' + "".join(charts) + "</div>")
    return p


def _html_reward(breakdown: dict[str, dict[int, dict[str, float]]] | None) -> list[str]:
    p = ['<h2 id="reward">Reward breakdown over time</h2>']
    if not breakdown:
        return p + ['<p class="muted">No trajectory samples in this run (<code>grpo.sample_trajectories</code>).</p>']
    charts = []
    for stage, steps in breakdown.items():
        series = {t: [(float(st), v[t]) for st, v in sorted(steps.items()) if t in v] for t in REWARD_TERMS}
        charts.append(
            svg_line_chart(
                f"{stage}: mean reward terms of the sampled trajectories",
                {k: v for k, v in series.items() if v},
                width=640,
                height=260,
            )
        )
    return p + [
        '<div class="charts">' + "".join(charts) + "</div>",
        '<p class="muted">From <code>samples/&lt;stage&gt;-step-N.jsonl</code> (each term before its '
        "weight; total is the composed reward).</p>",
    ]


def _html_failures(failure_mix: dict[str, dict[str, int]] | None) -> list[str]:
    p = ['<h2 id="failures">Failure-type mix</h2>']
    if not failure_mix:
        return p + ['<p class="muted">No evaluation trajectories in this run.</p>']
    return p + [
        svg_stacked_bars("evaluation trajectories by outcome and primary failure type", failure_mix),
        '<p class="muted">Each failed evaluation trajectory attributed to one primary failure type '
        "(<code>mentorrl.flywheel.attribution</code>, without expert references; "
        "<code>mentorrl flywheel</code> adds them).</p>",
    ]


def _html_review(review: list[dict[str, Any]] | None, review_label: str | None) -> list[str]:
    p = ['<h2 id="review">Review queue: top cases</h2>']
    if not review:
        return p + ['<p class="muted">No evaluation trajectories to review.</p>']
    p.append(
        f"<p>The {len(review)} highest-risk trajectories of <code>eval_{_esc(review_label)}.jsonl</code> "
        "in the review queue (<code>mentorrl.flywheel.review</code>).</p>"
    )
    p.append(
        "<table><tr><th>#</th><th>risk</th><th>trajectory</th><th>family</th><th>reasons</th>"
        "<th>outcome</th><th>tools</th><th>final answer</th></tr>"
    )
    for i, e in enumerate(review, 1):
        s = e["summary"]
        outcome = ("success" if s["success"] else "failed") + f", {s['finish_reason']}, {s['num_turns']} turns"
        if s.get("violations"):
            outcome += "; violations: " + ", ".join(s["violations"])
        p.append(
            f"<tr><td>{i}</td><td>{e['risk_score']:.2f}</td><td><code>{_esc(e['trajectory_id'])}</code>"
            f"<br>task <code>{_esc(e['task_id'])}</code></td><td>{_esc(e['family'])}</td>"
            f"<td>{_esc('; '.join(e['reasons']))}</td><td>{_esc(outcome)}</td>"
            f'<td>{_esc(", ".join(s["tools"]))}</td><td class="answer">{_esc(s.get("final_answer") or "")}'
            "</td></tr>"
        )
    p.append("</table>")
    return p


def report_html(
    report: dict[str, Any],
    records: list[dict[str, Any]],
    breakdown: dict[str, dict[int, dict[str, float]]] | None = None,
    failure_mix: dict[str, dict[str, int]] | None = None,
    review: list[dict[str, Any]] | None = None,
    review_label: str | None = None,
) -> str:
    """The run report as one self-contained HTML page: the held-out table, training curves per stage,
    the reward breakdown over steps, the failure-type mix per evaluation and the review queue's top cases."""
    p: list[str] = [
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>mentorrl run report</title><style>{_CSS}</style></head><body>",
        "<h1>Run report</h1>",
    ]
    p += _html_evaluation(report) + _html_curves(records) + _html_reward(breakdown)
    p += _html_failures(failure_mix) + _html_review(review, review_label)
    a = report.get("audit") or {}
    if a:
        p.append(
            '<h2 id="audit">Reward audit</h2><ul>'
            f"<li>high-reward failures flagged: {a.get('flagged_high_reward_failures', 0)}</li>"
            f"<li>rewards clipped: {a.get('rewards_clipped', 0)} (non-finite: {a.get('rewards_nonfinite', 0)})</li>"
            f"<li>reward-success gap warnings: {a.get('gap_warnings', 0)} of {len(a.get('gap_checks') or [])} "
            "checks</li></ul>"
        )
    p.append(
        '<p class="muted">Written by mentorrl beside report.md; self-contained (no script, nothing '
        "fetched).</p></body></html>"
    )
    return "\n".join(p) + "\n"


def write_report_html(run_dir: Path, report: dict[str, Any]) -> Path:
    """``report.html`` from the report, ``metrics.jsonl``, the trajectory samples and the evaluation trajectories."""
    from mentorrl.train.rundir import MetricsLog

    records = MetricsLog(run_dir / "metrics.jsonl").read()
    evals = list(report.get("evals", {}))
    final = evals[-1] if evals else None
    labels = evals + [f"{final}_{split}" for split in (report.get("other_splits") or {}) if final]
    mix, review, review_label = failure_review(run_dir, labels, review_label=final)
    out = run_dir / "report.html"
    out.write_text(
        report_html(report, records, reward_breakdown_by_step(run_dir), mix, review, review_label), encoding="utf-8"
    )
    return out
