"""A ``verifiers`` 0.4 taskset (``import verifiers.v1 as vf``: ``vf.Taskset`` / ``vf.Task`` with
``@vf.reward`` / ``@vf.metric`` scoring) run through mentorrl's rollout, reward and trajectory
contract, and loading an installed verifiers environment package by id.

``verifiers`` 0.4 dropped the classic ``Environment`` / ``Rubric`` API (:mod:`.verifiers_env`, for
0.2 and 0.3): an environment is now a *taskset* package (``pip install``-able, exporting its
``vf.Taskset`` subclass via ``__all__``), resolved by id with ``vf.load_taskset``; the episode is
played by an agent harness that calls the model over HTTP. Here mentorrl drives the model instead
and only the taskset's data and scoring are used:

* **Tasks** (:class:`VerifiersV1Tasks`): the taskset's tasks (the first ``max_tasks`` of an
  infinite one), in ``load()`` order, for every split (a taskset has no split convention; pass
  the taskset's own ``split`` argument, where it has one, in ``env.args``). A task's ``prompt`` is
  the mentorrl prompt; its ``system_prompt``, when it differs from the environment's (the first
  task's, which the contract renders), goes before it.
* **Turns.** A single-agent taskset without tool servers: the policy's final answer is the reply.
  A taskset with tool servers (``toolsets``) or its own multi-agent ``Env`` is refused with a
  :class:`~mentorrl.config.ConfigError` (not supported yet).
* **Reward.** :meth:`VerifiersV1Env.verify` builds the ``vf.Trace`` of the episode (system, user,
  the sampled assistant reply), runs the task's ``finalize`` (offline: no runtime) and its own
  ``score`` (its ``@vf.reward`` / ``@vf.metric`` methods and plugged rewards; signals that need a
  runtime are skipped, as ``verifiers`` does offline): ``Verdict.details["vf_reward"]`` is
  ``trace.reward`` (the weighted sum), ``vf_rewards`` / ``vf_metrics`` the named values. Success
  when ``vf_reward >= success_threshold`` (default 1.0); metrics or rewards named in
  ``violation_metrics`` above 0 are hard violations. A scoring error is a failed verdict with
  ``details["error"]``, never a crashed rollout.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

from mentorrl.config.base import ConfigError
from mentorrl.envs.base import Task, ToolRegistry, Verdict

from .common import AdapterTasks, NoExpert, run_async
from .verifiers_env import SCORE_TIMEOUT_S, row_prompt

MAX_TASKS = 1_000


def _v1() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise ConfigError(
            f"env.id: loading a verifiers environment by id needs verifiers>=0.4 (import verifiers.v1 failed: {e}); "
            "pip install 'verifiers==0.4.0'"
        ) from None
    return vf


def task_prompt(data: Any, system_prompt: str) -> str:
    """The mentorrl prompt of a v1 task's data (see the module docstring)."""
    if data.prompt is None:
        raise ValueError(f"task {data.id or data.idx!r}: no prompt (a task whose user opens the conversation)")
    system = data.system_prompt or ""
    prompt = data.prompt
    if isinstance(prompt, str):
        return prompt if system == system_prompt or not system else f"{system}\n\n{prompt}"
    messages = ([{"role": "system", "content": system}] if system else []) + list(prompt)
    return row_prompt({"prompt": messages, "example_id": data.id or data.idx}, system_prompt)


class VerifiersV1Tasks(AdapterTasks):
    """Tasks from a v1 taskset: each task's data travels in ``reference["vf_data"]`` (JSON)."""

    def __init__(self, taskset: Any, name: str, max_tasks: int = MAX_TASKS):
        tasks = list(itertools.islice(iter(taskset), max_tasks))
        system = (tasks[0].data.system_prompt or "") if tasks else ""
        rows = [
            (task_prompt(t.data, system), {"vf_data": t.data.model_dump(mode="json"), "family": name}) for t in tasks
        ]
        super().__init__(name, {"train": rows, "heldout": rows})


