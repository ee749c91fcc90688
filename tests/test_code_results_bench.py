"""bench/smollm2_code_results.py: a seed merged from its run directory keeps its per-task outcomes, and finished seeds
pool from the committed file alone, paired task by task."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _bench():
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("smollm2_code_results", BENCH / "smollm2_code_results.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _summary(bits: list[int]) -> dict:
    n = len(bits)
    return {
        "n": n,
        "success": sum(bits) / n,
        "success_ci95": [0.0, 1.0],
        "violation_rate": 0.0,
        "mean_policy_tokens": 10.0,
        "by_group": {"strings": {"n": n, "success": sum(bits) / n}},
    }


def _run(root: Path, seed: int, sft: list[int], grpo: list[int], order=None) -> Path:
    run = root / f"s{seed}"
    run.mkdir()
    (run / "config.yaml").write_text(f"recipe: [sft, grpo]\nseed: {seed}\ngrpo:\n  optim:\n    lr: 2.0e-05\n")
    ids = [f"code-heldout-{i:05d}" for i in range(len(sft))]
    for label, bits, o in (("sft", sft, None), ("grpo", grpo, order)):
        rows = [(t, b) for t, b in zip(ids, bits)]
        if o is not None:
            rows = [rows[i] for i in o]
        lines = [json.dumps({"task_id": t, "reward": {"success": bool(b)}}) for t, b in rows]
        (run / f"eval_{label}.jsonl").write_text("\n".join(lines) + "\n")
        (run / f"eval_{label}.json").write_text(json.dumps(_summary(bits)))
    steps = [{"stage": "grpo", "step_s": 2.0, "task_success": 0.5}, {"stage": "sft", "step_s": 1.0}]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(s) for s in steps) + "\n")
    return run


def test_update_then_pool_pairs_each_seed_task_with_itself(tmp_path):
    b = _bench()
    rng = random.Random(0)
    out = tmp_path / "results.json"
    diffs = []
    for seed in (1, 2):
        sft = [rng.randint(0, 1) for _ in range(40)]
        grpo = [rng.randint(0, 1) for _ in range(40)]
        diffs += [g - s for s, g in zip(sft, grpo)]
        b.update(out, _run(tmp_path, seed, sft, grpo), tmp_path / f"s{seed}", measured_at="abc1234")
    data = json.loads(out.read_text())
    row = data["runs"]["seed1"]
    assert (
        row["commit"] == "abc1234"
        and row["grpo_lr"] == 2e-5
        and row["sft_run"] == "RUNS/s1"
        and len(row["sft_bits"]) == 40
        and row["grpo_steps"]["steps"] == 1
    )
    p = b.pooled(data["runs"], ["seed1", "seed2"])
    assert p["pairs"] == 80 and p["tasks"] == 40 and p["diff"] == pytest.approx(100 * sum(diffs) / 80)
    lo, hi = p["ci95"]
    assert lo <= p["diff"] <= hi
    # the pooled figure equals the paired difference of the per-task outcomes, whatever the keys' order
    assert b.pooled(data["runs"], ["seed2", "seed1"])["diff"] == pytest.approx(p["diff"])


def test_a_paired_difference_is_narrower_than_the_unpaired_spread():
    """The cheapest fake of "paired" is two independent intervals: here GRPO fixes 10 of 200 tasks and breaks none,
    so the paired interval excludes 0 while each arm's own interval is several points wide."""
    b = _bench()
    sft = {f"t{i}": float(i % 2) for i in range(200)}
    grpo = dict(sft)
    for i in range(0, 20, 2):
        grpo[f"t{i}"] = 1.0
    p = b.paired_outcomes(sft, grpo)
    assert p["diff"] == pytest.approx(5.0) and p["ci95"][0] > 0


def test_outcomes_in_another_order_or_on_other_tasks_are_refused(tmp_path):
    b = _bench()
    with pytest.raises(SystemExit, match="same tasks"):
        b.split_seed(_run(tmp_path, 3, [1, 0, 1], [1, 1, 1], order=[2, 1, 0]), tmp_path / "s3")
    with pytest.raises(SystemExit, match="--update first"):
        b.pooled({"seed1": {"sft": {}}}, ["seed1"])
    with pytest.raises(ValueError, match="share no task"):
        b.paired_outcomes({"a": 1.0}, {"b": 0.0})


