"""The runtime side of the stage table (:mod:`mentorrl.config.stages`): a stage's code, found and run.

The built-in stages are listed once, in :data:`mentorrl.config.stages.BUILTIN_STAGES`, each with its
runner as an import path (``"mentorrl.train.recipes.grpo:run_grpo"``), imported the first time the
stage runs. A user's stage registers its function here::

    @register_stage("toy", config=ToyConfig, title="A toy stage", label="Toy", rl=True)
    def toy_stage(ws, model, resume=False): ...

``config`` is the stage's own pydantic section (read as ``ws.cfg.toy``; a recipe's YAML sets it
under ``toy:``), or None. A stage is a function ``run(ws, model, resume=False) -> Path`` (the stage's
final weights directory).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Callable, Iterable

from pydantic import BaseModel

from mentorrl.config.stages import (
    StageSpec,
    get_stage_spec,
    register_stage_spec,
    stage_specs,
    unregister_stage_spec,
)
from mentorrl.train.loop import Stage, run_on_loop

StageFn = Callable[..., Path]


def register_stage(
    name: str,
    *,
    config: type[BaseModel] | None = None,
    title: str | None = None,
    label: str | None = None,
    rl: bool = False,
    parallel: Iterable[str] = (),
    writes_samples: bool = False,
    needs: Callable[[Any], list[tuple[str, str]]] | None = None,
    replace: bool = False,
) -> Callable[[StageFn], StageFn]:
    """Register the decorated :class:`~mentorrl.train.loop.Stage` subclass (run by the one loop),
    or a plain ``run(ws, model, resume=False)``, as stage ``name`` with its own config section
    ``config`` (see :class:`~mentorrl.config.stages.StageSpec` for the rest). A taken name is an error
    unless ``replace`` (:func:`unregister_stage` brings a replaced built-in stage back)."""

    def deco(fn):
        runner = run_on_loop(fn) if isinstance(fn, type) and issubclass(fn, Stage) else fn
        register_stage_spec(
            StageSpec(
                name,
                config,
                runner,
                title or name,
                label or name.upper(),
                rl,
                frozenset(parallel),
                writes_samples,
                needs,
            ),
            replace=replace,
        )
        return fn

    return deco


def unregister_stage(name: str) -> None:
    """Forget stage ``name`` (for tests that register a toy stage)."""
    unregister_stage_spec(name)


def stages() -> dict[str, StageSpec]:
    """Every registered stage by name, the built-in ones first in recipe order."""
    return stage_specs()


def stage_names() -> tuple[str, ...]:
    return tuple(stage_specs())


def rl_stage_names() -> tuple[str, ...]:
    return tuple(n for n, s in stage_specs().items() if s.rl)


def get_stage(name: str) -> StageSpec:
    """The registered stage ``name``; ValueError naming the known ones otherwise."""
    return get_stage_spec(name)


def resolve_runner(spec: StageSpec) -> StageFn:
    """The function of stage ``spec``: its runner itself, or the one its ``"module:function"`` names."""
    if callable(spec.runner):
        return spec.runner
    module, _, attr = spec.runner.partition(":")
    fn = getattr(importlib.import_module(module), attr, None)
    if not callable(fn):
        raise ValueError(f"stage {spec.name}: runner {spec.runner!r} names no function")
    return fn


def run_stage_by_name(ws: Any, name: str, model, resume: bool) -> Path:
    """Run the registered stage ``name`` on ``model`` in workspace ``ws``."""
    return resolve_runner(get_stage(name))(ws, model, resume=resume)


__all__ = [
    "StageSpec",
    "get_stage",
    "register_stage",
    "resolve_runner",
    "rl_stage_names",
    "run_stage_by_name",
    "stage_names",
    "stages",
    "unregister_stage",
]
