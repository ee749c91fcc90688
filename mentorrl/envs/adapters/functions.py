"""Typed Python functions with docstrings as a mentorrl tool set (TRL's ``tools=[...]`` convention).

:func:`function_tools` turns each function into a :class:`~mentorrl.envs.base.Tool` whose name,
description and argument schema are exactly what ``transformers.utils.get_json_schema`` gives it
(type hints -> JSON types, the Google-style ``Args:`` section -> argument descriptions,
``Literal`` / ``(choices: [...])`` -> ``enum``), so a tool set written for TRL or a chat template
renders and validates the same here. :func:`tool` marks a function (optionally renaming it)
without changing it. The call path adds what the schema cannot say: an argument the function does
not take is ``bad_arguments``; a coroutine function is awaited; a result that is not JSON data is
shown as its ``str``.

:class:`FunctionEnv` is an environment around such a tool set: fixed tasks (prompt + reference),
every executed call recorded, and a user-supplied ``judge(task, calls, final_answer)`` that returns
a bool or a :class:`~mentorrl.envs.base.Verdict`.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from typing import Any, Callable, Sequence

from mentorrl.envs.base import Task, Tool, ToolError, ToolRegistry, ToolResult, Verdict

from .common import AdapterTasks, NoExpert, run_async


def tool(fn: Callable[..., Any] | None = None, *, name: str | None = None) -> Any:
    """Decorator: ``@tool`` or ``@tool(name="...")``. The function is returned unchanged (still
    callable as before); ``name`` replaces ``fn.__name__`` as the tool's name."""

    def mark(f: Callable[..., Any]) -> Callable[..., Any]:
        f.__mentorrl_tool_name__ = name or f.__name__  # type: ignore[attr-defined]
        return f

    return mark(fn) if fn is not None else mark


def json_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """``transformers.utils.get_json_schema(fn)``, renamed when :func:`tool` gave it a name. Raises
    ``transformers.utils.chat_template_utils.DocstringParsingException`` / ``TypeHintParsingException``
    for a function without a docstring, an undocumented argument or an untyped one."""
    from transformers.utils import get_json_schema

    schema = get_json_schema(fn)
    custom = getattr(fn, "__mentorrl_tool_name__", None)
    if custom is not None:
        schema["function"]["name"] = custom
    return schema


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    try:
        json.dumps(value, allow_nan=False)
        return value
    except (TypeError, ValueError):
        return str(value)


def _caller(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())

    def call(**arguments: Any) -> Any:
        unknown = sorted(set(arguments) - set(params)) if not takes_any else []
        if unknown:
            raise ToolError(
                f"bad arguments for {name}: unknown argument(s) {', '.join(unknown)}; "
                f"it takes {', '.join(params) or 'none'}",
                kind="bad_arguments",
            )
        return _jsonable(run_async(fn(**arguments)))

    return call


def function_tools(fns: Sequence[Callable[..., Any]]) -> list[Tool]:
    """One :class:`Tool` per function; ``Tool.parameters`` is get_json_schema's ``parameters``."""
    tools = []
    for fn in fns:
        f = json_schema(fn)["function"]
        tools.append(Tool(f["name"], f.get("description", ""), f["parameters"], _caller(fn, f["name"])))
    return tools


Judge = Callable[[Task, list[dict[str, Any]], "str | None"], "bool | Verdict"]


class FunctionEnv:
    """An environment whose tools are plain functions and whose verdict is ``judge``'s.

    ``judge(task, calls, final_answer)`` sees the calls this episode executed (each ``{"name",
    "arguments", "ok", "result", "error"}``, in order) and returns a bool (success) or a
    :class:`Verdict` (to report hard violations). A judge that raises gives a failed verdict with
    the error in ``details["judge_error"]``."""

    version = "1.0"

    def __init__(
        self,
        fns: Sequence[Callable[..., Any]],
        judge: Judge,
        name: str = "functions",
        system_prompt: str = "Use the tools to do the user's task, then answer briefly.",
        tool_timeout_s: float = 5.0,
        **_: Any,
    ):
        self.name, self.system_prompt, self.judge = name, system_prompt, judge
        self.registry = ToolRegistry(function_tools(fns), timeout_s=tool_timeout_s)
        self.task: Task | None = None
        self.calls: list[dict[str, Any]] = []

    def reset(self, task: Task) -> str:
        self.task, self.calls = task, []
        return task.prompt

    def step(self, name: Any, arguments: Any) -> ToolResult:
        r = self.registry.call(name, arguments)
        self.calls.append({"name": name, "arguments": arguments, "ok": r.ok, "result": r.content, "error": r.error})
        return r

    def verify(self, final_answer: str | None) -> Verdict:
        if self.task is None:
            return Verdict(success=False, details={"error": "no active episode"})
        try:
            out = self.judge(self.task, list(self.calls), final_answer)
        except Exception as e:  # noqa: BLE001 - the user's judge must not crash the rollout
            return Verdict(success=False, details={"judge_error": f"{type(e).__name__}: {e}"[:500]})
        return out if isinstance(out, Verdict) else Verdict(success=bool(out))

    def close(self) -> None:
        self.registry.close()


def function_entry(
    name: str,
    fns: Sequence[Callable[..., Any]],
    judge: Judge,
    tasks: dict[str, Sequence[tuple[str, dict[str, Any]]]],
    system_prompt: str | None = None,
    make_expert: Callable[[], Any] | None = None,
) -> Callable[[], Any]:
    """An :class:`~mentorrl.envs.EnvEntry` factory for :func:`~.common.register_adapter`: ``tasks``
    maps a split to its ``(prompt, reference)`` rows."""
    from mentorrl.envs import EnvEntry

    kw = {"system_prompt": system_prompt} if system_prompt is not None else {}

    def entry() -> EnvEntry:
        return EnvEntry(
            lambda **k: FunctionEnv(fns, judge, name=name, **kw, **k),
            lambda: AdapterTasks(name, tasks),
            make_expert or (lambda: NoExpert(name)),
        )

    return entry


__all__ = ["tool", "json_schema", "function_tools", "FunctionEnv", "function_entry"]
