"""A request rendered the way the checkpoint's chat template renders it, and a turn read back.

:class:`ChatRenderer` picks the rendering from the tokenizer's chat template
(:func:`mentorrl.chat_templates.resolve_tool_format` with ``auto``):

* the contract's own template (the tiny models, every checkpoint mentorrl writes with the ChatML
  contract), no template, or one that renders no tools: :func:`mentorrl.chat.prompt_pieces`, which
  ``apply_chat_template(messages, tools=..., add_generation_prompt=True)`` equals: with ``tools`` the
  system turn is the contract's (the system message's content, the tools' signatures, the call
  syntax), honouring the template's ``tool_descriptions`` / ``system_turn`` defaults
  (:func:`mentorrl.contract.chat_template_for`);
* a tool-aware template of a registered family (hermes, llama3_json):
  :meth:`mentorrl.chat_templates.TemplateChat.render_request` -- the template itself renders the
  messages and ``tools=``; calls are read in the family's format, the turn ends at the template's
  stop token.

Content is text either way: a control string in a message, a tool's name, description or schema never
becomes a control token (:class:`mentorrl.contract.ChatEncoder`)."""

from __future__ import annotations

import json
import logging
from typing import Any, Mapping, Sequence

from mentorrl.chat import MessageError, message_pieces_of, prompt_pieces
from mentorrl.chat_templates import (
    MENTORRL,
    TemplateChat,
    TemplateError,
    get_tool_format,
    resolve_tool_format,
    trained_without_tools,
)
from mentorrl.chat_templates.formats import PYTHON_TAG
from mentorrl.config import ConfigError
from mentorrl.contract import (
    IM_END,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ChatEncoder,
    ParsedAction,
    loads_bounded,
    parse_action,
    tool_call_pieces,
    turn_pieces,
)
from mentorrl.serve.tools import ToolPolicy

log = logging.getLogger(__name__)
_NAME_MARK = "mentorrlNAME"  # a placeholder tool name, to find where a rendered call's name starts


def _template_flag(source: str | None, name: str) -> bool:
    """A :func:`~mentorrl.contract.chat_template_for` template's default for ``name`` (true unless it says false)."""
    return not (source and f"{name} if {name} is defined else false" in source)


class ChatRenderer:
    """Request -> prompt pieces, and a generated turn -> an action, for one tokenizer (see the module docstring)."""

    def __init__(self, tokenizer: Any, tool_format: str = "auto"):
        source = getattr(tokenizer, "chat_template", None)
        source = source if isinstance(source, str) else None
        self.tokenizer, self.chat = tokenizer, self._native(tokenizer, source, tool_format)
        self.format = MENTORRL if self.chat is None else self.chat.name
        # a checkpoint trained with no tools in its prompt (its run's PROMPT_RECORD): a request's tools are not
        # rendered, as in training, and still name the functions a reply may call
        self.render_tools = self.chat is None or not trained_without_tools(tokenizer, self.format)
        self.tool_descriptions = _template_flag(source, "tool_descriptions")
        self.system_turn = _template_flag(source, "system_turn")
        self.encoder = ChatEncoder(tokenizer, self.chat.control_names if self.chat is not None else ())
        self.stop_token = IM_END if self.chat is None else self.chat.stop
        self.tags = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE) if self.chat is None else self.chat.fmt.tags
        # a reasoning block is cut from an answer at the end: its text cannot be streamed as it comes
        self.incremental = not (self.chat is not None and "</think>" in (source or ""))

    @staticmethod
    def _native(tokenizer: Any, source: str | None, tool_format: str) -> TemplateChat | None:
        try:
            name = resolve_tool_format(source, tool_format)
            return None if name == MENTORRL else TemplateChat(tokenizer, get_tool_format(name), None, None)
        except (ConfigError, TemplateError) as e:
            log.warning("mentorrl serve: rendering with the contract's ChatML, not the checkpoint's template: %s", e)
            return None

    # ---- the prompt ---------------------------------------------------------------------------
    def prompt_pieces(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]) -> list[str]:
        """The conversation and ``tools`` up to the generation prompt. Raises :class:`MessageError`."""
        if self.chat is None:
            return prompt_pieces(messages, tools or None, self.tool_descriptions, self.system_turn)
        for m in messages:
            message_pieces_of(m)  # the checks (role, tool calls, their arguments) of the ChatML rendering
        try:
            shown = (tools or None) if self.render_tools else None
            return self.chat.render_request([_native_message(m) for m in messages], shown)
        except TemplateError as e:
            raise MessageError(str(e)) from None

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        if self.chat is None:
            return "".join(tool_call_pieces(name, arguments))
        return self.chat.render_call(name, arguments)

    def prefill(self, policy: ToolPolicy) -> str:
        """The text the prompt ends with for a forced call: a call's opening up to its name (``required``)
        or up to its arguments (a named function); "" otherwise."""
        if not policy.forced:
            return ""
        whole = self.render_call(policy.name or _NAME_MARK, {})
        if policy.name is None:
            return whole[: whole.index(json.dumps(_NAME_MARK)) + 1]
        return whole[: whole.rindex("{}")]

    def turn_pieces(self, text: str) -> list[str]:
        """A policy turn's text (a prefill): its call tags are control pieces, the rest text."""
        return turn_pieces(text) if self.chat is None else self.chat.turn_pieces(text)

    def prompt_ids(self, pieces: list[str]) -> list[int]:
        return self.encoder.pieces(pieces)

    def banned_ids(self, policy: ToolPolicy) -> list[int]:
        """The single-token call openings a turn may not sample (``tool_choice: none``)."""
        if policy.parses:
            return []
        opens = (TOOL_CALL_OPEN,) if self.chat is None else tuple(t for t in self.tags if t != TOOL_CALL_CLOSE)
        return sorted({self.encoder.control_ids[t] for t in opens if t in self.encoder.control_ids})

    # ---- the turn -----------------------------------------------------------------------------
    def parse(self, text: str) -> ParsedAction:
        return parse_action(text) if self.chat is None else self.chat.parse(text)

    def call_start(self, text: str) -> int | None:
        """Where a call may start in ``text`` (a turn so far): the first call tag, or a partial one at the
        end; for llama3_json, 0 while the turn may still be a JSON call. None: no call begins here yet."""
        if self.format == "llama3_json":
            body = text.lstrip()
            maybe = not body or body.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(body)
            return 0 if maybe else None
        opens = [t for t in self.tags if t != TOOL_CALL_CLOSE and not t.startswith("</")] or list(self.tags)
        found = [i for i in (text.find(t) for t in opens) if i >= 0]
        for t in opens:
            for k in range(min(len(t) - 1, len(text)), 0, -1):
                if text.endswith(t[:k]):
                    found.append(len(text) - k)
                    break
        return min(found, default=None)


def _native_message(m: Mapping[str, Any]) -> dict[str, Any]:
    """An OpenAI message as chat templates take it: tool-call arguments as objects, not JSON strings."""
    out = {k: v for k, v in m.items() if k in ("role", "content", "tool_call_id", "name")}
    calls = m.get("tool_calls") or []
    if calls:
        out["tool_calls"] = []
        for c in calls:
            fn = c["function"]
            args = fn.get("arguments")
            args = loads_bounded(args) if isinstance(args, str) else (args or {})
            out["tool_calls"].append({"type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


__all__ = ["ChatRenderer"]
