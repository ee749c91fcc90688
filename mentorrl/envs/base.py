"""Environment protocol and the tool registry every environment uses.

An environment owns real state (SQLite), exposes tools with JSON-schema arguments, and
judges its own final state through a verifier. Tool calls coming from a model are
untrusted: the registry validates names and arguments, catches exceptions and enforces a
timeout, and turns every failure into a :class:`ToolResult` with an ``error_kind``
instead of raising. Arguments nested deeper than :data:`~mentorrl.contract.MAX_JSON_DEPTH` or
holding a non-finite number (NaN, Infinity) are ``bad_arguments`` before any schema or tool
sees them, and every error message is clipped to :data:`~mentorrl.contract.MAX_ERROR_CHARS`,
so a huge bad value is never echoed back whole.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import json
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol, Sequence

import jsonschema

from mentorrl.contract import MAX_ERROR_CHARS, MAX_JSON_DEPTH, clip_text


class ToolError(Exception):
    """Raised by a tool for an expected, user-facing failure (e.g. a policy rule).

    ``kind`` is "policy" for a refused action (a rule the tool enforces) and
    "tool_exception" otherwise.
    """

    def __init__(self, message: str, kind: str = "tool_exception"):
        super().__init__(message)
        self.kind = kind


@dataclass
class ToolResult:
    ok: bool
    content: Any  # JSON-serialisable output when ok, else None
    error: str | None = None
    error_kind: str | None = None  # unknown_tool | bad_arguments | tool_exception | timeout | policy
    latency_s: float = 0.0


@functools.lru_cache(maxsize=1024)
def _validator_for(key: str) -> jsonschema.Draft202012Validator:
    schema = json.loads(key)
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def schema_validator(schema: dict[str, Any]) -> jsonschema.Draft202012Validator:
    """A checked validator for a tool's argument schema, memoised by the schema's content: an
    environment built per episode re-checks nothing (checking the orders tools' nine schemas cost
    ~60 ms per environment, ~8 CPU-s per GRPO step of 128 episodes). Invalid schemas raise
    ``jsonschema.SchemaError`` every time (exceptions are not cached); a schema that is not JSON
    (a Python object inside) is checked without the memo."""
    try:
        key = json.dumps(schema, sort_keys=True)
    except (TypeError, ValueError):
        jsonschema.Draft202012Validator.check_schema(schema)
        return jsonschema.Draft202012Validator(schema)
    return _validator_for(key)


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # JSON schema of the arguments object
    fn: Callable[..., Any]

    def __post_init__(self) -> None:
        self._validator = schema_validator(self.parameters)

    def signature(self, with_description: bool = True) -> str:
        """One-line rendering for prompts: ``name(arg: type, ...) - description``."""
        props = self.parameters.get("properties", {})
        required = set(self.parameters.get("required", []))
        args = ", ".join(f"{k}{'' if k in required else '?'}: {v.get('type', 'any')}" for k, v in props.items())
        return f"{self.name}({args}) - {self.description}" if with_description else f"{self.name}({args})"

    def validation_error(self, arguments: Any) -> str | None:
        problem = argument_problem(arguments)
        if problem is not None:
            return clip_text(problem)
        try:
            err = jsonschema.exceptions.best_match(self._validator.iter_errors(arguments))
        except RecursionError:
            return f"arguments: nested deeper than {MAX_JSON_DEPTH} levels"
        if err is None:
            return None
        where = "/".join(str(p) for p in err.absolute_path) or "arguments"
        return clip_text(f"{where}: {err.message}")


def argument_problem(arguments: Any, max_depth: int = MAX_JSON_DEPTH) -> str | None:
    """What makes ``arguments`` unusable whatever the schema says: a non-finite number (NaN,
    Infinity, which JSON cannot carry but Python's parser accepts) or nesting deeper than
    ``max_depth``. Walks iteratively (no recursion); None when fine."""
    stack: list[tuple[str, Any, int]] = [("", arguments, 0)]
    while stack:
        path, value, depth = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return f"{path or 'arguments'}: must be a finite number, not {value!r}"
        if isinstance(value, (dict, list)):
            if depth >= max_depth:
                return f"{path or 'arguments'}: nested deeper than {max_depth} levels"
            items = value.items() if isinstance(value, dict) else enumerate(value)
            stack.extend((f"{path}/{k}" if path else str(k), v, depth + 1) for k, v in items)
    return None


class ToolRegistry:
    """Named tools plus the safe call path used by every rollout."""

    def __init__(
        self,
        tools: list[Tool],
        timeout_s: float = 5.0,
        on_timeout: Callable[[], None] | None = None,
        delay: Callable[[str], float] | None = None,
    ):
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate tool names: {names}")
        self.tools = {t.name: t for t in tools}
        self.timeout_s = timeout_s
        self.on_timeout = on_timeout
        self.delay = delay  # seconds slept inside each call before the tool runs (latency injection)
        self._pool: cf.ThreadPoolExecutor | None = None

    def __contains__(self, name: str) -> bool:
        return name in self.tools

    def specs(self) -> list[dict[str, Any]]:
        """OpenAI-style tool specs (``{"type": "function", "function": {...}}``)."""
        return [
            {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
            for t in self.tools.values()
        ]

    def call(self, name: Any, arguments: Any) -> ToolResult:
        t0 = time.perf_counter()

        def done(error: str | None = None, **kw: Any) -> ToolResult:
            error = clip_text(error, MAX_ERROR_CHARS) if error is not None else None
            return ToolResult(latency_s=time.perf_counter() - t0, error=error, **kw)

        if not isinstance(name, str) or name not in self.tools:
            known = ", ".join(sorted(self.tools))
            shown = clip_text(repr(name), 80)
            return done(
                ok=False, content=None, error=f"unknown tool {shown}; known tools: {known}", error_kind="unknown_tool"
            )
        tool = self.tools[name]
        if not isinstance(arguments, dict):
            return done(
                ok=False, content=None, error=f"arguments for {name} must be a JSON object", error_kind="bad_arguments"
            )
        problem = tool.validation_error(arguments)
        if problem is not None:
            return done(
                ok=False, content=None, error=f"bad arguments for {name}: {problem}", error_kind="bad_arguments"
            )
        wait_s = self.delay(name) if self.delay is not None else 0.0
        if wait_s >= self.timeout_s:  # decided by the drawn delay, not by the clock: see below
            time.sleep(self.timeout_s)  # what the caller of a tool this slow waits; the tool never runs
            return done(
                ok=False, content=None, error=f"tool {name} timed out after {self.timeout_s:g}s", error_kind="timeout"
            )
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tool-{name}")
        cancelled = threading.Event()

        def run() -> Any:
            if wait_s > 0 and cancelled.wait(wait_s):
                raise ToolError(f"tool {name} cancelled after timing out", kind="timeout")  # never runs late
            return tool.fn(**arguments)

        future = self._pool.submit(run)
        try:
            # an injected delay shorter than the timeout never causes one (the tool itself gets
            # ``timeout_s``): whether a call times out never depends on how busy the machine was
            out = future.result(timeout=self.timeout_s + wait_s)
        except cf.TimeoutError:
            cancelled.set()  # a call still waiting on its injected latency never executes its side effect
            if self.on_timeout is not None:
                self.on_timeout()  # e.g. sqlite3.Connection.interrupt(): abort the pending statement
            # the stuck worker cannot be killed; give later calls a fresh one
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
            return done(
                ok=False, content=None, error=f"tool {name} timed out after {self.timeout_s:g}s", error_kind="timeout"
            )
        except ToolError as e:
            return done(ok=False, content=None, error=str(e), error_kind=e.kind)
        except Exception as e:  # noqa: BLE001 - a tool bug must not crash the rollout
            return done(
                ok=False,
                content=None,
                error=f"tool {name} failed: {type(e).__name__}: {e}",
                error_kind="tool_exception",
            )
        return done(ok=True, content=out)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


@dataclass
class Task:
    """A task as the environment sees it. ``reference`` is private to the verifier/expert."""

    id: str
    family: str
    split: str  # train | heldout
    prompt: str  # the user's message
    seed: int  # seeds the episode database
    difficulty: str = "normal"  # normal | adversarial
    reference: dict[str, Any] = field(default_factory=dict)


@dataclass
class Verdict:
    """What the verifier concluded from environment state (never from the agent's claim alone)."""

    success: bool
    violations: list[str] = field(default_factory=list)  # hard constraints broken (forbidden side effects, rule bypass)
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class ToolAction:
    name: str
    arguments: dict[str, Any]


@dataclass
class FinalAnswer:
    """A scripted policy's final answer: ``text``, and the typed ``record`` it stands for where the
    environment reads typed answers (``env.answer_tool``): the episode then ends with that tool's call
    carrying the record; elsewhere the text is the answer."""

    text: str
    record: dict[str, Any] | None = None


Action = ToolAction | FinalAnswer


def final_answer_text(env: Any, answer: FinalAnswer) -> str:
    """What ``env.verify`` reads for a scripted final answer, without a tokenizer: the answer tool's
    call as JSON where the environment reads typed answers and the answer carries a record, else
    the text (what :class:`~mentorrl.rollout.episode.Episode` hands it for the same turn)."""
    tool = getattr(env, "answer_tool", None)
    if tool is not None and answer.record is not None:
        return json.dumps({"name": tool, "arguments": answer.record}, ensure_ascii=False)
    return answer.text


class Environment(Protocol):
    """One episode at a time. Create one instance per concurrent trajectory."""

    name: str
    version: str
    system_prompt: str
    registry: ToolRegistry
    # optional: the name of a registry tool whose call *is* the final answer (a typed record); the
    # episode ends on it and passes the call's JSON to ``verify``. Absent or None: a turn without a
    # tool call is the answer.
    # answer_tool: str | None

    def reset(self, task: Task) -> str:
        """Seed fresh state for ``task`` and return the user's opening message."""

    def step(self, name: Any, arguments: Any) -> ToolResult:
        """Run one tool call against the live state (through ``registry.call``)."""

    def verify(self, final_answer: str | None) -> Verdict:
        """Judge the final state (and, for information requests, the answer) against the task."""

    def close(self) -> None: ...


class TaskSource(Protocol):
    """Seeded tasks of a split. A source whose class sets ``stratifies = True`` also takes
    ``tasks(..., stratified=True)``: each of its strata (e.g. family x kind) gets its exact share. One
    whose class sets ``families`` (a tuple of names) says which task families it draws, so a family
    filter (``sft.families``) is checked against it before the first step."""

    def tasks(self, split: str, n: int, seed: int) -> list[Task]: ...


def draw_tasks(source: TaskSource, split: str, n: int, seed: int, stratified: bool = False) -> list[Task]:
    """``source.tasks(split, n, seed)``, stratified when asked (a clear error where the source cannot)."""
    if not stratified:
        return source.tasks(split=split, n=n, seed=seed)
    check_stratifies(source)
    return source.tasks(split=split, n=n, seed=seed, stratified=True)  # type: ignore[call-arg]


class UnknownFamilyError(ValueError):
    """A family filter names a family the task source never drew (:func:`draw_family_tasks`)."""


def draw_family_tasks(
    source: TaskSource, split: str, n: int, seed: int, families: Sequence[str], tries: int = 6
) -> list[Task]:
    """The first ``n`` tasks of ``families`` in ``source.tasks(split, m, seed)``, drawing ever larger ``m``
    (``2n``, then enough for the share of those families seen so far) until ``n`` are kept: the tasks keep
    the source's own mix within those families. Fewer than ``n`` when a finite source, or ``tries`` draws,
    hold fewer; a family none of the draws holds is an :class:`UnknownFamilyError` naming it."""
    wanted, m = set(families), 2 * n
    for _ in range(tries):
        drawn = source.tasks(split=split, n=m, seed=seed)
        kept = [t for t in drawn if t.family in wanted]
        if len(kept) >= n or len(drawn) < m:  # enough, or a finite source gave all it has
            break
        m = max(2 * m, int(1.25 * m * n / max(len(kept), 1)) + 1)
    missing = sorted(wanted - {t.family for t in kept})
    if missing:
        raise UnknownFamilyError(
            f"no {split!r} task of famil{'y' if len(missing) == 1 else 'ies'} {', '.join(missing)} among "
            f"{len(drawn)} drawn from {type(source).__name__}"
        )
    return kept[:n]


def check_stratifies(source: TaskSource) -> None:
    if not getattr(source, "stratifies", False):
        raise ValueError(
            f"eval.stratify: the task source {type(source).__name__} cannot draw stratified tasks "
            "(it has no `stratifies = True`); set eval.stratify: false"
        )


class ExpertPolicy(Protocol):
    def act(self, task: Task) -> Iterator[Action]:
        """A generator: yields actions; receives each tool observation (a ToolResult) via ``send``."""
