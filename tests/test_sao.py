"""SAO and the asynchronous actor/learner: staleness rules, weight sync, the rollout worker, the stage."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from test_resume import TINY_OVERRIDES
from typer.testing import CliRunner

from mentorrl.cli import app
from mentorrl.config import ConfigError, SAOConfig, load_config
from mentorrl.models.batch import collate, forward_logprobs
from mentorrl.replay.buffer import ReplayBuffer
from mentorrl.rollout import Rollout
from mentorrl.train.async_rl import RolloutPool, WeightBox, lag_histogram, staleness_weights
from mentorrl.train.rundir import MetricsLog
from mentorrl.trajectory import read_jsonl, write_jsonl


def test_staleness_drop_and_downweight():
    lags = [0, 1, 2, 3, 5]
    assert staleness_weights(lags, 2, "drop") == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert staleness_weights(lags, 2, "downweight", decay=0.5) == [1.0, 1.0, 1.0, 0.5, 0.125]
    assert staleness_weights(lags, 0, "downweight", decay=0.9) == pytest.approx([1.0, 0.9, 0.81, 0.729, 0.9**5])
    with pytest.raises(ValueError, match="future"):
        staleness_weights([1, -1], 2, "drop")
    with pytest.raises(ValueError, match="staleness mode"):
        staleness_weights([0], 2, "ignore")
    assert lag_histogram([2, 0, 2, 1, 0, 0]) == {"0": 3, "1": 1, "2": 2}


def test_weight_box_versions(model):
    box = WeightBox()
    assert box.newer_than(-1) is None and box.version == -1
    box.publish(model, 0)
    version, state = box.newer_than(-1)
    assert version == 0 and box.newer_than(0) is None
    assert all(v.device.type == "cpu" for v in state.values())
    p = next(iter(state))
    assert state[p].data_ptr() != model.state_dict()[p].data_ptr()  # a copy: training does not race the worker
    with pytest.raises(ValueError, match="went back"):
        box.publish(model, -3)


def _worker(model, contract, orders_entry, tasks, box, slots=4, queue_size=64, make_env=None, workers=1):
    return RolloutPool(
        model,
        Rollout(contract, make_env or orders_entry.make_env),
        iter(tasks),
        box,
        slots=slots,
        queue_size=queue_size,
        seed=3,
        workers=workers,
    )


def _recomputed_gap(model, trajs, pad_id) -> float:
    with torch.no_grad():
        lp = forward_logprobs(model, collate(trajs, pad_id), 1.0)[0]
    gap = 0.0
    for b, t in enumerate(trajs):
        for i, m in enumerate(t.loss_mask):
            if m:
                gap = max(gap, abs(lp[b, i].item() - t.logprobs[i]))
    return gap


def test_worker_follows_published_weights_and_tags_versions(
    tool_happy_model, make_contract, orders_entry, orders_tasks
):
    """Trajectories started after a sync carry the new version, and their recorded log-probs are
    exactly the new weights' (the worker reloads weights and re-prefills its live rows)."""
    contract = make_contract()
    box = WeightBox()
    box.publish(tool_happy_model, 0)
    w = _worker(tool_happy_model, contract, orders_entry, orders_tasks * 3, box)
    w.start()
    try:
        first = w.get(4, timeout_s=60)
        assert {t.policy_version for t in first} == {0}
        assert _recomputed_gap(tool_happy_model, first, contract.pad_token_id) < 1e-4
        changed = copy.deepcopy(tool_happy_model)
        with torch.no_grad():
            changed.lm_head.weight.mul_(1.5)  # a visibly different policy
        box.publish(changed, 1)
        later = []
        for _ in range(40):
            later += w.get(1, timeout_s=60)
            if sum(t.policy_version == 1 for t in later) >= 3:
                break
        new = [t for t in later if t.policy_version == 1]
        assert len(new) >= 3 and w.syncs == 2
        assert _recomputed_gap(changed, new, contract.pad_token_id) < 1e-4
        assert _recomputed_gap(tool_happy_model, new, contract.pad_token_id) > 1e-2
    finally:
        w.close()
    assert not w.is_alive()


