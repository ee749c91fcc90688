"""The run's rollout, as one explicit object: :class:`Rollout`.

A :class:`Rollout` holds everything a rollout depends on besides the model and the tasks: the
rollout contract, the environment factory, the reward weights and the generation backend chosen
by the ``rollout:`` config section (:class:`~mentorrl.rollout.backends.BackendChoice`, which owns
a vLLM engine once one is built). The workspace builds one (``ws.rollout``) and every stage, the
evaluation and the tools get it passed; nothing a rollout reads lives in a module global.

:class:`RolloutSpec` is its picklable part (no engine): what a Ray rollout actor gets to build
its own :class:`Rollout` (:mod:`mentorrl.distributed.ray_workers`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from mentorrl.contract import RolloutContract
from mentorrl.envs.base import Task
from mentorrl.rewards.compose import RewardWeights
from mentorrl.rollout.backends import BackendChoice
from mentorrl.rollout.episode import Episode
from mentorrl.rollout.runner import expert_demonstrations, rollout_tasks
from mentorrl.trajectory import Trajectory


@dataclass(frozen=True)
class RolloutSpec:
    """The picklable parts of a :class:`Rollout`: contract, environment factory (a picklable
    callable, e.g. :func:`mentorrl.envs.env_factory`), reward weights and the ``rollout:`` section."""

    contract: RolloutContract
    make_env: Callable[[], Any]
    weights: RewardWeights | None = None
    config: Any = None  # a mentorrl.config.RolloutConfig, or None for the hf defaults
    placement: Any = None  # the hf backend's device and dtype (mentorrl.models.device.Placement), or None

    def build(self) -> "Rollout":
        """A :class:`Rollout` with a backend choice of its own (its own vLLM engine, if any)."""
        return Rollout(self.contract, self.make_env, self.weights, BackendChoice(self.config, self.placement))


@dataclass(frozen=True)
class Rollout:
    """How this run rolls a model out on tasks. :meth:`with_contract` gives the same rollout under
    another contract (e.g. the evaluation temperature) sharing the backend and its engine;
    :meth:`close` frees the engine (a later rollout would build a new one)."""

    contract: RolloutContract
    make_env: Callable[[], Any]
    weights: RewardWeights | None = None
    backend: BackendChoice = field(default_factory=BackendChoice)

    def run(
        self,
        model,
        tasks: Sequence[Task],
        *,
        policy_version: int = 0,
        seed: int = 0,
        batch_size: int | None = None,
        token_budgets: Sequence[int | None] | None = None,
        on_batch: Callable[[int], None] | None = None,
    ) -> list[Trajectory]:
        """Trajectories in task order (:func:`~mentorrl.rollout.runner.rollout_tasks`), decoded by this
        rollout's backend brought to ``model``'s weights. ``batch_size``: how many decode together
        (None: all of ``tasks`` at once); ``token_budgets``: one cap per task on its tokens after
        the prompt; ``on_batch(n)`` after each batch of ``n``."""
        engine = self.backend.for_model(model, self.contract, policy_version)
        return rollout_tasks(
            model,
            self.contract,
            self.make_env,
            tasks,
            policy_version=policy_version,
            seed=seed,
            batch_size=max(len(tasks), 1) if batch_size is None else batch_size,
            weights=self.weights,
            on_batch=on_batch,
            token_budgets=token_budgets,
            backend=engine,
        )

    def stream(
        self,
        model,
        tasks: Sequence[Task],
        *,
        seed: int = 0,
        slots: int | None = None,
        indices: Sequence[int] | None = None,
        on_batch: Callable[[int], None] | None = None,
    ) -> list[Trajectory]:
        """Trajectories in task order, decoded with continuous batching: up to ``slots`` episodes in flight
        (None: all of ``tasks``), and a finished episode's row taken by the next task at once, so no
        batch waits for its longest episode (evaluations: about half the decoder passes of :meth:`run`).
        Task ``i`` samples from a generator seeded by ``(seed, indices[i])`` (default ``i``): its place in
        the whole set, so a share of it rolled out elsewhere (another rank) draws the same. ``on_batch(1)``
        after each finished episode. A backend that does not stream in process (vLLM) decodes in batches
        of ``slots`` (:meth:`run`, seeded by batch: ``indices`` are not honoured there)."""
        slots = max(len(tasks), 1) if slots is None else slots
        if not self.backend.streams_in_process:
            return self.run(model, tasks, seed=seed, batch_size=slots, on_batch=on_batch)
        order = iter(zip(tasks, range(len(tasks)) if indices is None else indices))

        def next_episode() -> Episode | None:
            nxt = next(order, None)
            if nxt is None:
                return None
            return Episode(self.contract, self.make_env(), nxt[0], weights=self.weights, seed_index=int(nxt[1]))

        engine = self.backend.rollout_engine(model, self.contract)
        done = None if on_batch is None else (lambda _traj: on_batch(1))
        return engine.run_stream(next_episode, slots=slots, seed=seed, on_finish=done, close_envs=True)

    def demonstrations(self, expert: Any, tasks: Sequence[Task]) -> list[Trajectory]:
        """The scripted ``expert``'s verified demonstrations on ``tasks`` (the ones it fails are left out)."""
        return expert_demonstrations(self.contract, self.make_env, expert, tasks, weights=self.weights)

    def sync(self, model, version: int) -> None:
        """After a learner update: the backend's engine (vLLM) gets ``model``'s weights as ``version``."""
        self.backend.sync(model, version)

    def with_contract(self, contract: RolloutContract) -> "Rollout":
        """This rollout under ``contract`` (the same environment, weights and backend)."""
        return self if contract is self.contract else replace(self, contract=contract)

    def with_temperature(self, temperature: float | None) -> "Rollout":
        """This rollout sampling at ``temperature`` (None: unchanged)."""
        if temperature is None:
            return self
        return self.with_contract(
            replace(self.contract, sampling=self.contract.sampling.model_copy(update={"temperature": temperature}))
        )

    def spec(self) -> RolloutSpec:
        """The picklable parts (for a rollout actor in another process)."""
        return RolloutSpec(self.contract, self.make_env, self.weights, self.backend.config, self.backend.placement)

    def close(self) -> None:
        self.backend.close()
