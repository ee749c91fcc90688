"""Tool-call formats: how a model family writes a tool call in its turn, keyed by template family.

A checkpoint's chat template renders an assistant message's ``tool_calls`` in its family's syntax; the
policy, trained and prompted with that template, writes its calls the same way. A :class:`ToolFormat`
is the pair: ``render`` writes one call as the template does (the text a scripted expert's turn is made
of) and ``parse`` reads a generated turn back into a :class:`~mentorrl.contract.ParsedAction`, never
raising (a call that cannot be parsed is ``malformed``, as in the contract's own format).

Registered formats (:data:`TOOL_FORMATS`; add one with :func:`register_tool_format`):

* ``hermes`` -- Qwen2.5, Qwen3, Hermes 2/3 Pro: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``;
* ``llama3_json`` -- Llama 3.1 / 3.2 / 3.3 custom tools: ``{"name": ..., "parameters": {...}}``, optionally
  after ``<|python_tag|>``.

:func:`detect_tool_format` picks one from a template's source (documented heuristics, in order): the
contract's own template (``mentorrl``) is recognised by its call-syntax line; ``<|python_tag|>``, or
``ipython`` with ``"parameters"``, is ``llama3_json``; ``<tool_call>`` is ``hermes``. ``prompt.tool_format``
overrides the detection.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable

from mentorrl.contract import ONE_CALL_ERROR, UNBALANCED_ERROR, ParsedAction, loads_bounded

MENTORRL = "mentorrl"  # the contract's own ChatML format (mentorrl.contract.CHAT_TEMPLATE)
HERMES_PROMPTED = "hermes_prompted"  # Hermes calls in the content of a template that renders no tools
MENTORRL_MARK = "Reply without a tool call to give the final answer."  # in every template chat_template_for writes


@dataclass(frozen=True)
class ToolFormat:
    """One family's tool-call syntax.

    ``tags``: the strings around a call that are the policy's own control tokens when the tokenizer has
    them (a turn's other text is plain); ``render(name, arguments)``: one call as the family's template
    writes it; ``parse(text)``: a generated turn (before the stop token) as an action; ``detect(source)``:
    whether a template's source is of this family."""

    name: str
    tags: tuple[str, ...]
    render: Callable[[str, dict[str, Any]], str]
    parse: Callable[[str], ParsedAction]
    detect: Callable[[str], bool]
    description: str = ""
    prompted: bool = False  # the template renders no tools: schemas go in the system text, calls stay content


def _dumps(obj: Any) -> str:
    """JSON as chat templates write it (``tojson``: ", "/": " separators, no ASCII escaping)."""
    return json.dumps(obj, ensure_ascii=False)


def _call_object(body: str, args_key: str, raw: str) -> ParsedAction:
    """``body`` parsed as ``{"name": str, args_key: object}`` (``"arguments"`` also accepted)."""
    try:
        obj = loads_bounded(body)
    except json.JSONDecodeError as e:
        return ParsedAction("malformed", raw=raw, error=f"malformed tool call: invalid JSON ({e.msg} at char {e.pos})")
    except ValueError as e:
        return ParsedAction("malformed", raw=raw, error=f"malformed tool call: {e}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ParsedAction(
            "malformed", raw=raw, error=f'malformed tool call: expected {{"name": str, "{args_key}": object}}'
        )
    args = obj.get(args_key, obj.get("arguments", {}))
    return ParsedAction("tool", raw=raw, name=obj["name"], arguments=args, body=body)


# ---- hermes: Qwen2.5 / Qwen3 / Hermes ------------------------------------------------------------
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"


def hermes_render(name: str, arguments: dict[str, Any]) -> str:
    return f"{HERMES_OPEN}\n{_dumps({'name': name, 'arguments': arguments})}\n{HERMES_CLOSE}"


def hermes_parse(text: str) -> ParsedAction:
    """Exactly one ``<tool_call>{json}</tool_call>`` is a call; a turn without the tags is an answer
    (text before a ``</think>`` is reasoning, not the answer)."""
    if HERMES_OPEN not in text and HERMES_CLOSE not in text:
        return ParsedAction("answer", raw=text, text=text.split("</think>")[-1].strip())
    if text.count(HERMES_OPEN) != 1 or text.count(HERMES_CLOSE) != 1:
        return ParsedAction("malformed", raw=text, error=ONE_CALL_ERROR)
    start, end = text.find(HERMES_OPEN), text.find(HERMES_CLOSE)
    if end < start:
        return ParsedAction("malformed", raw=text, error=UNBALANCED_ERROR)
    body = text[start + len(HERMES_OPEN) : end].strip()
    return _call_object(body, "arguments", body)


def hermes_detect(source: str) -> bool:
    return HERMES_OPEN in source


# ---- llama3_json: Llama 3.1 / 3.2 / 3.3 ---------------------------------------------------------
PYTHON_TAG = "<|python_tag|>"


def llama3_render(name: str, arguments: dict[str, Any]) -> str:
    return _dumps({"name": name, "parameters": arguments})


def llama3_parse(text: str) -> ParsedAction:
    """A turn that is one JSON object ``{"name": ..., "parameters": {...}}`` (``<|python_tag|>`` before it
    optional) is a call; a turn starting with ``<|python_tag|>`` or ``{"name"`` that is not one is
    malformed; anything else is an answer."""
    body = text.strip()
    tagged = body.startswith(PYTHON_TAG)
    if tagged:
        body = body[len(PYTHON_TAG) :].strip()
    if not tagged and not _LLAMA_CALL_START.match(body):
        return ParsedAction("answer", raw=text, text=body)
    return _call_object(body, "parameters", body)


_LLAMA_CALL_START = re.compile(r'^\{\s*"name"\s*:')


def llama3_detect(source: str) -> bool:
    return PYTHON_TAG in source or ("ipython" in source and '"parameters"' in source)


TOOL_FORMATS: dict[str, ToolFormat] = {}


def register_tool_format(fmt: ToolFormat) -> ToolFormat:
    """Add ``fmt`` to the registry (``prompt.tool_format`` names it; detection tries formats in order)."""
    if fmt.name in TOOL_FORMATS or fmt.name in (MENTORRL, "auto"):
        raise ValueError(f"tool format {fmt.name!r} is already registered")
    TOOL_FORMATS[fmt.name] = fmt
    return fmt


register_tool_format(
    ToolFormat("llama3_json", (PYTHON_TAG,), llama3_render, llama3_parse, llama3_detect, "Llama 3.1 JSON tool calls")
)
register_tool_format(
    ToolFormat(
        "hermes", (HERMES_OPEN, HERMES_CLOSE), hermes_render, hermes_parse, hermes_detect, "Qwen2.5 / Hermes tool calls"
    )
)


register_tool_format(
    ToolFormat(
        HERMES_PROMPTED,
        (HERMES_OPEN, HERMES_CLOSE),
        hermes_render,
        hermes_parse,
        lambda source: False,  # chosen for templates that render no tools (resolve_tool_format), never detected
        "Hermes tool calls, prompted: for a template with no tools section (SmolLM2, plain ChatML)",
        prompted=True,
    )
)


def prompted_system(system: str | None, tools: list[dict[str, Any]] | None) -> str | None:
    """The system message of a ``prompted`` format: the run's system prompt, then the tool schemas in a
    ``<tools>`` block and the call syntax, as Hermes-style function-calling data writes them (the template
    itself is never edited; it renders this as any system message)."""
    if not tools:
        return system
    schemas = "\n".join(_dumps(t) for t in tools)
    block = (
        "# Tools\n\nYou may call one function at a time. Their signatures are within <tools></tools> XML tags:\n"
        f"<tools>\n{schemas}\n</tools>\n\nWrite a call as a JSON object with the function name and its arguments "
        'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call>"
    )
    return f"{system}\n\n{block}" if system else block


def get_tool_format(name: str) -> ToolFormat:
    try:
        return TOOL_FORMATS[name]
    except KeyError:
        raise KeyError(f"unknown tool format {name!r}; registered: {', '.join(TOOL_FORMATS)}") from None


def renders_tools(source: str) -> bool:
    """Whether a template's source reads a ``tools`` variable (``apply_chat_template(..., tools=...)``)."""
    return bool(_TOOLS_VAR.search(source))


_TOOLS_VAR = re.compile(r"\btools\b")


def detect_tool_format(source: str | None) -> str | None:
    """The family of a chat template's source: ``"mentorrl"`` for the contract's own template, a
    registered format's name, or None (no template, or one whose tool syntax is not recognised)."""
    if not source:
        return None
    if MENTORRL_MARK in source:
        return MENTORRL
    for fmt in TOOL_FORMATS.values():
        if fmt.detect(source):
            return fmt.name
    return None


__all__ = [
    "HERMES_PROMPTED",
    "MENTORRL",
    "TOOL_FORMATS",
    "ToolFormat",
    "detect_tool_format",
    "get_tool_format",
    "hermes_parse",
    "hermes_render",
    "llama3_parse",
    "llama3_render",
    "prompted_system",
    "register_tool_format",
    "renders_tools",
]
