"""Plugins: modules that register stages (with their config sections) and environments, loaded before
a config is validated.

* a recipe's ``plugins: [my_pkg.stages]`` and ``mentorrl train --plugin my_pkg.stages`` name modules to
  import (each registers what it defines on import, e.g. with ``@register_stage``);
* an installed package declares entry points: in group ``mentorrl.stages`` an object that is a
  :class:`~mentorrl.config.stages.StageSpec` (registered), a function (called with no arguments to
  register its stages) or a module (its import registers them); in group ``mentorrl.envs`` an
  environment factory, loaded by :func:`mentorrl.envs.get_env` when a config names it.

Only modules already importable are imported (a config names them, it cannot ship code), and only
once each.
"""

from __future__ import annotations

import importlib
import re
import types
from importlib import metadata
from typing import Iterable

from mentorrl.config.base import ConfigError
from mentorrl.config.process import Once
from mentorrl.config.stages import StageSpec, register_stage_spec

MODULE_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
STAGE_GROUP = "mentorrl.stages"
ENV_GROUP = "mentorrl.envs"

_ENTRY_POINTS = Once()  # the installed entry points are loaded once per process


def load_entry_point_stages() -> None:
    """Load every installed ``mentorrl.stages`` entry point (once per process)."""
    if not _ENTRY_POINTS.first():
        return
    for ep in metadata.entry_points(group=STAGE_GROUP):
        try:
            obj = ep.load()
            if isinstance(obj, StageSpec):
                register_stage_spec(obj)
            elif callable(obj) and not isinstance(obj, (type, types.ModuleType)):
                obj()
        except Exception as e:  # a broken plugin: name it
            raise ConfigError(
                f"plugin entry point {STAGE_GROUP}:{ep.name} ({ep.value}) failed to load: {type(e).__name__}: {e}"
            ) from e


def import_plugin(module: str, where: str = "plugins") -> None:
    """Import plugin ``module`` (once: an imported module is in ``sys.modules``); a ConfigError
    naming ``where`` when it cannot be imported."""
    try:
        importlib.import_module(module)
    except Exception as e:  # not found, or its import failed: name the plugin
        raise ConfigError(f"{where}: cannot import plugin {module!r}: {type(e).__name__}: {e}") from e


def load_plugins(modules: Iterable[str] = ()) -> None:
    """The installed entry points, then ``modules`` in order."""
    load_entry_point_stages()
    for i, module in enumerate(modules):
        if isinstance(module, str) and MODULE_PATH.fullmatch(module):  # anything else: the config check names it
            import_plugin(module, f"plugins.{i}")


__all__ = ["ENV_GROUP", "MODULE_PATH", "STAGE_GROUP", "import_plugin", "load_entry_point_stages", "load_plugins"]
