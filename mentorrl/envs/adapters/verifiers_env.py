"""A ``verifiers`` environment (PyPI ``verifiers``, the format of prime-rl's environment hub) run
through mentorrl's rollout, reward and trajectory contract.

Supported: the classic API, ``import verifiers as vf`` (``verifiers`` 0.2 and 0.3; 0.3 keeps it as
``verifiers.legacy`` and answers the old names; 0.4 removed it: :mod:`.verifiers_v1` adapts 0.4): ``vf.SingleTurnEnv``, ``vf.ToolEnv``,
``vf.StatefulToolEnv`` and any other ``vf.MultiTurnEnv``. Nothing here imports ``verifiers`` until
an adapted environment runs, and mentorrl, not a ``verifiers`` client, drives the model.

* **Tasks** (:class:`VerifiersTasks`): the rows of ``get_dataset()`` (split ``train``) and of the
  ``eval_dataset`` (``heldout`` and ``hidden``; without one, ``heldout`` falls back to the train
  rows, as ``verifiers``' own evaluation does, and there is no ``hidden`` split). A row's user
  message is the task's prompt; its system message, when it differs from the environment's
  ``system_prompt`` (the contract's system prompt), goes before it. Few-shot assistant turns in a
  row's prompt are refused with a :class:`ValueError`.
* **Turns.** ``SingleTurnEnv``: the policy's answer is the completion (no tools).
  ``ToolEnv`` / ``StatefulToolEnv``: the environment's ``tool_defs`` are the mentorrl tools; each
  call goes through ``update_tool_args`` (stateful) and ``call_tool``, and the ``verifiers``
  message history gets the assistant tool-call message and the tool message, as its own loop
  would write them; the final answer is the last assistant message. Any other ``MultiTurnEnv``
  (a game, a simulated user): one tool, ``reply(message)``; the message is the assistant turn and
  ``env_response`` is the observation. Once the environment's stop conditions end the episode
  (``max_turns``, ``final_env_response``, ...), further calls are refused and the final answer is
  not added to the completion.
* **Reward.** :meth:`VerifiersEnv.verify` runs the environment's cleanup (which renders
  ``state["completion"]``) and its rubric's ``score_rollout``: success when the rubric's reward is
  at least ``success_threshold`` (default: the environment's ``pass_threshold``); metrics named
  in ``violation_metrics`` with a value above 0 are hard violations. The ``verifiers`` reward and
  metrics are in ``Verdict.details`` (``vf_reward``, ``vf_metrics``); mentorrl's composed reward
  (tiers, soft terms) is what trains.
* **Errors.** A tool that raises is an ``error: ...`` observation (``tool_exception``; the
  ``verifiers`` history gets the environment's ``error_formatter`` text, as its loop does);
  ``setup_state``, ``env_response`` or a rubric that raises gives an error observation or a failed
  verdict with ``details["error"]``. Group-level reward functions are not supported (the rubric
  scores one rollout at a time): that is a failed verdict saying so.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Callable

from mentorrl.envs.base import Task, Tool, ToolError, ToolRegistry, ToolResult, Verdict

from .common import AdapterTasks, NoExpert, run_async

SCORE_TIMEOUT_S = 120.0


def _text(content: Any) -> str:
    """A message's content as text (a string, or the text of its content parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for p in content:
        t = p.get("text") if isinstance(p, dict) else getattr(p, "text", None)
        parts.append(t if isinstance(t, str) else str(p))
    return "\n".join(parts)


def _field(msg: Any, key: str) -> Any:
    return msg.get(key) if isinstance(msg, dict) else getattr(msg, key, None)


