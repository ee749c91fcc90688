"""OpenAI chat messages <-> the rollout contract's text, in one place.

The server (`mentorrl serve`) and the black-box teachers both speak the OpenAI
chat-completions protocol, while policies see the contract's ChatML text. These functions
convert between the two so that a conversation sent over HTTP renders to exactly the text a
rollout would have produced:

* an assistant message with one tool call <-> ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
* an assistant message with text content <-> a final answer;
* a tool message's content is the observation text as rendered by the contract.

With ``tools=`` (OpenAI function schemas) the system turn is the contract's system turn (tool
signatures and call syntax), and the chat template saved with checkpoints
(:data:`mentorrl.contract.CHAT_TEMPLATE`) renders every conversation to the same text, so
``apply_chat_template`` agrees with a rollout.

:func:`prompt_pieces` gives the same rendering as pieces for :class:`mentorrl.contract.ChatEncoder`:
the content of every message is plain text (a user cannot close their turn with a literal
``<|im_end|>``); only the template's tokens and an assistant turn's tool-call tags are control
tokens, as in a rollout.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Mapping, Sequence

from mentorrl.contract import (
    IM_START,
    Control,
    ParsedAction,
    loads_bounded,
    message_pieces,
    parse_action,
    system_text,
    tool_call_pieces,
    turn_pieces,
)
from mentorrl.trajectory import Trajectory, dumps_compact

ROLES = ("system", "user", "assistant", "tool")


class MessageError(ValueError):
    """A chat message that cannot be rendered (unknown role, bad tool call)."""


def tool_call_dict(name: str, arguments: Mapping[str, Any] | None) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:12]}",
        "type": "function",
        "function": {"name": name, "arguments": dumps_compact(dict(arguments or {}))},
    }


def assistant_message(turn_text: str) -> dict[str, Any]:
    """The OpenAI assistant message for one generated turn (text before the stop token).

    A well-formed tool call becomes ``tool_calls``; anything else (an answer, or a malformed
    call the caller will count) is returned as ``content``."""
    action = parse_action(turn_text)
    if action.kind == "tool" and isinstance(action.arguments, dict):
        return {"role": "assistant", "content": None, "tool_calls": [tool_call_dict(action.name, action.arguments)]}
    return {"role": "assistant", "content": action.text if action.kind == "answer" else turn_text}


def message_pieces_of(msg: Mapping[str, Any]) -> list[str]:
    """A message's content as pieces (see :func:`mentorrl.contract.turn_pieces`): an assistant's
    tool calls and tool-call tags are control pieces, all other content is plain text."""
    role = msg.get("role")
    if role not in ROLES:
        raise MessageError(f"unknown role {role!r}; expected one of {', '.join(ROLES)}")
    calls = msg.get("tool_calls") or []
    if calls:
        if role != "assistant":
            raise MessageError(f"only assistant messages carry tool_calls, not {role!r}")
        parts: list[str] = []
        for c in calls:
            fn = c.get("function") if isinstance(c, Mapping) else None
            if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                raise MessageError("a tool call needs function.name")
            args = fn.get("arguments")
            args = {} if args is None else args
            try:
                args = loads_bounded(args) if isinstance(args, str) else args
            except json.JSONDecodeError as e:
                raise MessageError(f"tool call {fn['name']!r}: arguments are not JSON ({e.msg})") from None
            except ValueError as e:
                raise MessageError(f"tool call {fn['name']!r}: arguments: {e}") from None
            if not isinstance(args, Mapping):
                raise MessageError(f"tool call {fn['name']!r}: arguments must be a JSON object")
            parts += tool_call_pieces(fn["name"], dict(args))
        return turn_pieces(_content(role, msg.get("content") or "")) + parts
    content = _content(role, msg.get("content"))
    return turn_pieces(content) if role == "assistant" else [content]


def _content(role: str, content: Any) -> str:
    if content is None:
        return ""
    if not isinstance(content, str):
        raise MessageError(f"{role} message content must be a string")
    return content


def message_text(msg: Mapping[str, Any]) -> str:
    """A message's content in the contract's text form."""
    return "".join(message_pieces_of(msg))


def tool_signature(tool: Mapping[str, Any], with_description: bool = True) -> str:
    """The contract's one-line signature of an OpenAI tool schema (``{"type": "function",
    "function": {...}}`` or the bare function), as :meth:`mentorrl.envs.base.Tool.signature` writes it."""
    fn = tool.get("function", tool) if isinstance(tool, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise MessageError("a tool needs function.name")
    params = fn.get("parameters") or {}
    props, required = params.get("properties") or {}, set(params.get("required") or [])
    args = ", ".join(f"{k}{'' if k in required else '?'}: {v.get('type', 'any')}" for k, v in props.items())
    return f"{fn['name']}({args}) - {fn.get('description', '')}" if with_description else f"{fn['name']}({args})"


def prompt_pieces(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_descriptions: bool = True,
    system_turn: bool = True,
) -> list[str]:
    """:func:`prompt_text` as pieces for :class:`mentorrl.contract.ChatEncoder`."""
    messages = list(messages)
    pieces: list[str] = []
    if tools and system_turn:
        system = ""
        if messages and messages[0].get("role") == "system":
            system = _content("system", messages[0].get("content"))
            messages = messages[1:]
        sigs = [tool_signature(t, tool_descriptions) for t in tools]
        pieces += message_pieces("system", system_text(system, sigs))
    for m in messages:
        content = message_pieces_of(m)
        pieces += message_pieces(m["role"], content)
    return pieces + [Control(IM_START), "assistant\n"]


def prompt_text(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_descriptions: bool = True,
    system_turn: bool = True,
) -> str:
    """The contract's text for a conversation, ending with the header of the next assistant turn.

    With ``tools`` (OpenAI function schemas) the system turn is the contract's: the system
    message's content (or "") followed by the tools' signatures and the call syntax, as a rollout
    renders it; with ``system_turn=False`` (a ``prompt.system_turn: false`` contract) there is none and
    the tools are not listed. The checkpoint's chat template (:func:`mentorrl.contract.chat_template_for`)
    renders the same text."""
    return "".join(prompt_pieces(messages, tools, tool_descriptions, system_turn))


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
    msgs: list[dict[str, Any]] = [{"role": "system", "content": system}] if system is not None else []
    msgs.append({"role": "user", "content": user})
    for seg in traj.segments:
        if seg.role == "prompt":
            continue
        text = tokenizer.decode(traj.token_ids[seg.start : seg.end], skip_special_tokens=False)
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
    body = text[start + len(head) :] if start >= 0 else text
    end = body.find("<|im_end|>")
    return body[:end] if end >= 0 else body


__all__ = [
    "MessageError",
    "ROLES",
    "action_key",
    "action_of",
    "assistant_message",
    "message_pieces_of",
    "message_text",
    "prompt_pieces",
    "prompt_text",
    "tool_call_dict",
    "tool_signature",
    "trajectory_messages",
]
