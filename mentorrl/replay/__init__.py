"""Persistent prioritised replay of trajectories, hybrid online/expert/replay batches, segment replay."""

from mentorrl.replay.buffer import (
    CATEGORIES,
    REJECT_DUPLICATE,
    REJECT_LOW_ADVANTAGE,
    REJECT_LOW_REWARD,
    REJECT_TOO_LONG,
    SOURCES,
    AddResult,
    BatchItem,
    ReplayBuffer,
    ReplayBufferError,
    ReplayConfig,
    ReplayStats,
    apportion,
    hybrid_batch,
    segment_replay,
)

__all__ = [
    "CATEGORIES",
    "REJECT_DUPLICATE",
    "REJECT_LOW_ADVANTAGE",
    "REJECT_LOW_REWARD",
    "REJECT_TOO_LONG",
    "SOURCES",
    "AddResult",
    "BatchItem",
    "ReplayBuffer",
    "ReplayBufferError",
    "ReplayConfig",
    "ReplayStats",
    "apportion",
    "hybrid_batch",
    "segment_replay",
]