def test_worker_failure_reaches_the_learner(tool_happy_model, make_contract, orders_entry, orders_tasks):
    def broken_env():
        raise OSError("database is locked")

    box = WeightBox()
    box.publish(tool_happy_model, 0)
    w = _worker(tool_happy_model, make_contract(), orders_entry, orders_tasks, box, make_env=broken_env)
    w.start()
    with pytest.raises(RuntimeError, match="database is locked"):
        w.get(1, timeout_s=30)
    w.close()


def test_worker_backpressure_and_prompt_stop(tool_happy_model, make_contract, orders_entry, orders_tasks):
    box = WeightBox()
    box.publish(tool_happy_model, 0)
    w = _worker(tool_happy_model, make_contract(), orders_entry, orders_tasks * 5, box, queue_size=2)
    w.start()
    try:
        w.get(1, timeout_s=60)
        import time

        time.sleep(1.0)
        assert w.out.qsize() <= 2  # the worker waits for the learner instead of running ahead
    finally:
        w.close()
    assert not w.is_alive()


def test_sao_config_errors():
    with pytest.raises(ConfigError, match="needs a replay buffer"):
        load_config(None, ["sao.mix={online: 1, replay: 0.5}"])
    with pytest.raises(ConfigError, match="unknown sources"):
        load_config(None, ["sao.mix={online: 1, teacher: 1}"])
    with pytest.raises(ConfigError, match="mix.online must be > 0"):
        load_config(None, ["sao.mix={online: 0, expert: 1}"])
    with pytest.raises(ConfigError, match="stale"):
        load_config(None, ["sao.rollout.stale=ignore"])
    assert SAOConfig().mix == {"online": 1.0, "expert": 0.0, "replay": 0.0}


SAO_RECIPE = [
    "recipe=[sft, sao]",
    "sao.steps=4",
    "sao.batch_size=4",
    "sao.rollout.slots=4",
    "sao.critic.warmup_steps=1",
    "sao.checkpoint_every=2",
    "sao.replay={}",
    "sao.mix={online: 1, replay: 0.5, expert: 0.5}",
    "sao.num_demos=8",
    "eval.batch_size=4",
    "sao.sample_trajectories=4",
    "env.latency={kind: pareto, median_s: 0.01, alpha: 1.5, max_s: 0.2}",
    "sao.segment_replay={turns_per_segment: 1, min_tokens: 0}",
]


