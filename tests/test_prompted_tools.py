"""Tool use through a chat template that renders no tools (SmolLM2's plain ChatML): ``hermes_prompted``.

The checkpoint's template is kept as it is; the tool schemas go in the system message (a ``<tools>`` block),
a call stays the assistant turn's content (``<tool_call>{json}</tool_call>``) and a tool result is a ``tool``
message the template renders. Token in / token out: the rollout's ids equal ``apply_chat_template`` of the
same conversation at every turn boundary."""

from __future__ import annotations

import copy

import pytest
from family_templates import PLAIN_CHATML

from mentorrl.chat_templates import native_chat_for
from mentorrl.chat_templates.formats import HERMES_PROMPTED, prompted_system
from mentorrl.config import PromptFormat
from mentorrl.contract import ContractLimits, contract_for_env, render_observation_content, tool_schemas
from mentorrl.models.shipped import SHIPPED_ROOT
from mentorrl.rollout.episode import run_scripted_episode, run_text_turns


@pytest.fixture(scope="module")
def plain_tok():
    from transformers import AutoTokenizer

    tok = copy.deepcopy(AutoTokenizer.from_pretrained(SHIPPED_ROOT / "orders-tiny"))
    tok.chat_template = PLAIN_CHATML
    return tok


@pytest.fixture(scope="module")
def env(orders_entry):
    e = orders_entry.make_env()
    yield e
    e.close()


@pytest.fixture(scope="module")
def contract(plain_tok, env):
    chat = native_chat_for(plain_tok, env, PromptFormat())
    assert chat is not None and chat.name == HERMES_PROMPTED
    return contract_for_env(plain_tok, env, limits=ContractLimits(max_total_tokens=8192), chat=chat)


def _messages(system: str, user: str, turns: list[tuple[str, str]]) -> list[dict]:
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    for text, result in turns:
        msgs += [{"role": "assistant", "content": text}, {"role": "tool", "content": result}]
    return msgs


def test_the_template_is_kept_and_the_tools_are_in_the_system_text(contract, plain_tok, env):
    assert plain_tok.chat_template == PLAIN_CHATML
    system = contract.chat.system
    assert system.startswith(env.system_prompt) and "<tools>" in system and "final_answer" in system
    assert contract.chat.tools is None  # the template would ignore tools=
    assert system == prompted_system(env.system_prompt, tool_schemas(env))


def test_scripted_episodes_equal_the_template_at_every_turn_boundary(contract, plain_tok, env, orders_entry):
    for task in orders_entry.make_tasks().tasks("train", 6, 7):
        traj = run_scripted_episode(contract, env, task, orders_entry.make_expert())
        assert traj.finish_reason == "answer" and traj.reward.success, task.id
        user = env.reset(task)
        texts = [
            plain_tok.decode(traj.token_ids[s.start : s.end - 1], skip_special_tokens=False)
            for s in traj.segments
            if s.role == "policy"
        ]
        starts = [s.start for s in traj.segments if s.role == "policy"]
        for k, start in enumerate(starts):
            turns = [
                (texts[j], render_observation_content(c.error is None, c.result, c.error))
                for j, c in enumerate(traj.tool_calls[:k])
            ]
            text = plain_tok.apply_chat_template(
                _messages(contract.chat.system, user, turns), add_generation_prompt=True, tokenize=False
            )
            assert traj.token_ids[:start] == plain_tok.encode(text, add_special_tokens=False), (task.id, k)


@pytest.mark.parametrize(
    "turn",
    [
        '<tool_call>\n{"name": "find_customer", "arguments": {"email": "x"\n</tool_call>',  # truncated JSON
        '<tool_call>\n{"name": "delete_everything", "arguments": {}}\n</tool_call>',  # unknown tool
        'Let me check. <tool_call>\n{"name": "get_order", "arguments": {"order_id": "O-1"}}\n</tool_call> ok',
    ],
)
def test_malformed_calls_from_a_real_model_are_observations_not_crashes(contract, env, orders_entry, turn):
    task = orders_entry.make_tasks().tasks("train", 1, 3)[0]
    traj = run_text_turns(contract, env, task, [turn, "I could not do it."])
    assert traj.tool_calls and traj.finish_reason == "answer" and not traj.reward.success
