"""The bad-case flywheel: review sampling, failure attribution, routing, corrections, hard-task pool.

Trajectories without user feedback go through

* :mod:`~mentorrl.flywheel.review`       -- which ones a person should look at;
* :mod:`~mentorrl.flywheel.attribution`  -- why each failed one failed (one primary type);
* :mod:`~mentorrl.flywheel.routing`      -- which training method each failure type feeds;
* :mod:`~mentorrl.flywheel.corrections`  -- verified corrected trajectories and preference pairs;
* :mod:`~mentorrl.flywheel.hard_pool`    -- failed tasks sampled more often in later rollouts;
* :mod:`~mentorrl.cli.flywheel`     -- ``mentorrl flywheel`` (``register(app)``).
"""

from mentorrl.flywheel.attribution import (
    PRECEDENCE,
    Attribution,
    AttributionConfig,
    FailureDistribution,
    FailureType,
    attribute,
    failure_distribution,
)
from mentorrl.flywheel.corrections import (
    Corrections,
    PreferencePair,
    build_corrections,
    contract_for_trajectory,
    expert_reference_calls,
    find_tasks,
    load_tasks_jsonl,
    write_tasks_jsonl,
)
from mentorrl.flywheel.hard_pool import HardPoolConfig, HardTaskPool
from mentorrl.flywheel.review import ReviewConfig, ReviewEntry, RiskWeights, build_review_queue, write_review_queue
from mentorrl.flywheel.routing import DEFAULT_ROUTES, RoutingTable, TrainingMethod

__all__ = [
    "PRECEDENCE",
    "Attribution",
    "AttributionConfig",
    "Corrections",
    "DEFAULT_ROUTES",
    "FailureDistribution",
    "FailureType",
    "HardPoolConfig",
    "HardTaskPool",
    "PreferencePair",
    "ReviewConfig",
    "ReviewEntry",
    "RiskWeights",
    "RoutingTable",
    "TrainingMethod",
    "attribute",
    "build_corrections",
    "build_review_queue",
    "contract_for_trajectory",
    "expert_reference_calls",
    "failure_distribution",
    "find_tasks",
    "load_tasks_jsonl",
    "write_review_queue",
    "write_tasks_jsonl",
]
