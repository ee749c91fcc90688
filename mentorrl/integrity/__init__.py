"""Reward integrity: reward-hacking audits and offline reward validation.

* :mod:`mentorrl.integrity.attacks` -- scripted attacks per environment, the audit runner and
  the :class:`LostResponseEnv` fault-injection wrapper;
* :mod:`mentorrl.integrity.validation` -- labelled correct / corrupted trajectories, AUC and overlap;
* :mod:`mentorrl.cli.integrity` -- the ``mentorrl reward-audit`` command.
"""

from mentorrl.integrity.attacks import (
    Attack,
    AttackAuditConfig,
    AttackResult,
    AuditReport,
    LostResponseEnv,
    audit_env,
    get_attacks,
    register_attacks,
    run_audit,
)
from mentorrl.integrity.validation import (
    Corruption,
    ValidationReport,
    auc,
    get_corruptions,
    overlap_share,
    range_overlap,
    register_corruptions,
    run_validation,
    validate_env,
)

__all__ = [
    "Attack",
    "AttackResult",
    "AttackAuditConfig",
    "AuditReport",
    "Corruption",
    "LostResponseEnv",
    "ValidationReport",
    "audit_env",
    "auc",
    "get_attacks",
    "get_corruptions",
    "overlap_share",
    "range_overlap",
    "register_attacks",
    "register_corruptions",
    "run_audit",
    "run_validation",
    "validate_env",
]
