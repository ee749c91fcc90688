"""Launch a user's agent command once per episode, concurrently, each with its own timeout.

:func:`run_agents` runs ``argv`` (no shell) for every :class:`AgentJob`, at most ``concurrency`` at
once, each in its own process group with the job's variables added to the environment; one that
runs past ``timeout_s`` is killed with its whole group. Every outcome is an :class:`AgentOutcome`
(``ok``, ``nonzero``, ``crashed`` (killed by a signal), ``timeout`` or ``launch_error``): a failing
agent never raises here. Output goes to temporary files (no pipe can fill), of which only the last
``output_chars`` characters of stderr are kept. The caller decides what to log; the environment
(which holds the API key) is never part of an outcome."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
import threading
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
    timings: dict | None = None  # what a worker reported for the episode (e.g. model_s, tools_s, episode_s)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


def stderr_tail(f, chars: int) -> str:
    """The last ``chars`` characters of the binary file ``f`` (an agent's stderr), decoded leniently."""
    if not chars:
        return ""
    f.seek(0, os.SEEK_END)
    f.seek(max(0, f.tell() - 4 * chars))
    return f.read().decode("utf-8", "replace")[-chars:]


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
        tail = stderr_tail(err, output_chars) if status != "ok" else ""
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


WORKER_LINE_CHARS = 1_000_000  # one result line of a worker, at most


class AgentWorker:
    """Worker mode (``external.mode: worker``): the agent command started once, with ``env`` added to
    its environment and ``MENTORRL_WORKER=1``, ``MENTORRL_CONCURRENCY``; it serves every episode it
    is sent: one JSON line ``{"episode_id", "env": {...}}`` per episode on its stdin, one line
    ``{"episode_id", "ok": bool, "error"?: str, "timings"?: {...}}`` per finished episode on its stdout.
    It lives across steps (no per-episode process start, its HTTP connections kept alive); one that
    died is started again at the next :meth:`run`. Its own process group: :meth:`close` kills what it
    started too."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], concurrency: int, output_chars: int = 2000):
        self.argv, self.env, self.concurrency, self.output_chars = list(argv), dict(env), concurrency, output_chars
        self.proc: subprocess.Popen | None = None
        self.start_s = 0.0  # seconds spent starting workers (each start until it reads its first line)
        self.starts = 0
        self._cond = threading.Condition()
        self._done: dict[str, tuple[dict, float]] = {}
        self._err = None

    def _start(self) -> None:
        t0 = time.monotonic()
        self._err = tempfile.TemporaryFile()
        env = {**os.environ, **self.env, "MENTORRL_WORKER": "1", "MENTORRL_CONCURRENCY": str(self.concurrency)}
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            env=env,
            start_new_session=True,
        )
        threading.Thread(target=self._read, args=(self.proc,), name="mentorrl-agent-worker", daemon=True).start()
        self.start_s += time.monotonic() - t0
        self.starts += 1

    def _read(self, proc: subprocess.Popen) -> None:
        for raw in proc.stdout:  # type: ignore[union-attr]
            try:
                msg = json.loads(raw[:WORKER_LINE_CHARS])
                eid = str(msg["episode_id"])
            except (ValueError, KeyError, TypeError):
                continue  # not a result line (e.g. the agent's own print): ignored
            with self._cond:
                self._done[eid] = (msg if isinstance(msg, dict) else {}, time.monotonic())
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _tail(self) -> str:
        return stderr_tail(self._err, self.output_chars) if self._err is not None else ""

    def run(self, jobs: Sequence[AgentJob], timeout_s: float) -> list[AgentOutcome]:
        """Every job's outcome, in job order: ``ok`` / ``nonzero`` (the worker reported a failure), or,
        for an episode without a result, ``timeout`` (none within ``timeout_s`` per round of
        ``concurrency`` episodes) or ``crashed`` (the worker died)."""
        if not jobs:
            return []
        t0 = time.monotonic()
        with self._cond:
            self._done.clear()  # a late result of an earlier round's episode (closed since)
        try:
            if not self.alive():
                self._start()
            for job in jobs:
                self.proc.stdin.write(
                    (json.dumps({"episode_id": job.episode_id, "env": dict(job.env)}) + "\n").encode()
                )  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
        except (OSError, ValueError) as e:
            now = time.monotonic()
            return [AgentOutcome(j.episode_id, "launch_error", None, 0.0, now, type(e).__name__) for j in jobs]
        rounds = -(-len(jobs) // max(1, self.concurrency))
        deadline = t0 + timeout_s * rounds
        want = {j.episode_id for j in jobs}
        with self._cond:
            self._cond.wait_for(
                lambda: want <= self._done.keys() or not self.alive() or time.monotonic() >= deadline,
                timeout=max(0.0, deadline - time.monotonic()),
            )
            done = {e: self._done.pop(e) for e in list(self._done) if e in want}
        dead = not self.alive()
        tail = self._tail() if dead else ""
        out = []
        for j in jobs:
            if j.episode_id in done:
                msg, ended = done[j.episode_id]
                ok = msg.get("ok") is True
                timings = msg.get("timings") if isinstance(msg.get("timings"), dict) else None
                err = "" if ok else str(msg.get("error", ""))[: self.output_chars]
                out.append(
                    AgentOutcome(
                        j.episode_id, "ok" if ok else "nonzero", 0 if ok else 1, ended - t0, ended, err, timings
                    )
                )
            else:
                now = time.monotonic()
                out.append(AgentOutcome(j.episode_id, "crashed" if dead else "timeout", None, now - t0, now, tail))
        return out

    def close(self, timeout_s: float = 10.0) -> None:
        """Close its stdin (a worker ends when it closes), wait a little, then kill its process group."""
        if self.proc is None:
            return
        try:
            self.proc.stdin.close()  # type: ignore[union-attr]
            self.proc.wait(timeout=timeout_s)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
        _kill_group(self.proc)
        if self._err is not None:
            self._err.close()
        self.proc = None


def outcome_counts(outcomes: Sequence[AgentOutcome]) -> dict[str, float]:
    """``agent_<status>`` counts over :data:`OUTCOMES`."""
    return {f"agent_{s}": float(sum(o.status == s for o in outcomes)) for s in OUTCOMES}


__all__ = ["OUTCOMES", "AgentJob", "AgentWorker", "AgentOutcome", "outcome_counts", "run_agent", "run_agents"]
