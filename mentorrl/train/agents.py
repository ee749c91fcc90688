"""Launch a user's agent command once per episode, concurrently, each with its own timeout.

:func:`run_agents` runs ``argv`` (no shell) for every :class:`AgentJob`, at most ``concurrency`` at
once, each in its own process group with the job's variables added to the environment; one that
runs past ``timeout_s`` is killed with its whole group. Every outcome is an :class:`AgentOutcome`
(``ok``, ``nonzero``, ``crashed`` (killed by a signal), ``timeout`` or ``launch_error``): a failing
agent never raises here. Output goes to temporary files (no pipe can fill), of which only the last
``output_chars`` characters of stderr are kept. The caller decides what to log; the environment
(which holds the API key) is never part of an outcome."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

OUTCOMES = ("ok", "nonzero", "crashed", "timeout", "launch_error")


@dataclass(frozen=True)
class AgentJob:
    episode_id: str
    env: Mapping[str, str]  # added to the launching process's environment


@dataclass(frozen=True)
class AgentOutcome:
    episode_id: str
    status: str  # one of OUTCOMES
    returncode: int | None
    wall_s: float
    ended_at: float  # time.monotonic() when it ended
    stderr_tail: str = ""


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


def run_agent(argv: Sequence[str], job: AgentJob, timeout_s: float, output_chars: int = 2000) -> AgentOutcome:
    """Run one agent to completion, a timeout or a failure to start (see the module docstring)."""
    t0 = time.monotonic()
    with tempfile.TemporaryFile() as err:
        try:
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                env={**os.environ, **job.env},
                start_new_session=True,  # its own process group: a timeout kills what it started too
            )
        except (OSError, ValueError) as e:
            return AgentOutcome(job.episode_id, "launch_error", None, 0.0, time.monotonic(), type(e).__name__)
        try:
            code = proc.wait(timeout=timeout_s)
            status = "ok" if code == 0 else ("crashed" if code < 0 else "nonzero")
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            code, status = None, "timeout"
        ended = time.monotonic()
        tail = ""
        if status != "ok" and output_chars:
            err.seek(0, os.SEEK_END)
            err.seek(max(0, err.tell() - 4 * output_chars))
            tail = err.read().decode("utf-8", "replace")[-output_chars:]
    return AgentOutcome(job.episode_id, status, code, ended - t0, ended, tail)


def run_agents(
    argv: Sequence[str],
    jobs: Sequence[AgentJob],
    concurrency: int,
    timeout_s: float,
    output_chars: int = 2000,
    on_done: Callable[[AgentOutcome], None] | None = None,
) -> list[AgentOutcome]:
    """Every job's outcome, in job order; ``on_done`` is called as each ends (from a worker thread)."""

    def one(job: AgentJob) -> AgentOutcome:
        out = run_agent(argv, job, timeout_s, output_chars)
        if on_done is not None:
            on_done(out)
        return out

    if not jobs:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(jobs))), thread_name_prefix="mentorrl-agent") as ex:
        return list(ex.map(one, jobs))


def outcome_counts(outcomes: Sequence[AgentOutcome]) -> dict[str, float]:
    """``agent_<status>`` counts over :data:`OUTCOMES`."""
    return {f"agent_{s}": float(sum(o.status == s for o in outcomes)) for s in OUTCOMES}


__all__ = ["OUTCOMES", "AgentJob", "AgentOutcome", "outcome_counts", "run_agent", "run_agents"]
