"""A new rollout backend: the project's engine with a trace of every rollout call.

A rollout backend is a :class:`~mentorrl.rollout.backends.BackendKind` registered under a name; a recipe
picks it with ``rollout.backend: <name>``, and every stage's rollouts (training, evaluation) are decoded
by what its ``build(choice, model, contract, version)`` returns: a
:class:`~mentorrl.rollout.backends.base.GenerationBackend` (token ids in; sampled ids and their log-probs
out). This one wraps the default engine (``hf``) and appends one JSON line per call to
``$MENTORRL_TRACE`` (episodes, policy tokens, seconds): a template for a backend of your own (a remote
server, another inference library) that keeps the engine's batching and token-in / token-out records.

Register it by importing this module (a recipe's ``plugins: [my_pkg.traced_backend]``).
"""

from __future__ import annotations

import json
import os
import time

from mentorrl.rollout.backends import BackendKind, register_rollout_backend
from mentorrl.rollout.backends.hf import HFBackend


class TracedBackend(HFBackend):
    name = "hf_traced"

    def run_episodes(self, episodes, seed=0):
        t0 = time.perf_counter()
        trajs = super().run_episodes(episodes, seed=seed)
        path = os.environ.get("MENTORRL_TRACE")
        if path:
            line = {
                "episodes": len(trajs),
                "policy_tokens": sum(t.num_policy_tokens for t in trajs),
                "seconds": round(time.perf_counter() - t0, 4),
                "version": self.version,
            }
            with open(path, "a") as f:
                f.write(json.dumps(line) + "\n")
        return trajs


class TracedKind(BackendKind):
    """Built per call over the choice's placed model, with the choice's engine settings, like ``hf``."""

    def build(self, choice, model, contract, version):
        return TracedBackend(choice.placed(model), contract, **choice.engine_settings)


def register() -> None:
    """Make ``rollout.backend: hf_traced`` available (importing this module does it once)."""
    from mentorrl.config.names import ROLLOUT_BACKENDS

    if "hf_traced" not in ROLLOUT_BACKENDS:
        register_rollout_backend("hf_traced", TracedKind())


register()
