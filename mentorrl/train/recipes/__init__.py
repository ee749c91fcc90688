"""The built-in training stages, one module each, registered with
:func:`mentorrl.train.registry.register_stage` on import (in recipe order)."""

from mentorrl.train.recipes import sft, rft, grpo, ppo, sao, opd, blackbox, evolve  # noqa: F401  (registers them)
