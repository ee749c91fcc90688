"""orders: customer support for a small shop (in the manner of tau-bench retail).

The agent looks up customers, orders and stock and makes changes through tools that
enforce the store policy; the verifier replays the task's reference actions on a fresh
copy of the episode's database and compares the resulting state with the agent's.
"""

from .backend import TOOL_SPECS, OrdersBackend
from .env import SYSTEM_PROMPT, OrdersEnv
from .expert import OrdersExpert
from .tasks import ADVERSARIAL, FAMILIES, OrdersTasks

__all__ = [
    "OrdersEnv",
    "OrdersTasks",
    "OrdersExpert",
    "FAMILIES",
    "ADVERSARIAL",
    "OrdersBackend",
    "TOOL_SPECS",
    "SYSTEM_PROMPT",
]
