"""The run report: evaluations, rollout budget per stage, RFT rounds, the reward audit and the
per-step rollout metrics (tool calls, malformed calls, finish reasons, turns, tokens, seconds,
CPU utilisation) of the RL stage, with their plot.

Built from ``metrics.jsonl`` and the evaluation summaries, so it can be rebuilt for any run
directory after the fact (``build_report``) and is written as ``report.json`` + ``report.md``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mentorrl.train.audit import AuditConfig
from mentorrl.train.registry import rl_stage_names


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def end_to_end_gap(rl: list[dict[str, Any]], before: float | None, after: float | None,
                   audit: AuditConfig) -> dict[str, Any] | None:
    """Training reward over the first vs the last window of an RL stage, against held-out success before vs after."""
    if not rl or before is None or after is None:
        return None
    w = audit.reward_window
    first = _mean([r["reward_mean"] for r in rl[:w]])
    last = _mean([r["reward_mean"] for r in rl[-w:]])
    d_reward, d_success = last - first, after - before
    warn = d_reward > audit.reward_rise and d_success <= audit.success_rise
    return {"reward_first_window": first, "reward_last_window": last, "reward_delta": d_reward,
            "heldout_before": before, "heldout_after": after, "success_delta": d_success, "warning": warn}


def async_summary(sao: list[dict[str, Any]]) -> dict[str, Any] | None:
    """SAO's asynchronous bookkeeping over the stage: policy-lag histogram, stale data, masking, throughput."""
    if not sao:
        return None
    hist: dict[str, int] = {}
    for r in sao:
        for lag, n in (r.get("policy_lag_hist") or {}).items():
            hist[lag] = hist.get(lag, 0) + int(n)
    updated = [r for r in sao if r.get("actor_updated")]
    return {"policy_lag_hist": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
            "trajectories": int(sum(r.get("rollouts", 0) for r in sao)),
            "stale_dropped": int(sum(r.get("stale_dropped", 0) for r in sao)),
            "stale_downweighted": int(sum(r.get("stale_downweighted", 0) for r in sao)),
            "masked_frac_mean": _mean([r.get("masked_frac", 0.0) for r in updated]),
            "traj_per_s": sao[-1].get("traj_per_s"), "policy_version": sao[-1].get("policy_version")}


