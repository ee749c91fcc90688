"""Generation backends under the rollout engine, and the choice of one (:class:`BackendChoice`).

- :class:`~mentorrl.rollout.backends.base.GenerationBackend`: token ids in, sampled ids and their
  log-probs (at the contract's temperature) out; ``set_weights(version, state_dict)``, ``close()``.
- ``hf`` (:class:`~mentorrl.rollout.backends.hf.HFBackend`, the default): the project's engine.
- ``vllm`` (:class:`~mentorrl.rollout.backends.vllm.VLLMBackend`): a vLLM engine in this process.
- a user's: ``register_rollout_backend(name, kind)`` with a :class:`BackendKind` (how a choice builds it for a
  model), in the registry ``rollout.backend`` is checked against (:data:`mentorrl.config.names.ROLLOUT_BACKENDS`).

A run's ``rollout:`` config section picks one: :class:`BackendChoice` is built from it (by
:class:`mentorrl.rollout.api.Rollout`, which the workspace builds once) and owns the vLLM engine,
built on first use. The engine follows the policy: :meth:`BackendChoice.sync` pushes the model's
weights whenever they changed since the last push (tracked by the parameters' in-place version
counters, so every optimizer step and ``load_state_dict`` is seen, in every stage), and learner
stages call it right after their updates. Nothing here is process-wide: two choices built from
two configs decode with their own settings and their own engines.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

from mentorrl.config import names as config_names  # the registry lives in the schema layer
from mentorrl.contract import RolloutContract
from mentorrl.rollout.backends.base import (
    Generation,
    GenerationBackend,
    backend_of,
    drive_episodes,
    put_unless_stopped,
    stream_episodes,
    turn_seed,
)
from mentorrl.rollout.dispatch import INLINE_TOOL_S

__all__ = [
    "BackendChoice",
    "BackendKind",
    "SharedEngineKind",
    "register_rollout_backend",
    "Generation",
    "GenerationBackend",
    "backend_name",
    "backend_of",
    "decoder_name",
    "drive_episodes",
    "inline_tool_s",
    "put_unless_stopped",
    "stream_episodes",
    "turn_seed",
]


def backend_name(cfg: Any) -> str:
    """The backend a ``rollout:`` section (:class:`mentorrl.config.RolloutConfig`, or None) names (hf, vllm or a
    registered one)."""
    return getattr(cfg, "backend", "hf") or "hf"


def decoder_name(cfg: Any) -> str:
    """The hf backend's decoder (``rollout.decoder``: auto, slots or hf)."""
    return getattr(cfg, "decoder", "auto") or "auto"


def inline_tool_s(cfg: Any) -> float:
    """The hf engine's inline threshold for tool calls and verifications, in seconds (``rollout.inline_tool_ms``)."""
    ms = getattr(cfg, "inline_tool_ms", None)
    return INLINE_TOOL_S if ms is None else float(ms) / 1000.0


class PlacedCopies:
    """Per policy model, a frozen copy on another device / in another dtype (e.g. a bfloat16 rollout of
    an fp32 learner, or the rollout on another GPU), refreshed from the policy whenever its parameters
    changed in place (an optimizer step, a checkpoint load), as the vLLM engine follows it."""

    def __init__(self):
        self._copies: "weakref.WeakKeyDictionary[Any, tuple[Any, Any, tuple]]" = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    @staticmethod
    def _key(model) -> tuple:
        return tuple(p._version for p in model.parameters())

    def get(self, model, placement) -> Any:
        """The copy of ``model`` on ``placement`` (``.device``, ``.dtype``) with its current weights."""
        import torch

        with self._lock:
            held = self._copies.get(model)
            key = self._key(model)
            if held is None or held[1] != placement:
                copy = _detached_copy(model).to(device=placement.device, dtype=placement.dtype).eval()
                self._copies[model] = (copy, placement, key)
                return copy
            copy, _, seen = held
            if seen != key:
                with torch.no_grad():
                    for dst, src in zip(copy.parameters(), model.parameters()):
                        dst.copy_(src)  # casts and moves
                self._copies[model] = (copy, placement, key)
            return copy


