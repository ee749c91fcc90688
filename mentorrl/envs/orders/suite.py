"""The orders environment's whole reward-hacking suite and validation corruptions: the state and
history attacks of :mod:`.hacks`, the answer attacks of :mod:`.claim_attacks` (the first red
team's classes) and of :mod:`.statement_attacks` (the second red team's classes); they build on
each other's helpers, so the lists meet here, not in any one module."""

from __future__ import annotations

from mentorrl.envs.suites import Attack, Corruption

from .claim_attacks import claim_attacks, claim_corruptions
from .hacks import state_attacks, state_corruptions
from .statement_attacks import statement_attacks, statement_corruptions


def orders_attacks() -> list[Attack]:
    """Every orders attack, in the order the audit reports them."""
    return [*state_attacks(), *claim_attacks(), *statement_attacks()]


def orders_corruptions() -> list[Corruption]:
    """Every orders corruption for offline reward validation."""
    return [*state_corruptions(), *claim_corruptions(), *statement_corruptions()]


__all__ = ["orders_attacks", "orders_corruptions"]
