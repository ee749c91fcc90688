"""The one training loop: seeds, hook order, the learner's policy version, resume of stage state."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mentorrl.train.loop import HOOKS, SEED_SPACE, RLLoop, Stage, StepBatch, StepSeeds, derive_seed


# ------------------------------------------------------------------ seeds -----
@given(st.integers(0, 2**63 - 1), st.text(min_size=1, max_size=12), st.integers(0, 10**6), st.text(max_size=12))
def test_a_seed_is_a_pure_function_of_run_stage_step_and_purpose(run, stage, step, purpose):
    a = StepSeeds(run, stage, step)
    assert a(purpose) == StepSeeds(run, stage, step)(purpose) == a.at(step)(purpose)
    assert 0 <= a(purpose) < SEED_SPACE
    assert a.rng(purpose).random() == StepSeeds(run, stage, step).rng(purpose).random()


@settings(max_examples=200)
@given(st.integers(0, 10**9), st.integers(0, 10**5))
def test_neighbouring_steps_purposes_and_stages_get_unrelated_seeds(run, step):
    """The old ad-hoc formulas (seed * K + 17 * step + c) made streams collide across stages and
    steps; derived seeds differ whenever any part differs."""
    s = StepSeeds(run, "grpo", step)
    seeds = {
        s("tasks"),
        s("rollout"),
        s("minibatches"),
        s.at(step + 1)("tasks"),
        StepSeeds(run, "ppo", step)("tasks"),
        StepSeeds(run + 1, "grpo", step)("tasks"),
        StepSeeds(run, "grpo", None)("tasks"),
    }
    assert len(seeds) == 7


def test_derive_seed_does_not_depend_on_python_hash_randomisation():
    assert derive_seed(0, "grpo", 3, "tasks") == 1079054783  # fixed across processes and versions


# -------------------------------------------------------------------- loop -----
class CountingStage(Stage):
    """A toy stage: records the hooks it sees, does ``updates`` SFT steps on the expert's demonstrations."""

    name = "counting"
    section = "sft"
    update_metrics = ()

    def __init__(self, ws, model, demos, updates=2, steps=4, stop_at=None):
        self.demos, self.n_updates, self._steps, self.stop_at = demos, updates, steps, stop_at
        self.seen: list[tuple[int, str]] = []
        self.counter = {"steps_seen": 0}
        super().__init__(ws, model)

    @property
    def steps(self):
        return self._steps

    @property
    def checkpoint_every(self):
        return 2

    def make_pool(self):
        return []

    def tasks(self, b: StepBatch):
        self.seen.append((b.step, "tasks"))

    def rollout(self, b):
        self.seen.append((b.step, "rollout"))
        b.trajs = self.demos[:2]

    def score(self, b):
        self.seen.append((b.step, "score"))
        if self.stop_at is not None and b.step == self.stop_at:
            b.stop = True

    def advantages(self, b):
        self.seen.append((b.step, "advantages"))

    def update(self, b):
        self.seen.append((b.step, "update"))
        for _ in range(self.n_updates):
            b.updates.append(self.learner.sft_step(b.trajs))
        b.metrics["loss"] = b.updates[-1]["loss"]

    def after(self, b):
        self.seen.append((b.step, "after"))
        self.counter["steps_seen"] += 1
        b.metrics["steps_seen"] = float(self.counter["steps_seen"])

    def state_dict(self):
        return dict(self.counter)

    def load_state_dict(self, state):
        self.counter.update(state)


@pytest.fixture()
def loop_ws(tmp_path, tokenizer):
    from mentorrl.config import load_config
    from mentorrl.train.workspace import open_workspace

    def make(name="run"):
        cfg = load_config(None, [f"run_dir={tmp_path / name}", "threads=1"])
        ws = open_workspace(cfg, show_progress=False)
        ws.bind_tokenizer(tokenizer)
        return ws

    return make


def _records(ws):
    return [json.loads(x) for x in (ws.run_dir / "metrics.jsonl").read_text().splitlines()]


