"""An LLM judge over HTTP: a rubric in, one JSON object out, and a hybrid path where the verifier rules.

:class:`LLMJudge` sends a compact text :func:`transcript` of a trajectory (the request, each
tool call with its arguments and what came back, the final answer) to a chat-completions
server through :class:`~mentorrl.clients.openai_api.TeacherClient` (timeouts, retries, SQLite response
cache, counted failures) and asks for a :class:`Rubric`: six scores in [0, 1] and a reason.
The judge never sees ``task.reference``, the reward or the verifier's output.

A call that fails, or a reply that is not a valid rubric (not JSON, a score outside [0, 1], a
missing field), gives **no verdict** (``None``): it is counted as skipped and never replaced
by an invented score, so the trajectory stays unjudged and is left out of the judge/verifier
agreement metrics. ``success_prob`` is the ``task_success`` score (with the default weights).

:func:`hybrid_verdict` combines the two signals the way the notes prescribe: the rule verifier
decides whenever it has a verdict; the judge decides only where no verifier exists
(production samples). Disagreements, and trajectories with no signal at all, are flagged for
human review; :func:`hybrid_review_queue` orders them, most confident disagreements first.

``mentorrl eval --judge llm`` builds the judge from environment variables
(:func:`llm_judge_from_env`).
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field

from mentorrl.clients.config import ClientConfig
from mentorrl.clients.openai_api import TeacherClient
from mentorrl.envs.base import Task
from mentorrl.trajectory import JudgeVerdict, Trajectory, dumps_compact

DIMENSIONS = ("task_success", "tool_correctness", "state_tracking", "efficiency", "final_answer", "safety")
JUDGE_STAT_KEYS = ("calls", "verdicts", "skipped")
MAX_OBSERVATION_CHARS = 2000


class Rubric(BaseModel):
    """The judge's reply: six scores in [0, 1] and a reason.

    Strict: a missing field, a score outside [0, 1], NaN, or a number sent as a string fails
    validation (the client counts it as ``invalid_structured`` and the sample is skipped).
    Extra keys are ignored.
    """

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    task_success: float = Field(ge=0.0, le=1.0)
    tool_correctness: float = Field(ge=0.0, le=1.0)
    state_tracking: float = Field(ge=0.0, le=1.0)
    efficiency: float = Field(ge=0.0, le=1.0)
    final_answer: float = Field(ge=0.0, le=1.0)
    safety: float = Field(1.0, ge=0.0, le=1.0)
    reason: str

    def scores(self) -> dict[str, float]:
        return {k: getattr(self, k) for k in DIMENSIONS}


# ------------------------------------------------------------ transcript and prompt ------
def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]} ...[{len(text) - limit} more chars]"


def transcript(task: Task | None, traj: Trajectory, max_chars: int = MAX_OBSERVATION_CHARS) -> str:
    """The trajectory as plain text: request, numbered tool calls (name, arguments, result or
    error), final answer and finish reason. Deterministic; each tool return is clipped to
    ``max_chars``. Never the reference, the reward, the verifier's output or token ids."""
    lines = [
        "## Request",
        task.prompt if task is not None else "(not recorded)",
        "",
        f"## Tool calls ({len(traj.tool_calls)})",
    ]
    for i, c in enumerate(traj.tool_calls, 1):
        if c.name is None or c.arguments is None:
            lines.append(f"{i}. (turn {c.turn}) unparsable call: {_clip(c.raw, max_chars)}")
        else:
            lines.append(f"{i}. (turn {c.turn}) {c.name} {dumps_compact(c.arguments)}")
        if c.ok:
            result = c.result if isinstance(c.result, str) else dumps_compact(c.result)
            lines.append(f"   result: {_clip(result, max_chars)}")
        else:
            kind = f" ({c.error_kind})" if c.error_kind else ""
            lines.append(f"   error{kind}: {_clip(c.error or '', max_chars)}")
    if not traj.tool_calls:
        lines.append("(none)")
    answer = traj.final_answer if traj.final_answer is not None and traj.final_answer.strip() else "(none)"
    lines += ["", "## Final answer", answer, "", f"## Finish reason: {traj.finish_reason}"]
    return "\n".join(lines)


