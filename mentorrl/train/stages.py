"""Compatibility names for callers outside :mod:`mentorrl.train` written before issue 18.

The stages moved: the workspace and evaluation to :mod:`mentorrl.train.workspace`, the resumable
runner to :mod:`mentorrl.train.stage_runner`, the shared loop to :mod:`mentorrl.train.loop`, the
critic to :mod:`mentorrl.train.critic`, and each stage to its own module under
:mod:`mentorrl.train.recipes` (registered in :mod:`mentorrl.train.registry`). New code imports
from those modules; nothing in ``mentorrl/train`` imports this one.
"""

from mentorrl.train.critic import Critic, critic_advantages
from mentorrl.train.loop import FINISH_REASONS, TRAIN_POOL_SEED_OFFSET, outcome_rewards, rollout_metrics
from mentorrl.train.recipes.grpo import grpo_stage
from mentorrl.train.recipes.ppo import ppo_stage
from mentorrl.train.recipes.rft import RFT_POOL_SEED_OFFSET, rft_stage
from mentorrl.train.recipes.sft import sft_stage
from mentorrl.train.stage_runner import cpu_cores, run_stage, step_timing
from mentorrl.train.workspace import Workspace, eval_contract, evaluate, frozen_copy, heldout_check, open_workspace

__all__ = ["FINISH_REASONS", "RFT_POOL_SEED_OFFSET", "TRAIN_POOL_SEED_OFFSET", "Critic", "Workspace", "cpu_cores",
           "critic_advantages", "eval_contract", "evaluate", "frozen_copy", "grpo_stage", "heldout_check",
           "open_workspace", "outcome_rewards", "ppo_stage", "rft_stage", "rollout_metrics", "run_stage", "sft_stage",
           "step_timing"]
