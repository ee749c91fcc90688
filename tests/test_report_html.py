"""report.html: written beside report.md, self-contained (no script, nothing fetched), with the
training curves, the reward breakdown over steps, the failure-type mix and the review queue's top
cases; untrusted text (the policy's answers) is escaped. A real headless browser loads it in
``bench/check_report_html.py`` (Chromium is not part of CI)."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser

from mentorrl.config import AuditConfig
from mentorrl.train.report import build_report, report_html, svg_line_chart, write_report
from mentorrl.trajectory import RewardBreakdown, ToolCall, Trajectory, write_jsonl

INJECTION = '<script>alert("pwned")</script><img src="https://example.com/x.png">'


def _traj(i: int, success: bool, answer: str | None, split: str = "heldout", tool_error: bool = False) -> Trajectory:
    calls = [ToolCall(turn=0, name="get_order", arguments={"order_id": i}, raw="{}", result={"ok": True})]
    if tool_error:
        calls.append(
            ToolCall(
                turn=1,
                name="cancel_order",
                arguments={},
                raw="{}",
                error="missing order_id",
                error_kind="bad_arguments",
            )
        )
    total = (1.0 if success else 0.0) + 0.1 - (0.25 if tool_error else 0.0)
    return Trajectory(
        id=f"{split}-{i}",
        task_id=f"task-{i}",
        family=("cancel_order", "lookup")[i % 2],
        split=split,
        token_ids=[1, 2, 3],
        loss_mask=[0, 1, 1],
        logprobs=[0.0, -0.5, -0.5],
        env_name="orders",
        env_version="1",
        tool_calls=calls,
        final_answer=answer,
        num_turns=len(calls) + 1,
        finish_reason="answer" if answer else "max_turns",
        reward=RewardBreakdown(
            task=float(success),
            tool=0.5 if tool_error else 1.0,
            runtime=-0.25 if tool_error else 0.0,
            format=1.0 if answer else 0.0,
            success=success,
            total=total,
            details={"verbosity": 0.0},
        ),
    )


def make_run(run_dir) -> dict:
    """A run directory as a real run leaves it: metrics.jsonl, trajectory samples, evaluation
    trajectories and summaries; returns its report (``build_report``)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    recs = [{"stage": "sft", "step": s, "loss": 2.0 / s, "step_s": 0.1} for s in range(1, 6)]
    recs += [
        {
            "stage": "grpo",
            "step": s,
            "loss": 0.1 * s,
            "reward_mean": 0.2 + 0.1 * s,
            "task_success": 0.1 * s,
            "tool_calls_per_traj": 1.5,
            "rollouts": 4,
            "step_s": 0.5,
            "note": "text",
            "policy_lag_hist": {"0": 1},
        }
        for s in range(1, 6)
    ]
    recs[-2]["heldout_success"] = 0.5
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (run_dir / "samples").mkdir(exist_ok=True)
    for s in range(1, 6):
        write_jsonl(
            run_dir / "samples" / f"grpo-step-{s:06d}.jsonl",
            [_traj(s * 10 + k, success=k < s, answer="done", split="train") for k in range(4)],
        )
    evals = {}
    for label, n_ok in (("sft", 3), ("grpo", 6)):
        trajs = [
            _traj(
                k,
                success=k < n_ok,
                answer=(INJECTION if k == 9 else ("done" if k % 3 else None)),
                tool_error=(k % 4 == 1),
            )
            for k in range(10)
        ]
        write_jsonl(run_dir / f"eval_{label}.jsonl", trajs)
        evals[label] = {
            "n": 10,
            "success": n_ok / 10,
            "success_ci95": [0.1, 0.9],
            "mean_reward": 0.5,
            "violation_rate": 0.0,
        }
    return build_report(recs, evals, AuditConfig(), pre_rl_label="sft", final_label="grpo")


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)


def test_report_html_beside_report_md(tmp_path):
    run = tmp_path / "run"
    report = make_run(run)
    j, m = write_report(run, report)
    page = run / "report.html"
    assert j.exists() and m.exists() and page.parent == m.parent
    html = page.read_text(encoding="utf-8")
    p = _Page()
    p.feed(html)
    tags = [t for t, _ in p.tags]
    text = " ".join(p.text)

    # self-contained: no script at all, nothing fetched (no src / external href / @import / url())
    assert "script" not in tags and "link" not in tags and "img" not in tags and "iframe" not in tags
    assert not any("src" in a for _, a in p.tags)
    assert not any(
        a.get("href", "#").split(":")[0] in ("http", "https", "file") or "//" in a.get("href", "") for _, a in p.tags
    )
    assert "@import" not in html and "url(" not in html

    # sections and charts: curves of both stages, reward terms over steps, failure mix, review queue
    for section in ("evaluation", "curves", "reward", "failures", "review"):
        assert f'id="{section}"' in html
    svgs = re.findall(r"<svg .*?</svg>", html, flags=re.S)
    assert len(svgs) >= 6
    assert any('aria-label="loss"' in s for s in svgs) and any('aria-label="reward_mean"' in s for s in svgs)
    breakdown = next(s for s in svgs if "mean reward terms" in s)
    assert breakdown.count("<polyline") == 6  # total, task, tool, format, runtime, verbosity
    mix = next(s for s in svgs if "primary failure type" in s)
    assert "sft (n=10)" in mix and "grpo (n=10)" in mix and "success" in mix and mix.count('<rect class="bar"') >= 3
    assert "Review queue: top cases" in text and "grpo-" not in text  # the review rows are the final evaluation's
    assert "heldout-" in html and "eval_grpo.jsonl" in html

    # the policy's text is escaped, never markup
    assert INJECTION not in html
    assert "&lt;script&gt;alert(&quot;pwned&quot;)&lt;/script&gt;" in html


def test_review_queue_rows_are_highest_risk_first(tmp_path):
    run = tmp_path / "run"
    write_report(run, make_run(run))
    html = (run / "report.html").read_text(encoding="utf-8")
    table = html[html.index('id="review"') :]
    risks = [float(x) for x in re.findall(r"<tr><td>\d+</td><td>([0-9.]+)</td>", table)]
    assert risks and risks == sorted(risks, reverse=True) and len(risks) <= 10


def test_report_html_of_a_run_without_evaluations_or_samples():
    report = build_report([{"stage": "sft", "step": 1, "loss": 1.0}], {}, AuditConfig())
    html = report_html(report, [{"stage": "sft", "step": 1, "loss": 1.0}])
    assert "No evaluation in this run" in html and "No trajectory samples" in html
    assert "No evaluation trajectories to review" in html and "<svg" in html


def test_line_chart_handles_flat_and_empty_series():
    assert svg_line_chart("x", {}) == ""
    flat = svg_line_chart("flat", {"a": [(1.0, 0.5)]})
    assert flat.startswith("<svg") and "nan" not in flat and "<circle" in flat


def test_a_failing_html_page_never_costs_the_run_its_report(tmp_path, monkeypatch):
    import pytest

    import mentorrl.train.report as R

    run = tmp_path / "run"
    report = make_run(run)
    monkeypatch.setattr(R, "failure_review", lambda *a, **k: (_ for _ in ()).throw(ValueError("duplicate ids")))
    with pytest.warns(RuntimeWarning, match=r"report.html not written \(ValueError: duplicate ids\)"):
        j, m = write_report(run, report)
    assert j.exists() and m.exists() and not (run / "report.html").exists()
