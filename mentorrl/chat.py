"""OpenAI chat messages <-> the rollout contract's text, in one place.

The server (`mentorrl serve`) and the black-box teachers both speak the OpenAI
chat-completions protocol, while policies see the contract's ChatML text. These functions
convert between the two so that a conversation sent over HTTP renders to exactly the text a
rollout would have produced:

* an assistant message with one tool call <-> ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
* an assistant message with text content <-> a final answer;
* a tool message's content is the observation text as rendered by the contract.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Mapping, Sequence

from mentorrl.contract import IM_START, ParsedAction, parse_action, render_message, render_tool_call
from mentorrl.trajectory import Trajectory

ROLES = ("system", "user", "assistant", "tool")


class MessageError(ValueError):
    """A chat message that cannot be rendered (unknown role, bad tool call)."""


def tool_call_dict(name: str, arguments: Mapping[str, Any] | None) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(dict(arguments or {}))}}


def assistant_message(turn_text: str) -> dict[str, Any]:
    """The OpenAI assistant message for one generated turn (text before the stop token).

    A well-formed tool call becomes ``tool_calls``; anything else (an answer, or a malformed
    call the caller will count) is returned as ``content``."""
    action = parse_action(turn_text)
    if action.kind == "tool" and isinstance(action.arguments, dict):
        return {"role": "assistant", "content": None, "tool_calls": [tool_call_dict(action.name, action.arguments)]}
    return {"role": "assistant", "content": action.text if action.kind == "answer" else turn_text}


def message_text(msg: Mapping[str, Any]) -> str:
    """A message's content in the contract's text form."""
    role = msg.get("role")
    if role not in ROLES:
        raise MessageError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
    calls = msg.get("tool_calls") or []
    if calls:
        if role != "assistant":
            raise MessageError(f"only assistant messages carry tool_calls, not {role!r}")
        parts = []
        for c in calls:
            fn = c.get("function") if isinstance(c, Mapping) else None
            if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                raise MessageError("a tool call needs function.name")
            args = fn.get("arguments", "{}")
            try:
                args = json.loads(args) if isinstance(args, str) else args
            except json.JSONDecodeError as e:
                raise MessageError(f"tool call {fn['name']!r}: arguments are not JSON ({e.msg})") from None
            if not isinstance(args, Mapping):
                raise MessageError(f"tool call {fn['name']!r}: arguments must be a JSON object")
            parts.append(render_tool_call(fn["name"], dict(args)))
        return (msg.get("content") or "") + "".join(parts)
    content = msg.get("content")
    if content is None:
        return ""
    if not isinstance(content, str):
        raise MessageError(f"{role} message content must be a string")
    return content


def prompt_text(messages: Sequence[Mapping[str, Any]]) -> str:
    """The contract's text for a conversation, ending with the header of the next assistant turn."""
    return "".join(render_message(m["role"], message_text(m)) for m in messages) + f"{IM_START}assistant\n"


def action_of(msg: Mapping[str, Any]) -> ParsedAction:
    """The action an assistant message takes, parsed the way a rollout parses a turn."""
    return parse_action(message_text(msg))


def action_key(action: ParsedAction) -> str:
    """A canonical key for comparing actions: tool name + sorted arguments, or the answer text."""
    if action.kind == "tool":
        return "tool:" + json.dumps([action.name, action.arguments], sort_keys=True)
    if action.kind == "answer":
        return "answer:" + " ".join((action.text or "").split())
    return "malformed:" + action.raw


def trajectory_messages(traj: Trajectory, tokenizer, system: str | None, user: str) -> list[dict[str, Any]]:
    """The OpenAI messages of a recorded trajectory: system (if any), user, then each policy turn
    (decoded from its token ids) and each observation."""
    msgs: list[dict[str, Any]] = ([{"role": "system", "content": system}] if system is not None else [])
    msgs.append({"role": "user", "content": user})
    for seg in traj.segments:
        if seg.role == "prompt":
            continue
        text = tokenizer.decode(traj.token_ids[seg.start:seg.end], skip_special_tokens=False)
        if seg.role == "policy":
            msgs.append(assistant_message(_strip_turn(text)))
        else:
            msgs.append({"role": "tool", "content": _observation_content(text)})
    return msgs


def _strip_turn(text: str) -> str:
    for stop in ("<|im_end|>", "<|endoftext|>"):
        text = text.replace(stop, "")
    return text


def _observation_content(text: str) -> str:
    head = f"{IM_START}tool\n"
    start = text.find(head)
    body = text[start + len(head):] if start >= 0 else text
    end = body.find("<|im_end|>")
    return body[:end] if end >= 0 else body


__all__ = ["MessageError", "ROLES", "action_key", "action_of", "assistant_message", "message_text", "prompt_text",
           "tool_call_dict", "trajectory_messages"]
