"""The sizes and pretraining settings of the tiny local model, as config sections (declared with the
run config in :mod:`mentorrl.config.model`, re-exported here for the model builders)."""

from __future__ import annotations

from mentorrl.config.model import CORPUS_VERSIONS, ModelSpec, PretrainSpec

__all__ = ["CORPUS_VERSIONS", "ModelSpec", "PretrainSpec"]
