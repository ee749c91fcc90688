"""The τ²-bench environment: a domain of the user's clone, run in its own interpreter, behind
mentorrl's :class:`~mentorrl.envs.base.Environment` protocol.

* :func:`handshake` starts the domain once when the run is set up: the interpreter, its version
  against the clone's ``requires-python``, the domain's import and its tool schemas are checked
  there, so a mismatch is a :class:`~mentorrl.config.ConfigError` naming ``env.python`` or
  ``env.domain`` before the first step.
* :class:`Tau2Env` keeps one child process (:mod:`.protocol`) for its episodes; :meth:`~Tau2Env.reset`
  builds a fresh domain environment in it (with the task's initial state), so no state crosses
  episodes. The tools are the toolkit's own schemas plus ``message_user`` (the user's answer is
  the observation); the domain policy is in the system turn; the final message ends the
  conversation. :meth:`~Tau2Env.verify` scores with the benchmark's rules (:mod:`.reward`) and
  records them in ``Verdict.details["tau2"]``.
* A child that fails (hangs, floods, garbage, exits) fails the episode: the tool call is an error
  observation, the verdict a failure with ``details["error"]``; the next reset starts a new child.
"""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass
from typing import Any

from mentorrl.config.base import ConfigError
from mentorrl.contract import clip_text
from mentorrl.envs.base import Task, Tool, ToolError, ToolRegistry, ToolResult, Verdict, schema_validator
from mentorrl.envs.latency import LatencySampler

from .protocol import Child, ChildFailure
from .records import Tau2Settings, Tau2Task
from .reward import gold_calls, score
from .users import LLMUser, ScriptedUser

USER_TOOL = "message_user"
MAX_TOOLS = 256
MAX_DESCRIPTION = 4000
MAX_OBSERVATION_CHARS = 16_000
MAX_POLICY_CHARS = 200_000
START_TIMEOUT_S = 120.0
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
SYSTEM = (
    "You are a customer service agent of the {domain} domain. Follow the policy below. Use the tools to act; "
    "talk to the customer with the {user_tool} tool (its result is the customer's answer); your final reply "
    "without a tool call ends the conversation and is your last message to the customer.\n\n<policy>\n{policy}\n</policy>"
)
SOLO_SYSTEM = (
    "You are a customer service agent of the {domain} domain, solving a ticket on your own: there is no customer "
    "to talk to, and you have the customer's tools as well as yours. Follow the policy below; your final reply "
    "without a tool call ends the task.\n\n<policy>\n{policy}\n</policy>"
)


@dataclass(frozen=True)
class DomainSpec:
    """What the handshake learnt: the policy, the agent tools' schemas (JSON) and the mutating tools."""

    policy: str
    tools_json: str
    mutating: tuple[str, ...]
    python_version: tuple[int, ...]

    @property
    def tools(self) -> list[dict[str, Any]]:
        return json.loads(self.tools_json)


def required_python(settings: Tau2Settings) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """The clone's ``requires-python`` bounds (``>=`` and ``<``), from its pyproject.toml when it has one."""
    try:
        spec = tomllib.loads((settings.clone / "pyproject.toml").read_text())["project"]["requires-python"]
    except (OSError, KeyError, tomllib.TOMLDecodeError, TypeError):
        return None, None
    lo = re.search(r">=\s*(\d+)\.(\d+)", str(spec))
    hi = re.search(r"<\s*(\d+)\.(\d+)", str(spec))
    return (tuple(map(int, lo.groups())) if lo else None, tuple(map(int, hi.groups())) if hi else None)  # type: ignore[return-value]


