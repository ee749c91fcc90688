"""Crash safety of the self-evolving loop (``evolve``): a resumed stage sees its persisted state
(the SQLite replay buffer, ``versions.json`` and ``versions/vN``) exactly as the restored
checkpoint recorded it, and a stage started from scratch starts from an empty buffer.

The stage runs for real (tiny model, real rollouts, real SQLite buffer, real checkpoints); the
only stand-in is the verifier's verdict, forced to "success" for every other training rollout,
because the buffer admits only verified successes and a random-init model never succeeds."""

from __future__ import annotations

import copy
import io
import json

import pytest
from test_resume import TINY_OVERRIDES

from mentorrl.config import load_config
from mentorrl.replay.buffer import ReplayBuffer
from mentorrl.train import loop as loop_mod
from mentorrl.train import stage_helpers
from mentorrl.train.learner import Learner
from mentorrl.train.rundir import MetricsLog

FAST_EVOLVE = [
    "evolve.iterations=2",
    "evolve.steps_per_iteration=2",
    "evolve.tasks_per_step=2",
    "evolve.samples_per_task=2",
    "evolve.eval_tasks=2",
    "evolve.window=4",
    "evolve.raise_above=0.01",
    "evolve.lower_below=0.0",
    "evolve.replay_batch=2",
    "evolve.accept_margin=1.0",
    "eval.batch_size=4",
]


class _Killed(Exception):
    pass


def _workspace(tmp_path, tokenizer, orders_entry):
    from rich.console import Console

    from mentorrl.train.workspace import Workspace

    cfg = load_config(None, TINY_OVERRIDES + FAST_EVOLVE + [f"run_dir={tmp_path / 'run'}"])
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


def _half_verified(real, on_call=None):
    """``collect_group`` (the stage's training rollouts; held-out checks are left alone) whose every
    other trajectory is verified a success (so the buffer admits it)."""

    def collect(*args, **kwargs):
        if on_call is not None:
            on_call()
        grp = real(*args, **kwargs)
        return grp._replace(  # a Collected record (a NamedTuple)
            trajs=[
                t.model_copy(update={"reward": t.reward.model_copy(update={"success": True})}) if i % 2 == 0 else t
                for i, t in enumerate(grp.trajs)
            ]
        )

    return collect


def _snapshot(run_dir) -> dict:
    """The evolve stage's persisted state on disk: buffer entries, versions.json, version dirs."""
    root = run_dir / "evolve"
    with ReplayBuffer(root / "replay.sqlite") as buf:
        ids = buf.ids()
        rejections = buf.stats().rejections
    versions = json.loads((root / "versions.json").read_text()) if (root / "versions.json").exists() else None
    dirs = sorted(p.name for p in (root / "versions").iterdir()) if (root / "versions").is_dir() else []
    return {"ids": ids, "rejections": rejections, "versions": versions, "dirs": dirs}


def _run_killed_at_the_step_4_checkpoint(tmp_path, tokenizer, orders_entry, model, monkeypatch):
    """Runs evolve until it dies writing the step-4 checkpoint (after iteration 2 was closed:
    its buffer entries, its ``versions.json`` entry and ``versions/v2`` are on disk). Returns the
    persisted state as the step-2 checkpoint recorded it, and the state at the kill."""
    from mentorrl.train import stage_checkpoints as stages_mod
    from mentorrl.train.recipes import evolve as evolve_mod

    ws, _ = _workspace(tmp_path, tokenizer, orders_entry)
    real_save = stages_mod.save_checkpoint
    seen: dict = {}

    def save_then_die(stage_dir, step, *a, **kw):
        if step == 4:
            seen["killed"] = _snapshot(ws.run_dir)
            raise _Killed  # dies before the step-4 checkpoint is written: resume restores step 2
        seen["checkpoint"] = _snapshot(ws.run_dir)
        return real_save(stage_dir, step, *a, **kw)

    monkeypatch.setattr(stages_mod, "save_checkpoint", save_then_die)
    monkeypatch.setattr(loop_mod, "collect_group", _half_verified(stage_helpers.collect_group))
    with pytest.raises(_Killed):
        evolve_mod.evolve_stage(ws, copy.deepcopy(model), resume=False)
    monkeypatch.setattr(stages_mod, "save_checkpoint", real_save)
    at_ckpt, killed = seen["checkpoint"], seen["killed"]
    # the test tests something: the discarded steps added entries and closed iteration 2
    assert at_ckpt["ids"] and set(killed["ids"]) > set(at_ckpt["ids"])
    assert [v["version"] for v in at_ckpt["versions"]] == [0, 1] and at_ckpt["dirs"] == ["v0", "v1"]
    assert [v["version"] for v in killed["versions"]] == [0, 1, 2] and killed["dirs"] == ["v0", "v1", "v2"]
    return ws, at_ckpt, killed


