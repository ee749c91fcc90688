"""Environments users bring (mentorrl.envs.adapters): a Gymnasium environment and decorated Python
functions, each defined here (no downloads), played with scripted turns (rewards, errors as
observations) and trained two GRPO steps. The verifiers adapters: test_env_adapters_vf04.py
(verifiers 0.4) and test_env_adapters_vf_classic.py (the classic API of 0.2 / 0.3)."""

from __future__ import annotations

import json

import pytest

from mentorrl.contract import ContractLimits, PromptFormat, SamplingParams, contract_for_env
from mentorrl.envs import get_env
from mentorrl.envs.adapters import (
    GymTextEnv,
    function_entry,
    function_tools,
    gym_entry,
    register_adapter,
    tool,
)
from mentorrl.envs.adapters.common import is_registered
from mentorrl.rollout.episode import run_text_turns

gym = pytest.importorskip("gymnasium")


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def _register(name: str, entry) -> None:
    if not is_registered(name):
        register_adapter(name, entry)


@pytest.fixture(scope="module")
def contract_for(tokenizer):
    def make(env):
        return contract_for_env(
            tokenizer,
            env,
            SamplingParams(max_new_tokens=24),
            ContractLimits(max_turns=8, max_total_tokens=1024),
            PromptFormat(),
        )

    return make


def _grpo(tmp_path, env_name: str, model_dir) -> dict:
    from mentorrl.config import load_config
    from mentorrl.train.pipeline import run_recipe
    from mentorrl.train.rundir import MetricsLog

    cfg = load_config(
        None,
        [
            f"env.name={env_name}",
            f"model.path={model_dir}",
            f"run_dir={tmp_path / 'run'}",
            "threads=1",
            "recipe=[grpo]",
            "grpo.steps=2",
            "grpo.tasks_per_step=2",
            "grpo.samples_per_task=2",
            "audit.eval_every=0",
            "audit.preflight=false",
            "eval.num_tasks=0",
            "sampling.max_new_tokens=16",
            "limits.max_turns=2",
            "limits.max_total_tokens=512",
        ],
    )
    run_recipe(cfg, show_progress=False)
    steps = MetricsLog(tmp_path / "run" / "metrics.jsonl").read("grpo")
    assert [r["step"] for r in steps][-1] >= 1 and len(steps) == 2, steps
    assert all(r["rollouts"] == 4 for r in steps)
    return steps


# ============================================================= decorated functions ======
INVENTORY = {"apple": 3, "pear": 0}


@tool
def stock(item: str) -> int:
    """How many of an item are in stock.

    Args:
        item: the item's name, e.g. "apple"
    """
    if item not in INVENTORY:
        raise KeyError(f"no item {item!r}")
    return INVENTORY[item]


@tool(name="convert")
def to_unit(amount: float, unit: str = "dozen") -> float:
    """Convert a count of items to another unit.

    Args:
        amount: how many items
        unit: the unit (choices: ["dozen", "pair"])
    """
    return amount / (12 if unit == "dozen" else 2)


def shop_judge(task, calls, final_answer):
    looked = any(c["ok"] and c["name"] == "stock" and c["arguments"] == {"item": task.reference["item"]} for c in calls)
    return looked and str(INVENTORY[task.reference["item"]]) in (final_answer or "")


SHOP_TASKS = {
    "train": [(f"How many {i}s are in stock?", {"item": i}) for i in INVENTORY],
    "heldout": [("How many apples are in stock?", {"item": "apple"})],
}


def test_function_tools_use_get_json_schema():
    from transformers.utils import get_json_schema

    from mentorrl.envs.base import ToolRegistry

    specs = ToolRegistry(function_tools([stock, to_unit])).specs()
    for spec, fn, name in zip(specs, (stock, to_unit), ("stock", "convert")):
        want = get_json_schema(fn)
        want["function"].pop("return", None)
        want["function"]["name"] = name
        assert spec == want
    assert specs[1]["function"]["parameters"]["properties"]["unit"]["enum"] == ["dozen", "pair"]
    assert stock("apple") == 3  # the decorator leaves the function as it was


def test_function_env_rewards_and_errors(contract_for):
    _register("shop-test", function_entry("shop-test", [stock, to_unit], shop_judge, SHOP_TASKS))
    entry = get_env("shop-test")
    env = entry.make_env(tool_timeout_s=2.0)
    contract = contract_for(env)
    task = next(t for t in entry.make_tasks().tasks("train", 4, 0) if t.reference["item"] == "apple")
    good = run_text_turns(contract, env, task, [call("stock", item="apple"), "There are 3 apples."])
    assert good.reward.success and good.reward.total > 1.0
    claim = run_text_turns(contract, env, task, ["There are 3 apples."])
    assert not claim.reward.success and claim.reward.total == 0.0
    bad = run_text_turns(
        contract,
        env,
        task,
        [
            call("stock", item="plum"),
            call("stock", item="apple", colour="red"),
            call("convert", amount="x"),
            '<tool_call>{"name": "stock", "arguments": {"item": </tool_call>',
            "3",
        ],
    )
    kinds = [c.error_kind for c in bad.tool_calls]
    assert kinds == ["tool_exception", "bad_arguments", "bad_arguments", "malformed"], kinds
    assert "KeyError" in bad.tool_calls[0].error and "unknown argument(s) colour" in bad.tool_calls[1].error
    env.close()