def check_schema(raw: Any) -> dict[str, Any]:
    """One tool schema from the child, allow-listed: ``{"type": "function", "function": {name, description,
    parameters}}`` with a valid name and a checkable object schema; a ValueError otherwise."""
    fn = raw.get("function") if isinstance(raw, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not _NAME.match(fn["name"]):
        raise ValueError(f"not an OpenAI function schema with a valid name: {clip_text(repr(raw), 200)}")
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    if not isinstance(params, dict) or params.get("type") != "object":
        raise ValueError(f"tool {fn['name']}: parameters must be an object schema")
    schema_validator(params)
    desc = fn.get("description")
    return {
        "name": fn["name"],
        "description": clip_text(desc if isinstance(desc, str) else "", MAX_DESCRIPTION),
        "parameters": params,
    }


def _spec_from_hello(settings: Tau2Settings, reply: dict[str, Any]) -> DomainSpec:
    version = tuple(int(x) for x in reply.get("python", [])[:3] if isinstance(x, int))
    lo, hi = required_python(settings)
    if len(version) < 2 or (lo and version[:2] < lo) or (hi and version[:2] >= hi):
        raise ConfigError(
            f"env.python: {settings.python} is Python {'.'.join(map(str, version)) or '?'}; the clone asks for "
            f"{'>=' + '.'.join(map(str, lo)) if lo else ''}{',<' + '.'.join(map(str, hi)) if hi else ''}"
        )
    raw_tools = reply.get("tools")
    if not isinstance(raw_tools, list) or not raw_tools or len(raw_tools) > MAX_TOOLS:
        raise ConfigError(f"env.domain: {settings.domain} must have 1 to {MAX_TOOLS} agent tools")
    try:
        tools = [check_schema(t) for t in raw_tools]
    except ValueError as e:
        raise ConfigError(f"env.domain: {settings.domain}: {e}") from None
    names = [t["name"] for t in tools]
    if len(set(names)) != len(names) or USER_TOOL in names:
        raise ConfigError(f"env.domain: {settings.domain}: duplicate tool names or a tool named {USER_TOOL!r}")
    policy = reply.get("policy")
    if not isinstance(policy, str) or len(policy) > MAX_POLICY_CHARS:
        raise ConfigError(
            f"env.domain: {settings.domain}: the policy must be text of at most {MAX_POLICY_CHARS} characters"
        )
    mutating = tuple(str(m) for m in (reply.get("mutating") or []) if m in names)
    return DomainSpec(policy, json.dumps(tools), mutating, version)


def handshake(settings: Tau2Settings) -> DomainSpec:
    """Start the domain once and check it (see the module docstring)."""
    try:
        child = Child(settings.python, settings.clone, settings.domain, solo=settings.solo)
    except ChildFailure as e:
        raise ConfigError(f"env.python: {e}") from None
    try:
        reply = child.request("hello", START_TIMEOUT_S)
    except ChildFailure as e:
        raise ConfigError(f"env.python: the domain's interpreter failed: {e}") from None
    finally:
        child.close()
    if not reply["ok"]:
        why = str(reply.get("error"))[:1000]
        if "ModuleNotFoundError" in why or "ImportError" in why:
            raise ConfigError(
                f"env.python: {settings.python} cannot import the {settings.domain} domain: {why} (install the "
                "clone's dependencies into that interpreter, e.g. `uv sync` in the clone, and point env.python "
                "at its .venv/bin/python)"
            )
        if settings.solo and "solo" in why.lower():
            raise ConfigError(f"env.solo: the {settings.domain} domain has no solo mode: {why}")
        if "FileNotFoundError" in why:
            raise ConfigError(f"env.path: the {settings.domain} domain could not find a data file: {why}")
        raise ConfigError(f"env.domain: the {settings.domain} domain failed to load: {why}")
    return _spec_from_hello(settings, reply)


def make_client(config_json: str | None) -> Any:
    """A TeacherClient for a ClientConfig given as JSON (the LLM user, the judge); None for None."""
    if config_json is None:
        return None
    from mentorrl.clients.config import ClientConfig
    from mentorrl.clients.openai_api import TeacherClient

    return TeacherClient(ClientConfig.model_validate_json(config_json))


class Tau2Env:
    """One τ²-bench domain of the user's clone (see the module docstring). One episode at a time."""

    answer_tool = None

    def __init__(self, settings: Tau2Settings, spec: DomainSpec, tool_timeout_s: float = 5.0, latency: Any = None):
        self.settings, self.spec = settings, spec
        self.name, self.version = "tau2", f"tau2/{settings.domain}"
        template = SOLO_SYSTEM if settings.solo else SYSTEM
        self.system_prompt = template.format(domain=settings.domain, policy=spec.policy, user_tool=USER_TOOL)
        self.call_timeout_s = max(0.5, tool_timeout_s - 0.25)  # the child's deadline, inside the registry's
        tools = [Tool(t["name"], t["description"], t["parameters"], self._domain_tool(t["name"])) for t in spec.tools]
        if not settings.solo:  # solo mode has no customer to talk to
            tools.append(
                Tool(
                    USER_TOOL,
                    "Send a message to the customer; the result is the customer's answer.",
                    {"type": "object", "properties": {"message": {"type": "string"}}, "required": ["message"]},
                    self._message_user,
                )
            )
        self._latency = LatencySampler(latency) if latency is not None else None
        self.registry = ToolRegistry(tools, timeout_s=tool_timeout_s, on_timeout=self._on_timeout, delay=self._latency)
        self.child: Child | None = None
        self.user_client = make_client(settings.user_client) if settings.user == "llm" else None
        self.judge = make_client(settings.judge)
        self.task: Tau2Task | None = None
        self.user: Any = None
        self.failure: str | None = None
        self.episode = 0  # counts resets
        self.messages: list[str] = []  # the agent's messages to the user
        self.calls: list[tuple[str, dict[str, Any]]] = []  # the agent's domain tool calls that ran
        self.transcript: list[tuple[str, str]] = []

    # ---- the child ----------------------------------------------------------
    def _request(self, op: str, timeout_s: float, **fields: Any) -> dict[str, Any]:
        if self.failure is not None:
            raise ChildFailure(self.failure)
        if self.child is None or not self.child.alive:
            if self.child is not None:
                self.child.close()
            try:
                self.child = Child(
                    self.settings.python, self.settings.clone, self.settings.domain, solo=self.settings.solo
                )
            except ChildFailure as e:
                self.failure = f"the {self.settings.domain} environment process did not start: {e}"
                raise ChildFailure(self.failure) from None
        child, episode = self.child, self.episode
        try:
            return child.request(op, timeout_s, **fields)
        except ChildFailure as e:
            why = f"the {self.settings.domain} environment process failed: {e}"
            if episode == self.episode:  # a call that timed out may end after its episode: it touches nothing then
                self.failure = why
                if self.child is child:
                    self.child = None
            child.close()
            raise ChildFailure(why) from None

    def _on_timeout(self) -> None:
        child, self.child = self.child, None
        self.failure = self.failure or "a tool call timed out; the environment process was stopped"
        if child is not None:
            child.kill()  # the stalled call then fails at once; it closes the pipes

    # ---- the protocol -------------------------------------------------------
    def reset(self, task: Task) -> str:
        self.task = Tau2Task.model_validate(task.reference["tau2"])
        if self._latency is not None:
            self._latency.start_episode(task.seed)
        self.episode += 1
        self.failure, self.messages, self.calls, self.transcript = None, [], [], []
        scenario, turns = self.task.user_scenario, self.settings.max_user_turns
        self.user = (
            LLMUser(scenario, self.user_client, turns)
            if self.user_client is not None
            else ScriptedUser(scenario, turns)
        )
        try:
            reply = self._request("reset", START_TIMEOUT_S, initial_state=self.task.initial_state)
            if not reply["ok"]:
                self.failure = (
                    f"the {self.settings.domain} environment failed to reset: {str(reply.get('error'))[:500]}"
                )
        except ChildFailure:
            pass  # self.failure says why: every call errors and the verdict fails
        opening = (self.task.ticket or "") if self.settings.solo else self.user.opening()
        self.transcript.append(("user", opening))
        return opening

    def step(self, name: Any, arguments: Any) -> ToolResult:
        return self.registry.call(name, arguments)

    def _domain_tool(self, name: str) -> Any:
        def call(**arguments: Any) -> Any:
            try:
                reply = self._request("call", self.call_timeout_s, name=name, arguments=arguments)
            except ChildFailure as e:
                raise ToolError(str(e)) from None
            self.transcript.append(("assistant", f"{name}({json.dumps(arguments, default=str)[:2000]})"))
            if not reply["ok"]:
                raise ToolError(clip_text(str(reply.get("error")), MAX_OBSERVATION_CHARS))
            content = reply.get("content")
            self.calls.append((name, arguments))
            text = clip_text(content if isinstance(content, str) else json.dumps(content), MAX_OBSERVATION_CHARS)
            self.transcript.append(("tool", text[:4000]))
            return text

        return call

    def _message_user(self, message: str) -> str:
        self.messages.append(message)
        self.transcript.append(("assistant", message))
        answer = self.user.reply(message)
        self.transcript.append(("user", answer))
        return answer

    def verify(self, final_answer: str | None) -> Verdict:
        if self.task is None:
            raise RuntimeError("verify before reset")
        if final_answer:
            self.messages.append(final_answer)
            self.transcript.append(("assistant", final_answer))
        crit = self.task.evaluation_criteria
        evaluation = None
        if self.failure is None and crit is not None and {"DB", "ENV_ASSERTION"} & set(crit.reward_basis):
            assertions = [a.model_dump() for a in crit.env_assertions or []]
            try:
                evaluation = self._request(
                    "evaluate",
                    START_TIMEOUT_S,
                    actions=gold_calls(crit),
                    assertions=assertions,
                    initial_state=self.task.initial_state,
                )
            except ChildFailure:
                pass
            if evaluation is not None and not evaluation["ok"]:
                self.failure = f"evaluation failed: {str(evaluation.get('error'))[:500]}"
        if self.failure is not None:
            return Verdict(success=False, details={"error": self.failure, "env_error": True, "tau2": {"reward": 0.0}})
        judge = self.judge if crit is not None and crit.needs_judge else None
        outcome = score(self.task.id, crit, evaluation, self.messages, self.calls, self.transcript, judge)
        return Verdict(success=outcome.reward == 1.0, details={"tau2": outcome.model_dump()})

    def close(self) -> None:
        self.registry.close()
        if self.child is not None:
            self.child.close()
            self.child = None
        for client in (self.user_client, self.judge):
            if client is not None:
                client.close()
        self.user_client = self.judge = None


__all__ = ["DomainSpec", "Tau2Env", "USER_TOOL", "check_schema", "handshake", "make_client", "required_python"]
