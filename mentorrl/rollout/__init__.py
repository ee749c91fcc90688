"""Rolling models out on tasks: the run's :class:`Rollout` (contract, environments, reward weights,
generation backend), the engine, episodes and the generation backends."""

from mentorrl.rollout.api import Rollout, RolloutSpec
from mentorrl.rollout.backends import BackendChoice

__all__ = ["BackendChoice", "Rollout", "RolloutSpec"]
