"""Evaluation-only task splits and the guard that keeps them out of training (stdlib only: the run
config checks ``train_split`` with it when a config is loaded)."""

from __future__ import annotations

from typing import Iterable

HIDDEN_SPLITS = frozenset({"hidden", "novel_wording"})  # evaluation-only splits


class HiddenSetError(ValueError):
    """Raised when hidden evaluation tasks are about to be used for training."""


def assert_trainable_splits(splits: Iterable[str]) -> None:
    """Refuse split names that are evaluation-only (``hidden``, ``novel_wording``). Call it on a config's
    training splits."""
    bad = sorted({s for s in splits if s in HIDDEN_SPLITS})
    if bad:
        what = "the hidden evaluation set" if bad[0] == "hidden" else "an evaluation-only stress set"
        raise HiddenSetError(
            f"split {bad[0]!r} is {what} and is never used for training; pick another split"
        )


__all__ = ["HIDDEN_SPLITS", "HiddenSetError", "assert_trainable_splits"]