class VerifiersV1Env:
    """One episode at a time of a single-turn v1 taskset, scored by the task's own rewards."""

    def __init__(
        self,
        taskset: Any,
        name: str = "verifiers",
        version: str = "1.0",
        success_threshold: float = 1.0,
        violation_metrics: tuple[str, ...] = (),
        tool_timeout_s: float = 5.0,
        **_: Any,
    ):
        self.taskset, self.name, self.version = taskset, name, version
        self.task_cls = type(taskset).task_type()
        self.data_cls = self.task_cls.data_type()
        first = next(iter(taskset), None)
        self.system_prompt = (first.data.system_prompt or "") if first is not None else ""
        self.threshold = float(success_threshold)
        self.violation_metrics = tuple(violation_metrics)
        self.registry = ToolRegistry([], timeout_s=tool_timeout_s)
        self.vf_task: Any = None
        self.error: str | None = None

    def reset(self, task: Task) -> str:
        self.error = None
        try:
            data = self.data_cls.model_validate(task.reference["vf_data"])
            self.vf_task = self.task_cls(data, self.taskset.config.task)
        except Exception as e:  # noqa: BLE001 - the episode fails (verdict), the rollout goes on
            self.vf_task, self.error = None, f"setup failed: {type(e).__name__}: {e}"[:500]
        return task.prompt

    def step(self, name: Any, arguments: Any) -> Any:
        return self.registry.call(name, arguments)  # no tools: an unknown_tool error observation

    def close(self) -> None:
        self.registry.close()

    def trace(self, reply: str) -> Any:
        """The ``vf.Trace`` of an episode of the current task that answered ``reply``."""
        return build_trace(self.vf_task, reply)

    def verify(self, final_answer: str | None) -> Verdict:
        if self.vf_task is None:
            return Verdict(success=False, details={"error": self.error or "no active episode"})
        try:
            trace = self.trace(final_answer or "")
            run_async(score_trace(self.vf_task, trace), SCORE_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - a scoring bug fails the episode, not the run
            return Verdict(success=False, details={"error": f"scoring failed: {type(e).__name__}: {e}"[:500]})
        rewards = {k: float(r.score) for k, r in trace.rewards.items() if r is not None}
        metrics = {k: float(v) for k, v in trace.metrics.items() if v is not None}
        values = {**metrics, **rewards}
        violations = [f"{m} = {values[m]:g}" for m in self.violation_metrics if values.get(m, 0.0) > 0]
        reward = float(trace.reward)
        details: dict[str, Any] = {"vf_reward": reward, "vf_rewards": rewards, "vf_metrics": metrics}
        unscored = sorted(k for k, r in trace.rewards.items() if r is None)
        if unscored:
            details["vf_unscored"] = unscored
        if trace.errors:
            details["error"] = f"{trace.errors[-1].type}: {trace.errors[-1].message}"[:500]
        success = reward >= self.threshold and "error" not in details and not violations
        return Verdict(success=success, violations=violations, details=details)


def build_trace(vf_task: Any, reply: str) -> Any:
    """A ``vf.Trace`` of ``vf_task`` whose messages are its prompt and one sampled reply."""
    import verifiers.v1 as vf
    from verifiers.v1.state import state_cls

    data = vf_task.data
    prompt = [vf.UserMessage(content=data.prompt)] if isinstance(data.prompt, str) else list(data.prompt or [])
    messages = ([vf.SystemMessage(content=data.system_prompt)] if data.system_prompt else []) + prompt
    nodes = [vf.MessageNode(message=m, parent=i - 1 if i else None) for i, m in enumerate(messages)]
    nodes.append(
        vf.MessageNode(
            message=vf.AssistantMessage(content=reply), parent=len(nodes) - 1 if nodes else None, sampled=True
        )
    )
    return vf.Trace(
        task=vf.TraceTask(type=type(vf_task).__name__, data=data, key=vf_task.key, hash=vf_task.hash),
        state=state_cls(type(vf_task))(),
        agent=vf.AgentInfo(config=vf.AgentConfig(), name="mentorrl"),
        nodes=nodes,
        is_completed=True,
        ok=True,
        stop_condition="final_answer",
    )


async def score_trace(vf_task: Any, trace: Any) -> None:
    """The task's ``finalize`` (no runtime) then its own ``score``; an error lands on the trace."""
    try:
        await vf_task.finalize(trace, None)
        await vf_task.score(trace)
    except Exception as e:  # noqa: BLE001 - recorded on the trace, read by verify
        trace.record_error(e)


def _resolve_taskset(vf: Any, env_id: str, args: dict[str, Any]) -> Any:
    from pydantic import ValidationError

    try:
        config_type = vf.taskset_config_type(env_id)
    except ModuleNotFoundError as e:
        raise ConfigError(f"env.id: no installed verifiers environment {env_id!r}: {e}") from None
    except (AttributeError, TypeError, ValueError) as e:
        raise ConfigError(f"env.id: {env_id!r} is not a verifiers environment (a taskset package): {e}") from None
    try:
        config = config_type.model_validate({**args, "id": env_id})
    except ValidationError as e:
        bad = "; ".join(f"env.args.{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
        raise ConfigError(f"{bad} (verifiers environment {env_id!r}, config {config_type.__name__})") from None
    try:
        return vf.load_taskset(config)
    except Exception as e:  # noqa: BLE001 - the package's own constructor: name the field
        raise ConfigError(
            f"env.args: verifiers environment {env_id!r} failed to load: {type(e).__name__}: {e}"
        ) from None


def _check_supported(vf: Any, env_id: str, taskset: Any) -> None:
    from verifiers.v1.envs.single_agent import SingleAgentEnv

    env_cls = vf.environment_class(env_id)
    if not issubclass(env_cls, SingleAgentEnv):
        raise ConfigError(
            f"env.id: verifiers environment {env_id!r} plays its tasks with its own {env_cls.__name__} (a "
            "multi-agent or simulated-user episode); mentorrl supports single-agent tasksets"
        )
    task_cls = type(taskset).task_type()
    if task_cls.toolsets(taskset.config.task) or type(taskset).toolsets(taskset.config):
        raise ConfigError(
            f"env.id: verifiers environment {env_id!r} has tool servers (toolsets); mentorrl supports tasksets "
            "without them (single-turn)"
        )


def load_taskset(env_id: str, args: dict[str, Any] | None = None) -> Any:
    """The installed verifiers 0.4 environment ``env_id`` (a taskset package or module, or a hub id
    ``owner/name``), built with ``args`` (its config's fields). Bad input is a ConfigError naming
    ``env.id`` or ``env.args``."""
    if not isinstance(env_id, str) or not env_id.strip():
        raise ConfigError(f"env.id: a verifiers environment id (an installed package or module), got {env_id!r}")
    if args is not None and not isinstance(args, dict):
        raise ConfigError(f"env.args: a mapping of the environment's arguments, got {type(args).__name__}")
    vf = _v1()
    taskset = _resolve_taskset(vf, env_id, dict(args or {}))
    _check_supported(vf, env_id, taskset)
    if next(iter(taskset), None) is None:
        raise ConfigError(f"env.args: verifiers environment {env_id!r} has no tasks with these arguments")
    return taskset


def _package_version(env_id: str) -> str:
    from importlib import metadata

    name = env_id.rsplit("/", 1)[-1].split("@", 1)[0]
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "0"


def verifiers_v1_entry(
    taskset: Any,
    name: str = "verifiers",
    version: str = "1.0",
    make_expert: Callable[[], Any] | None = None,
    max_tasks: int = MAX_TASKS,
    **env_kw: Any,
) -> Callable[[], Any]:
    """An :class:`~mentorrl.envs.EnvEntry` factory over a loaded v1 taskset; ``env_kw``
    (``success_threshold``, ``violation_metrics``) go to :class:`VerifiersV1Env`."""
    from mentorrl.envs import EnvEntry

    def entry() -> EnvEntry:
        return EnvEntry(
            lambda **k: VerifiersV1Env(taskset, name=name, version=version, **{**env_kw, **k}),
            lambda: VerifiersV1Tasks(taskset, name, max_tasks),
            make_expert or (lambda: NoExpert(name)),
        )

    return entry


ADAPTER_KEYS = ("success_threshold", "violation_metrics", "max_tasks")


def load_verifiers_entry(env_id: str, args: dict[str, Any] | None = None) -> Any:
    """The EnvEntry of ``env: {name: verifiers, id: ..., args: {...}}``: ``args`` go to the
    environment's config, except the adapter's own keys (``success_threshold``,
    ``violation_metrics``, ``max_tasks``)."""
    args = dict(args or {}) if isinstance(args, dict) else args
    own = {k: args.pop(k) for k in ADAPTER_KEYS if isinstance(args, dict) and k in args}
    if "max_tasks" in own and (not isinstance(own["max_tasks"], int) or own["max_tasks"] < 1):
        raise ConfigError(f"env.args.max_tasks: a positive integer, got {own['max_tasks']!r}")
    version = f"{_package_version(env_id)}+{env_id}"
    if _classic_loader() is not None:  # verifiers 0.2 / 0.3: vf.load_environment(id, **args)
        return _classic_entry(env_id, args, own)
    taskset = load_taskset(env_id, args)
    return verifiers_v1_entry(taskset, name="verifiers", version=version, **own)()


def _classic_loader() -> Callable[..., Any] | None:
    try:
        import verifiers
    except ImportError:
        return None
    return getattr(verifiers, "load_environment", None) if hasattr(verifiers, "MultiTurnEnv") else None


def _classic_entry(env_id: str, args: Any, own: dict[str, Any]) -> Any:
    from .verifiers_env import verifiers_entry

    if not isinstance(args, dict):
        raise ConfigError(f"env.args: a mapping of the environment's arguments, got {type(args).__name__}")
    own.pop("max_tasks", None)
    try:
        vf_env = _classic_loader()(env_id, **args)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"env.id: cannot load verifiers environment {env_id!r}: {type(e).__name__}: {e}") from None
    except TypeError as e:
        raise ConfigError(f"env.args: verifiers environment {env_id!r}: {e}") from None
    return verifiers_entry(vf_env, name="verifiers", **own)()


__all__ = [
    "VerifiersV1Env",
    "VerifiersV1Tasks",
    "build_trace",
    "load_taskset",
    "load_verifiers_entry",
    "score_trace",
    "task_prompt",
    "verifiers_v1_entry",
]
