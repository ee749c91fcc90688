"""bench/demo_wall.py's pure parts: what a rerun skips, and a finished run's figures read back."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import demo_wall  # noqa: E402


def test_done_keys_skips_finished_pairs_and_a_torn_line(tmp_path):
    res = tmp_path / "r.jsonl"
    assert demo_wall.done_keys(res) == set()
    res.write_text(
        json.dumps({"arm": "today", "seed": 0})
        + "\n"
        + json.dumps({"arm": "whole", "seed": 1})
        + "\n"
        + json.dumps({"arm": "today", "seed": 0, "tag": "malloc-auto"})
        + '\n{"arm": "to'
    )
    # rows without a tag (the first ones) are keyed by the empty tag: a tagged rerun of the same arm is new work
    assert demo_wall.done_keys(res) == {("today", 0, ""), ("whole", 1, ""), ("today", 0, "malloc-auto")}


def test_run_figures_reads_evals_and_grpo_cores_busy(tmp_path):
    for name, s in (("eval_sft.json", 0.5), ("eval_grpo.json", 0.8)):
        (tmp_path / name).write_text(json.dumps({"success": s, "success_ci95": [s - 0.05, s + 0.05], "n": 500}))
    rows = [{"stage": "sft", "cpu_util": 0.1}, {"stage": "grpo", "cpu_util": 0.6}, {"stage": "grpo", "cpu_util": 0.8}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n{torn")
    figs = demo_wall.run_figures(tmp_path)
    assert figs["sft"]["success"] == 0.5 and figs["grpo"]["n"] == 500 and "hidden" not in figs
    assert abs(figs["grpo_cores_busy"] - 0.7) < 1e-9


def test_every_arm_is_a_list_of_overrides():
    assert demo_wall.ARMS["today"] == []
    assert all("=" in s for sets in demo_wall.ARMS.values() for s in sets)
