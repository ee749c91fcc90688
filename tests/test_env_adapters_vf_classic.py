"""The classic verifiers adapter (verifiers 0.2 / 0.3: vf.SingleTurnEnv, vf.ToolEnv, vf.MultiTurnEnv),
environments defined here, played with scripted turns and trained two GRPO steps. verifiers 0.4
removed that API (the test extra pins 0.4: test_env_adapters_vf04.py), so these skip there."""

from __future__ import annotations

import pytest
from test_env_adapters import _grpo, _register, call, contract_for  # noqa: F401 - contract_for: a fixture

from mentorrl.envs import get_env
from mentorrl.envs.adapters import VerifiersEnv, verifiers_entry
from mentorrl.rollout.episode import run_text_turns

vf = pytest.importorskip("verifiers")
if not hasattr(vf, "MultiTurnEnv"):
    pytest.skip(f"verifiers {vf.__version__} has no classic API (it is 0.4 or later)", allow_module_level=True)


def _dataset(rows):
    from datasets import Dataset

    return Dataset.from_list(rows)


def exact_answer(completion, answer, parser) -> float:
    return 1.0 if (parser.parse_answer(completion) or "").strip() == answer else 0.0


def make_single_turn():
    rows = [
        {"question": f"What is {a} + {b}? Answer with the number only.", "answer": str(a + b)}
        for a, b in [(2, 2), (3, 4), (5, 1), (6, 3)]
    ]
    return vf.SingleTurnEnv(
        dataset=_dataset(rows),
        eval_dataset=_dataset(rows[:2]),
        system_prompt="You add numbers.",
        rubric=vf.Rubric(funcs=[exact_answer]),
    )


def lookup(word: str) -> str:
    """Look up the secret code of a word.

    Args:
        word: the word
    """
    if word == "crash":
        raise RuntimeError("the code book is on fire")
    return word[::-1].upper()


def make_tool_env():
    rows = [{"question": f"What is the code of {w}?", "answer": w[::-1].upper()} for w in ("cat", "dog", "owl")]
    rubric = vf.Rubric(funcs=[exact_answer])
    return vf.ToolEnv(
        dataset=_dataset(rows), tools=[lookup], max_turns=4, system_prompt="Use the code book.", rubric=rubric
    )


class EchoGame(vf.MultiTurnEnv):
    """The environment answers each message; after two messages it ends the game."""

    async def env_response(self, messages, state, **kwargs):
        n = sum(1 for m in messages if m.role == "assistant")
        if "explode" in (messages[-1].content or ""):
            raise ValueError("the game exploded")
        if n >= 2:
            state["final_env_response"] = [{"role": "user", "content": "game over"}]
            return []
        return [{"role": "user", "content": f"say it again ({n})"}]


def said_twice(completion) -> float:
    said = [m.content for m in completion if m.role == "assistant"]
    return 1.0 if len(said) == 2 and said[0] == said[1] else 0.0


def make_multi_turn():
    return EchoGame(
        dataset=_dataset([{"question": "Say one word twice.", "answer": ""}]),
        rubric=vf.Rubric(funcs=[said_twice]),
        max_turns=5,
    )


def test_verifiers_single_turn(contract_for):
    _register("vf-add-test", verifiers_entry(make_single_turn(), name="vf-add-test"))
    entry = get_env("vf-add-test")
    env = entry.make_env(tool_timeout_s=2.0)
    assert isinstance(env, VerifiersEnv) and env.kind == "single" and env.system_prompt == "You add numbers."
    contract = contract_for(env)
    tasks = entry.make_tasks().tasks("train", 6, 0)
    assert len({t.reference["row"] for t in tasks}) == 4 and "Answer with the number only" in tasks[0].prompt
    assert len(entry.make_tasks().tasks("hidden", 3, 0)) == 3  # the eval_dataset
    for t in tasks[:3]:
        right = run_text_turns(contract, env, t, [t.reference["vf_row"]["answer"]])
        wrong = run_text_turns(contract, env, t, ["12345"])
        assert right.reward.success and right.reward.details["vf_reward"] == 1.0
        assert not wrong.reward.success and wrong.reward.total == 0.0
    stray = run_text_turns(contract, env, tasks[0], [call("lookup", word="x"), "4"])
    assert stray.tool_calls[0].error_kind == "unknown_tool"
    env.close()


