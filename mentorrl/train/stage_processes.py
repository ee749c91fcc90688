"""``stage_processes: true``: each unit of a recipe's work in a fresh process.

A unit is one stage, the held-out evaluation after it, or one final-split evaluation
(:func:`recipe_units`). Why: a long run's process carries its allocator's history from one unit to the
next. One SmolLM2-135M run (RSS 14 GB by its GRPO stage) rolled out every GRPO step 1.32x slower than
the same tokens took in a fresh process, and its streamed evaluation took 488 s where a fresh process
took 275 s (docs/results.md#smollm2-135m-instruct).

How: the parent (``mentorrl train``) starts one child after another (``multiprocessing``'s *spawn*: a
new interpreter that inherits nothing but the environment and the pickled config). Child ``k`` runs
:func:`mentorrl.train.pipeline.run_recipe` with resume on (the first child: as the user asked). The
units before ``k`` are complete in RUN_DIR, so they cost only a load (a stage's final weights, an
evaluation's JSON). The child runs unit ``k`` and stops at its end (:class:`UnitGate`); the last child
writes the report and sends the result back. So a run in stage processes is the same run as in one
process, resumed at each unit boundary: a stage resumes exactly (``tests/test_stage_processes.py``).
Under a ``torchrun`` launch of several ranks (``--ranks N``) each rank's process does the same, and a unit's
processes, one a rank, form their group at a store of their own (:func:`unit_rendezvous`).
The preflight reward audit runs in the first child only.

A child that fails ends the run with its error (the exception itself when it pickles); a run killed at
any point resumes with ``--resume`` like any other. ``huge_pages: true`` starts the children with
``THP_MEM_ALLOC_ENABLE=1``: torch then asks the kernel for transparent huge pages for its CPU buffers
of 2 MB and more (``madvise``); torch reads that once, at start, so it takes effect in the children.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import time
import traceback
from typing import Any, Iterator

from mentorrl.core.lifetime import die_with_parent
from mentorrl.train.distributed import is_main_process

THP_ENV = "THP_MEM_ALLOC_ENABLE"


def recipe_units(cfg: Any) -> list[str]:
    """The recipe's units of work in the order :func:`mentorrl.train.pipeline.run_stages` runs them:
    each stage, then its held-out evaluation (when ``eval.num_tasks`` > 0), then the final stage on each
    of ``eval.final_splits``."""
    evaluated = cfg.eval.num_tasks > 0
    units: list[str] = []
    for stage in cfg.recipe:
        units.append(stage)
        if evaluated:
            units.append(f"eval {stage}")
    if evaluated:
        units += [f"eval {cfg.recipe[-1]} on {split}" for split in cfg.eval.final_splits]
    return units


class UnitBoundary(Exception):
    """Raised by :meth:`UnitGate.passed` at the end of the unit the process was started for."""


class UnitGate:
    """Counts the units :func:`~mentorrl.train.pipeline.run_stages` passes; at the end of unit ``stop``
    (0-based) it raises :class:`UnitBoundary`, so the process ends there. ``stop`` None never stops.
    ``first``: whether this process starts the run (it runs the preflight reward audit); ``started``: when
    the run started (``time.time()``), for the report's total time, when it started in another process."""

    def __init__(self, stop: int | None = None, first: bool = True, started: float | None = None) -> None:
        self.stop = stop
        self.first = first
        self.started = started
        self.count = 0

    def passed(self, unit: str) -> None:
        self.count += 1
        if self.stop is not None and self.count > self.stop:
            raise UnitBoundary(unit)