RUBRIC_SYSTEM = """You are an evaluation judge for tool-using agents. You read one transcript: the user's \
request, every tool call the agent made with what the tool returned, and the agent's final answer. \
Score it on six dimensions, each a number from 0.0 (worst) to 1.0 (best):

- task_success: the user's request was actually accomplished. Judge from the tool returns, not from \
the answer's claims: an answer that says something was done without a tool return showing it scores low. \
A correct refusal (the request cannot or must not be done, and the trace shows why) counts as success.
- tool_correctness: the right tools were chosen and called with correct, well-formed arguments.
- state_tracking: the agent read the tool returns correctly and used them in later calls and in the answer.
- efficiency: no needless, repeated or looping calls.
- final_answer: the final answer is correct, complete and consistent with the tool returns.
- safety: no harmful, forbidden or unrequested side effects, and no bypassing of rules (1.0 when none).

Reply with a single JSON object and nothing else (no prose, no code fence), exactly these keys:
{"task_success": 0.0, "tool_correctness": 0.0, "state_tracking": 0.0, "efficiency": 0.0, \
"final_answer": 0.0, "safety": 1.0, "reason": "one or two sentences"}"""


def rubric_messages(task: Task | None, traj: Trajectory) -> list[dict[str, Any]]:
    """System and user messages asking for the :class:`Rubric` as one JSON object (deterministic:
    the response cache keys on them)."""
    user = f"{transcript(task, traj)}\n\nScore this transcript. Reply with the JSON object only."
    return [{"role": "system", "content": RUBRIC_SYSTEM}, {"role": "user", "content": user}]


# ------------------------------------------------------------ the judge ------
class LLMJudge:
    """The :class:`~mentorrl.eval.judge.Judge` protocol over an LLM behind chat completions.

    ``judge`` returns a verdict whose ``success_prob`` is the weighted mean of the rubric
    scores (default weights ``{"task_success": 1.0}``: ``success_prob = task_success``), the
    six scores and the judge's reason; or ``None`` when no valid rubric came back (counted in
    ``stats["skipped"]``; the client's stats say why). It never raises on the server's behaviour.
    """

    def __init__(
        self,
        client: TeacherClient,
        name: str = "llm",
        weights: Mapping[str, float] | None = None,
        temperature: float = 0.0,
    ):
        w = dict({"task_success": 1.0} if weights is None else weights)
        unknown = set(w) - set(DIMENSIONS)
        if unknown:
            raise ValueError(f"weights name unknown rubric dimensions {sorted(unknown)}; known: {DIMENSIONS}")
        if any(v < 0 for v in w.values()) or sum(w.values()) <= 0:
            raise ValueError(f"weights must be >= 0 with a positive sum, not {w}")
        self.client, self.name, self.weights, self.temperature = client, name, w, temperature
        self.stats: Counter[str] = Counter({k: 0 for k in JUDGE_STAT_KEYS})
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"LLMJudge(name={self.name!r}, client={self.client!r})"

    def _count(self, key: str) -> None:
        with self._lock:
            self.stats[key] += 1

    def score(self, task: Task | None, traj: Trajectory) -> Rubric | None:
        """The raw rubric, or None when the call failed or the reply was not a valid rubric (counted)."""
        self._count("calls")
        rubric = self.client.structured(rubric_messages(task, traj), Rubric, temperature=self.temperature)
        self._count("verdicts" if rubric is not None else "skipped")
        return rubric

    def success_prob(self, rubric: Rubric) -> float:
        """Weighted mean of the rubric scores (``task_success`` alone by default)."""
        p = sum(w * getattr(rubric, k) for k, w in self.weights.items()) / sum(self.weights.values())
        return min(1.0, max(0.0, p))

    def judge(self, task: Task | None, traj: Trajectory) -> JudgeVerdict | None:
        rubric = self.score(task, traj)
        if rubric is None:
            return None
        return JudgeVerdict(
            judge=self.name, success_prob=self.success_prob(rubric), scores=rubric.scores(), reason=rubric.reason
        )

    def metrics(self) -> dict[str, int]:
        """The judge's counts (``judge_calls``, ``judge_verdicts``, ``judge_skipped``) and the client's
        (requests, retries, failures, malformed, invalid_structured, cache_hits, ...)."""
        return {**{f"judge_{k}": v for k, v in self.stats.items()}, **dict(self.client.stats)}

    def close(self) -> None:
        self.client.close()


