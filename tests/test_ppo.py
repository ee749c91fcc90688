"""PPO with a critic: the value model, the critic learner, GAE advantages per trajectory, and the stage end to end."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from test_resume import TINY_OVERRIDES
from typer.testing import CliRunner

from mentorrl.cli import app
from mentorrl.config import CriticConfig, GAEConfig, PPOConfig
from mentorrl.models.value import ValueModel, build_critic
from mentorrl.train.critic import critic_advantages
from mentorrl.train.learner import CriticLearner
from mentorrl.train.rundir import MetricsLog


@pytest.fixture
def demos(make_demos):
    return make_demos(12)[1]


def test_fresh_critic_predicts_zero_and_round_trips(model, demos, tmp_path):
    critic = ValueModel.from_policy(model)
    learner = CriticLearner(critic, PPOConfig().critic.optim, pad_id=0)
    values = learner.values(demos[:3])
    assert [v.shape[0] for v in values] == [len(t.token_ids) for t in demos[:3]]
    assert all(v.abs().max() == 0 for v in values)
    assert all(p.requires_grad for p in critic.parameters())
    assert all(not p.requires_grad or p is not q for p, q in zip(model.parameters(), critic.decoder.parameters()))
    critic.head.bias.data.fill_(0.5)
    critic.save(tmp_path / "v.safetensors")
    other = ValueModel.from_policy(model)
    other.load(tmp_path / "v.safetensors")
    assert torch.equal(other.head.bias, critic.head.bias)


def test_critic_learns_the_returns(model, demos):
    """Value updates move the critic's predictions on policy tokens towards the returns."""
    critic = ValueModel.from_policy(copy.deepcopy(model))
    learner = CriticLearner(critic, PPOConfig().critic.optim.model_copy(update={"lr": 3e-3}), pad_id=0)
    batch = demos[:8]
    returns = [torch.full((len(t.token_ids),), 0.8) for t in batch]
    first = learner.value_step(batch, returns, learner.values(batch), clip=None)["value_loss"]
    for _ in range(20):
        learner.value_step(batch, returns, learner.values(batch), clip=None)
    last = learner.value_step(batch, returns, learner.values(batch), clip=None)["value_loss"]
    assert last < 0.2 * first
    v = learner.values(batch)
    on_policy = torch.cat([vi[torch.tensor(t.loss_mask) != 0] for vi, t in zip(v, batch)])
    assert (on_policy.mean() - 0.8).abs() < 0.2


def test_critic_advantages_are_return_minus_value_with_lambda_one(demos):
    trajs = demos[:3]
    values = [torch.full((len(t.token_ids),), 0.25) for t in trajs]
    rewards = torch.tensor([1.2, 0.0, -1.0])
    p = GAEConfig(lam=1.0, gamma=1.0, normalize_advantages=False)
    adv, ret = critic_advantages(trajs, rewards, values, p)
    for t, a, r, reward in zip(trajs, adv, ret, rewards.tolist()):
        m = torch.tensor(t.loss_mask) != 0
        assert torch.allclose(a[m], torch.full_like(a[m], reward - 0.25))
        assert torch.allclose(r[m], torch.full_like(r[m], reward)) and a[~m].abs().sum() == 0
    white, _ = critic_advantages(trajs, rewards, values, GAEConfig(lam=1.0))
    allp = torch.cat([a[torch.tensor(t.loss_mask) != 0] for t, a in zip(trajs, white)])
    assert abs(allp.mean().item()) < 1e-5 and abs(allp.std(unbiased=False).item() - 1) < 1e-3


def test_gae_value_lam_gives_the_critic_monte_carlo_returns(demos):
    """ppo.gae.value_lam decouples the critic's returns from the advantages' lambda (VAPO: 1)."""
    trajs = demos[:3]
    values = [torch.linspace(0.0, 1.0, len(t.token_ids)) for t in trajs]
    rewards = torch.tensor([1.2, 0.0, -1.0])
    adv_c, ret_c = critic_advantages(trajs, rewards, values, GAEConfig(lam=0.5, normalize_advantages=False))
    adv_d, ret_d = critic_advantages(
        trajs, rewards, values, GAEConfig(lam=0.5, value_lam=1.0, normalize_advantages=False)
    )
    for t, a_c, a_d, r_d, reward in zip(trajs, adv_c, adv_d, ret_d, rewards.tolist()):
        m = torch.tensor(t.loss_mask) != 0
        assert torch.equal(a_c, a_d)  # the policy's advantages are unchanged
        assert torch.allclose(r_d[m], torch.full_like(r_d[m], reward))  # lambda 1, gamma 1: the outcome itself
    assert not all(torch.allclose(a, b) for a, b in zip(ret_c, ret_d))


@pytest.mark.slow
def test_sft_ppo_recipe_end_to_end(tmp_path):
    args = ["demo", "--run-dir", str(tmp_path / "run")]
    for ov in TINY_OVERRIDES + [
        "recipe=[sft, ppo]",
        "ppo.steps=3",
        "ppo.tasks_per_step=4",
        "ppo.critic.warmup_steps=1",
        "ppo.checkpoint_every=2",
        "eval.batch_size=4",
    ]:
        args += ["--set", ov]
    res = CliRunner().invoke(app, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    run = tmp_path / "run"
    ppo = MetricsLog(run / "metrics.jsonl").read("ppo")
    assert [r["step"] for r in ppo] == [1, 2, 3]
    assert [r["actor_updated"] for r in ppo] == [0.0, 1.0, 1.0]  # one critic warm-up step
    assert all(
        {"value_loss", "explained_variance", "value_clip_frac", "logprob_abs_gap", "policy_lag_max"} <= set(r)
        for r in ppo
    )
    assert (run / "ppo" / "critic" / "value_model.safetensors").exists()
    assert "ppo" in json.loads((run / "report.json").read_text())["evals"]
    before = (run / "metrics.jsonl").read_text()
    again = CliRunner().invoke(app, [*args, "--resume"], catch_exceptions=False)
    assert again.exit_code == 0 and (run / "metrics.jsonl").read_text() == before


def test_critic_backbones(model, demos, tmp_path):
    """critic.backbone: a head on a copy of the policy's decoder, a fresh small model, or a checkpoint's decoder."""
    own = build_critic(model, CriticConfig())
    assert own.decoder.config.hidden_size == model.config.hidden_size
    assert torch.equal(own.decoder.get_input_embeddings().weight, model.get_decoder().get_input_embeddings().weight)
    small = build_critic(model, CriticConfig(backbone="separate"))
    assert small.decoder.config.hidden_size == 64 and small.decoder.config.num_hidden_layers == 2
    assert small.decoder.get_input_embeddings().num_embeddings == model.config.vocab_size
    model.save_pretrained(tmp_path / "ckpt")
    loaded = build_critic(model, CriticConfig(backbone="separate", path=str(tmp_path / "ckpt")))
    assert torch.equal(loaded.decoder.get_input_embeddings().weight, model.get_decoder().get_input_embeddings().weight)
    values = CriticLearner(small, CriticConfig().optim, pad_id=0).values(demos[:2])
    assert [v.shape[0] for v in values] == [len(t.token_ids) for t in demos[:2]] and all(
        v.abs().max() == 0 for v in values
    )
