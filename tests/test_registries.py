"""One registry idiom for every extension point (issue 57 item 3) and the loss chosen in config (item 4).

Invariants: a taken name is an error unless replacement is explicit; an unknown name is an error listing the
known ones; the names a config accepts are the registry's own (register -> validates, unregister -> refused)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mentorrl.config import ConfigError, load_config
from mentorrl.config.registry import DuplicateName, Registry, UnknownName


def extension_registries() -> dict[str, Registry]:
    from mentorrl.algos.advantages import ADVANTAGE_ESTIMATORS
    from mentorrl.algos.losses import POLICY_LOSSES
    from mentorrl.algos.opd_terms import ADVANTAGE_TERMS, TOKEN_TERMS
    from mentorrl.config.stages import STAGES
    from mentorrl.envs import ENVIRONMENTS
    from mentorrl.train.recipes.blackbox import RECIPES
    from mentorrl.train.recipes.opd import LOSS_TERMS

    return {
        "advantages": ADVANTAGE_ESTIMATORS,
        "losses": POLICY_LOSSES,
        "stages": STAGES,
        "opd token terms": TOKEN_TERMS,
        "opd advantage terms": ADVANTAGE_TERMS,
        "opd loss terms": LOSS_TERMS,
        "black-box recipes": RECIPES,
        "environments": ENVIRONMENTS,
    }


@pytest.mark.parametrize("name", list(extension_registries()))
def test_every_extension_point_is_one_registry_idiom(name):
    reg = extension_registries()[name]
    assert isinstance(reg, Registry) and len(reg) > 0
    taken = next(iter(reg))
    with pytest.raises(DuplicateName, match="replace=True"):
        reg.register(taken, object())
    with pytest.raises(UnknownName, match=taken):  # the message lists the known names
        reg.get("no-such-" + taken)
    held = reg.get(taken)
    assert reg.register(taken, held) is held  # the same object again: a module imported twice


OPS = st.lists(
    st.tuples(st.sampled_from(["register", "replace", "unregister"]), st.sampled_from("abc"), st.integers(0, 2)),
    max_size=30,
)


@given(OPS)
def test_a_registry_behaves_as_a_dict_that_refuses_silent_replacement(ops):
    reg: Registry[int] = Registry("thing", builtin=("z",))
    model: dict[str, object] = {}
    objs = [object(), object(), object()]
    for op, name, i in ops:
        if op == "unregister":
            assert reg.unregister(name) is model.pop(name, None)
        elif op == "replace" or name not in model or model[name] is objs[i]:
            reg.register(name, objs[i], replace=op == "replace")
            model[name] = objs[i]
        else:
            with pytest.raises(DuplicateName):
                reg.register(name, objs[i])
        assert dict(reg.items()) == model
        assert reg.names() == sorted({*model, "z"})


def test_reserved_names_are_refused():
    from mentorrl.config.stages import STAGES

    with pytest.raises(ValueError, match="reserved"):
        STAGES.register("limits", object())


def test_the_config_accepts_exactly_the_registered_losses():
    from mentorrl.algos.losses import POLICY_LOSSES, register_policy_loss

    with pytest.raises(ConfigError, match="unknown policy loss 'plug_loss'"):
        load_config(None, ["grpo.loss=plug_loss"])

    @register_policy_loss("plug_loss")
    def plug(logprobs, old_logprobs, advantages, mask, **kw):
        return (logprobs * 0).sum(), {}

    try:
        assert load_config(None, ["grpo.loss=plug_loss"]).grpo.loss == "plug_loss"
    finally:
        POLICY_LOSSES.unregister("plug_loss")
    with pytest.raises(ConfigError, match="unknown policy loss 'plug_loss'"):
        load_config(None, ["grpo.loss=plug_loss"])


def test_a_loss_that_cannot_take_the_stage_arguments_is_refused_before_the_first_step():
    from mentorrl.train.recipes.grpo import grpo_loss_kwargs

    plain = load_config(None, ["grpo.loss=clipped"]).grpo
    assert set(grpo_loss_kwargs(plain)) == {"eps_low", "eps_high", "agg"}
    kl = load_config(None, ["grpo.loss=clipped", "grpo.kl_coef=0.01"]).grpo
    with pytest.raises(ConfigError, match="grpo.loss: .*'clipped' does not take kl_coef, ref_logprobs"):
        grpo_loss_kwargs(kl)
    assert grpo_loss_kwargs(load_config(None, ["grpo.kl_coef=0.01"]).grpo)["kl_coef"] == 0.01


def test_the_configured_loss_is_the_one_the_update_calls(monkeypatch):
    """grpo.loss reaches the learner: the GRPO stage's update hands its name to pg_update."""
    import mentorrl.train.recipes.grpo as grpo_mod

    seen = {}

    def fake_pg_update(learner, trajs, adv, k, seed, **kw):
        seen.update(kw)
        return []

    monkeypatch.setattr(grpo_mod, "pg_update", fake_pg_update)
    stage = grpo_mod.GRPOStage.__new__(grpo_mod.GRPOStage)
    stage.cfg = load_config(None, ["grpo.loss=masked_is"]).grpo
    stage.loss_kwargs = grpo_mod.grpo_loss_kwargs(stage.cfg)
    stage.learner, stage.ref_model = None, None

    class B:
        trajs, groups, updates, metrics = [], [], [], {}
        adv = __import__("torch").zeros(0)
        data = grpo_mod.GRPOStepData()

        def seeds(self, name):
            return 0

    stage.update(B())
    assert seen["kind"] == "masked_is" and seen["eps_low"] == stage.cfg.eps_low


# ---- a rollout backend is registered like anything else ------------------------------------------
def test_a_plugin_rollout_backend_is_picked_by_config_and_decodes(
    tool_happy_model, make_contract, orders_entry, orders_tasks
):
    """One file's worth of plugin: a backend kind wrapping the project's engine, counting its calls. The config
    accepts its name only while it is registered, and a rollout under it decodes through it."""
    from mentorrl.config import RolloutConfig
    from mentorrl.config.names import ROLLOUT_BACKENDS
    from mentorrl.rollout.api import Rollout
    from mentorrl.rollout.backends import BackendChoice, BackendKind, register_rollout_backend
    from mentorrl.rollout.backends.hf import HFBackend

    calls = []

    class Counting(HFBackend):
        name = "counting"

        def run_episodes(self, episodes, seed=0):
            calls.append(len(episodes))
            return super().run_episodes(episodes, seed=seed)

    class CountingKind(BackendKind):
        def build(self, choice, model, contract, version):
            return Counting(choice.placed(model), contract, **choice.engine_settings)

    with pytest.raises(ValueError, match="unknown rollout backend 'counting'; registered: hf, vllm"):
        RolloutConfig(backend="counting")
    register_rollout_backend("counting", CountingKind())
    try:
        with pytest.raises(DuplicateName):
            register_rollout_backend("counting", CountingKind())
        choice = BackendChoice(RolloutConfig(backend="counting"))
        assert not choice.streams_in_process and BackendChoice(None).streams_in_process
        contract = make_contract(max_new_tokens=8, max_turns=2)
        tasks = orders_tasks[:3]
        trajs = Rollout(contract, orders_entry.make_env, None, choice).run(tool_happy_model, tasks, seed=1)
        assert len(trajs) == 3 and sum(calls) == 3  # every episode went through the plugin
    finally:
        ROLLOUT_BACKENDS.unregister("counting")
    with pytest.raises(ValueError, match="unknown rollout backend"):
        RolloutConfig(backend="counting")
