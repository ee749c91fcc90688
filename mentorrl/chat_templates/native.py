"""A conversation rendered by the checkpoint's own chat template, token in / token out.

:class:`TemplateChat` is the rendering a :class:`~mentorrl.contract.RolloutContract` uses when the
checkpoint ships a tool-aware template (``contract.chat``): the prompt is
``tokenizer.apply_chat_template(messages, tools=..., add_generation_prompt=True)``; a tool observation is
what the template writes after a policy turn's stop token up to the next generation prompt. The policy's
own tokens go into the trajectory as generated; nothing is re-rendered.

Content stays text. Before rendering, every control string in the system, user and tool messages and
the tool schemas (each added or special token of the tokenizer) is swapped for a marker of private-use characters, so whatever
the template does to content (``trim``, ``tojson``) it cannot produce a control token from it. In the
rendered text the control strings are the template's own (:class:`~mentorrl.contract.Control` pieces);
the markers become their original strings again, as plain text, which
:class:`~mentorrl.contract.ChatEncoder` encodes without control tokens. A tool result holding
``"<|im_end|>"``, ``"{{"`` or ``"</tool_call>"`` is those characters.

At construction the template is probed (:meth:`TemplateChat.probe`): the generation prompt, the
control token that ends an assistant turn (the stop token), and the observation's place. Then the
prefix property is checked over a three-turn conversation: the rollout's stream (prompt, turn, stop,
observation, ...) must equal the template's rendering of the conversation up to each turn boundary.
A template that re-renders earlier turns (Qwen3-style templates drop earlier turns' reasoning) breaks
it; :attr:`TemplateChat.prefix_problem` says how, and the run says so."""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from mentorrl.chat_templates.formats import ToolFormat, prompted_system
from mentorrl.contract import Control, ParsedAction

_MARK_OPEN, _MARK_CLOSE = "\ue000", "\ue001"
_MARK = re.compile(f"{_MARK_OPEN}(\\d+){_MARK_CLOSE}")
PROBE_USER = "mentorrl probe: a user message"
PROBE_RESULT = "mentorrl probe: a tool result"


class TemplateError(ValueError):
    """A chat template the contract cannot render a tool-calling conversation with."""


def control_strings(tokenizer: Any) -> list[str]:
    """Every added or special token of ``tokenizer`` (the strings that encode to a control token)."""
    names = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        names.add(str(getattr(tok, "content", tok)))
    return sorted((n for n in names if n), key=len, reverse=True)