def test_the_table_lists_a_shared_sft_once_and_every_grpo_with_its_paired_difference(tmp_path):
    b = _bench()
    out = tmp_path / "results.json"
    run = _run(tmp_path, 0, [1, 0, 0, 1], [1, 1, 0, 1])
    b.update(out, run, run, key="seed0_lr2e-5", measured_at="x")
    b.update(out, run, run, key="seed0_again", measured_at="x")
    data = json.loads(out.read_text())
    data["pooled"] = {"all": b.pooled(data["runs"], ["seed0_lr2e-5"])}
    lines = b.table(data).splitlines()
    assert sum("seed 0, SFT" in x for x in lines) == 1
    grpo = [x for x in lines if "GRPO lr 2e-5" in x]
    assert len(grpo) == 2 and all("+25.0 [" in x for x in grpo)
    assert "(4 tasks): +25.0" in lines[-1] and "-" not in lines[-1].split(":")[-1]


def test_seeds_on_the_same_tasks_pool_as_one_observation_per_task():
    """Two seeds with the same outcomes on the same 200 tasks carry no more evidence than one: the clustered
    interval is the one seed's. Concatenating the seeds (the cheap fake) would narrow it by about 1/sqrt(2)."""
    sys.path.insert(0, str(BENCH))
    import _arms

    rng = random.Random(1)
    base = "".join(rng.choice("01") for _ in range(200))
    arm = "".join("1" if rng.random() < 0.6 else b for b in base)
    one = _arms.pooled_bits([("fp", base, arm)])
    two = _arms.pooled_bits([("fp", base, arm), ("fp", base, arm)])
    assert two["diff"] == pytest.approx(one["diff"]) and two["ci95"] == one["ci95"]
    assert two["tasks"] == 200 and two["pairs"] == 400
    concatenated = _arms.paired_bits(base + base, arm + arm)
    assert concatenated["ci95"][1] - concatenated["ci95"][0] < 0.8 * (one["ci95"][1] - one["ci95"][0])
    # seeds on other task lists are distinct draws: their tasks add up
    assert _arms.pooled_bits([("fp", base, arm), ("other", base, arm)])["tasks"] == 400
    with pytest.raises(ValueError):
        _arms.pooled_bits([("fp", base, arm[:-1])])


def test_seeds_merges_each_seed_as_it_finishes_and_a_rerun_skips_them(tmp_path, monkeypatch):
    b = _bench()
    import seeds_lift

    trained = []

    def fake_train(out, seed, overrides, config, ranks=1):  # stands in for a whole `mentorrl train` of the seed
        if seed == 3:
            raise SystemExit("seed 3: killed")
        trained.append(seed)
        run = _run(out, seed, [1, 0, 1, 0], [1, 1, 1, 0])
        run.rename(out / f"seed-{seed}")
        return {"wall_s": 60.0 * ranks, "resumed": False}

    monkeypatch.setattr(seeds_lift, "run_seed", fake_train)
    results, out = tmp_path / "results.json", tmp_path / "runs"
    out.mkdir()
    with pytest.raises(SystemExit, match="seed 3"):
        b.run_seeds(results, out, [1, 2, 3], "lr2e-5", ["grpo.steps=10"], "cfg.yaml")
    held = json.loads(results.read_text())["runs"]
    assert sorted(held) == ["seed1_lr2e-5", "seed2_lr2e-5"] and held["seed1_lr2e-5"]["overrides"] == ["grpo.steps=10"]
    monkeypatch.setattr(seeds_lift, "run_seed", lambda *a: trained.append(a[1]) or fake_train(*a))
    with pytest.raises(SystemExit):
        b.run_seeds(results, out, [1, 2, 3], "lr2e-5", ["grpo.steps=10"], "cfg.yaml")
    assert trained == [1, 2, 3]  # the rerun tried seed 3 alone
    # as 2 ranks: another arm (its launch is part of its overrides), its ranks and wall time on the row
    monkeypatch.setattr(seeds_lift, "run_seed", fake_train)
    (tmp_path / "r2").mkdir()
    b.run_seeds(results, tmp_path / "r2", [1], "steps20", ["grpo.steps=20"], "cfg.yaml", ranks=2)
    row = json.loads(results.read_text())["runs"]["seed1_steps20"]
    assert row["ranks"] == 2 and row["wall_s"] == 120.0 and row["overrides"] == ["--ranks 2", "grpo.steps=20"]