def build_report(records: list[dict[str, Any]], evals: dict[str, dict[str, Any]], audit: AuditConfig,
                 pre_rl_label: str | None = None, final_label: str | None = None,
                 rl_stage: str = "grpo", other_splits: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """``rl_stage``'s records feed the gap checks and the end-to-end gap; the reward audit
    counts cover every RL stage of the run. ``other_splits``: the final checkpoint's evaluations
    on other splits (hidden, the novel_wording stress set), reported beside the held-out ones."""
    by_stage: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_stage.setdefault(r.get("stage", "?"), []).append(r)
    stages = {
        name: {"steps": len(rs), "rollouts": int(sum(r.get("rollouts", 0) for r in rs)),
               "seconds": sum(r.get("step_s", 0.0) for r in rs)}
        for name, rs in by_stage.items()
    }
    rl = by_stage.get(rl_stage, [])
    every_rl = [r for name in rl_stage_names() for r in by_stage.get(name, [])]
    checks = [r for r in rl if "heldout_success" in r]
    keys = ("n", "success", "success_ci95", "mean_reward", "violation_rate", "tool_success", "mean_turns")
    report: dict[str, Any] = {
        "evals": {k: {key: v.get(key) for key in keys} for k, v in evals.items()},
        "other_splits": {k: {key: v.get(key) for key in keys} for k, v in (other_splits or {}).items()},
        "stages": stages,
        "rft_rounds": [{k: r.get(k) for k in ("step", "positive_task_rate", "trajectory_success_rate",
                                              "samples_to_success", "tasks_in_band", "selected", "dataset_size",
                                              "rollouts")} for r in by_stage.get("rft", [])],
        "audit": {
            "flagged_high_reward_failures": int(sum(r.get("reward_flagged", 0) for r in every_rl)),
            "rewards_clipped": int(sum(r.get("reward_clipped", 0) for r in every_rl)),
            "rewards_nonfinite": int(sum(r.get("reward_nonfinite", 0) for r in every_rl)),
            "gap_checks": [{"step": r["step"], "heldout_success": r["heldout_success"],
                            "reward_mean": r.get("reward_mean"), "warning": bool(r.get("gap_warning"))} for r in checks],
            "gap_warnings": int(sum(bool(r.get("gap_warning")) for r in checks)),
            "end_to_end": end_to_end_gap(
                rl,
                evals.get(pre_rl_label, {}).get("success") if pre_rl_label else None,
                evals.get(final_label, {}).get("success") if final_label else None,
                audit,
            ),
        },
    }
    step_stage = rl_stage if rl else next((n for n in reversed(list(by_stage)) if any(
        "tool_calls_per_traj" in r for r in by_stage[n])), None)
    summary = step_metrics_summary(step_stage, by_stage.get(step_stage, [])) if step_stage else None
    if summary is not None:
        report["step_metrics"] = summary
    if "sao" in by_stage:
        report["async"] = async_summary(by_stage["sao"])
    if "opd" in by_stage:
        report["opd"] = opd_summary(by_stage["opd"])
    return report


STEP_METRICS = ("tool_calls_per_traj", "malformed_call_rate", "finish_answer", "finish_max_turns", "finish_max_tokens",
                "finish_length", "mean_turns", "mean_policy_tokens", "rollout_s", "update_s", "step_s", "cpu_util",
                "rollout_cpu_util")
STEP_METRIC_LABELS = {"tool_calls_per_traj": "tool calls per trajectory", "malformed_call_rate": "malformed-call rate",
                      "finish_answer": "finished with an answer", "finish_max_turns": "finished at the turn limit",
                      "finish_max_tokens": "finished at the context budget",
                      "finish_length": "finished with a turn cut at max_new_tokens", "mean_turns": "turns",
                      "mean_policy_tokens": "policy tokens per trajectory", "rollout_s": "rollout seconds",
                      "update_s": "update seconds", "step_s": "step seconds", "cpu_util": "CPU utilisation (step)",
                      "rollout_cpu_util": "CPU utilisation (rollout)"}
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

    return {"stage": stage, "steps": len(rows), "cpu_cores": rows[-1].get("cpu_cores"),
            "first": {k: vals(k)[0] for k in keys}, "last": {k: vals(k)[-1] for k in keys},
            "means": {k: _mean(vals(k)) for k in keys}}


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
        "heldout_checks": [{"step": r["step"], "rollout_tokens": r.get("rollout_tokens_total"),
                            "heldout_success": r["heldout_success"]} for r in records if "heldout_success" in r],
    }


def _pct(x: Any) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _num(x: Any) -> str:
    return "-" if x is None else f"{x:g}"


def _eval_row(label: str, e: dict[str, Any]) -> str:
    """``| label | n | success | 95% CI | mean reward | violations |`` for one evaluation summary."""
    lo, hi = e.get("success_ci95") or (None, None)
    return (f"| {label} | {e.get('n')} | {_pct(e.get('success'))} | [{_pct(lo)}, {_pct(hi)}] | "
            f"{(e.get('mean_reward') or 0):.3f} | {_pct(e.get('violation_rate'))} |")


