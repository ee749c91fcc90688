"""A request's ``tools`` and ``tool_choice``: checked (400 naming the parameter), and what they do.

``tool_choice`` (default ``auto``, with or without ``tools``: a client that lists its tools in the
system message, as the policy was trained, still gets its calls back as ``tool_calls``):

* ``none`` -- no tool call is returned: the turn is text (``content``), whatever it holds, and the
  rendering's single-token call tags (``<tool_call>``, ``<|python_tag|>``) cannot be sampled;
* ``auto`` -- a well-formed call in the checkpoint's format comes back as ``tool_calls``;
* ``required`` -- the prompt ends with the opening of a call up to its name (``<tool_call>{"name": "``),
  so the policy writes a call;
* ``{"type": "function", "function": {"name": N}}`` -- the prompt ends with the opening of a call of
  ``N`` up to its arguments (``<tool_call>{"name": "N", "arguments": ``), so the policy writes its
  arguments.

A ``required`` or named call is validated: it must parse, name a tool of the request (``N`` when
named) and its arguments must satisfy the tool's JSON schema. One that does not comes back as text
(``content``: the prefilled opening and what the policy wrote), without ``tool_calls``, with the
finish reason ``stop`` (``length`` when the budget ran out). Under ``auto`` a parsed call comes back
as ``tool_calls`` whatever its arguments (the client's tool validates them, as with OpenAI)."""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import jsonschema

from mentorrl.serve.protocol import MAX_TOOLS, APIError, check_utf8

TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
CHOICES = ("none", "auto", "required")


def _bad(message: str, param: str = "tools") -> APIError:
    return APIError(400, message, param=param)


def check_tools(tools: Sequence[Any] | None) -> list[dict[str, Any]]:
    """The request's tools as ``{"type": "function", "function": {name, description?, parameters}}``.

    Raises :class:`APIError` (400, ``param`` naming the entry) for an entry that is not a function
    tool, a name that is not 1-64 of ``[A-Za-z0-9_-]`` or is repeated, a description that is not a
    string, parameters that are not a JSON-schema object, or text that is not UTF-8."""
    if tools is None:
        return []
    if len(tools) > MAX_TOOLS:
        raise _bad(f"tools: at most {MAX_TOOLS} tools, got {len(tools)}")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        fn = _check_tool(tool, f"tools[{i}]")
        if fn["name"] in seen:
            raise _bad(f"tools[{i}].function.name: {fn['name']!r} is given twice", f"tools[{i}].function.name")
        seen.add(fn["name"])
        out.append({"type": "function", "function": fn})
    return out


def _check_tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, Mapping):
        raise _bad(f"{where}: a tool must be an object", where)
    if tool.get("type") != "function":
        raise _bad(f"{where}.type: must be 'function', got {tool.get('type')!r}", f"{where}.type")
    fn = tool.get("function")
    if not isinstance(fn, Mapping):
        raise _bad(f"{where}.function: must be an object with a name", f"{where}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise _bad(
            f"{where}.function.name: must be 1-64 letters, digits, '_' or '-', got {name!r}", f"{where}.function.name"
        )
    out: dict[str, Any] = {"name": name}
    desc = fn.get("description")
    if desc is not None:
        if not isinstance(desc, str):
            raise _bad(f"{where}.function.description: must be a string", f"{where}.function.description")
        check_utf8(desc, f"{where}.function.description")
        out["description"] = desc
    params = fn.get("parameters")
    out["parameters"] = _check_parameters(params, f"{where}.function.parameters")
    return out