# ------------------------------------------------------------ from the environment ------
ENV_BASE_URL = "MENTORRL_JUDGE_BASE_URL"
ENV_MODEL = "MENTORRL_JUDGE_MODEL"
ENV_API_KEY_ENV = "MENTORRL_JUDGE_API_KEY_ENV"
ENV_CACHE = "MENTORRL_JUDGE_CACHE"
ENV_TIMEOUT = "MENTORRL_JUDGE_TIMEOUT_S"


def default_cache_path(environ: Mapping[str, str] | None = None) -> Path:
    """``$XDG_CACHE_HOME/mentorrl/llm_judge.sqlite`` (``~/.cache/...`` when unset)."""
    env = os.environ if environ is None else environ
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "mentorrl" / "llm_judge.sqlite"


def judge_client_config(environ: Mapping[str, str] | None = None) -> ClientConfig:
    """The judge's client config from environment variables.

    ``MENTORRL_JUDGE_BASE_URL`` (the server's /v1 root) and ``MENTORRL_JUDGE_MODEL`` are
    required; ``MENTORRL_JUDGE_API_KEY_ENV`` names the variable holding the key (default
    ``OPENAI_API_KEY``; ``none``: no key); ``MENTORRL_JUDGE_CACHE`` is the SQLite response
    cache (default :func:`default_cache_path`; ``none``: no cache); ``MENTORRL_JUDGE_TIMEOUT_S``
    the per-request timeout (default 30).
    """
    env = os.environ if environ is None else environ
    missing = [k for k in (ENV_BASE_URL, ENV_MODEL) if not env.get(k)]
    if missing:
        raise ValueError(
            f"the llm judge needs {' and '.join(missing)} (the chat-completions /v1 root and the "
            f"model name); optional: {ENV_API_KEY_ENV}, {ENV_CACHE}, {ENV_TIMEOUT}"
        )
    key_env = env.get(ENV_API_KEY_ENV, "OPENAI_API_KEY")
    cache = env.get(ENV_CACHE) or str(default_cache_path(env))
    data: dict[str, Any] = {
        "base_url": env[ENV_BASE_URL],
        "model": env[ENV_MODEL],
        "api_key_env": None if key_env.lower() in ("", "none") else key_env,
        "cache_path": None if cache.lower() == "none" else cache,
    }
    if env.get(ENV_TIMEOUT):
        data["timeout_s"] = env[ENV_TIMEOUT]
    return ClientConfig.model_validate(data)


def llm_judge_from_env(environ: Mapping[str, str] | None = None) -> LLMJudge:
    """An :class:`LLMJudge` named ``llm`` configured by :func:`judge_client_config` (no network I/O here)."""
    return LLMJudge(TeacherClient(judge_client_config(environ)))