def _detached_copy(model):
    """A deep copy of ``model`` without gradients, frozen."""
    import copy

    grads = [p.grad for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    try:
        out = copy.deepcopy(model)
    finally:
        for p, g in zip(model.parameters(), grads):
            p.grad = g
    for p in out.parameters():
        p.requires_grad_(False)
    return out


class BackendKind:
    """A registered rollout backend: how a :class:`BackendChoice` builds it for a model (:meth:`build`).
    ``streams_in_process``: the backend is the project's engine over a model in this process, which streaming
    rollouts (SAO's worker, Ray actors) drive directly (:meth:`BackendChoice.rollout_engine`); otherwise they go
    through :meth:`BackendChoice.for_model` round by round."""

    streams_in_process: bool = False

    def build(self, choice: "BackendChoice", model, contract: RolloutContract, version: int | None):
        raise NotImplementedError


class EngineKind(BackendKind):
    """``hf``: the project's engine (:class:`~mentorrl.rollout.backends.hf.HFBackend`), a fresh one per call over
    the choice's placed model."""

    streams_in_process = True

    def build(self, choice, model, contract, version):
        from mentorrl.rollout.backends.hf import HFBackend

        return HFBackend(choice.placed(model), contract, **choice.engine_settings)


class SharedEngineKind(BackendKind):
    """A backend holding one engine per choice (``vllm``): ``make(model, contract, rollout_config)`` builds it on
    first use; it is rebuilt when it is not ``compatible`` with a later model or contract, and follows the model's
    weights (``follow(model, version)``)."""

    def __init__(self, make):
        self.make = make

    def build(self, choice, model, contract, version):
        return choice.shared_engine(self.make, model, contract, version)


def _vllm_engine(model, contract, config):
    from mentorrl.rollout.backends.vllm import VLLMBackend

    return VLLMBackend(model, contract, config)


def register_rollout_backend(name: str, kind: BackendKind, replace: bool = False) -> BackendKind:
    """Make ``rollout.backend: name`` decode with ``kind`` (a taken name is an error unless ``replace``)."""
    return config_names.ROLLOUT_BACKENDS.register(name, kind, replace=replace)


register_rollout_backend("hf", EngineKind())
register_rollout_backend("vllm", SharedEngineKind(_vllm_engine))


class BackendChoice:
    """The generation backend a ``rollout:`` section picks (``config``: a
    :class:`mentorrl.config.RolloutConfig`, or None for the hf defaults), and the vLLM engine it
    owns once one was asked for. :meth:`close` frees that engine."""

    def __init__(self, config: Any = None, placement: Any = None):
        """``placement``: the hf backend's device and dtype (a :class:`mentorrl.models.device.Placement`,
        resolved from ``rollout.device`` / ``rollout.dtype``); None decodes the model where it is."""
        self.config = config
        self.placement = placement
        self._engine: Any = None  # this choice's vLLM backend, built on first use
        self._lock = threading.Lock()
        self._copies = PlacedCopies()

    @property
    def name(self) -> str:
        return backend_name(self.config)

    @property
    def kind(self) -> BackendKind:
        return config_names.ROLLOUT_BACKENDS.get(self.name)

    @property
    def streams_in_process(self) -> bool:
        """Whether streaming rollouts drive the project's engine here (:attr:`BackendKind.streams_in_process`)."""
        return self.kind.streams_in_process

    @property
    def decoder(self) -> str:
        return decoder_name(self.config)

    @property
    def inline_tool_s(self) -> float:
        return inline_tool_s(self.config)

    @property
    def tool_sync(self) -> str:
        return getattr(self.config, "tool_sync", None) or "next_step"

    @property
    def engine_settings(self) -> dict[str, Any]:
        """The project's engine settings this choice names (decoder, inline tool threshold, tool sync), as
        :class:`~mentorrl.rollout.engine.RolloutEngine` and :class:`HFBackend` take them."""
        return {"decoder": self.decoder, "inline_tool_s": self.inline_tool_s, "tool_sync": self.tool_sync}

    @property
    def engine(self) -> Any:
        """The vLLM engine built so far (None: none yet, or the hf backend)."""
        return self._engine

    def rollout_engine(self, model, contract: RolloutContract):
        """The project's engine (:class:`~mentorrl.rollout.engine.RolloutEngine`) over ``model`` with
        this choice's decoder and tool threshold (hf; for streaming rollouts)."""
        from mentorrl.rollout.engine import RolloutEngine

        return RolloutEngine(self.placed(model), contract, **self.engine_settings)

    def stream(
        self,
        model,
        contract: RolloutContract,
        next_episode: Callable[[], Any],
        on_finish: Callable[[Any], None],
        *,
        sync: Callable[[], bool],
        slots: int,
        seed: int,
        stop: threading.Event,
        backend: GenerationBackend | None = None,
        before_round: Callable[[], Any] | None = None,
    ) -> None:
        """Streaming rollouts, the one loop of SAO's worker thread and a Ray actor's stream: episodes from
        ``next_episode`` (until it returns None or ``stop`` is set) decoded with continuous batching, each
        finished one handed to ``on_finish``. A backend that :attr:`streams_in_process` runs the project's
        engine over ``model`` (``sync`` before every forward pass: new weights, True to recompute the live
        rows' KV cache); any other decodes round by round through ``backend`` (``before_round`` first)."""
        common = {"slots": slots, "seed": seed, "on_finish": on_finish, "stop": stop, "close_envs": True}
        if self.streams_in_process:
            self.rollout_engine(model, contract).run_stream(next_episode, before_step=sync, **common)
        else:
            stream_episodes(backend, next_episode, before_round=before_round, **common)

    def placed(self, model):
        """The model the hf backend decodes for ``model``: itself when it already sits on this choice's
        device in its dtype (or no placement was asked for), else a copy there with ``model``'s current
        weights (:class:`PlacedCopies`)."""
        if self.placement is None or self.placement.matches(model):
            return model
        return self._copies.get(model, self.placement)

    def for_model(self, model, contract: RolloutContract, version: int | None = None) -> GenerationBackend:
        """The backend that decodes ``model``'s rollouts under ``contract``, as the registered kind of
        ``rollout.backend`` builds it: a fresh :class:`HFBackend` over the model itself, or this choice's vLLM
        engine with ``model``'s current weights."""
        return self.kind.build(self, model, contract, version)

    def shared_engine(self, make, model, contract: RolloutContract, version: int | None) -> GenerationBackend:
        """This choice's one engine (:class:`SharedEngineKind`), built by ``make`` on first use or when the
        held one is not compatible with ``model`` / ``contract``, given ``model``'s current weights."""
        with self._lock:
            if self._engine is not None and not self._engine.compatible(model, contract):
                self._release()
            if self._engine is None:
                self._engine = make(model, contract, self.config)
            engine = self._engine
        engine.contract = contract  # the eval contract may differ from the training one in temperature only
        engine.follow(model, version)
        return engine

    def sync(self, model, version: int) -> None:
        """After a learner update: push ``model``'s weights (policy ``version``) to this choice's
        engine if it has one and they changed (a no-op for the hf backend, which decodes the model itself)."""
        engine = self._engine
        if engine is not None:
            engine.follow(model, version)

    def _release(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()

    def close(self) -> None:
        """Close this choice's vLLM engine, if any (a later rollout builds a new one)."""
        with self._lock:
            self._release()

    def __repr__(self) -> str:
        return f"BackendChoice({self.name}, decoder={self.decoder}, inline_tool_s={self.inline_tool_s:g})"
