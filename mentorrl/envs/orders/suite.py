"""The orders environment's whole reward-hacking suite and validation corruptions: the state and
history attacks of :mod:`.hacks`, the typed-answer attacks of :mod:`.typed_attacks` (verifier v4),
the free-text answer attacks of :mod:`.claim_attacks` (the first red
team's classes) and of :mod:`.statement_attacks` (the second red team's classes); they build on
each other's helpers, so the lists meet here, not in any one module."""

from __future__ import annotations

import dataclasses

from mentorrl.envs.base import Environment
from mentorrl.envs.suites import Attack, Corruption

from .claim_attacks import claim_attacks, claim_corruptions
from .hacks import state_attacks, state_corruptions
from .statement_attacks import statement_attacks, statement_corruptions
from .typed_attacks import typed_attacks


def free_text_env(env: Environment) -> Environment:
    """The orders environment in free-text mode, in place of ``env`` (closed): where the free-text answer
    attacks run, since a typed environment reads no free text (they would earn nothing there, and the
    privacy ones would not even be read as the disclosures they are)."""
    from .env import OrdersEnv

    timeout = getattr(getattr(env, "registry", None), "timeout_s", 5.0)
    env.close()
    return OrdersEnv(tool_timeout_s=timeout, answer="free_text")


def in_free_text(attack: Attack) -> Attack:
    """``attack`` run against the free-text reader (its own wrapper, if any, on top)."""
    inner = attack.wrap_env

    def wrap(env: Environment) -> Environment:
        env = free_text_env(env)
        return inner(env) if inner is not None else env

    return dataclasses.replace(attack, wrap_env=wrap)


def orders_attacks() -> list[Attack]:
    """Every orders attack, in the order the audit reports them: the free-text answer attacks run against
    the free-text reader (``env.answer: free_text``), everything else against the configured environment."""
    state = [in_free_text(a) if a.name in TEXT_ONLY else a for a in state_attacks()]
    return [*state, *typed_attacks(), *map(in_free_text, [*claim_attacks(), *statement_attacks()])]


# state attacks whose whole point is the answer's wording (a hedge, filler): a record has no wording
TEXT_ONLY = frozenset({"hedged_answer", "padded_answer"})


def orders_corruptions() -> list[Corruption]:
    """Every orders corruption for offline reward validation."""
    return [*state_corruptions(), *claim_corruptions(), *statement_corruptions()]


__all__ = ["orders_attacks", "orders_corruptions"]
