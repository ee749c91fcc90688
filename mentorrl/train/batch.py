"""Compatibility re-export: the learner's tensor views moved to :mod:`mentorrl.models.batch`.

``models/value.py`` needs them below ``train/``; this module stays only while modules in
``train/`` still import the old path.
"""

from mentorrl.models.batch import (  # noqa: F401
    TokenBatch,
    collate,
    forward_logprobs,
    forward_selected_logprobs,
    shared_prefix_len,
)

__all__ = ["TokenBatch", "collate", "forward_logprobs", "forward_selected_logprobs", "shared_prefix_len"]