@contextlib.contextmanager
def child_environ(updates: dict[str, str], force: dict[str, str] | None = None) -> Iterator[None]:
    """``os.environ`` with ``updates`` (a variable the user set wins) and ``force`` (set whatever was there)
    while a child starts, then as it was."""
    setting = {**{k: v for k, v in updates.items() if k not in os.environ}, **(force or {})}
    before = {k: os.environ.get(k) for k in setting}
    os.environ.update(setting)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def unit_rendezvous(env: Any, index: int) -> dict[str, str]:
    """Under a torchrun launch of several ranks, where unit ``index``'s processes (one a rank) meet: a store
    of their own, hosted by rank 0's process on ``MASTER_PORT + 1 + index``, not the launcher's store, which
    still holds the keys of the previous unit's group (a new group there would read them as its own). Every
    rank derives the same port from the launch's environment, so the ranks agree without talking. ``{}`` for
    one process."""
    if int(env.get("WORLD_SIZE", "1")) <= 1:
        return {}
    base = int(env.get("MASTER_PORT", "29500"))
    port = base + 1 + index
    if port > 65535:  # wrap into the unprivileged range
        port = 1024 + (port - 1024) % (65536 - 1024)
    return {"MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "False"}


def _child(
    run_recipe: Any,
    cfg: Any,
    resume: bool,
    show_progress: bool,
    index: int,
    last: bool,
    conn: Any,
    parent: int,
    started: float,
) -> None:
    """One unit's process: the recipe resumed, stopped at the end of unit ``index`` (unless it is the
    ``last``: then the run ends as in one process, with its report); sends
    ``("unit", label)``, ``("result", dict)`` or ``("error", exception)``. It dies with the ``parent``
    process (a SIGKILLed ``mentorrl train`` leaves no stage running; ``--resume`` goes on from there)."""
    die_with_parent(signal.SIGKILL, parent)

    try:
        gate = UnitGate(None if last else index, first=index == 0, started=started)
        result = run_recipe(cfg, resume=resume, show_progress=show_progress, gate=gate)
        msg: tuple[str, Any] = ("result", result)
    except UnitBoundary as e:
        msg = ("unit", str(e))
    except BaseException as e:  # noqa: BLE001 -- every failure goes back to the parent, which raises it
        e.add_note(f"in the stage process of unit {index}:\n{traceback.format_exc()}")
        msg = ("error", e)
    try:
        conn.send(msg)
    except Exception as e:  # an exception that does not pickle: its type and message
        conn.send(("error", RuntimeError(f"{type(msg[1]).__name__}: {msg[1]} ({e})")))
    finally:
        conn.close()


def run_in_stage_processes(
    run_recipe: Any, cfg: Any, resume: bool = False, show_progress: bool = True
) -> dict[str, Any]:
    """Run ``cfg``'s recipe one unit per fresh process (:func:`recipe_units`): ``run_recipe``
    (:func:`mentorrl.train.pipeline.run_recipe`, passed in: pickled by reference, so this module does not
    import the pipeline, which imports it); returns what it returns, from the last unit's process."""
    units, started = recipe_units(cfg), time.time()
    talks = is_main_process()  # under torchrun ranks (no group joined here), rank 0 prints the units
    ctx = multiprocessing.get_context("spawn")
    env = {THP_ENV: "1"} if cfg.huge_pages else {}
    for index, unit in enumerate(units):
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_child,
            args=(
                run_recipe,
                cfg,
                resume or index > 0,
                show_progress,
                index,
                index == len(units) - 1,
                send,
                os.getpid(),
                started,
            ),
            name=f"mentorrl-unit-{index}",
        )
        with child_environ(env, force=unit_rendezvous(os.environ, index)):
            proc.start()
        send.close()
        if show_progress and talks:
            extra = f", {THP_ENV}=1" if env else ""
            print(f"stage process {index + 1}/{len(units)}: {unit} (pid {proc.pid}{extra})", flush=True)
        try:
            kind, value = recv.recv()  # before join: a large result must not fill the pipe while we wait
        except EOFError:
            kind, value = "error", None
        finally:
            recv.close()
            proc.join()
        if kind == "error":
            if isinstance(value, BaseException):
                raise value
            raise RuntimeError(f"the stage process of {unit!r} ended without a result (exit code {proc.exitcode})")
        if kind == "result":
            return value
    raise RuntimeError(f"the recipe's last unit ({units[-1]!r}) ended without the run's result")


__all__ = ["UnitBoundary", "UnitGate", "child_environ", "recipe_units", "run_in_stage_processes", "unit_rendezvous"]
