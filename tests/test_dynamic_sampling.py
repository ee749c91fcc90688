"""grpo.dynamic_sampling (DAPO): a step trains on tasks_per_step groups whose rewards differ, drawn in rounds."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mentorrl.config import AuditConfig, ConfigError, load_config
from mentorrl.train import dynamic_sampling as ds
from mentorrl.train import stage_helpers
from mentorrl.train.loop import StepBatch, StepSeeds

AUDIT = AuditConfig()


def traj(reward: float):
    return SimpleNamespace(reward=SimpleNamespace(total=reward, success=reward >= 1.0))


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 5).flatmap(
        lambda g: st.tuples(
            st.just(g), st.lists(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=g, max_size=g), max_size=8)
        )
    )
)
def test_informative_groups_are_exactly_the_groups_whose_rewards_differ(case):
    g, groups = case
    trajs = [traj(r) for grp in groups for r in grp]
    assert ds.informative_groups(trajs, g, AUDIT) == [i for i, grp in enumerate(groups) if len(set(grp)) > 1]


def task(i: int):
    return SimpleNamespace(id=f"t{i}")


def mixed(t) -> bool:
    """The fake policy's groups differ on every third task and are all-equal on the rest."""
    return int(t.id[1:]) % 3 == 0


class FakeRollouts:
    """The stage's rollout (``Stage.roll``) stand-in: rewards a pure function of (task, sample), every call
    recorded with its seed."""

    def __init__(self):
        self.calls: list[tuple[list[str], int]] = []

    def __call__(self, ws, model, tasks, group_size, version, seed, where, shard=False):
        self.calls.append(([t.id for t in tasks], seed))
        trajs = [traj(float(mixed(t) and k == 0)) for t in tasks for k in range(group_size)]
        return SimpleNamespace(trajs=trajs, rollout_s=1.0, rollout_cpu_s=2.0)


def step(pool, want: int, g: int, fake: FakeRollouts, step_no: int = 0):
    stage = SimpleNamespace(pool=pool, ws=SimpleNamespace(cfg=SimpleNamespace(audit=AUDIT)), model=None, name="grpo")
    stage.learner = SimpleNamespace(version=0)
    stage.roll = lambda b, tasks, g, purpose, where=None, shard=False: fake(
        stage.ws, None, tasks, g, 0, b.seeds(purpose), where, shard=shard
    )
    b = StepBatch(step=step_no, seeds=StepSeeds(0, "grpo", step_no))
    b.tasks = b.seeds.rng("tasks").sample(pool, want)
    first = fake(None, None, b.tasks, g, 0, b.seeds("rollout"), None)
    b.trajs, b.group_size = first.trajs, g
    b.metrics = {"rollout_s": 1.0, "rollout_cpu_s": 2.0}
    return stage, b


@pytest.fixture
def fake(monkeypatch):
    f = FakeRollouts()
    monkeypatch.setattr(
        stage_helpers,
        "rollout_metrics",
        lambda trajs: {"task_success": sum(t.reward.success for t in trajs) / len(trajs)},
    )
    return f


def test_a_step_is_filled_with_informative_groups_from_fresh_tasks(fake):
    pool = [task(i) for i in range(60)]
    stage, b = step(pool, 4, 3, fake)
    ds.fill_informative(stage, b, max_rounds=8)
    assert len(b.tasks) == 4 and len(b.trajs) == 12  # refilled, not merely filtered
    assert all(mixed(t) for t in b.tasks)
    drawn = [i for ids, _ in fake.calls for i in ids]
    assert len(drawn) == len(set(drawn))  # no task twice within a step
    assert [t.id for t in b.tasks] == [i for i in drawn if mixed(SimpleNamespace(id=i))][:4]  # draw order
    for k, t in enumerate(b.tasks):  # each kept group's trajectories are its own
        assert [x.reward.total for x in b.trajs[3 * k : 3 * k + 3]] == [1.0, 0.0, 0.0]
    rounds = len(fake.calls)
    assert b.metrics["dynamic_rounds"] == rounds
    assert b.metrics["rollouts"] == 3 * len(drawn) and b.metrics["rollout_s"] == rounds
    assert b.metrics["dynamic_informative_share"] == pytest.approx(
        sum(map(mixed, map(lambda i: SimpleNamespace(id=i), drawn))) / len(drawn)
    )
    assert len({seed for _, seed in fake.calls}) == rounds  # every round its own rollout seed

    again = FakeRollouts()
    # the same step of the same run draws the same rounds
    stage2, b2 = step(pool, 4, 3, again)
    ds.fill_informative(stage2, b2, max_rounds=8)
    assert again.calls == fake.calls and [t.id for t in b2.tasks] == [t.id for t in b.tasks]


def test_rounds_and_the_pool_bound_a_step(fake):
    pool = [task(i) for i in range(60)]
    stage, b = step(pool, 4, 2, fake)
    ds.fill_informative(stage, b, max_rounds=1)  # no further round: the first batch's informative groups only
    assert len(fake.calls) == 1 and all(mixed(t) for t in b.tasks) and len(b.trajs) == 2 * len(b.tasks)

    dull = [task(i) for i in (1, 2, 4, 5, 7, 8, 10, 11)]  # never informative: 8 tasks, 2 rounds of 4
    stage, b = step(dull, 4, 2, fake)
    first = [t.id for t in b.tasks]
    fake.calls.clear()
    ds.fill_informative(stage, b, max_rounds=5)
    assert len(fake.calls) == 1  # the pool ran out after one more round
    assert [t.id for t in b.tasks] == first and b.metrics["dynamic_informative_share"] == 0.0  # none: no update


def test_the_setting_is_validated_and_refused_where_it_cannot_run():
    cfg = load_config(None, ["grpo.dynamic_sampling={max_rounds: 3}"])
    assert cfg.grpo.dynamic_sampling.max_rounds == 3
    for bad in ("grpo.dynamic_sampling={max_rounds: 0}", "grpo.dynamic_sampling={rounds: 3}"):
        with pytest.raises(ConfigError):
            load_config(None, [bad])
    with pytest.raises(ConfigError, match="external.dynamic_sampling"):
        load_config(None, ["recipe=[external]", "external.agent=[x]", "external.dynamic_sampling={max_rounds: 2}"])


def test_a_grpo_run_with_dynamic_sampling_rolls_out_its_rounds(tmp_path, model, tokenizer):
    from test_overlap import OVERRIDES

    from mentorrl.train.loop import loop_for
    from mentorrl.train.recipes.grpo import GRPOStage
    from mentorrl.train.workspace import open_workspace

    over = [o for o in OVERRIDES if "overlap" not in o] + ["grpo.steps=2", "grpo.dynamic_sampling={max_rounds: 3}"]
    cfg = load_config(None, [*over, f"run_dir={tmp_path}"])
    ws = open_workspace(cfg, show_progress=False)
    ws.bind_tokenizer(tokenizer)
    stage = GRPOStage(ws, copy.deepcopy(model))
    assert len(stage.pool) >= 2 * 3 * 2  # room for every round of every step
    loop_for(stage).run()
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 2
    for r in recs:  # an untrained model fails every task: no group is informative, every round is spent
        assert r["dynamic_rounds"] == 3 and r["rollouts"] == 3 * 2 * 2 and r["dynamic_informative_share"] == 0.0
