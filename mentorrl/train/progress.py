"""Stage progress a terminal and a cluster log can both read.

On a terminal a stage shows a rich progress bar. When stdout is not a terminal (a cluster job,
``nohup``, CI) a bar prints nothing until the stage ends, so a stage prints plain lines instead, one
after the first step, then at least every ``logging.log_every_steps`` steps, and after any step that
ends ``logging.log_every_s`` seconds or more after the last line, and after the last step::

    [grpo] step 12/100 reward=0.431 success=0.250 tok/s=1234 elapsed=0:01:23 eta=0:10:05

(``-`` where the stage does not log that value). :class:`LineThrottle` decides when a line is due
and :func:`progress_line` writes it; both are pure, given a clock.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

REWARD_KEYS = ("reward_mean", "reward")
SUCCESS_KEYS = ("task_success", "success", "positive_task_rate")
TOKEN_KEYS = ("rollout_tokens", "train_tokens", "student_rollout_tokens", "teacher_tokens")


@dataclass
class LineThrottle:
    """When a plain progress line is due: after the first step a stage runs, when ``every_steps``
    steps have passed since the last line, when ``every_s`` seconds have, and after the stage's last step."""

    every_steps: int = 10
    every_s: float = 30.0
    last_step: int | None = None
    last_t: float = 0.0

    def due(self, step: int, total: int, now: float, last: bool = False) -> bool:
        """Whether step ``step`` (1-based, of ``total``), ending at ``now``, gets a line (``last``: the
        stage stops after it); records it if so."""
        due = (
            last
            or self.last_step is None
            or step >= total
            or step - self.last_step >= self.every_steps
            or now - self.last_t >= self.every_s
        )
        if due:
            self.last_step, self.last_t = step, now
        return due


def _clock(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "-"
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _first(m: dict[str, Any], keys: tuple[str, ...]) -> float | None:
    for k in keys:
        v = m.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            return float(v)
    return None


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None or not math.isfinite(v) else format(v, fmt)


def progress_line(
    stage: str, step: int, total: int, metrics: dict[str, Any], elapsed: float, done: int, tokens: float | None
) -> str:
    """One plain progress line: ``done`` steps ran in this process in ``elapsed`` seconds (the ETA is
    their mean pace times the steps left), ``tokens`` the tokens they counted (None: not logged)."""
    eta = elapsed / done * (total - step) if done > 0 else None
    tok_s = tokens / elapsed if tokens is not None and elapsed > 0 else None
    return (
        f"[{stage}] step {step}/{total}"
        f" reward={_num(_first(metrics, REWARD_KEYS), '.3f')}"
        f" success={_num(_first(metrics, SUCCESS_KEYS), '.3f')}"
        f" tok/s={_num(tok_s, '.0f')}"
        f" elapsed={_clock(elapsed)} eta={_clock(eta)}"
    )


class StepLines:
    """A stage's plain progress lines, written through ``emit``."""

    def __init__(
        self,
        stage: str,
        total: int,
        emit: Callable[[str], None],
        every_steps: int = 10,
        every_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.stage, self.total, self.emit, self.clock = stage, total, emit, clock
        self.throttle = LineThrottle(every_steps, every_s)
        self.t0 = clock()
        self.done = 0
        self.tokens: float | None = None

    def update(self, step: int, metrics: dict[str, Any], last: bool = False) -> None:
        """Step ``step`` (1-based) finished with ``metrics`` (``last``: the stage ends early after it)."""
        self.done += 1
        tok = _first(metrics, TOKEN_KEYS)
        if tok is not None:
            self.tokens = (self.tokens or 0.0) + tok
        now = self.clock()
        if self.throttle.due(step, self.total, now, last):
            self.emit(progress_line(self.stage, step, self.total, metrics, now - self.t0, self.done, self.tokens))


class _Bar:
    """The terminal's rich bar."""

    def __init__(self, prog, stage: str, total: int, start: int):
        self.prog = prog
        self.bar = prog.add_task(stage, total=total, completed=start, info="")

    def update(self, step: int, m: dict[str, Any], last: bool = False) -> None:
        info = " ".join(
            f"{k}={m[k]:.3f}"
            for k in ("loss", "reward_mean", "task_success", "positive_task_rate")
            if isinstance(m.get(k), (int, float))
        )
        self.prog.update(self.bar, advance=1, info=info)


class _Silent:
    def update(self, step: int, m: dict[str, Any], last: bool = False) -> None:
        pass


def _emitter(console: Any) -> Callable[[str], None]:
    """Print one plain line (no markup, never wrapped) and flush it: a redirected stdout is
    block-buffered, and the line belongs in the log now, not at exit."""

    def emit(line: str) -> None:
        console.print(line, markup=False, highlight=False, soft_wrap=True)
        flush = getattr(console.file, "flush", None)
        if flush is not None:
            flush()

    return emit


@contextmanager
def stage_progress(ws: Any, stage: str, total: int, start: int) -> Iterator[Any]:
    """What a stage reports its steps to (``.update(step, metrics)``): a rich bar on a terminal, plain
    lines (``logging.log_every_steps`` / ``log_every_s``) when stdout is not one, nothing when the
    workspace shows no progress (a rank other than 0, a quiet caller)."""
    if not getattr(ws, "show_progress", False):
        yield _Silent()
        return
    console = ws.console
    if console.is_terminal:
        with ws.progress() as prog:
            yield _Bar(prog, stage, total, start)
        return
    section = getattr(ws.cfg, "logging", None)
    yield StepLines(
        stage,
        total,
        _emitter(console),
        every_steps=getattr(section, "log_every_steps", 10),
        every_s=getattr(section, "log_every_s", 30.0),
    )


class _CountLines:
    """Plain lines for a count (an evaluation's rollouts): ``[eval final] 120/200 elapsed=... eta=...``."""

    def __init__(
        self, label: str, total: int, emit: Callable[[str], None], throttle: LineThrottle, clock=time.monotonic
    ):
        self.label, self.total, self.emit, self.throttle, self.clock = label, total, emit, throttle, clock
        self.t0, self.n = clock(), 0

    def advance(self, n: int) -> None:
        self.n += n
        now = self.clock()
        if self.throttle.due(self.n, self.total, now):
            elapsed = now - self.t0
            eta = elapsed / self.n * (self.total - self.n) if self.n else None
            self.emit(f"[{self.label}] {self.n}/{self.total} elapsed={_clock(elapsed)} eta={_clock(eta)}")


@contextmanager
def count_progress(ws: Any, label: str, total: int) -> Iterator[Callable[[int], None] | None]:
    """``advance(n)`` for a counted phase (an evaluation): a rich bar on a terminal, plain lines
    (at most one per ``logging.log_every_s``, and the last) when stdout is not one; None without progress."""
    if not getattr(ws, "show_progress", False):
        yield None
        return
    if ws.console.is_terminal:
        with ws.progress() as prog:
            bar = prog.add_task(label, total=total, info="")
            yield lambda n: prog.update(bar, advance=n)
        return
    every_s = getattr(getattr(ws.cfg, "logging", None), "log_every_s", 30.0)
    yield _CountLines(label, total, _emitter(ws.console), LineThrottle(10**9, every_s)).advance


__all__ = ["LineThrottle", "StepLines", "count_progress", "progress_line", "stage_progress"]
