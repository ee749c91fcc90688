"""code: small Python programming tasks solved by writing and running code in a sandbox.

The policy edits ``solution.py`` in a per-episode workspace with ``read_file`` / ``write_file``,
runs snippets with ``run_python`` and the visible tests with ``run_tests``; every program runs in
the sandbox of :mod:`.sandbox`. The verifier runs hidden tests on a fresh copy of the workspace
(:meth:`CodeEnv.verify`); the reward-hacking suite and the validation corruptions are in
:mod:`.attacks` (the registry entry in :mod:`mentorrl.envs` names them).
"""

from .env import SYSTEM_PROMPT, CodeEnv
from .expert import CodeExpert
from .problems import FAMILIES, VARIANTS
from .sandbox import Limits, SandboxUnavailable, check_sandbox
from .tasks import CodeTasks

__all__ = [
    "CodeEnv",
    "CodeTasks",
    "CodeExpert",
    "FAMILIES",
    "VARIANTS",
    "SYSTEM_PROMPT",
    "Limits",
    "SandboxUnavailable",
    "check_sandbox",
]
