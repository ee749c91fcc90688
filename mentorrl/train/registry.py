"""The stage registry: every training stage a recipe can name, registered beside its code.

A stage is a function ``run(ws, model, resume=False) -> Path`` (the stage's final weights
directory) decorated with::

    @register_stage("grpo", config="grpo", title="GRPO", label="GRPO", rl=True)
    def grpo_stage(ws, model, resume=False): ...

``config`` names the stage's :class:`~mentorrl.config.RunConfig` section (None for a stage
without one), ``title`` is the rule printed before it runs, ``label`` its short name in the
evaluation table, and ``rl`` marks a reinforcement-learning stage (the report compares the last
RL stage with the stage before it). The built-in stages live one per module in
:mod:`mentorrl.train.recipes`; :func:`get_stage` and :func:`stage_names` load them on first use.
Adding a stage is one new module with its registration.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

StageFn = Callable[..., Path]


@dataclass(frozen=True)
class StageSpec:
    """A registered stage."""

    name: str
    run: StageFn
    config: str | None
    title: str
    label: str
    rl: bool


_STAGES: dict[str, StageSpec] = {}


def register_stage(name: str, *, config: str | None = None, title: str | None = None, label: str | None = None,
                   rl: bool = False) -> Callable[[StageFn], StageFn]:
    """Register the decorated ``run(ws, model, resume=False)`` as stage ``name`` (see the module doc).
    Registering a name twice replaces the earlier stage (a test's toy stage, a reloaded module)."""

    def deco(fn: StageFn) -> StageFn:
        _STAGES[name] = StageSpec(name, fn, config, title or name, label or name.upper(), rl)
        return fn

    return deco


def unregister_stage(name: str) -> None:
    """Forget stage ``name`` (for tests that register a toy stage)."""
    _STAGES.pop(name, None)


def _load_builtin() -> None:
    import mentorrl.train.recipes  # noqa: F401  (each module registers its stage on import)


def stages() -> dict[str, StageSpec]:
    """Every registered stage by name, the built-in ones first in recipe order."""
    _load_builtin()
    return dict(_STAGES)


def stage_names() -> tuple[str, ...]:
    return tuple(stages())


def rl_stage_names() -> tuple[str, ...]:
    return tuple(n for n, s in stages().items() if s.rl)


def get_stage(name: str) -> StageSpec:
    """The registered stage ``name``; ValueError naming the known ones otherwise."""
    known = stages()
    if name not in known:
        raise ValueError(f"unknown stage {name!r}; registered: {', '.join(known)}")
    return known[name]


def run_stage_by_name(ws: Any, name: str, model, resume: bool) -> Path:
    """Run the registered stage ``name`` on ``model`` in workspace ``ws``."""
    return get_stage(name).run(ws, model, resume=resume)