def test_hooks_run_in_order_and_the_learner_counts_policy_versions(loop_ws, model, make_demos):
    _, demos = make_demos(4)
    ws = loop_ws()
    stage = CountingStage(ws, copy.deepcopy(model), demos, updates=3, steps=3)
    final = RLLoop(stage).run()
    assert (final / "DONE").exists()
    assert stage.seen == [(s, h) for s in range(3) for h in HOOKS]
    assert [r["policy_version"] for r in _records(ws)] == [3.0, 6.0, 9.0]  # one version per optimizer step
    assert stage.learner.version == 9


def test_a_stop_after_scoring_skips_the_update_and_ends_the_stage(loop_ws, model, make_demos):
    _, demos = make_demos(4)
    ws = loop_ws()
    stage = CountingStage(ws, copy.deepcopy(model), demos, steps=5, stop_at=1)
    RLLoop(stage).run()
    assert stage.seen[-3:] == [(1, "tasks"), (1, "rollout"), (1, "score")]
    assert [r["step"] for r in _records(ws)] == [1, 2]


def test_resume_restores_the_stage_state_and_the_policy_version(loop_ws, model, make_demos):
    """A run killed after step 3 (checkpoint at step 2) resumes with the checkpoint's stage state
    and learner version, redoes step 3 and ends where an uninterrupted run ends."""
    _, demos = make_demos(4)
    ws_full = loop_ws("full")
    RLLoop(CountingStage(ws_full, copy.deepcopy(model), demos)).run()
    full = _records(ws_full)

    ws = loop_ws("killed")

    class Killed(CountingStage):
        def after(self, b):
            super().after(b)
            if b.step == 2:
                raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        RLLoop(Killed(ws, copy.deepcopy(model), demos)).run()
    resumed_stage = CountingStage(ws, copy.deepcopy(model), demos)
    RLLoop(resumed_stage).run(resume=True)
    got = _records(ws)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert [r["steps_seen"] for r in got] == [r["steps_seen"] for r in full]  # the stage's own state came back
    assert [r["policy_version"] for r in got] == [r["policy_version"] for r in full]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in full], rel=1e-5)


def test_every_builtin_stage_runs_on_the_loop():
    """No stage builds its own loop: each registered built-in runner is a Stage class run by RLLoop."""
    from mentorrl.train.registry import get_stage, resolve_runner, stage_names

    for name in stage_names():
        run = resolve_runner(get_stage(name))
        owner = getattr(run, "stage_cls", None)
        assert owner is not None and issubclass(owner, Stage) and owner.name == name, name


def test_no_recipe_bumps_the_policy_version_or_builds_a_loop_by_hand():
    from pathlib import Path

    import mentorrl.train.recipes as recipes

    for path in sorted(Path(recipes.__file__).parent.glob("*.py")):
        text = path.read_text()
        assert '["policy"] +=' not in text, path.name
        assert "run_stage(" not in text, path.name
        assert "1_000_003" not in text and "* 7_777" not in text, path.name  # seeds come from StepSeeds


def test_every_stage_declares_a_slotted_step_record():
    """Each stage's ``step_data`` is a slotted StepData dataclass with defaults: the loop makes one per
    step, and a misspelt field is an AttributeError, never a silent new key."""
    import dataclasses

    from mentorrl.train.loop import StepData, step_data_state
    from mentorrl.train.recipes.blackbox import BlackBoxStage
    from mentorrl.train.recipes.evolve import EvolveStage
    from mentorrl.train.recipes.external import ExternalStage
    from mentorrl.train.recipes.grpo import GRPOStage
    from mentorrl.train.recipes.opd import OPDStage
    from mentorrl.train.recipes.ppo import PPOStage
    from mentorrl.train.recipes.rft import RFTStage
    from mentorrl.train.recipes.sao import SAOStage
    from mentorrl.train.recipes.sft import SFTStage

    stages = (BlackBoxStage, EvolveStage, ExternalStage, GRPOStage, OPDStage, PPOStage, RFTStage, SAOStage, SFTStage)
    for cls in stages:
        d = cls.step_data()
        assert isinstance(d, StepData) and dataclasses.is_dataclass(d) and not hasattr(d, "__dict__"), cls
        assert type(d)(**step_data_state(d)) == d
        with pytest.raises(AttributeError):
            d.not_a_field = 1
    assert GRPOStage.step_data().nll is None and ExternalStage.step_data().episodes == []
