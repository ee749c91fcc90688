"""Issue 41, item 6: a resumed run is never offered a replay entry from a policy version ahead of its
restored learner. The rule lives where a resume reads the buffer (``BufferCheckpoints.restore``), keyed
on the restored policy version, so it holds for any producer that wrote entries ahead of a checkpoint."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from test_replay import traj
from test_resume import TINY_OVERRIDES, _env

from mentorrl.config import load_config
from mentorrl.replay import ReplayBuffer, ReplayConfig
from mentorrl.replay.checkpointing import BufferCheckpoints, ResumeDrops
from mentorrl.train.consistency import batch_checks
from mentorrl.train.rundir import MetricsLog


def _gate_passes(buf: ReplayBuffer, version: int) -> bool:
    """The consistency gate's policy-version check over everything the buffer can offer a learner at ``version``."""
    trajs = buf.sample(len(buf), current_version=version)
    return next(c for c in batch_checks(trajs, version, "orders", "1.0", "") if c.name == "policy_version").passed


def _checkpoints(buf: ReplayBuffer) -> tuple[BufferCheckpoints, list[str]]:
    said: list[str] = []
    return BufferCheckpoints(buf, keep=2, stage="test", say=said.append), said


def test_entries_ahead_of_the_restored_version_are_dropped_even_under_the_mark(tmp_path):
    """A producer wrote entries of v3 and v4 before the checkpoint was taken with the learner at v2
    (as a rollout overlapped with the update may): the mark covers them, the version rule drops them,
    counts them by version and says so; entries up to v2 stay, in order."""
    with ReplayBuffer(tmp_path / "r.sqlite", ReplayConfig(capacity=50)) as buf:
        ck, said = _checkpoints(buf)
        for i, v in enumerate([0, 1, 2, 3, 4, 4, 2]):
            buf.add(traj(i, version=v))
        saved = ck.state()
        buf.add(traj(99, version=5))  # after the checkpoint: the rollback's
        assert not _gate_passes(buf, 2)  # what a resumed learner at v2 would have been offered
        drops = ck.restore(saved, version=2)
        assert _gate_passes(buf, 2)
        assert drops == ResumeDrops(version=2, discarded=1, ahead={3: 1, 4: 2, 5: 1}, by_version_rule=3)
        assert drops.metrics() == {"replay_resume_discarded": 1.0, "replay_resume_ahead_dropped": 4.0}
        assert buf.ids() == ["t-0", "t-1", "t-2", "t-6"]
        assert buf.versions_ahead(2) == {}
        assert any("4 replay entries from policy versions ahead of the restored learner (v2)" in s for s in said)
        assert any("1 of v3, 2 of v4, 1 of v5" in s for s in said)
        assert ck.take_metrics() == drops.metrics() and ck.take_metrics() == {}  # once, on the first step


def test_a_checkpoint_without_marks_still_gets_the_version_rule(tmp_path):
    with ReplayBuffer(tmp_path / "r.sqlite") as buf:
        ck, said = _checkpoints(buf)
        for i, v in enumerate([0, 3, 1, 7]):
            buf.add(traj(i, version=v))
        drops = ck.restore({}, version=1)  # predates marks: the buffer is kept, but not what is ahead
        assert (drops.discarded, drops.ahead, drops.by_version_rule) == (0, {3: 1, 7: 1}, 2)
        assert buf.ids() == ["t-0", "t-2"] and "predates replay-buffer marks" in said[0]


def test_an_evicted_entry_ahead_is_not_brought_back_by_the_rollback(tmp_path):
    """Capacity 2: the entry of v3 is evicted by later inserts after the checkpoint; the rollback would
    restore it, the version rule drops it, and no later rollback brings it back either."""
    with ReplayBuffer(tmp_path / "r.sqlite", ReplayConfig(capacity=2)) as buf:
        ck, _ = _checkpoints(buf)
        buf.add(traj(0, version=3))
        buf.add(traj(1, version=0))
        saved = ck.state()
        buf.add(traj(2, version=1))  # evicts t-0 (v3)
        drops = ck.restore(saved, version=1)
        assert buf.ids() == ["t-1"] and drops.by_version_rule == 1
        buf.rollback(saved["replay"])
        assert buf.ids() == ["t-1"]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(0, 6), max_size=12),  # versions written before the checkpoint
    st.lists(st.integers(0, 9), max_size=8),  # versions written after it (discarded steps)
    st.integers(0, 6),  # the restored learner's version
    st.integers(1, 8),  # capacity
)
def test_after_a_restore_nothing_is_ahead_and_the_rest_is_the_checkpoints(before, after, version, capacity):
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d, ReplayBuffer(Path(d) / "r.sqlite", ReplayConfig(capacity=capacity)) as buf:
        ck, _ = _checkpoints(buf)
        for i, v in enumerate(before):
            buf.add(traj(i, version=v))
        at_checkpoint = [(t.id, t.policy_version) for t in buf.trajectories()]
        saved = ck.state()
        for i, v in enumerate(after):
            buf.add(traj(f"a{i}", version=v))
        ahead_then = buf.versions_ahead(version)
        drops = ck.restore(saved, version=version)
        assert drops.ahead == ahead_then
        assert [(t.id, t.policy_version) for t in buf.trajectories()] == [
            (i, v) for i, v in at_checkpoint if v <= version
        ]
        assert drops.discarded <= len(after)


