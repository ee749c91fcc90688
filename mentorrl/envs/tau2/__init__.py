"""τ²-bench (Sierra Research's tau2-bench) from the user's own clone: ``env: {name: tau2, path: <clone>,
domain: retail|airline|telecom|<any>, split: train|test|base, task_set: tasks|small|full}``.

Nothing of the benchmark is copied into mentorrl: the domain's code and data are loaded from the
clone at run time, in the clone's own interpreter (:mod:`.child`, spoken to by :mod:`.protocol`),
so the upstream package's Python (>= 3.12) and dependencies stay out of the learner's. Modules:
:mod:`.records` (the task files, the clone checks), :mod:`.env` (the environment), :mod:`.users`
(scripted and LLM users), :mod:`.reward` (the benchmark's reward), :mod:`.audit` (expert, attacks,
screen), :mod:`.tasks` (the task source). docs/bring-your-env.md#tau2-bench is the user's guide.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path
from typing import Any

from mentorrl.config.base import ConfigError
from mentorrl.envs import EnvEntry

from .audit import Tau2Expert, screen_tasks, tau2_attacks
from .env import DomainSpec, Tau2Env, handshake
from .records import Tau2Settings, check_clone, default_python
from .tasks import Tau2Tasks, check_split, tasks_for


def settings_from_config(env_cfg: Any) -> Tau2Settings:
    """The checked settings of an ``env:`` section naming tau2 (a ConfigError naming the field)."""
    clone, domain = check_clone(env_cfg.path, env_cfg.domain, env_cfg.task_set)
    python = env_cfg.python or default_python(clone)
    if "/" in python:
        if not Path(python).expanduser().is_file():
            raise ConfigError(f"env.python: {python!r} does not exist")
        python = str(Path(python).expanduser())
    elif shutil.which(python) is None:
        raise ConfigError(f"env.python: {python!r} is not on PATH; set env.python to the clone's interpreter")

    def dump(c: Any) -> str | None:
        return None if c is None else c.model_dump_json()

    settings = Tau2Settings(
        clone=clone,
        domain=domain,
        split=env_cfg.split or "train",
        python=python,
        user=env_cfg.user,
        user_client=dump(env_cfg.user_client),
        judge=dump(env_cfg.judge),
        exclude_hackable=env_cfg.exclude_hackable,
        max_user_turns=env_cfg.max_user_turns,
        solo=env_cfg.solo,
        task_set=env_cfg.task_set,
    )
    check_split(settings)
    return settings


@functools.lru_cache(maxsize=8)
def _spec(settings: Tau2Settings) -> DomainSpec:
    return handshake(settings)


def tau2_entry(env_cfg: Any) -> EnvEntry:
    """The run's environment entry: every check (clone, domain, data files, split, interpreter, the
    domain's import and tool schemas) runs here, before the first step."""
    settings = settings_from_config(env_cfg)
    spec = _spec(settings)
    return EnvEntry(
        functools.partial(Tau2Env, settings, spec),
        functools.partial(tasks_for, settings, spec),
        functools.partial(Tau2Expert, spec.mutating, settings.solo),
        attacks=tau2_attacks,
        mutating_tools=spec.mutating,
    )


__all__ = [
    "DomainSpec",
    "Tau2Env",
    "Tau2Expert",
    "Tau2Settings",
    "Tau2Tasks",
    "handshake",
    "screen_tasks",
    "settings_from_config",
    "tau2_attacks",
    "tau2_entry",
]
