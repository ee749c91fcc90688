"""Stratified evaluation draws (``eval.stratify``, issue 17): every (family, kind) stratum gets its
exact share of ``n``, so held-out, hidden and novel_wording sets of one size hold the same mix and
their success rates differ by wording and worlds, not by which families a draw happened to favour.
The unstratified draw (what every earlier measurement used) is unchanged."""

from __future__ import annotations

import hashlib
import json
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mentorrl.cli.eval import agent_eval_config
from mentorrl.config import load_config
from mentorrl.envs.base import draw_tasks
from mentorrl.envs.orders import OrdersTasks
from mentorrl.envs.orders.tasks import STRATA, STRATUM_SHARES, stratum_counts
from mentorrl.eval.sets import EvalSetSpec, load_eval_set
from mentorrl.train.workspace import open_workspace

EVAL_SPLITS = ("heldout", "hidden", "novel_wording")


def _mix(tasks) -> Counter:
    return Counter((t.family, t.reference["kind"]) for t in tasks)


@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 5000))
def test_each_stratum_gets_its_share_within_one_task(n):
    counts = stratum_counts(n)
    assert sum(counts) == n and len(counts) == len(STRATA)
    for c, w in zip(counts, STRATUM_SHARES):
        assert abs(c - n * w) < 1.0
    assert counts == stratum_counts(n)  # deterministic: the same n, the same counts
    assert sum(STRATUM_SHARES) == pytest.approx(1.0)


@settings(max_examples=12, deadline=None)
@given(n=st.integers(1, 120), seed=st.integers(0, 10**6))
def test_every_evaluation_split_holds_the_same_exact_mix(n, seed):
    want = Counter({s: c for s, c in zip(STRATA, stratum_counts(n)) if c})
    for split in EVAL_SPLITS:
        tasks = OrdersTasks().tasks(split, n, seed, stratified=True)
        assert _mix(tasks) == want, split
        assert len({t.id for t in tasks}) == n and len({t.seed for t in tasks}) == n
        assert all(t.split == split for t in tasks)


def test_the_mix_is_shuffled_not_sorted_and_the_draw_is_seeded():
    a = OrdersTasks().tasks("heldout", 200, 7, stratified=True)
    assert [t.prompt for t in a] == [t.prompt for t in OrdersTasks().tasks("heldout", 200, 7, stratified=True)]
    fams = [t.family for t in a]
    runs = sum(1 for x, y in zip(fams, fams[1:]) if x != y)
    assert runs > 100  # a sorted plan would change family 20 times at most
    b = OrdersTasks().tasks("heldout", 200, 8, stratified=True)
    assert [t.prompt for t in a] != [t.prompt for t in b]


def test_unstratified_draws_are_unchanged():
    """The draw every earlier measurement used (hashes taken before stratification existed)."""
    want = {"heldout": "2bd212bac53a9946", "hidden": "a6aaa8eb60e4c155", "train": "c227212b6e707a73"}
    for split, h in want.items():
        tasks = OrdersTasks().tasks(split, 120, 12345)
        got = hashlib.sha256(json.dumps([[t.id, t.seed, t.prompt, t.family] for t in tasks]).encode()).hexdigest()
        assert got[:16] == h, split
        assert [t.id for t in draw_tasks(OrdersTasks(), split, 120, 12345)] == [t.id for t in tasks]


def test_golden_keeps_its_curated_cycle():
    plain = OrdersTasks().tasks("golden", 30, 0)
    assert [t.prompt for t in OrdersTasks().tasks("golden", 30, 0, stratified=True)] == [t.prompt for t in plain]


def test_the_run_config_stratifies_the_runs_and_mentorrl_evals_evaluation_sets(tmp_path):
    cfg = load_config(None, ["eval.stratify=true", "eval.num_tasks=60", f"run_dir={tmp_path / 'run'}"])
    ws = open_workspace(cfg, show_progress=False)
    for split in ("heldout", "hidden"):
        got = ws.eval_tasks(split, 60)
        assert [t.id for t in got] == [t.id for t in OrdersTasks().tasks(split, 60, cfg.eval.seed, stratified=True)]
    assert [t.id for t in ws.eval_tasks("golden", 20)] == [t.id for t in OrdersTasks().tasks("golden", 20, 12345)]
    # `mentorrl eval -c CONFIG` draws its generated sets the same way (golden stays curated)
    ecfg = agent_eval_config(cfg, [EvalSetSpec(kind="hidden", num_tasks=60), EvalSetSpec(kind="golden")])
    assert ecfg.stratify
    hidden = load_eval_set(ecfg.sets[0], OrdersTasks(), ecfg)
    assert _mix(hidden.tasks) == _mix(OrdersTasks().tasks("hidden", 60, ecfg.seed, stratified=True))
    golden = load_eval_set(ecfg.sets[1], OrdersTasks(), ecfg)
    assert [t.id for t in golden.tasks] == [t.id for t in OrdersTasks().tasks("golden", len(golden.tasks), ecfg.seed)]
    # off by default: the unstratified draw
    plain = open_workspace(load_config(None, [f"run_dir={tmp_path / 'plain'}"]), show_progress=False)
    assert [t.id for t in plain.eval_tasks("heldout", 60)] == [t.id for t in OrdersTasks().tasks("heldout", 60, 12345)]
    assert not agent_eval_config(plain.cfg, []).stratify


def test_a_task_source_that_cannot_stratify_is_refused_before_the_first_step(tmp_path):
    cfg = load_config(None, ["env.name=code", "eval.stratify=true", f"run_dir={tmp_path / 'run'}"])
    with pytest.raises(ValueError, match="eval.stratify"):
        open_workspace(cfg, show_progress=False)