def test_an_evaluation_with_a_task_twice_is_refused_for_pairing_and_kept_whole_in_bits(tmp_path):
    """Pairing by task id needs one outcome a task: a dict would keep the last of two silently."""
    sys.path.insert(0, str(BENCH))
    import _arms

    f = tmp_path / "eval_x.jsonl"
    rows = [("t0", True), ("t1", False), ("t0", False)]
    f.write_text("\n".join(json.dumps({"task_id": t, "reward": {"success": ok}}) for t, ok in rows) + "\n")
    with pytest.raises(ValueError, match="repeated task ids"):
        _arms.task_outcomes(f)
    assert _arms.task_bits(f)[1] == "100"


def test_pool_also_gives_the_over_seeds_interval_with_each_seed_as_one_value(tmp_path):
    """The seeds as the unit (the results page's rule): each run's own paired difference is one value; the pooled
    by-task bootstrap is narrower, and is not the test the table's over-seeds figure reports."""
    b = _bench()
    out = tmp_path / "results.json"
    lifts = {1: 2, 2: 1, 3: 4}  # tasks gained, of 40
    for seed, k in lifts.items():
        sft = [0] * 10 + [1] * 30
        grpo = [1] * k + [0] * (10 - k) + [1] * 30
        b.update(out, _run(tmp_path, seed, sft, grpo), tmp_path / f"s{seed}", measured_at="abc1234")
    p = b.pooled(json.loads(out.read_text())["runs"], ["seed1", "seed2", "seed3"])
    s = p["over_seeds"]
    assert s["diffs"] == pytest.approx([5.0, 2.5, 10.0]) and s["mean"] == pytest.approx(17.5 / 3)
    # Student-t with 2 degrees of freedom: t = 4.303, sd of (5, 2.5, 10) = 3.819
    half = 4.303 * 3.8188 / 3**0.5
    assert s["ci95"][0] == pytest.approx(17.5 / 3 - half, abs=0.01) and s["ci95"][1] == pytest.approx(
        17.5 / 3 + half, abs=0.01
    )
    data = json.loads(out.read_text())
    data["pooled"] = {"all": p}
    assert "over seeds" in b.table(data) and json.loads(json.dumps(p)) == p  # the file keeps it as written


def test_the_zero_shot_row_keeps_its_per_task_outcomes_on_the_seeds_task_fingerprint(tmp_path):
    b = _bench()
    sft = [1, 0, 1, 1]
    run = _run(tmp_path, 1, sft, sft)
    z = tmp_path / "zero"
    z.mkdir()
    ids = [f"code-heldout-{i:05d}" for i in range(4)]
    (z / "trajectories-heldout.jsonl").write_text(
        "".join(json.dumps({"task_id": t, "reward": {"success": i == 2}}) + "\n" for i, t in enumerate(ids))
    )
    overall = {"n": 4, "success": 0.25, "success_ci95": [0.0, 0.7], "tool_calls": 0, "violation_rate": 0.0}
    overall["mean_policy_tokens"] = 300.0
    metrics = {"overall": overall, "by_family": {"strings": {"n": 4, "success": 0.25}}}
    (z / "eval_summary.json").write_text(json.dumps({"sets": {"heldout": {"metrics": metrics, "sampling": {}}}}))
    row = b.zero_shot(z)
    out = tmp_path / "r.json"
    b.update(out, run, run, measured_at="abc")
    assert row["bits"] == "0010" and row["tasks"] == json.loads(out.read_text())["runs"]["seed1"]["tasks"]
    (z / "trajectories-heldout.jsonl").unlink()
    assert "bits" not in b.zero_shot(z)  # the summary alone still gives the row


def test_a_seed_run_as_ranks_is_labelled_so_in_the_table(tmp_path):
    b = _bench()
    out = tmp_path / "r.json"
    b.update(out, _run(tmp_path, 5, [0, 1], [1, 1]), tmp_path / "s5", key="seed5_x", measured_at="abc")
    data = json.loads(out.read_text())
    data["runs"]["seed5_x"]["ranks"] = 2
    assert "| seed 5 (2 ranks), SFT |" in b.table(data) and "| seed 5 (2 ranks), GRPO lr 2e-5 |" in b.table(data)
    data["runs"]["seed5_x"]["overrides"] = ["grpo.steps=20"]  # another design than the first's 10 steps: named
    assert "| seed 5 (2 ranks), GRPO 20 steps, lr 2e-5 |" in b.table(data)