def _check_parameters(params: Any, where: str) -> dict[str, Any]:
    if params is None:
        return {"type": "object", "properties": {}}
    if not isinstance(params, Mapping):
        raise _bad(f"{where}: must be a JSON schema object", where)
    if params.get("type", "object") != "object":
        raise _bad(f"{where}.type: the arguments' schema must be of type 'object'", where)
    props = params.get("properties", {})
    if not isinstance(props, Mapping) or not all(isinstance(v, Mapping) for v in props.values()):
        raise _bad(f"{where}.properties: must map each argument's name to its schema", where)
    _check_strings(params, where)
    try:
        key = json.dumps(params, sort_keys=True, allow_nan=False)
    except (TypeError, ValueError):  # not plain JSON: checked afresh
        problem = _schema_problem_of(dict(params))
    else:
        problem = _schema_problem(key)
    if problem is not None:
        raise _bad(f"{where}: not a valid JSON schema ({problem[:200]})", where)
    return dict(params)


@functools.lru_cache(maxsize=256)
def _schema_problem(text: str) -> str | None:
    """:func:`_schema_problem_of` the schema whose canonical JSON is ``text``, remembered: an agent sends
    the same tools with every turn, and checking a schema against the metaschema costs milliseconds of
    the server's GIL each time (more than half of a recording server's Python time, measured)."""
    return _schema_problem_of(json.loads(text))


def _schema_problem_of(schema: dict[str, Any]) -> str | None:
    """Why ``schema`` is not a valid JSON schema (draft 2020-12), or None."""
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        return e.message
    return None


def _check_strings(value: Any, where: str) -> None:
    """Every string (keys too) in ``value`` is UTF-8."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            check_utf8(v, where)
        elif isinstance(v, Mapping):
            stack += [*v.keys(), *v.values()]
        elif isinstance(v, (list, tuple)):
            stack += list(v)


@dataclass
class ToolPolicy:
    """What a request's ``tool_choice`` asks (see the module docstring)."""

    choice: str  # "none", "auto", "required" or "named"
    name: str | None = None  # the named function
    schemas: dict[str, dict[str, Any]] = field(default_factory=dict)  # tool name -> its arguments' schema

    @property
    def parses(self) -> bool:
        """Whether a call in the turn comes back as ``tool_calls``."""
        return self.choice != "none"

    @property
    def forced(self) -> bool:
        """Whether the prompt ends with a call's opening (and the call is validated)."""
        return self.choice in ("required", "named")

    def accepts(self, name: str | None, arguments: Any) -> bool:
        """Whether a parsed call comes back as ``tool_calls``."""
        if not self.parses or not isinstance(arguments, dict) or not isinstance(name, str):
            return False
        if not self.forced:
            return True
        if name not in self.schemas or (self.name is not None and name != self.name):
            return False
        try:
            return jsonschema.Draft202012Validator(self.schemas[name]).is_valid(arguments)
        except Exception:  # a $ref that cannot be resolved, a pattern the regex engine refuses
            return False


def tool_policy(tool_choice: Any, tools: Sequence[Mapping[str, Any]]) -> ToolPolicy:
    """The :class:`ToolPolicy` of ``tool_choice`` for the checked ``tools``. Raises :class:`APIError`
    (400, ``param="tool_choice"``) for an unknown choice, ``required`` or a named function without
    tools, or a function that is not among them."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    if tool_choice is None:
        return ToolPolicy("auto", schemas=schemas)
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise _bad(
                f"tool_choice: expected one of {', '.join(CHOICES)} or a function, got {tool_choice!r}", "tool_choice"
            )
        if tool_choice == "required" and not tools:
            raise _bad("tool_choice: 'required' needs tools", "tool_choice")
        return ToolPolicy(tool_choice, schemas=schemas)
    fn = tool_choice.get("function") if isinstance(tool_choice, Mapping) else None
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(tool_choice, Mapping) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise _bad('tool_choice: a named choice is {"type": "function", "function": {"name": ...}}', "tool_choice")
    if name not in schemas:
        raise _bad(f"tool_choice: function {name!r} is not among the request's tools", "tool_choice")
    return ToolPolicy("named", name, schemas)


__all__ = ["CHOICES", "TOOL_NAME", "ToolPolicy", "check_tools", "tool_policy"]