def row_prompt(row: dict[str, Any], system_prompt: str | None) -> str:
    """The user-facing prompt of a dataset row (see the module docstring)."""
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list):
        raise ValueError(f"dataset row {row.get('example_id')!r}: 'prompt' must be a string or a list of messages")
    head, users = [], []
    for m in prompt:
        role, content = _field(m, "role"), _text(_field(m, "content"))
        if role == "system":
            if content != (system_prompt or ""):
                head.append(content)
        elif role == "user":
            users.append(content)
        else:
            raise ValueError(
                f"dataset row {row.get('example_id')!r}: a {role!r} message in the prompt (few-shot "
                "turns) is not supported; mentorrl prompts are a system prompt and a user message"
            )
    if not users:
        raise ValueError(f"dataset row {row.get('example_id')!r}: the prompt has no user message")
    return "\n\n".join(head + users)


class VerifiersTasks(AdapterTasks):
    """Tasks from a ``verifiers`` environment's datasets (see the module docstring)."""

    def __init__(self, vf_env: Any, name: str):
        train = vf_env.get_dataset() if (vf_env.dataset is not None or vf_env.dataset_source is not None) else None
        has_eval = vf_env.eval_dataset is not None or getattr(vf_env, "eval_dataset_source", None) is not None
        evals = vf_env.get_eval_dataset() if has_eval else None
        sp = vf_env.system_prompt

        def rows(ds: Any) -> list[tuple[str, dict[str, Any]]]:
            if ds is None:
                return []
            out = []
            for r in ds:
                r = dict(r)
                out.append((row_prompt(r, sp), {"vf_row": r, "family": str(r.get("task") or name)}))
            return out

        tr, ev = rows(train), rows(evals)
        super().__init__(name, {"train": tr, "heldout": ev or tr, "hidden": ev})


def _no_client() -> Any:
    """A ``verifiers`` client that refuses to be used: ``init_state`` needs one, mentorrl samples."""
    from verifiers.clients import Client

    class MentorrlDrivesTheModel(Client):
        def setup_client(self, config: Any) -> Any:
            return None

        def _refuse(self, *a: Any, **k: Any) -> Any:
            raise RuntimeError("mentorrl drives the model: a verifiers client is never called by the adapter")

        to_native_tool = to_native_prompt = get_native_response = _refuse
        raise_from_native_response = from_native_response = _refuse

        async def close(self) -> None:
            return None

    return MentorrlDrivesTheModel(None)


