"""OpenAI chat messages and the contract's text agree: a recorded trajectory sent over HTTP
renders back to exactly the text the policy saw."""

from __future__ import annotations

import json

import pytest

from mentorrl.chat import (MessageError, action_key, action_of, assistant_message, message_text, prompt_text,
                           trajectory_messages)


def test_trajectory_messages_render_back_to_the_policy_context(make_demos, tokenizer):
    contract, demos = make_demos(6)
    assert demos
    for traj in demos:
        user = tokenizer.decode(traj.token_ids, skip_special_tokens=False).split("<|im_start|>user\n")[1].split(
            "<|im_end|>")[0]
        msgs = trajectory_messages(traj, tokenizer, contract.system_text(), user)
        policy = [s for s in traj.segments if s.role == "policy"]
        assert sum(m["role"] == "assistant" for m in msgs) == len(policy)
        # the context before every policy turn is the text of the messages before it
        assistant_at = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        for seg, i in zip(policy, assistant_at):
            seen = tokenizer.decode(traj.token_ids[:seg.start], skip_special_tokens=False)
            assert prompt_text(msgs[:i]) == seen
        # the actions read back are the ones the expert took
        calls = [action_of(m) for m in msgs if m["role"] == "assistant"]
        tools = [(a.name, a.arguments) for a in calls if a.kind == "tool"]
        assert tools == [(c.name, c.arguments) for c in traj.tool_calls]
        assert calls[-1].kind == "answer" and calls[-1].text == traj.final_answer


def test_assistant_message_shapes():
    m = assistant_message('<tool_call>{"name": "get_order", "arguments": {"order_id": 7}}</tool_call>')
    assert m["content"] is None and m["tool_calls"][0]["function"]["name"] == "get_order"
    assert json.loads(m["tool_calls"][0]["function"]["arguments"]) == {"order_id": 7}
    assert assistant_message("  Order 7 shipped. ") == {"role": "assistant", "content": "Order 7 shipped."}
    bad = "<tool_call>{not json</tool_call>"
    assert assistant_message(bad)["content"] == bad  # kept verbatim for the caller to count
    same = action_key(action_of(m))
    assert same == action_key(action_of({"role": "assistant", "tool_calls": [
        {"function": {"name": "get_order", "arguments": '{"order_id": 7}'}}]}))
    assert same != action_key(action_of(assistant_message('<tool_call>{"name": "get_order", "arguments": {"order_id": 8}}</tool_call>')))


@pytest.mark.parametrize("msg, match", [
    ({"role": "robot", "content": "x"}, "unknown role"),
    ({"role": "user", "content": "x", "tool_calls": [{"function": {"name": "a"}}]}, "only assistant"),
    ({"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}, "function.name"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "a", "arguments": "{x"}}]}, "not JSON"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "a", "arguments": "[1]"}}]}, "JSON object"),
    ({"role": "user", "content": 5}, "must be a string"),
])
def test_bad_messages_are_named(msg, match):
    with pytest.raises(MessageError, match=match):
        message_text(msg)