@pytest.mark.slow
def test_sft_sao_recipe_end_to_end_and_check(tmp_path):
    args = ["demo", "--run-dir", str(tmp_path / "run")]
    for ov in TINY_OVERRIDES + SAO_RECIPE:
        args += ["--set", ov]
    res = CliRunner().invoke(app, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    run = tmp_path / "run"
    sao = MetricsLog(run / "metrics.jsonl").read("sao")
    assert [r["step"] for r in sao] == [1, 2, 3, 4]
    assert [r["actor_updated"] for r in sao] == [0.0, 1.0, 1.0, 1.0]  # one critic warm-up step
    assert [r["policy_version"] for r in sao] == [0.0, 1.0, 2.0, 3.0]
    for r in sao:
        assert {
            "masked_frac",
            "ratio_p05",
            "ratio_p50",
            "ratio_p95",
            "policy_lag_mean",
            "explained_variance",
            "traj_per_s",
            "buffer_size",
        } <= set(r)
        assert sum(r["policy_lag_hist"].values()) == r["rollouts"] == 4
        assert r["expert_items"] + r["replay_items"] == 4 and r["online_items"] + r["stale_dropped"] == 4
    # nothing to replay before the first add: expert data fills the replay share; then 2 + 2
    assert (sao[0]["replay_items"], sao[0]["expert_items"]) == (0, 4)
    assert all((r["replay_items"], r["expert_items"]) == (2, 2) for r in sao[1:])
    consumed = [json.loads((run / "sao" / "consumed" / f"step-{s:06d}.json").read_text()) for s in range(1, 5)]
    online = [i for c in consumed for i in c["online"]]
    assert len(online) == len(set(online))
    for c in consumed[1:]:
        assert not set(c["replay"]) & set(c["online"])
    with ReplayBuffer(run / "sao" / "replay.sqlite") as buf:
        assert set(online) <= set(buf.ids())
    assert (run / "sao" / "critic" / "value_model.safetensors").exists()
    report = json.loads((run / "report.json").read_text())
    assert sum(report["async"]["policy_lag_hist"].values()) == report["async"]["trajectories"] == 16
    assert report["audit"]["end_to_end"]["heldout_after"] == report["evals"]["sao"]["success"]
    assert "Asynchronous training (SAO)" in (run / "report.md").read_text()
    assert (run / "curves.png").read_bytes()[:4] == b"\x89PNG"

    checked = CliRunner().invoke(app, ["check", str(run)])
    assert checked.exit_code == 0 and "sao-step-000004" in checked.output and "all 4 recorded" in checked.output, (
        checked.output
    )
    # a doctored batch: a tool-observation token made trainable, and a policy version from the future
    sample = run / "samples" / "sao-step-000002.jsonl"
    trajs = list(read_jsonl(sample))
    segs = trajs[0].segments  # the tiny SFT policy may make no tool call: then a prompt token
    seg = next((s for s in segs if s.role == "observation"), next(s for s in segs if s.role != "policy"))
    trajs[0].loss_mask[seg.start] = 1
    trajs[-1].policy_version = 99
    write_jsonl(sample, trajs)
    checked = CliRunner().invoke(app, ["check", str(run)])
    assert checked.exit_code == 1
    assert "observation_mask" in checked.output and "policy_version" in checked.output


CRASH_STEPS = 40
CRASH_RECIPE = [
    "recipe=[sft, sao]",
    f"sao.steps={CRASH_STEPS}",
    "sao.batch_size=4",
    "sao.rollout.slots=4",
    "sao.critic.warmup_steps=1",
    "sao.checkpoint_every=1",
    "sao.replay={}",
    "sao.mix={online: 1, replay: 0.5}",
    "eval.batch_size=4",
    "sao.sample_trajectories=4",
    "env.latency={kind: pareto, median_s: 0.1, alpha: 1.5, max_s: 1.0}",
]


@pytest.mark.slow
def test_sao_resumes_after_sigkill_at_random_moments(tmp_path):
    """A real training process is SIGKILLed at seeded-random moments (wherever it is: the reward
    audit, SFT, evaluation, mid-SAO step, a checkpoint or a buffer write), resumed with --resume
    each time, and finally run to the end: every step is logged exactly once, the replay buffer
    is intact, and no trajectory is trained on as online data by two steps."""
    import os
    import random
    import signal
    import sqlite3
    import subprocess
    import sys
    import time

    import yaml
    from test_resume import _env

    run_dir = tmp_path / "run"
    cfg = load_config(None, TINY_OVERRIDES + CRASH_RECIPE + [f"run_dir={run_dir}"])
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    cmd = [sys.executable, "-m", "mentorrl.cli", "demo", "--config", str(cfg_path)]
    rng = random.Random(20261130)
    kills = 0
    sao_steps_seen_at_kill = []

    def sao_logged() -> int:
        return len(MetricsLog(run_dir / "metrics.jsonl").read("sao")) if (run_dir / "metrics.jsonl").exists() else 0

    for attempt in range(4):
        proc = subprocess.Popen(
            cmd + (["--resume"] if attempt else []),
            cwd=tmp_path,
            env=_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        if attempt == 0:
            time.sleep(rng.uniform(1.0, 5.0))  # somewhere in start-up, the reward audit or SFT
        else:  # somewhere inside the SAO steps: a random delay after the next step was logged
            target, deadline = sao_logged() + rng.randint(1, 3), time.monotonic() + 180
            while sao_logged() < target and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(rng.uniform(0.0, 0.6))
        if proc.poll() is not None:
            break  # finished before this kill: the loop has nothing left to interrupt
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        kills += 1
        sao_steps_seen_at_kill.append(sao_logged())
    assert kills >= 3, "the run finished before it could be interrupted three times: nothing was tested"
    assert any(0 < n < CRASH_STEPS for n in sao_steps_seen_at_kill), f"no kill landed mid-SAO: {sao_steps_seen_at_kill}"
    res = subprocess.run(cmd + ["--resume"], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr

    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]  # no torn line survives
    assert [r["step"] for r in records if r["stage"] == "sft"] == [1, 2, 3, 4]
    assert [r["step"] for r in records if r["stage"] == "sao"] == list(range(1, CRASH_STEPS + 1))
    assert (run_dir / "sao" / "final" / "DONE").exists() and (run_dir / "eval_sao.json").exists()
    sao = [r for r in records if r["stage"] == "sao"]
    # the version counter continued across restarts: +1 after every step that updated the actor
    for prev, cur in zip(sao, sao[1:]):
        assert cur["policy_version"] == prev["policy_version"] + cur["actor_updated"]
    assert sao[-1]["policy_version"] == sum(r["actor_updated"] for r in sao) > CRASH_STEPS / 2

    db = run_dir / "sao" / "replay.sqlite"
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        ids = [row[0] for row in conn.execute("SELECT traj_id FROM entries")]
    assert len(ids) == len(set(ids))
    online = []
    for step in range(1, CRASH_STEPS + 1):
        consumed = json.loads((run_dir / "sao" / "consumed" / f"step-{step:06d}.json").read_text())
        online += consumed["online"]
        assert not set(consumed["replay"]) & set(consumed["online"])
    assert len(online) == len(set(online)), "a trajectory was trained on as online data by two steps"
    assert set(online) <= set(ids)  # every trained online trajectory is in the buffer
    sampled = [
        json.loads(x)["id"]
        for f in sorted((run_dir / "samples").glob("sao-step-*.jsonl"))
        for x in f.read_text().splitlines()
    ]
    assert len(sampled) == len(set(sampled))
    with ReplayBuffer(db) as buf:  # and the buffer opens and samples after all of it
        assert len(buf) == len(ids) and len(buf.sample(4, current_version=CRASH_STEPS)) == 4


def test_two_workers_share_one_task_stream(tool_happy_model, make_contract, orders_entry, orders_tasks):
    """Two rollout threads draw from one task stream (each task once) into one queue."""
    box = WeightBox()
    box.publish(tool_happy_model, 0)
    tasks = orders_tasks[:12]
    pool = _worker(tool_happy_model, make_contract(), orders_entry, tasks, box, slots=3, workers=2)
    pool.start()
    try:
        got = pool.get(12, timeout_s=120)
    finally:
        pool.close()
    assert sorted(t.task_id for t in got) == sorted(t.id for t in tasks)
    assert all(w.produced > 0 for w in pool.workers) and pool.produced == 12
    assert not pool.is_alive()
    with pytest.raises(ValueError, match="workers"):
        RolloutPool(
            tool_happy_model, Rollout(make_contract(), orders_entry.make_env), iter([]), box, 1, 1, 0, workers=0
        )


class _Killed(Exception):
    pass


def _sao_workspace(tmp_path, tokenizer, orders_entry, overrides):
    import io

    from rich.console import Console

    from mentorrl.train.workspace import Workspace

    cfg = load_config(None, TINY_OVERRIDES + overrides + [f"run_dir={tmp_path / 'run'}"])
    out = io.StringIO()
    ws = Workspace(
        cfg=cfg,
        run_dir=tmp_path / "run",
        env_entry=orders_entry,
        console=Console(file=out, width=300),
        show_progress=False,
    )
    ws.run_dir.mkdir(parents=True, exist_ok=True)
    ws.bind_tokenizer(tokenizer)
    return ws, out


FAST_SAO = [
    "sao.steps=4",
    "sao.batch_size=3",
    "sao.rollout.slots=3",
    "sao.critic.warmup_steps=1",
    "sao.checkpoint_every=2",
    "sao.replay={capacity: 7}",
    "sao.mix={online: 1, replay: 1}",
    "sao.sample_trajectories=0",
    "audit.eval_every=0",
]


def test_sao_resume_rolls_the_replay_buffer_back_to_the_checkpoint(
    tmp_path, tokenizer, orders_entry, model, monkeypatch
):
    """Killed in step 3 after its trajectories entered the (real SQLite) buffer, with the step-2
    checkpoint on disk: the resumed run sees the buffer exactly as it was at the checkpoint (the
    discarded step's entries are gone, what they evicted is back), and no entry ever carries a
    policy version newer than the learner that samples it."""
    from mentorrl.train.recipes import sao as sao_mod

    ws, out = _sao_workspace(tmp_path, tokenizer, orders_entry, FAST_SAO)
    db = ws.run_dir / "sao" / "replay.sqlite"
    real_record = sao_mod._record_batch
    at_checkpoint: dict = {}
    discarded: list[str] = []

    def record_then_die(run_dir, step, items, n):
        real_record(run_dir, step, items, n)
        if step == 2:  # the step-2 checkpoint follows this step: the buffer as it will be recorded
            with ReplayBuffer(db) as buf:
                at_checkpoint.update(ids=buf.ids(), versions=[t.policy_version for t in buf.trajectories()])
        if step == 3:
            with ReplayBuffer(db) as buf:
                discarded.extend(i for i in buf.ids() if i not in at_checkpoint["ids"])
            raise _Killed  # after this step's buffer writes, before its checkpoint

    monkeypatch.setattr(sao_mod, "_record_batch", record_then_die)
    with pytest.raises(_Killed):
        sao_mod.sao_stage(ws, copy.deepcopy(model), resume=False)
    assert discarded, "the killed step added nothing to the buffer: nothing was tested"
    with ReplayBuffer(db) as buf:
        assert len(buf) == 7  # at capacity: the discarded step's inserts evicted checkpointed entries
        evicted_by_discarded = set(at_checkpoint["ids"]) - set(buf.ids())
    assert evicted_by_discarded

    seen_at_first_step: dict = {}
    sampled_versions: list[tuple[int, int]] = []
    real_hybrid = sao_mod._hybrid

    def watching_hybrid(s, online, demos, buffer, current, rng):
        if not seen_at_first_step:
            seen_at_first_step.update(ids=buffer.ids(), versions=[t.policy_version for t in buffer.trajectories()])
        items = real_hybrid(s, online, demos, buffer, current, rng)
        sampled_versions.extend((it.trajectory.policy_version, current) for it in items if it.source == "replay")
        return items

    monkeypatch.setattr(sao_mod, "_record_batch", real_record)
    monkeypatch.setattr(sao_mod, "_hybrid", watching_hybrid)
    ws2, out2 = _sao_workspace(tmp_path, tokenizer, orders_entry, FAST_SAO)
    sao_mod.sao_stage(ws2, copy.deepcopy(model), resume=True)
    assert "resuming from step-000002" in out2.getvalue()
    assert seen_at_first_step == at_checkpoint  # the checkpoint's buffer, evicted entries back, in order
    assert all(v <= current for v, current in sampled_versions)
    replayed = {
        i
        for s in (3, 4)
        for i in json.loads((ws.run_dir / "sao" / "consumed" / f"step-{s:06d}.json").read_text())["replay"]
    }
    assert not replayed & set(discarded), "an entry of a discarded step was replayed"
    with ReplayBuffer(db) as buf:
        assert not set(buf.ids()) & set(discarded)
    sao = MetricsLog(ws.run_dir / "metrics.jsonl").read("sao")
    assert [r["step"] for r in sao] == [1, 2, 3, 4]


def test_sao_resume_refuses_a_replaced_replay_buffer_naming_it(tmp_path, tokenizer, orders_entry, model, monkeypatch):
    from mentorrl.replay import ReplayBufferError
    from mentorrl.train.recipes import sao as sao_mod

    ws, _ = _sao_workspace(tmp_path, tokenizer, orders_entry, FAST_SAO)
    real_record = sao_mod._record_batch

    def die_in_step_3(run_dir, step, items, n):
        real_record(run_dir, step, items, n)
        if step == 3:
            raise _Killed

    monkeypatch.setattr(sao_mod, "_record_batch", die_in_step_3)
    with pytest.raises(_Killed):
        sao_mod.sao_stage(ws, copy.deepcopy(model), resume=False)
    db = ws.run_dir / "sao" / "replay.sqlite"
    for f in db.parent.glob("replay.sqlite*"):
        f.unlink()
    ReplayBuffer(db).close()  # another (empty) buffer in its place
    monkeypatch.setattr(sao_mod, "_record_batch", real_record)
    with pytest.raises(ReplayBufferError, match="replay.sqlite.*replaced"):
        sao_mod.sao_stage(ws, copy.deepcopy(model), resume=True)
    db.write_bytes(b"garbage" * 100)
    with pytest.raises(ReplayBufferError, match="replay.sqlite"):
        sao_mod.sao_stage(ws, copy.deepcopy(model), resume=True)
