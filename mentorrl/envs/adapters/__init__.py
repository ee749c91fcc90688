"""Environments users bring: adapters that put another framework's environment behind mentorrl's
:class:`~mentorrl.envs.base.Environment` protocol, so it trains and evaluates through the same
rollout, reward and trajectory contract as ``orders`` and ``code``.

* :mod:`.verifiers_v1`: a ``verifiers`` 0.4 taskset (``import verifiers.v1 as vf``), and an installed
  verifiers environment package loaded by id (``env: {name: verifiers, id: ..., args: ...}``): its
  tasks become tasks, its own ``@vf.reward`` / ``@vf.metric`` methods score the episode.
* :mod:`.verifiers_env`: a ``verifiers`` environment (the classic ``SingleTurnEnv`` /
  ``MultiTurnEnv`` / ``ToolEnv`` / ``StatefulToolEnv`` API of ``import verifiers as vf``): its
  dataset rows become tasks, its tools become mentorrl tools, its rubric scores the episode.
* :mod:`.gym_env`: a Gymnasium-style ``reset`` / ``step`` environment with text observations and
  text (or named discrete) actions, played through one action tool.
* :mod:`.functions`: typed Python functions with docstrings (as in TRL's ``tools=[...]``) become
  a tool set, with the JSON schema ``transformers.utils.get_json_schema`` gives them.

Each builds an :class:`~mentorrl.envs.EnvEntry` (:func:`register_adapter` registers it under a
name, so ``env: {name: ...}`` works in a recipe). Neither ``verifiers`` nor ``gymnasium`` is
imported by mentorrl: an adapter only duck-types the object it is given. The outside code is
untrusted like a model's tool call: an exception in it becomes an ``error: ...`` observation
(or, in a verifier, a failed verdict with the error in its details), never a crashed rollout.
"""

from .common import AdapterTasks, NoExpert, register_adapter, run_async
from .functions import FunctionEnv, function_entry, function_tools, tool
from .gym_env import GymTasks, GymTextEnv, gym_entry
from .verifiers_env import VerifiersEnv, verifiers_entry
from .verifiers_v1 import VerifiersV1Env, verifiers_v1_entry

__all__ = [
    "AdapterTasks",
    "NoExpert",
    "register_adapter",
    "run_async",
    "FunctionEnv",
    "function_entry",
    "function_tools",
    "tool",
    "GymTasks",
    "GymTextEnv",
    "gym_entry",
    "VerifiersEnv",
    "verifiers_entry",
    "VerifiersV1Env",
    "verifiers_v1_entry",
]