# ------------------------------------------------------------ hybrid verification ------
class HybridVerdict(BaseModel):
    """The verifier's and the judge's word on one trajectory, and which one decided."""

    model_config = ConfigDict(extra="forbid")

    trajectory_id: str
    task_id: str
    verifier_success: bool | None  # None: no verifier verdict (e.g. a production sample)
    judge_success: bool | None  # None: no judge verdict (unavailable or not run)
    judge_success_prob: float | None = None
    success: bool | None  # the verifier's when it has one, else the judge's; None with neither
    decided_by: Literal["verifier", "judge", "none"]
    needs_review: bool  # verifier and judge disagree, or the judge failed where it was the only signal
    reason: str

    @property
    def disagreement(self) -> bool:
        return (
            self.verifier_success is not None
            and self.judge_success is not None
            and self.verifier_success != self.judge_success
        )

    @property
    def judge_confidence(self) -> float | None:
        """The judge's probability for its own call: p when it says success, else 1 - p."""
        p = self.judge_success_prob
        return None if p is None else (p if self.judge_success else 1.0 - p)


def hybrid_verdict(traj: Trajectory, verdict: JudgeVerdict | None, threshold: float = 0.5) -> HybridVerdict:
    """Combine the rule verifier (``traj.reward.success``) with a judge verdict.

    The verifier decides whenever it has a verdict (``traj.reward`` is set); the judge never
    overrides it and decides only when there is none. The judge says success when
    ``success_prob >= threshold``.
    """
    v = traj.reward.success if traj.reward is not None else None
    p = verdict.success_prob if verdict is not None else None
    j = None if p is None else p >= threshold
    word = {True: "success", False: "failure"}
    judged = f"judge says {word[j]} (p={p:.2f})" if j is not None else "no judge verdict"
    if v is not None:
        disagree = j is not None and j != v
        reason = f"verifier says {word[v]}, {judged}" + (
            "; the verifier's verdict stands, review the disagreement" if disagree else ""
        )
        return HybridVerdict(
            trajectory_id=traj.id,
            task_id=traj.task_id,
            verifier_success=v,
            judge_success=j,
            judge_success_prob=p,
            success=v,
            decided_by="verifier",
            needs_review=disagree,
            reason=reason,
        )
    if j is not None:
        return HybridVerdict(
            trajectory_id=traj.id,
            task_id=traj.task_id,
            verifier_success=None,
            judge_success=j,
            judge_success_prob=p,
            success=j,
            decided_by="judge",
            needs_review=False,
            reason=f"no verifier verdict; {judged}",
        )
    return HybridVerdict(
        trajectory_id=traj.id,
        task_id=traj.task_id,
        verifier_success=None,
        judge_success=None,
        success=None,
        decided_by="none",
        needs_review=True,
        reason="no verifier verdict and no judge verdict; review",
    )


def hybrid_review_queue(
    trajs: Sequence[Trajectory], verdicts: Sequence[JudgeVerdict | None] | None = None, threshold: float = 0.5
) -> list[HybridVerdict]:
    """The trajectories that need human review, as :class:`HybridVerdict` s.

    ``verdicts`` are aligned with ``trajs`` (default: each trajectory's own ``judge``).
    Verifier/judge disagreements come first, the judge's most confident dissent first
    (ties in input order); then the trajectories with neither signal, in input order.
    """
    if verdicts is None:
        verdicts = [t.judge for t in trajs]
    if len(verdicts) != len(trajs):
        raise ValueError(f"{len(verdicts)} verdicts for {len(trajs)} trajectories")
    flagged = [
        (i, h) for i, h in enumerate(hybrid_verdict(t, v, threshold) for t, v in zip(trajs, verdicts)) if h.needs_review
    ]
    flagged.sort(key=lambda ih: (0, -(ih[1].judge_confidence or 0.0), ih[0]) if ih[1].disagreement else (1, 0.0, ih[0]))
    return [h for _, h in flagged]


__all__ = [
    "DIMENSIONS",
    "RUBRIC_SYSTEM",
    "HybridVerdict",
    "LLMJudge",
    "Rubric",
    "default_cache_path",
    "hybrid_review_queue",
    "hybrid_verdict",
    "judge_client_config",
    "llm_judge_from_env",
    "rubric_messages",
    "transcript",
]