def report_markdown(report: dict[str, Any]) -> str:
    lines = ["# Run report", "", "## Held-out evaluation", "",
             "| checkpoint | n | success | 95% CI | mean reward | violations |", "|---|---|---|---|---|---|"]
    for label, e in report["evals"].items():
        lines.append(_eval_row(label, e))
    if report.get("other_splits"):
        lines += ["", "## Final checkpoint on other splits", "",
                  "`novel_wording` is a stress set worded with words training never uses; it is not the headline.", "",
                  "| split | n | success | 95% CI | mean reward | violations |", "|---|---|---|---|---|---|"]
        for split, e in report["other_splits"].items():
            lines.append(_eval_row(split, e))
    lines += ["", "## Stages", "", "| stage | steps | rollouts | seconds |", "|---|---|---|---|"]
    for name, s in report["stages"].items():
        lines.append(f"| {name} | {s['steps']} | {s['rollouts']} | {s['seconds']:.0f} |")
    if report["rft_rounds"]:
        lines += ["", "## RFT rounds", "", "| round | positive-task rate | trajectory success | samples to success | "
                  "tasks in band | kept | set size |", "|---|---|---|---|---|---|---|"]
        for r in report["rft_rounds"]:
            sts = r.get("samples_to_success")
            cells = [_num(r.get(k)) for k in ("tasks_in_band", "selected", "dataset_size")]
            lines.append(f"| {r['step']} | {_pct(r.get('positive_task_rate'))} | {_pct(r.get('trajectory_success_rate'))} | "
                         f"{'-' if sts is None else f'{sts:.2f}'} | " + " | ".join(cells) + " |")
    a = report["audit"]
    lines += ["", "## Reward audit", "",
              f"- high-reward failures flagged by the reward debugger: {a['flagged_high_reward_failures']}",
              f"- rewards clipped before advantages: {a['rewards_clipped']} (non-finite: {a['rewards_nonfinite']})",
              f"- reward-success gap warnings during training: {a['gap_warnings']} of {len(a['gap_checks'])} checks"]
    e2e = a.get("end_to_end")
    if e2e:
        verdict = ("WARNING: reward rose while held-out success did not (reward hacking or overfitting "
                   "to the training tasks)") if e2e["warning"] else "consistent"
        lines.append(f"- end to end: training reward {e2e['reward_first_window']:.3f} -> {e2e['reward_last_window']:.3f}, "
                     f"held-out success {_pct(e2e['heldout_before'])} -> {_pct(e2e['heldout_after'])}: {verdict}")
    sm = report.get("step_metrics")
    if sm:
        pct = {"malformed_call_rate", "finish_answer", "finish_max_turns", "finish_max_tokens", "finish_length",
               "cpu_util", "rollout_cpu_util"}

        def cell(k: str, v: float) -> str:
            return _pct(v) if k in pct else f"{v:.2f}"

        cores = f" of {int(sm['cpu_cores'])} cores" if sm.get("cpu_cores") else ""
        lines += ["", "## Per-step rollout metrics", "",
                  f"Stage `{sm['stage']}`, {sm['steps']} steps (`metrics.jsonl`; CPU utilisation is the share"
                  f"{cores} the process kept busy).", ""]
        if sm.get("plot"):
            lines += [f"![per-step rollout metrics]({sm['plot']})", ""]
        lines += ["| metric | first step | last step | mean |", "|---|---|---|---|"]
        lines += [f"| {STEP_METRIC_LABELS[k]} | {cell(k, sm['first'][k])} | {cell(k, sm['last'][k])} | "
                  f"{cell(k, sm['means'][k])} |" for k in sm["means"]]
    asy = report.get("async")
    if asy:
        lags = ", ".join(f"{k}: {v}" for k, v in asy["policy_lag_hist"].items())
        lines += ["", "## Asynchronous training (SAO)", "",
                  f"- trajectories consumed: {asy['trajectories']} ({asy['traj_per_s'] or 0:.2f}/s), "
                  f"stale dropped: {asy['stale_dropped']}, down-weighted: {asy['stale_downweighted']}",
                  f"- policy lag histogram (versions: trajectories): {lags}",
                  f"- mean share of policy tokens masked by the importance ratio: {_pct(asy['masked_frac_mean'])}",
                  f"- final policy version: {_num(asy['policy_version'])}"]
    opd = report.get("opd")
    if opd:
        kl0, kl1 = opd["reverse_kl_first"], opd["reverse_kl_last"]
        lines += ["", "## On-policy distillation", "",
                  f"- student rollout tokens (policy tokens generated): {opd['student_rollout_tokens']}",
                  f"- teacher tokens read: {opd['teacher_tokens']}; alignment failures: {opd['alignment_failures']}",
                  f"- reverse KL(student || teacher) estimate per policy token: "
                  f"{'-' if kl0 is None else f'{kl0:.3f}'} -> {'-' if kl1 is None else f'{kl1:.3f}'}"]
        if opd["distilled_token_share"] is not None:
            lines.append(f"- ShortOPD: mean share of policy tokens distilled {_pct(opd['distilled_token_share'])}")
        if opd["heldout_checks"]:
            lines += ["", "| step | student rollout tokens | held-out success |", "|---|---|---|"]
            lines += [f"| {c['step']} | {_num(c['rollout_tokens'])} | {_pct(c['heldout_success'])} |"
                      for c in opd["heldout_checks"]]
    return "\n".join(lines) + "\n"


def write_report(run_dir: Path, report: dict[str, Any]) -> tuple[Path, Path]:
    j, m = run_dir / "report.json", run_dir / "report.md"
    j.write_text(json.dumps(report, indent=2))
    m.write_text(report_markdown(report))
    return j, m
