"""Helpers for tests that run the rollout engine over real environments."""

from __future__ import annotations

from mentorrl.rollout.engine import RolloutEngine
from mentorrl.rollout.episode import Episode


def engine_run(model, contract, entry, tasks, episode_cls=Episode, seed: int = 0, on_finish=None, **engine_kw):
    """``RolloutEngine(model, contract, **engine_kw)`` over one fresh ``entry`` environment per task
    (closed afterwards): ``(engine, trajectories)``."""
    envs = [entry.make_env() for _ in tasks]
    try:
        engine = RolloutEngine(model, contract, **engine_kw)
        trajs = engine.run([episode_cls(contract, e, t) for e, t in zip(envs, tasks)], seed=seed, on_finish=on_finish)
    finally:
        for e in envs:
            e.close()
    return engine, trajs