class TemplateChat:
    """The checkpoint's template as the contract's rendering (see the module docstring).

    ``system``: the system message's content (None: no system message); ``tools``: OpenAI function
    schemas passed as ``tools=`` (None: none); ``fmt``: the family's tool-call format."""

    def __init__(
        self,
        tokenizer: Any,
        fmt: ToolFormat,
        system: str | None,
        tools: Sequence[Mapping[str, Any]] | None,
    ):
        self._prompted: tuple[str | None, list[dict[str, Any]]] | None = None
        if fmt.prompted and tools:  # the template renders no tools: they are the system text's, calls the content's
            self._prompted = (system, [dict(t) for t in tools])
            system, tools = prompted_system(*self._prompted), None
        self.tokenizer, self.fmt, self.system = tokenizer, fmt, system
        self.tools = [dict(t) for t in tools] if tools else None
        self.name = fmt.name
        self.control_names = control_strings(tokenizer)
        vocab = tokenizer.get_vocab()
        self._ids = {n: vocab[n] for n in self.control_names if n in vocab}
        self._control = re.compile("|".join(re.escape(n) for n in self._ids)) if self._ids else None
        self._escape = re.compile("|".join([*(re.escape(n) for n in self.control_names), _MARK_OPEN, _MARK_CLOSE]))
        self.turn_tags = tuple(t for t in fmt.tags if t in self._ids)
        self._tags = re.compile("(" + "|".join(re.escape(t) for t in self.turn_tags) + ")") if self.turn_tags else None
        self.probe()

    # ---- rendering -----------------------------------------------------------------------------
    def render(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool, with_tools: bool = True
    ) -> list[str]:
        """``messages`` rendered by the template, as pieces: the template's control strings are
        :class:`Control` pieces, everything else (content included) plain text. An assistant message is
        the policy's own turn: it is rendered as given (its tags and reasoning markers are the policy's
        control tokens, and templates read them, e.g. to split off reasoning)."""
        return self._render(messages, self.tools if with_tools else None, add_generation_prompt, False)

    def render_request(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None
    ) -> list[str]:
        """A client's conversation and its own ``tools`` (a chat-completions request), ending with the
        generation prompt, as pieces. Every string is content here, an assistant message's too (a client
        is not the policy): a control string in it, or in a tool's name or description, stays text. A prompted
        format puts the request's tools in the system message (the template renders none)."""
        if self.fmt.prompted and tools:
            msgs = list(messages)
            first = msgs[0] if msgs and msgs[0].get("role") == "system" else None
            system = prompted_system(first.get("content") if first else None, [dict(t) for t in tools])
            return self._render([{"role": "system", "content": system}, *msgs[1 if first else 0 :]], None, True, True)
        return self._render(messages, [dict(t) for t in tools] if tools else None, True, True)

    def _render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
        escape_assistant: bool,
    ) -> list[str]:
        table: list[str] = []

        def escape(s: str) -> str:
            def mark(m: re.Match) -> str:
                table.append(m.group(0))
                return f"{_MARK_OPEN}{len(table) - 1}{_MARK_CLOSE}"

            return self._escape.sub(mark, s)

        def prepare(m: Mapping[str, Any]) -> Any:
            if m.get("role") == "assistant" and not escape_assistant:
                return m
            if self._prompted is not None and not escape_assistant and m.get("role") == "system":
                if m.get("content") == self.system:  # the block's own tags are template text: control strings
                    base, tools = self._prompted
                    return {**m, "content": prompted_system(base and escape(base), _map_strings(tools, escape))}
            return _map_strings(m, escape)

        try:
            text = self.tokenizer.apply_chat_template(
                [prepare(m) for m in messages],
                tools=_map_strings(tools, escape) if tools else None,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
        except Exception as e:  # jinja's TemplateError, raise_exception, a missing variable
            raise TemplateError(f"the checkpoint's chat template cannot render the conversation: {e}") from None
        return self._pieces(text, table)

    def _pieces(self, text: str, table: list[str]) -> list[str]:
        out: list[str] = []
        for i, part in enumerate(_MARK.split(text)):
            if i % 2:
                out.append(table[int(part)])  # content's control string: plain text
            elif self._control is None:
                out.append(part)
            else:
                pos = 0
                for m in self._control.finditer(part):
                    out += [part[pos : m.start()], Control(m.group(0))]
                    pos = m.end()
                out.append(part[pos:])
        return [p for p in out if p]

    def conversation(self, user: str, turns: Sequence[tuple[str, str | None]] = ()) -> list[dict[str, Any]]:
        """The messages of an episode: system (if any), ``user``, then per turn the assistant message of
        the policy's text and (when not None) the tool result."""
        msgs: list[dict[str, Any]] = [{"role": "system", "content": self.system}] if self.system is not None else []
        msgs.append({"role": "user", "content": user})
        for text, result in turns:
            msgs.append(self.assistant_message(text))
            if result is not None:
                msgs.append({"role": "tool", "content": result})
        return msgs

    def assistant_message(self, text: str) -> dict[str, Any]:
        """A policy turn's text as the assistant message the template renders back to that text: a call
        in the family's format becomes ``tool_calls`` (the text before it the content), else content."""
        action = self.fmt.parse(text)
        if self.fmt.prompted or action.kind != "tool" or not isinstance(action.arguments, dict):
            return {"role": "assistant", "content": text}
        cut = min((text.find(t) for t in self.fmt.tags if t in text), default=0)
        call = {"type": "function", "function": {"name": action.name, "arguments": action.arguments}}
        return {"role": "assistant", "content": text[:cut].rstrip(), "tool_calls": [call]}

    def prompt_pieces(self, user: str) -> list[str]:
        return self.render(self.conversation(user), add_generation_prompt=True)

    def observation_pieces(self, content: str) -> list[str]:
        """What the template writes after a policy turn's stop token: the tool turn holding ``content``
        and the next generation prompt."""
        return _drop_prefix(self._observation_render(content, self._light), self._turn_prefix)

    def _observation_render(self, content: str, light: bool) -> list[str]:
        """A one-call conversation ending in the tool result ``content``: the run's (system, tools), or
        ``light``, a bare user message (cheaper; used when the probe finds it renders the result alike)."""
        if not light:
            return self.render(self.conversation(PROBE_USER, [(self._probe_call, content)]), True)
        msgs = [{"role": "user", "content": PROBE_USER}, self.assistant_message(self._probe_call)]
        return self.render([*msgs, {"role": "tool", "content": content}], True, with_tools=False)

    def _try_light(self) -> None:
        """Render observations without the system turn and tools when that gives the same pieces."""
        try:
            bare = [{"role": "user", "content": PROBE_USER}]
            prefix = "".join(self.render(bare, True, with_tools=False)) + self._probe_call + self.stop
            same = all(
                _drop_prefix(self._observation_render(c, True), prefix)
                == _drop_prefix(self._observation_render(c, False), self._turn_prefix)
                for c in (PROBE_RESULT, '{"x": "<y>\n"}')
            )
        except TemplateError:
            same = False
        if same:
            self._light, self._turn_prefix = True, prefix

    def turn_pieces(self, text: str) -> list[str]:
        """A policy turn's text: the family's call tags are the policy's control tokens, the rest text."""
        if self._tags is None:
            return [text] if text else []
        return [Control(p) if i % 2 else p for i, p in enumerate(self._tags.split(text)) if p]

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        return self.fmt.render(name, arguments)

    def parse(self, text: str) -> ParsedAction:
        return self.fmt.parse(text)

    # ---- probing ---------------------------------------------------------------------------------
    def probe(self) -> None:
        """Find the stop token and the observation's place, then check the prefix property."""
        name = self.tools[0].get("function", self.tools[0]).get("name", "tool") if self.tools else "tool"
        self._probe_call = self.fmt.render(str(name), {"query": "probe"})
        head = "".join(self.render(self.conversation(PROBE_USER), add_generation_prompt=True))
        whole = "".join(self.render(self.conversation(PROBE_USER, [(self._probe_call, PROBE_RESULT)]), True))
        if not whole.startswith(head + self._probe_call):
            raise TemplateError(
                f"the chat template does not render a {self.fmt.name} tool call as the policy writes it: after "
                f"the prompt it renders {whole[len(head) : len(head) + 120]!r}, not {self._probe_call!r}; "
                "set prompt.tool_format to the template's family"
            )
        rest = whole[len(head) + len(self._probe_call) :]
        stop = next((n for n in self._ids if rest.startswith(n)), None)
        if stop is None:
            raise TemplateError(
                f"the chat template does not end an assistant turn with a control token (after a call it writes "
                f"{rest[:60]!r}); the rollout needs one as the turn's stop token"
            )
        self.stop = stop
        self.stop_id = self._ids[stop]
        self._turn_prefix, self._light = head + self._probe_call + stop, False
        self._try_light()
        self.prefix_problem = self.prefix_check()

    def prefix_check(self) -> str | None:
        """None when the rollout's stream equals the template's rendering at every turn boundary of a
        three-turn probe conversation (a reasoning block before each call when the template knows
        ``<think>``); else what differs."""
        think = "<think>\nprobe reasoning\n</think>\n\n" if "<think>" in str(self.tokenizer.chat_template) else ""
        turns = [(think + self._probe_call, f"{PROBE_RESULT} {k}") for k in range(3)]
        stream = "".join(self.prompt_pieces(PROBE_USER))
        for k, (text, result) in enumerate(turns):
            stream += text + self.stop + "".join(self.observation_pieces(result))
            rendered = "".join(self.render(self.conversation(PROBE_USER, turns[: k + 1]), add_generation_prompt=True))
            if rendered != stream:
                at = next(
                    (i for i, (a, b) in enumerate(zip(rendered, stream)) if a != b), min(len(rendered), len(stream))
                )
                return (
                    f"the chat template breaks the prefix property: rendering the conversation after turn {k + 1} "
                    f"differs from the rollout's stream at character {at} ({rendered[at : at + 60]!r} vs "
                    f"{stream[at : at + 60]!r}); it re-renders earlier turns (e.g. drops their reasoning), so a "
                    "trajectory's tokens are not apply_chat_template's rendering of its finished conversation"
                )
        return None


def _map_strings(value: Any, fn) -> Any:
    """``value`` with ``fn`` applied to every string in it (dict keys too)."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, Mapping):
        return {_map_strings(k, fn): _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_map_strings(v, fn) for v in value]
    return value


def _drop_prefix(pieces: list[str], prefix: str) -> list[str]:
    """``pieces`` without their first ``len(prefix)`` characters, which must be ``prefix`` and end on a
    piece boundary."""
    text, n = "", 0
    for i, p in enumerate(pieces):
        if text == prefix:
            return pieces[i:]
        text += p
        n = i
    if text == prefix:
        return []
    raise TemplateError(
        f"the chat template renders a tool-calling conversation's start differently each time (piece {n}); "
        "its observation cannot be placed"
    )


__all__ = ["PROBE_RESULT", "PROBE_USER", "TemplateChat", "TemplateError", "control_strings"]
