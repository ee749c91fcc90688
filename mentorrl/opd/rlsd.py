"""RLSD (self-distillation with verifiable rewards): which trajectories are distilled, and how much.

Only trajectories the verifier passed are distillation targets; among them, higher reward and
shorter length weigh more. A configurable share of each batch is *exploration*: trained by the
RL loss only, never distilled, so the frozen self-teacher does not pull every sample back to
what it already does. Loss = L_RL + lambda * L_SD (see :func:`mentorrl.algos.distill.mix_advantages`
and :meth:`mentorrl.train.learner.Learner.distill_step`). The functions are pure and live in
:mod:`mentorrl.algos.distill` (the OPD stage's ``rlsd_*`` terms call them); they are re-exported here.
"""

from __future__ import annotations

from mentorrl.algos.distill import distill_weights, exploration_split

__all__ = ["distill_weights", "exploration_split"]