class VerifiersEnv:
    """One episode at a time of a (shared, stateless-between-rollouts) ``verifiers`` environment."""

    version = "1.0"

    def __init__(
        self,
        vf_env: Any,
        name: str = "verifiers",
        success_threshold: float | None = None,
        violation_metrics: tuple[str, ...] = (),
        tool_timeout_s: float = 5.0,
        **_: Any,
    ):
        import verifiers as vf

        if not hasattr(vf, "MultiTurnEnv"):
            raise TypeError(
                f"the classic verifiers API (vf.SingleTurnEnv, vf.ToolEnv, ...) needs verifiers<0.4, and "
                f"verifiers {getattr(vf, '__version__', '?')} is installed: adapt a verifiers 0.4 taskset with "
                "mentorrl.envs.adapters.verifiers_v1 (or env: {name: verifiers, id: ...})"
            )
        self.vf, self.name = vf_env, name
        self.system_prompt = vf_env.system_prompt or ""
        self.threshold = float(
            success_threshold if success_threshold is not None else getattr(vf_env, "pass_threshold", 0.5)
        )
        self.violation_metrics = tuple(violation_metrics)
        if isinstance(vf_env, vf.ToolEnv):
            self.kind = "tool"
            tools = [
                Tool(
                    t.name,
                    t.description or "",
                    t.parameters or {"type": "object", "properties": {}},
                    self._tool_fn(t.name),
                )
                for t in (vf_env.tool_defs or [])
            ]
        elif isinstance(vf_env, vf.SingleTurnEnv):
            self.kind, tools = "single", []
        elif isinstance(vf_env, vf.MultiTurnEnv):
            self.kind = "multi"
            tools = [
                Tool(
                    "reply",
                    "send your next message to the environment; returns its response",
                    {
                        "type": "object",
                        "properties": {"message": {"type": "string", "minLength": 1}},
                        "required": ["message"],
                        "additionalProperties": False,
                    },
                    self._reply,
                )
            ]
        else:
            raise TypeError(
                f"unsupported verifiers environment {type(vf_env).__name__}: expected a SingleTurnEnv, "
                "ToolEnv, StatefulToolEnv or another MultiTurnEnv"
            )
        self.stateful = isinstance(vf_env, getattr(vf, "StatefulToolEnv", ()))
        self.registry = ToolRegistry(tools, timeout_s=tool_timeout_s)
        self.state: Any = None
        self.messages: list[Any] = []
        self.error: str | None = None

    # -- episode ---------------------------------------------------------------------
    def reset(self, task: Task) -> str:
        self.state, self.messages, self.error = None, [], None
        row = task.reference["vf_row"]
        try:
            state = run_async(self.vf.init_state(row, _no_client(), "mentorrl"))
            new = run_async(self.vf.setup_state(state)) if hasattr(self.vf, "setup_state") else None
            self.state = new if new is not None else state
            self.messages = list(self.state["prompt"])
        except Exception as e:  # noqa: BLE001 - the episode fails (verdict), the rollout goes on
            self.error = f"setup failed: {type(e).__name__}: {e}"[:500]
        return task.prompt

    def step(self, name: Any, arguments: Any) -> ToolResult:
        self._reached = False
        r = self.registry.call(name, arguments)
        if not r.ok and not self._reached and self.state is not None and self.kind == "tool":
            # a call the registry refused (unknown tool, bad arguments): the history shows it too
            args = json.dumps(arguments) if isinstance(arguments, dict) else str(arguments)
            self._assistant(self._tool_call_message(str(name), args))
            self.messages.append(self._tool_message(self._last_call_id, r.error or "error"))
        return r

    def close(self) -> None:
        self.registry.close()

    # -- verifiers messages ------------------------------------------------------------
    def _assistant(self, msg: Any) -> None:
        from verifiers.types import TrajectoryStep

        prompt = list(self.messages)
        self.messages.append(msg)
        self.state["trajectory"].append(
            TrajectoryStep(
                prompt=prompt,
                completion=[msg],
                response=None,
                tokens=None,
                reward=None,
                advantage=None,
                is_truncated=False,
                trajectory_id=self.state["trajectory_id"],
                extras={},
            )
        )

    def _tool_call_message(self, name: str, arguments: str) -> Any:
        from verifiers.types import AssistantMessage, ToolCall

        self._last_call_id = f"call_{uuid.uuid4().hex[:12]}"
        return AssistantMessage(
            content="", tool_calls=[ToolCall(id=self._last_call_id, name=name, arguments=arguments)]
        )

    def _tool_message(self, call_id: str, content: Any) -> Any:
        from verifiers.types import ToolMessage

        return ToolMessage(role="tool", content=content, tool_call_id=call_id)

    def _ended(self) -> bool:
        return bool(run_async(self.vf.is_completed(self.state)))

    def _live(self) -> None:
        self._reached = True
        if self.state is None:
            raise ToolError(f"the environment could not start ({self.error}); reply with a final answer")
        if self.state.get("is_completed"):
            raise ToolError(
                f"the episode is over ({self.state.get('stop_condition')}); reply with your final answer", kind="policy"
            )

    def _tool_fn(self, name: str) -> Callable[..., Any]:
        def call(**arguments: Any) -> Any:
            self._live()
            self._assistant(self._tool_call_message(name, json.dumps(arguments)))
            call_id = self._last_call_id
            try:
                args = dict(arguments)
                if self.stateful:
                    args = self.vf.update_tool_args(name, args, list(self.messages), self.state)
                msg = run_async(self.vf.call_tool(name, args, call_id))
            except Exception as e:
                self.messages.append(self._tool_message(call_id, self.vf.error_formatter(e)))
                raise ToolError(f"tool {name} failed: {type(e).__name__}: {e}") from None
            self.messages.append(msg)
            self._ended()
            return _text(msg.content)

        return call

    def _reply(self, message: str) -> Any:
        from verifiers.types import AssistantMessage
        from verifiers.utils.message_utils import maybe_normalize_messages

        self._live()
        self._assistant(AssistantMessage(content=message))
        if self._ended():
            return {"done": True, "note": "the episode is over; reply with your final answer"}
        try:
            resp = run_async(self.vf.env_response(list(self.messages), self.state))
            resp = maybe_normalize_messages(resp, field_name="env_response")
        except Exception as e:
            raise ToolError(f"the environment failed to respond: {type(e).__name__}: {e}") from None
        self.messages.extend(resp)
        out: dict[str, Any] = {"response": "\n".join(_text(_field(m, "content")) for m in resp)}
        final = self.state.get("final_env_response")
        if final is not None:
            final = maybe_normalize_messages(final, field_name="final_env_response")
            out["response"] = "\n".join(_text(_field(m, "content")) for m in final) or out["response"]
        if self._ended():
            out.update(done=True, note="the episode is over; reply with your final answer")
        return out

    # -- verdict ------------------------------------------------------------------------
    def verify(self, final_answer: str | None) -> Verdict:
        if self.state is None:
            return Verdict(success=False, details={"error": self.error or "no active episode"})
        from verifiers.types import AssistantMessage

        state = self.state
        try:
            if final_answer is not None and not state.get("is_completed"):
                self._assistant(AssistantMessage(content=final_answer))
            run_async(self.vf.is_completed(state))
            run_async(self.vf.cleanup(state), SCORE_TIMEOUT_S)  # renders state["completion"]
            if state.get("completion") is None:
                state["completion"] = self.messages[len(state["prompt"]) :]
            rubric = self.vf.rubric
            if getattr(self.vf, "score_rollouts", True):
                run_async(rubric.score_rollout(state), SCORE_TIMEOUT_S)
            else:
                run_async(rubric.dummy_score_rollout(state), SCORE_TIMEOUT_S)
            run_async(rubric.cleanup(state), SCORE_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - a scoring bug fails the episode, not the run
            return Verdict(success=False, details={"error": f"scoring failed: {type(e).__name__}: {e}"[:500]})
        reward = float(state.get("reward") or 0.0)
        metrics = {k: float(v) for k, v in (state.get("metrics") or {}).items()}
        violations = [f"{m} = {metrics[m]:g}" for m in self.violation_metrics if metrics.get(m, 0.0) > 0]
        details: dict[str, Any] = {"vf_reward": reward, "vf_metrics": metrics}
        if state.get("error") is not None:
            details["error"] = str(state["error"])[:500]
        if state.get("stop_condition"):
            details["vf_stop"] = state["stop_condition"]
        success = reward >= self.threshold and "error" not in details and not violations
        return Verdict(success=success, violations=violations, details=details)


def verifiers_entry(
    vf_env: Any, name: str = "verifiers", make_expert: Callable[[], Any] | None = None, **env_kw: Any
) -> Callable[[], Any]:
    """An :class:`~mentorrl.envs.EnvEntry` factory for :func:`~.common.register_adapter`; ``env_kw``
    (``success_threshold``, ``violation_metrics``) go to :class:`VerifiersEnv`."""
    from mentorrl.envs import EnvEntry

    def entry() -> EnvEntry:
        return EnvEntry(
            lambda **k: VerifiersEnv(vf_env, name=name, **{**env_kw, **k}),
            lambda: VerifiersTasks(vf_env, name),
            make_expert or (lambda: NoExpert(name)),
        )

    return entry


__all__ = ["VerifiersEnv", "VerifiersTasks", "verifiers_entry", "row_prompt"]