def parity_judge(task, calls, final_answer):
    """A reward a policy that ends its turn earns half the time (an untrained tiny model rarely ends one)."""
    return len(final_answer or "") % 2 == 1


def test_function_env_trains_two_grpo_steps(tmp_path, tiny_model_dir):
    _register("shop-parity-test", function_entry("shop-parity-test", [stock, to_unit], parity_judge, SHOP_TASKS))
    steps = _grpo(tmp_path, "shop-parity-test", tiny_model_dir)
    assert all(r["reward_mean"] <= 1.5 for r in steps)


# ====================================================================== gymnasium ======
class GuessEnv(gym.Env):
    """Guess a number in 1..8: text actions, text observations ("higher" / "lower" / "correct")."""

    def __init__(self):
        self.action_space = gym.spaces.Text(max_length=8)
        self.observation_space = gym.spaces.Text(max_length=64)
        self.target = 0

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.target = int(self.np_random.integers(1, 9))
        self.turns = 0
        return "I picked a number from 1 to 8.", {}

    def step(self, action):
        guess = int(action)  # a non-number raises: the adapter shows the error
        self.turns += 1
        if guess == self.target:
            return "correct", 1.0, True, False, {}
        return ("higher" if guess < self.target else "lower"), 0.0, False, self.turns >= 6, {}


def _solve(env: GymTextEnv) -> list[str]:
    lo, hi, turns = 1, 8, []
    # replay the search offline: the adapter's gym env holds the target after reset
    while True:
        mid = (lo + hi) // 2
        turns.append(call("act", action=str(mid)))
        if mid == env.gym.target:
            return turns + ["Found it."]
        lo, hi = (mid + 1, hi) if mid < env.gym.target else (lo, mid - 1)


def test_gym_env_rewards_and_errors(contract_for):
    _register("guess-test", gym_entry("guess-test", GuessEnv, "Find my number; guess with act."))
    entry = get_env("guess-test")
    env = entry.make_env(tool_timeout_s=2.0)
    contract = contract_for(env)
    task = entry.make_tasks().tasks("train", 1, 0)[0]
    env.reset(task)
    turns = _solve(env)
    good = run_text_turns(contract, env, task, turns)
    assert good.reward.success and good.reward.total > 1.0, good.reward
    assert good.tool_calls[-1].result["observation"] == "correct" and good.tool_calls[-1].result["done"]
    bad = run_text_turns(contract, env, task, [call("act", action="seven"), call("act", action=""), "I give up."])
    assert [c.error_kind for c in bad.tool_calls] == ["tool_exception", "bad_arguments"]
    assert "ValueError" in bad.tool_calls[0].error
    assert not bad.reward.success
    after = run_text_turns(contract, env, task, turns[:-1] + [turns[0], "done"])
    assert after.tool_calls[-1].error_kind == "policy" and "episode is over" in after.tool_calls[-1].error
    held = entry.make_tasks().tasks("heldout", 3, 0)
    assert {t.seed for t in held}.isdisjoint({t.seed for t in entry.make_tasks().tasks("train", 50, 0)})
    env.close()


class BrokenReset(GuessEnv):
    def reset(self, seed=None, options=None):
        raise RuntimeError("no display")


def test_gym_env_that_raises_on_reset_fails_the_episode_not_the_run(contract_for):
    env = GymTextEnv(BrokenReset, name="broken")
    contract = contract_for(env)
    task = get_env("guess-test").make_tasks().tasks("train", 1, 0)[0] if is_registered("guess-test") else None
    if task is None:
        from mentorrl.envs.adapters import GymTasks

        task = GymTasks("broken", "Find my number.").tasks("train", 1, 0)[0]
    traj = run_text_turns(contract, env, task, [call("act", action="4"), "done"])
    assert traj.tool_calls[0].error_kind == "policy"
    assert not traj.reward.success and "no display" in traj.reward.details["error"]


def test_gym_env_trains_two_grpo_steps(tmp_path, tiny_model_dir):
    _register("guess-test", gym_entry("guess-test", GuessEnv, "Find my number; guess with act."))
    _grpo(tmp_path, "guess-test", tiny_model_dir)