def test_verifiers_tool_env(contract_for):
    _register("vf-code-test", verifiers_entry(make_tool_env(), name="vf-code-test"))
    entry = get_env("vf-code-test")
    env = entry.make_env(tool_timeout_s=2.0)
    assert env.kind == "tool" and list(env.registry.tools) == ["lookup"]
    contract = contract_for(env)
    task = entry.make_tasks().tasks("train", 3, 0)[0]
    word = task.prompt.split()[-1].rstrip("?")
    good = run_text_turns(contract, env, task, [call("lookup", word=word), word[::-1].upper()])
    assert good.reward.success and good.tool_calls[0].result == word[::-1].upper()
    completion = env.state["completion"]
    assert [m.role for m in completion] == ["assistant", "tool", "assistant"]
    assert env.state["metrics"]["total_tool_calls"] == 1.0
    bad = run_text_turns(
        contract, env, task, [call("lookup", word="crash"), call("lookup", wrd="cat"), call("nope"), "no idea"]
    )
    assert [c.error_kind for c in bad.tool_calls] == ["tool_exception", "bad_arguments", "unknown_tool"]
    assert "on fire" in bad.tool_calls[0].error and not bad.reward.success
    assert "on fire" in env.messages[len(env.state["prompt"]) + 1].content  # verifiers' history has it too
    env.close()


def test_verifiers_multi_turn(contract_for):
    env = VerifiersEnv(make_multi_turn(), name="vf-echo")
    assert env.kind == "multi"
    contract = contract_for(env)
    from mentorrl.envs.adapters.verifiers_env import VerifiersTasks

    task = VerifiersTasks(env.vf, "vf-echo").tasks("train", 1, 0)[0]
    good = run_text_turns(contract, env, task, [call("reply", message="moon"), call("reply", message="moon"), "bye"])
    assert [c.result for c in good.tool_calls] == [
        {"response": "say it again (1)"},
        {"response": "game over", "done": True, "note": "the episode is over; reply with your final answer"},
    ]
    assert good.reward.success and good.reward.details["vf_stop"] == "has_final_env_response"
    boom = run_text_turns(contract, env, task, [call("reply", message="explode"), "bye"])
    assert boom.tool_calls[0].error_kind == "tool_exception" and "exploded" in boom.tool_calls[0].error
    assert not boom.reward.success
    env.close()


def test_verifiers_rubric_that_raises_is_a_failed_verdict(contract_for):
    def broken(completion) -> float:
        raise RuntimeError("judge down")

    class GroupOnly(vf.Rubric):
        pass

    base = make_single_turn()
    base.rubric = vf.Rubric(funcs=[broken])  # verifiers logs a failing reward function and scores it 0
    env = VerifiersEnv(base, name="vf-broken")
    contract = contract_for(env)
    from mentorrl.envs.adapters.verifiers_env import VerifiersTasks

    task = VerifiersTasks(base, "vf-broken").tasks("train", 1, 0)[0]
    traj = run_text_turns(contract, env, task, [task.reference["vf_row"]["answer"]])
    assert not traj.reward.success and traj.reward.details["vf_reward"] == 0.0
    base.rubric = GroupOnly(funcs=[lambda completions: [1.0 for _ in completions]])
    traj = run_text_turns(contract, env, task, [task.reference["vf_row"]["answer"]])
    assert not traj.reward.success and "scoring failed" in traj.reward.details["error"]


def odd_length(completion) -> float:
    return float(sum(len(m.content or "") for m in completion if m.role == "assistant") % 2)


def test_verifiers_single_turn_trains_two_grpo_steps(tmp_path, tiny_model_dir):
    env = make_single_turn()
    env.rubric = vf.Rubric(funcs=[odd_length])  # earned half the time by any answer
    _register("vf-parity-test", verifiers_entry(env, name="vf-parity-test"))
    steps = _grpo(tmp_path, "vf-parity-test", tiny_model_dir)
    assert all(r["reward_mean"] <= 1.5 for r in steps)


def test_verifiers_tool_env_trains_two_grpo_steps(tmp_path, tiny_model_dir):
    _register("vf-code-test", verifiers_entry(make_tool_env(), name="vf-code-test"))
    _grpo(tmp_path, "vf-code-test", tiny_model_dir)
