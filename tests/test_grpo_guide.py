"""grpo.guide: expert — a group in which no rollout succeeded gets the scripted expert's verified
demonstration in place of its lowest-reward rollout, relabelled with the current policy's
log-probs, so GRPO has a signal towards success on tasks the policy never solves."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest
import torch
from test_resume import TINY_OVERRIDES
from typer.testing import CliRunner

from mentorrl.algos.advantages import get_advantage_estimator
from mentorrl.cli import app
from mentorrl.config import OptimConfig, RunConfig
from mentorrl.envs.adapters.common import NoExpert
from mentorrl.envs.base import FinalAnswer
from mentorrl.models.batch import collate, forward_logprobs
from mentorrl.rollout import Rollout
from mentorrl.rollout.runner import expert_demonstrations, rollout_tasks
from mentorrl.train.learner import Learner
from mentorrl.train.recipes.grpo import guide_expert
from mentorrl.train.rundir import MetricsLog
from mentorrl.train.stage_helpers import guide_failed_groups, guided_advantages, pg_update

G = 3


@pytest.fixture(scope="module")
def setting(orders_entry, make_contract, model, find_task):
    contract = make_contract(max_turns=8, max_total_tokens=2048)
    cfg = RunConfig()
    ws = SimpleNamespace(
        contract=contract,
        make_env=orders_entry.make_env,
        cfg=cfg,
        rollout=Rollout(contract, orders_entry.make_env, cfg.reward),
    )
    tasks = [find_task("refund"), find_task("order_status")]
    grouped = [t for t in tasks for _ in range(G)]
    trajs = rollout_tasks(
        model, contract, orders_entry.make_env, grouped, policy_version=0, seed=5, batch_size=len(grouped)
    )
    assert not any(t.reward.success for t in trajs)  # an untrained model: every rollout fails
    # group 1 holds one success (the expert's, as if the policy had found it)
    solved = expert_demonstrations(contract, orders_entry.make_env, orders_entry.make_expert(), [tasks[1]])[0]
    trajs[G + 1] = solved
    return ws, SimpleNamespace(tasks=tasks, trajs=trajs)


def test_only_failed_groups_get_a_relabelled_demonstration(setting, model, orders_entry, tokenizer):
    ws, group = setting
    guided = guide_failed_groups(
        ws, model, group.tasks, group.trajs, orders_entry.make_expert(), policy_version=7, pad_id=tokenizer.pad_token_id
    )
    assert [i for i, _ in guided] == [0]  # group 1 holds a success: nothing for it
    demo = guided[0][1]
    assert demo.source == "expert" and demo.reward.success and demo.task_id == group.tasks[0].id
    assert demo.policy_version == 7
    # behaviour log-probs are the current policy's on the policy tokens (ratio 1 at the update), 0 elsewhere
    lp, _ = forward_logprobs(model, collate([demo], tokenizer.pad_token_id), ws.contract.sampling.temperature)
    mask = torch.tensor(demo.loss_mask, dtype=torch.bool)
    got = torch.tensor(demo.logprobs)
    torch.testing.assert_close(got[mask], lp[0, : len(demo.token_ids)][mask], rtol=1e-5, atol=1e-5)
    assert (got[~mask] == 0).all() and (got[mask] < 0).all()


class _WrongExpert:
    """Answers every task with a constant; the verifier never accepts it."""

    def act(self, task):
        yield FinalAnswer("I cannot help with that.")


def test_a_task_the_expert_cannot_solve_gets_nothing(setting, model, tokenizer):
    ws, group = setting
    assert guide_failed_groups(ws, model, group.tasks, group.trajs, _WrongExpert(), 0, tokenizer.pad_token_id) == []


def test_guided_advantages_treat_the_demonstration_as_one_more_group_member():
    est = get_advantage_estimator("grpo")
    rewards = torch.tensor([[-1.0, 0.0, 0.1], [0.0, 1.2, 0.5], [0.2, 0.2, 0.2]])
    plain = est(rewards, normalize_std=True).reshape(-1)
    adv, demo = guided_advantages(est, rewards, [], normalize_std=True)
    assert torch.equal(adv, plain) and demo.numel() == 0  # no guidance: exactly GRPO
    adv, demo = guided_advantages(est, rewards, [(0, 1.2), (2, 1.2)], normalize_std=True)
    want0 = est(torch.tensor([[-1.0, 0.0, 0.1, 1.2]]), normalize_std=True).view(-1)
    want2 = est(torch.tensor([[0.2, 0.2, 0.2, 1.2]]), normalize_std=True).view(-1)
    torch.testing.assert_close(adv.view(3, 3)[0], want0[:3])
    torch.testing.assert_close(adv.view(3, 3)[2], want2[:3])
    torch.testing.assert_close(demo, torch.stack([want0[3], want2[3]]))
    torch.testing.assert_close(adv.view(3, 3)[1], plain.view(3, 3)[1])  # an unguided group is untouched
    a0 = adv.view(3, 3)[0]
    assert demo[0] > 0 and a0[0] < a0[1] < 0  # the violation (-1) stays the most pushed-down member
    assert (adv.view(3, 3)[2] < 0).all()  # a group of equal failures now has a signal


def test_the_guided_update_raises_the_demonstration(setting, model, orders_entry, tokenizer):
    ws, group = setting
    ((i, demo),) = guide_failed_groups(
        ws, model, group.tasks, group.trajs, orders_entry.make_expert(), 0, tokenizer.pad_token_id
    )
    rows = list(group.trajs[i * G : (i + 1) * G]) + [demo]
    est = get_advantage_estimator("grpo")
    adv, demo_adv = guided_advantages(
        est, torch.tensor([[t.reward.total for t in rows[:G]]]), [(0, demo.reward.total)], normalize_std=True
    )
    adv = torch.cat([adv, demo_adv])
    m = copy.deepcopy(model).train()
    learner = Learner(m, OptimConfig(lr=3e-3, micro_batch_size=4), tokenizer.pad_token_id)
    pad = tokenizer.pad_token_id

    def seq_lp(mod):
        with torch.no_grad():
            lp, _ = forward_logprobs(mod, collate(rows, pad), 1.0)
        return (lp * collate(rows, pad).loss_mask).sum(1)

    before = seq_lp(model)
    pg_update(learner, rows, adv, 1, seed=0, kind="grpo", eps_low=0.2, eps_high=0.28)
    after = seq_lp(m.eval())
    assert after[G] > before[G] + 1.0


def test_an_environment_without_an_expert_is_refused_before_the_first_step():
    cfg = RunConfig.model_validate({"grpo": {"guide": "expert"}})
    ws = SimpleNamespace(cfg=cfg, env_entry=SimpleNamespace(make_expert=lambda: NoExpert("x")))
    with pytest.raises(ValueError, match="needs a scripted expert"):
        guide_expert(ws)
    assert guide_expert(SimpleNamespace(cfg=RunConfig())) is None
    with pytest.raises(ValueError):
        RunConfig.model_validate({"grpo": {"guide": "teacher"}})


def _guided_demo(run, overrides: list[str]):
    """``mentorrl demo`` of 2 guided GRPO steps on the tiny model (with ``overrides``); its CLI result."""
    args = ["demo", "--run-dir", str(run)]
    for ov in TINY_OVERRIDES + [
        "recipe=[grpo]",
        "grpo.steps=2",
        "grpo.guide=expert",
        "limits.max_turns=6",
        "limits.max_total_tokens=1024",
        "audit.preflight=false",
        *overrides,
    ]:
        args += ["--set", ov]
    res = CliRunner().invoke(app, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res


def test_a_guided_grpo_run_logs_its_guided_groups_and_passes_the_check(tmp_path):
    run = tmp_path / "run"
    _guided_demo(run, ["grpo.guide_sft=0.5", "eval.final_splits=[]"])
    rows = MetricsLog(run / "metrics.jsonl").read("grpo")
    assert len(rows) == 2 and all(r["guided_groups"] >= 1 for r in rows)  # an untrained policy fails everything
    assert all(r["rollouts"] == 2 * 2 for r in rows)  # the policy's own; the demonstrations come on top
    assert all(r["task_success"] == 0 for r in rows)  # the policy's own rollouts, not the demonstrations
    assert json.loads((run / "report.json").read_text())["evals"]
    checked = CliRunner().invoke(app, ["check", str(run)])
    assert checked.exit_code == 0, checked.output


# ---- grpo.guide_sft: an SFT term on the step's demonstrations, inside the same updates ----
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st

from mentorrl.algos.losses import weighted_nll  # noqa: E402
from mentorrl.train.recipes.grpo import guide_nll_weights  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.data())
def test_weighted_nll_is_the_weighted_sum_of_masked_token_nll(b, t, data):
    lp = torch.tensor(data.draw(st.lists(st.lists(st.floats(-30, 0), min_size=t, max_size=t), min_size=b, max_size=b)))
    mask = torch.tensor(data.draw(st.lists(st.lists(st.booleans(), min_size=t, max_size=t), min_size=b, max_size=b)))
    w = torch.tensor(data.draw(st.lists(st.sampled_from([0.0, 0.5, 2.0]), min_size=b, max_size=b)))
    want = sum(float(w[i]) * sum(-float(lp[i, j]) for j in range(t) if mask[i, j]) for i in range(b))
    poisoned = torch.where(mask, lp, torch.full_like(lp, float("nan")))  # junk off the mask never leaks
    poisoned[w == 0] = float("nan")  # nor from a row of weight 0
    got = weighted_nll(poisoned, mask, w)
    assert abs(float(got) - want) <= 1e-4 * max(1.0, abs(want))


def test_guide_nll_weights_are_a_token_mean_over_the_demonstrations():
    demos = [SimpleNamespace(num_policy_tokens=30), SimpleNamespace(num_policy_tokens=10)]
    w = guide_nll_weights(5, demos, 2.0)
    assert w[:5].abs().sum() == 0 and torch.allclose(w[5:], torch.full((2,), 2.0 / 40))
    assert guide_nll_weights(3, [], 1.0).abs().sum() == 0


def _grads(model, fn):
    m = copy.deepcopy(model).train()
    fn(m)
    return torch.cat([p.grad.reshape(-1) for p in m.parameters() if p.grad is not None])


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step")
def test_the_sft_term_adds_exactly_its_gradient_whatever_the_micro_batching(setting, model, orders_entry, tokenizer):
    """policy_step(nll_weights=w) has the gradient of the clipped loss plus sum_i w_i NLL_i, with 1 or 4
    sequences per micro-batch (the term is normalised over the batch, not per micro-batch)."""
    ws, group = setting
    ((i, demo),) = guide_failed_groups(
        ws, model, group.tasks, group.trajs, orders_entry.make_expert(), 0, tokenizer.pad_token_id
    )
    rows = list(group.trajs) + [demo]
    adv = torch.linspace(-1, 1, len(rows))
    w = guide_nll_weights(len(group.trajs), [demo], 0.7)
    pad = tokenizer.pad_token_id

    def step(mb, nll):
        def fn(m):
            learner = Learner(m, OptimConfig(lr=1e-9, micro_batch_size=mb, max_grad_norm=1e9), pad)
            learner.optimizer.step = lambda *a, **k: None  # keep the gradient, not the update
            learner.policy_step(rows, adv, "grpo", nll_weights=nll, eps_low=0.2, eps_high=0.28)

        return fn

    base = _grads(model, step(32, None))
    with_term = _grads(model, step(1, w))
    torch.testing.assert_close(_grads(model, step(4, w)), with_term, rtol=1e-4, atol=1e-6)

    def nll_only(m):
        lp, _ = forward_logprobs(m, collate([demo], pad), 1.0)
        (weighted_nll(lp, collate([demo], pad).loss_mask, torch.tensor([0.7 / demo.num_policy_tokens]))).backward()

    torch.testing.assert_close(with_term - base, _grads(model, nll_only), rtol=1e-3, atol=1e-6)
    assert (with_term - base).abs().max() > 1e-4  # the term is not a no-op


def test_pg_update_forwards_a_demonstration_with_zero_advantage_but_an_sft_weight(setting, model, tokenizer):
    """drop_zero skips zero-advantage rows, but not one the SFT term trains on; sequence-level advantages only."""
    ws, group = setting
    rows = list(group.trajs[:2])
    adv = torch.zeros(2)
    pad = tokenizer.pad_token_id
    m = copy.deepcopy(model)
    learner = Learner(m, OptimConfig(lr=1e-3), pad)
    assert pg_update(learner, rows, adv, 1, 0, kind="grpo", drop_zero=True) == []
    ups = pg_update(learner, rows, adv, 1, 0, kind="grpo", drop_zero=True, nll_weights=torch.tensor([0.0, 0.1]))
    assert len(ups) == 1 and any(not torch.equal(a, b) for a, b in zip(m.parameters(), model.parameters()))
    with pytest.raises(ValueError, match="one advantage per trajectory"):
        pg_update(learner, rows, [torch.zeros(3)] * 2, 1, 0, nll_weights=torch.ones(2))


def test_guide_sft_needs_the_expert_guide():
    with pytest.raises(ValueError, match="guide_sft"):
        RunConfig.model_validate({"grpo": {"guide_sft": 1.0}})
    with pytest.raises(ValueError):
        RunConfig.model_validate({"grpo": {"guide": "expert", "guide_sft": -1.0}})
    assert RunConfig.model_validate({"grpo": {"guide": "expert", "guide_sft": 1.0}}).grpo.guide_sft == 1.0


# ---- grpo.pool: expert_verified: only tasks the expert solves within the run's limits ----
def test_expert_verified_pool_keeps_exactly_the_tasks_the_expert_solves(orders_entry, make_contract):
    from rich.console import Console

    from mentorrl.config import ConfigError
    from mentorrl.train.recipes.grpo import expert_verified_pool

    def ws_with(max_total_tokens: int):
        contract = make_contract(max_turns=8, max_total_tokens=max_total_tokens)
        cfg = RunConfig()
        return SimpleNamespace(
            cfg=cfg,
            env_entry=orders_entry,
            console=Console(quiet=True),
            rollout=Rollout(contract, orders_entry.make_env, cfg.reward),
            on_main=lambda fn: fn(),  # one process: the workspace's on_main is fn()
        )

    pool = orders_entry.make_tasks().tasks(split="train", n=24, seed=3)
    ws = ws_with(2048)
    kept = expert_verified_pool(ws, pool)
    demos = {d.task_id: d for d in ws.rollout.demonstrations(orders_entry.make_expert(), pool)}
    assert kept == [t for t in pool if t.id in demos] and kept  # in the pool's order, each one verified
    assert all(demos[t.id].reward.success for t in kept)
    # a smaller budget: the tasks whose replay still fits it, fewer (the budget counts past the system turn;
    # a replay under a smaller budget may differ, e.g. its tool results cut shorter, so not a size threshold)
    system = ws.rollout.contract.system_tokens
    size = sorted(len(demos[t.id].token_ids) - system for t in kept)
    small = ws_with(size[len(size) // 2])
    some = expert_verified_pool(small, pool)
    again = {d.task_id: d for d in small.rollout.demonstrations(orders_entry.make_expert(), pool)}
    assert [t.id for t in some] == [t.id for t in pool if t.id in again] and 0 < len(some) < len(kept)
    none = SimpleNamespace(**{**vars(ws), "rollout": SimpleNamespace(demonstrations=lambda expert, tasks: [])})
    with pytest.raises(ConfigError, match="left none of 24 tasks"):
        expert_verified_pool(none, pool)
    # an environment without an expert is refused, named
    from dataclasses import replace

    ws.env_entry = replace(orders_entry, make_expert=NoExpert)
    with pytest.raises(ValueError, match="needs a scripted expert"):
        expert_verified_pool(ws, pool)
    with pytest.raises(ValueError):
        RunConfig.model_validate({"grpo": {"pool": "solvable"}})


def test_a_grpo_run_on_the_expert_verified_pool_guides_every_failed_group(tmp_path):
    run = tmp_path / "run"
    res = _guided_demo(run, ["grpo.pool=expert_verified", "eval.num_tasks=0"])
    assert "grpo.pool expert_verified:" in res.output
    rows = MetricsLog(run / "metrics.jsonl").read("grpo")
    assert len(rows) == 2 and all(r["guided_groups"] == 2 for r in rows)  # every failed group got its demonstration
    assert all(r["trained_trajectories"] > 0 for r in rows)
