"""The worked examples of docs/bring-your-env.md run here: each ``python`` block registers an
environment, which then plays scripted episodes (a right answer succeeds, a bad call is an error
observation). The page's code cannot drift from the adapters."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from mentorrl.contract import ContractLimits, contract_for_env
from mentorrl.envs import get_env
from mentorrl.envs.adapters.common import is_registered
from mentorrl.rollout.episode import run_text_turns

pytest.importorskip("verifiers.v1")
pytest.importorskip("gymnasium")

PAGE = Path(__file__).resolve().parents[1] / "docs" / "bring-your-env.md"
BLOCKS = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest.fixture(scope="module")
def examples():
    assert len(BLOCKS) == 3, "one worked example per adapter"
    names = ("codes", "guess", "shop")
    for block, name in zip(BLOCKS, names):
        if not is_registered(name):
            exec(compile(block, f"{PAGE.name}:{name}", "exec"), {"__name__": f"docs_{name}"})
    return {n: get_env(n) for n in names}


def _play(entry, tokenizer, turns_for):
    env = entry.make_env(tool_timeout_s=2.0)
    contract = contract_for_env(tokenizer, env, limits=ContractLimits(max_turns=8, max_total_tokens=1024))
    try:
        task = entry.make_tasks().tasks("train", 1, 0)[0]
        env.reset(task)
        good = run_text_turns(contract, env, task, turns_for(env, task))
        bad = run_text_turns(contract, env, task, [call(next(iter(env.registry.tools)), nope=1), "no idea"])
        return good, bad
    finally:
        env.close()


def test_verifiers_example(examples, tokenizer):
    entry = examples["codes"]
    env = entry.make_env(tool_timeout_s=2.0)
    contract = contract_for_env(tokenizer, env, limits=ContractLimits(max_turns=8, max_total_tokens=1024))
    try:
        task = entry.make_tasks().tasks("train", 1, 0)[0]
        word = task.prompt.split()[-1].rstrip("?")
        good = run_text_turns(contract, env, task, [word[::-1].upper()])
        bad = run_text_turns(contract, env, task, [call("lookup", word=word), "no idea"])
    finally:
        env.close()
    assert good.reward.success and good.reward.details["vf_reward"] == 1.0
    assert env.system_prompt == "Answer with the code only."
    assert bad.tool_calls[0].error_kind == "unknown_tool" and not bad.reward.success


def test_gym_example(examples, tokenizer):
    def turns(env, task):
        return [call("act", action=str(env.gym.target)), "Found it."]

    good, bad = _play(examples["guess"], tokenizer, turns)
    assert good.reward.success and good.tool_calls[0].result["observation"] == "correct"
    assert bad.tool_calls[0].error_kind == "bad_arguments" and not bad.reward.success


def test_function_example(examples, tokenizer):
    def turns(env, task):
        item = task.reference["item"]
        return [call("stock", item=item), f"{ {'apple': 3, 'pear': 0}[item] } in stock."]

    good, bad = _play(examples["shop"], tokenizer, turns)
    assert good.reward.success
    assert bad.tool_calls[0].error_kind == "bad_arguments" and not bad.reward.success