# ------------------------------------------------------------------ a real SIGKILL -----
# The real CLI with one fault injected: right after the replay buffer committed an entry from a policy
# version ahead of the last SAO checkpoint's learner (i.e. between that write and the next checkpoint),
# the process SIGKILLs itself. What it knew at that moment goes to the marker file first.
KILL_AHEAD_CLI = """
import json, os, signal
from mentorrl.replay import buffer as buffer_mod
from mentorrl.train import stage_checkpoints
seen = {"version": None, "step": None}
_save, _add = stage_checkpoints.save_checkpoint, buffer_mod.ReplayBuffer.add
def save_checkpoint(stage_dir, step, model, tokenizer, state):
    out = _save(stage_dir, step, model, tokenizer, state)
    if stage_dir.name == "sao":
        seen.update(version=state["learner"]["version"], step=step)
    return out
def add(self, traj, *args, **kwargs):
    res = _add(self, traj, *args, **kwargs)
    if res and seen["version"] is not None and traj.policy_version > seen["version"]:
        with open(os.environ["MENTORRL_TEST_MARKER"], "w") as f:
            json.dump({**seen, "entry": traj.id, "entry_version": traj.policy_version}, f)
        os.kill(os.getpid(), signal.SIGKILL)
    return res
stage_checkpoints.save_checkpoint, buffer_mod.ReplayBuffer.add = save_checkpoint, add
from mentorrl.cli import app
app()
"""

KILL_STEPS = 20
KILL_RECIPE = [
    "recipe=[sao]",
    f"sao.steps={KILL_STEPS}",
    "sao.batch_size=3",
    "sao.rollout.slots=3",
    "sao.rollout.sync_every=1",
    "sao.critic.warmup_steps=1",
    # room for the learner to move past the checkpoint's version (entries lag it by ~2) before the next one
    "sao.checkpoint_every=10",
    "sao.replay={}",
    "sao.mix={online: 1, replay: 1}",
    "sao.sample_trajectories=0",
    "audit.eval_every=0",
]


def _ahead_rows(db, version: int) -> list[tuple[str, int]]:
    with sqlite3.connect(db) as conn:
        q = "SELECT traj_id, policy_version FROM entries WHERE policy_version > ? ORDER BY seq"
        return [(r[0], int(r[1])) for r in conn.execute(q, (version,))]


def _strip_replay_marks(ckpt) -> None:
    """Make ``ckpt`` look written before replay marks existed (its checksums rewritten to match)."""
    import torch

    from mentorrl.core.checksums import write_manifest

    state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    for key in ("replay", "replay_marks"):
        state["extra"]["stage"].pop(key)
    torch.save(state, ckpt / "trainer_state.pt")
    write_manifest(ckpt)


def _resume(tmp_path, args) -> str:
    res = subprocess.run(
        [sys.executable, "-m", "mentorrl.cli", *args, "--resume"],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = " ".join((res.stdout + res.stderr).split())
    assert res.returncode == 0, out
    return out


@pytest.mark.slow
def test_sao_killed_between_a_buffer_write_and_the_next_checkpoint_resumes(tmp_path):
    """A real SAO process is SIGKILLed right after the buffer committed an entry from a policy version
    ahead of its last checkpoint. The resumed run drops every such entry before its first step (counted
    in the log and in the first step's record), never trains on one (the consistency gate would raise),
    and runs to the end with every step logged once and the version counter continued. The same holds
    when the checkpoint carries no replay mark (written before marks existed): then the version rule
    alone drops them."""
    import shutil

    run_dir = tmp_path / "run"
    cfg = load_config(None, TINY_OVERRIDES + KILL_RECIPE + [f"run_dir={run_dir}"])
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    marker = tmp_path / "killed.json"
    env = dict(_env(), MENTORRL_TEST_MARKER=str(marker))
    args = ["demo", "--config", str(cfg_path), "--no-eval"]
    proc = subprocess.run(
        [sys.executable, "-c", KILL_AHEAD_CLI, *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    killed = json.loads(marker.read_text())
    assert killed["entry_version"] > killed["version"]
    db = run_dir / "sao" / "replay.sqlite"
    ahead = _ahead_rows(db, killed["version"])
    assert (killed["entry"], killed["entry_version"]) in ahead  # committed: it survived the kill
    assert len(MetricsLog(run_dir / "metrics.jsonl").read("sao")) > killed["step"]  # past the checkpoint
    unmarked = tmp_path / "unmarked"
    shutil.copytree(tmp_path, unmarked, ignore=shutil.ignore_patterns("unmarked"))

    for where, by_rule in ((tmp_path, 0), (unmarked, len(ahead))):
        if by_rule:
            cfg_u = yaml.safe_load((unmarked / "cfg.yaml").read_text())
            cfg_u["run_dir"] = str(unmarked / "run")
            (unmarked / "cfg.yaml").write_text(yaml.safe_dump(cfg_u, sort_keys=False))
            _strip_replay_marks(unmarked / "run" / "sao" / "checkpoints" / f"step-{killed['step']:06d}")
        out = _resume(where, ["demo", "--config", str(where / "cfg.yaml"), "--no-eval"])
        assert f"resuming from step-{killed['step']:06d}" in out, out
        said = f"{len(ahead)} replay entries from policy versions ahead of the restored learner (v{killed['version']})"
        assert said in out and f"{by_rule} not covered by the checkpoint's mark" in out, out
        sao = MetricsLog(where / "run" / "metrics.jsonl").read("sao")
        assert [r["step"] for r in sao] == list(range(1, KILL_STEPS + 1))
        first = sao[killed["step"]]  # the first step after the resume
        assert first["replay_resume_ahead_dropped"] == len(ahead)
        assert all("replay_resume_ahead_dropped" not in r for r in sao if r is not first)
        assert first["policy_version"] >= killed["version"]
        for prev, cur in zip(sao, sao[1:]):
            assert cur["policy_version"] == prev["policy_version"] + cur["actor_updated"]
        with ReplayBuffer(where / "run" / "sao" / "replay.sqlite") as buf:  # none of them came back
            assert not {i for i, _ in ahead} & set(buf.ids())
