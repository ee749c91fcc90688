"""Evaluation-only task splits and the guard that keeps them out of training. Declared with the run
config (:mod:`mentorrl.config.names`), which checks ``train_split`` with it when a config is loaded."""

from __future__ import annotations

from mentorrl.config.names import HIDDEN_SPLITS, HiddenSetError, assert_trainable_splits

__all__ = ["HIDDEN_SPLITS", "HiddenSetError", "assert_trainable_splits"]