def test_evolve_resume_restores_buffer_and_versions_to_the_checkpoint(
    tmp_path, tokenizer, orders_entry, model, monkeypatch
):
    """Killed while writing the step-4 checkpoint, with the step-2 one on disk: the resumed stage
    starts its first redone step from the checkpoint's buffer (entries of the discarded steps 3-4
    gone, rejection counts restored), ``versions.json`` and ``versions/`` as at the checkpoint,
    never replays a discarded entry, and finishes with a consistent version list."""
    from mentorrl.train.recipes import evolve as evolve_mod

    _, at_ckpt, killed = _run_killed_at_the_step_4_checkpoint(tmp_path, tokenizer, orders_entry, model, monkeypatch)
    discarded = set(killed["ids"]) - set(at_ckpt["ids"])

    ws, out = _workspace(tmp_path, tokenizer, orders_entry)
    first: dict = {}

    def on_rollout():
        if not first:
            first.update(_snapshot(ws.run_dir))

    replayed: list[str] = []
    real_sft = Learner.sft_step

    def watching_sft(self, batch, *a, **kw):
        replayed.extend(t.id for t in batch)
        return real_sft(self, batch, *a, **kw)

    monkeypatch.setattr(loop_mod, "collect_group", _half_verified(stage_helpers.collect_group, on_rollout))
    monkeypatch.setattr(Learner, "sft_step", watching_sft)
    evolve_mod.evolve_stage(ws, copy.deepcopy(model), resume=True)
    assert "resuming from step-000002" in out.getvalue()
    assert first == at_ckpt  # buffer (same entries, same order, same counts), versions.json and versions/ dirs
    assert replayed and not set(replayed) & discarded, "an entry of a discarded step was replayed"
    end = _snapshot(ws.run_dir)
    assert not set(end["ids"]) & discarded
    assert [v["version"] for v in end["versions"]] == [0, 1, 2] and end["dirs"] == ["v0", "v1", "v2"]
    assert [r["step"] for r in MetricsLog(ws.run_dir / "metrics.jsonl").read("evolve")] == [1, 2, 3, 4]


def test_evolve_fresh_start_empties_the_buffer_of_an_earlier_run(tmp_path, tokenizer, orders_entry, model, monkeypatch):
    """A stage started from step 0 (no --resume) in a run dir that holds an earlier attempt's
    buffer and versions starts from an empty buffer and only its own versions."""
    from mentorrl.train.recipes import evolve as evolve_mod

    _run_killed_at_the_step_4_checkpoint(tmp_path, tokenizer, orders_entry, model, monkeypatch)
    ws, _ = _workspace(tmp_path, tokenizer, orders_entry)
    first: dict = {}

    def on_rollout():
        first.update(_snapshot(ws.run_dir))
        raise _Killed  # seen what the first step starts from: enough

    monkeypatch.setattr(loop_mod, "collect_group", _half_verified(stage_helpers.collect_group, on_rollout))
    with pytest.raises(_Killed):
        evolve_mod.evolve_stage(ws, copy.deepcopy(model), resume=False)
    assert first["ids"] == [] and first["rejections"] == {}
    assert [v["version"] for v in first["versions"]] == [0] and first["dirs"] == ["v0"]


def test_evolve_resume_refuses_a_replaced_replay_buffer_naming_it(
    tmp_path, tokenizer, orders_entry, model, monkeypatch
):
    from mentorrl.replay import ReplayBufferError
    from mentorrl.train.recipes import evolve as evolve_mod

    ws, _, _ = _run_killed_at_the_step_4_checkpoint(tmp_path, tokenizer, orders_entry, model, monkeypatch)
    db = ws.run_dir / "evolve" / "replay.sqlite"
    for f in db.parent.glob("replay.sqlite*"):
        f.unlink()
    ReplayBuffer(db).close()  # another (empty) buffer in its place
    with pytest.raises(ReplayBufferError, match="replay.sqlite.*replaced"):
        evolve_mod.evolve_stage(ws, copy.deepcopy(model), resume=True)
