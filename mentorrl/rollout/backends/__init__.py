"""Generation backends under the rollout engine, and which one this process uses.

- :class:`~mentorrl.rollout.backends.base.GenerationBackend`: token ids in, sampled ids and their
  log-probs (at the contract's temperature) out; ``set_weights(version, state_dict)``, ``close()``.
- ``hf`` (:class:`~mentorrl.rollout.backends.hf.HFBackend`, the default): the project's engine.
- ``vllm`` (:class:`~mentorrl.rollout.backends.vllm.VLLMBackend`): a vLLM engine in this process.

The run's ``rollout:`` config section picks one (:func:`configure`, called when a workspace
opens); :func:`mentorrl.rollout.runner.rollout_tasks` asks :func:`backend_for` for it. A vLLM
engine is built once per process and follows the policy: :func:`sync_weights` pushes the
model's weights whenever they changed since the last push (tracked by the parameters' in-place
version counters, so every optimizer step and ``load_state_dict`` is seen, in every stage), and
learner stages call it right after their updates.
"""

from __future__ import annotations

from typing import Any

from mentorrl.rollout.dispatch import INLINE_TOOL_S
from mentorrl.rollout.backends.base import (Generation, GenerationBackend, backend_of, drive_episodes, stream_episodes,
                                           turn_seed)

__all__ = ["Generation", "GenerationBackend", "backend_for", "backend_name", "backend_of", "configure", "current_config", "decoder_name", "drive_episodes", "inline_tool_s",
           "release", "stream_episodes", "sync_weights", "turn_seed"]

_config: Any = None  # the active RolloutConfig (None: hf)
_engine: Any = None  # the process's vLLM backend, built on first use


def configure(cfg: Any) -> None:
    """Use ``cfg`` (a :class:`mentorrl.config.RolloutConfig`, or None for hf) for this process's rollouts.
    A vLLM engine built under another config is closed."""
    global _config
    if cfg != _config:
        release()
    _config = cfg


def current_config() -> Any:
    return _config


def decoder_name() -> str:
    """The hf backend's decoder (``rollout.decoder``: auto, slots or hf)."""
    return getattr(_config, "decoder", "auto") or "auto"


def inline_tool_s() -> float:
    """The hf engine's inline threshold for tool calls and verifications, in seconds (``rollout.inline_tool_ms``)."""
    ms = getattr(_config, "inline_tool_ms", None)
    return INLINE_TOOL_S if ms is None else float(ms) / 1000.0


def backend_name() -> str:
    return getattr(_config, "backend", "hf") or "hf"


def backend_for(model, contract, version: int | None = None) -> GenerationBackend:
    """The backend that decodes ``model``'s rollouts under ``contract``: a fresh :class:`HFBackend`
    over the model itself, or the process's vLLM engine with ``model``'s current weights."""
    if backend_name() == "hf":
        from mentorrl.rollout.backends.hf import HFBackend

        return HFBackend(model, contract, decoder=decoder_name(), inline_tool_s=inline_tool_s())
    global _engine
    from mentorrl.rollout.backends.vllm import VLLMBackend

    if _engine is not None and not _engine.compatible(model, contract):
        release()
    if _engine is None:
        _engine = VLLMBackend(model, contract, _config)
    _engine.contract = contract  # the eval contract may differ from the training one in temperature only
    _engine.follow(model, version)
    return _engine


def sync_weights(model, version: int) -> None:
    """After a learner update: push ``model``'s weights (policy ``version``) to the process's
    engine if it has one and they changed (a no-op for the hf backend, which decodes the model itself)."""
    if _engine is not None:
        _engine.follow(model, version)


def release() -> None:
    """Close the process's vLLM engine, if any."""
    global _engine
    if _engine is not None:
        _engine.close()
        _engine = None
