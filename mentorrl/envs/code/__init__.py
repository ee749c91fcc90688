"""code: small Python programming tasks solved by writing and running code in a sandbox.

The policy edits ``solution.py`` in a per-episode workspace with ``read_file`` / ``write_file``,
runs snippets with ``run_python`` and the visible tests with ``run_tests``; every program runs in
the sandbox of :mod:`.sandbox`. The verifier runs hidden tests on a fresh copy of the workspace
(:meth:`CodeEnv.verify`); the reward-hacking suite and the validation corruptions are in
:mod:`.attacks` (:func:`register_suites` registers them).
"""

from .env import SYSTEM_PROMPT, CodeEnv
from .expert import CodeExpert
from .problems import FAMILIES, VARIANTS
from .sandbox import Limits, SandboxUnavailable, check_sandbox
from .tasks import CodeTasks


def register_suites() -> None:
    """Register the code environment's attacks and corruptions with the integrity registries (once)."""
    from mentorrl.integrity.attacks import ATTACKS
    from mentorrl.integrity.validation import CORRUPTIONS

    from .attacks import code_attacks, code_corruptions

    if "code" not in ATTACKS.registered and "code" not in ATTACKS.builtins:
        ATTACKS.register("code", code_attacks)
    if "code" not in CORRUPTIONS.registered and "code" not in CORRUPTIONS.builtins:
        CORRUPTIONS.register("code", code_corruptions)


__all__ = ["CodeEnv", "CodeTasks", "CodeExpert", "FAMILIES", "VARIANTS", "SYSTEM_PROMPT", "Limits",
           "SandboxUnavailable", "check_sandbox", "register_suites"]
