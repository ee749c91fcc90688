"""Asynchronous actor/learner on one machine: a rollout worker thread keeps trajectories coming
while the learner trains, with versioned weight syncs and a staleness rule.

Data flow::

    task stream -> RolloutWorker (own copy of the policy, or the rollout's vLLM engine;
                   continuous batching, heavy-tailed tools)
                -> queue of finished trajectories, each tagged with the policy version that started it
                -> learner: staleness rule (drop / down-weight), critic advantages, masked-IS update
                -> every ``sync_every`` learner steps: WeightBox.publish(version + 1)
                -> the worker loads the new weights before its next forward pass and re-prefills
                   its live rows, so every token's recorded log-prob is the one its sampler used.

The worker runs in a thread: torch releases the GIL inside its kernels, tool calls sleep in
the engine's own thread pool, and the queue gives back-pressure (the worker blocks when the
learner falls ``queue_size`` trajectories behind).
"""

from __future__ import annotations

import copy
import queue
import threading
from collections import Counter
from typing import Iterator, Sequence

import torch

from mentorrl.rollout.api import Rollout
from mentorrl.rollout.backends import stream_episodes
from mentorrl.rollout.episode import Episode
from mentorrl.trajectory import Trajectory


# ------------------------------------------------------------------ staleness ----
def staleness_weights(lags: Sequence[int], max_staleness: int, mode: str, decay: float = 0.5) -> list[float]:
    """Per-trajectory weights from policy lag (learner version - behaviour version).

    A lag up to ``max_staleness`` weighs 1. Beyond it, ``mode="drop"`` gives 0 (the caller drops
    the trajectory) and ``mode="downweight"`` gives ``decay ** (lag - max_staleness)``.
    """
    if mode not in ("drop", "downweight"):
        raise ValueError(f"unknown staleness mode {mode!r}; expected 'drop' or 'downweight'")
    out = []
    for lag in lags:
        if lag < 0:
            raise ValueError(f"policy lag {lag} < 0: a trajectory from a future policy version")
        over = lag - max_staleness
        out.append(1.0 if over <= 0 else (0.0 if mode == "drop" else decay**over))
    return out


def lag_histogram(lags: Sequence[int]) -> dict[str, int]:
    """``{"0": n0, "1": n1, ...}``: how many trajectories lagged by each number of versions."""
    return {str(k): v for k, v in sorted(Counter(int(x) for x in lags).items())}


# ------------------------------------------------------------------ weight sync ----
class WeightBox:
    """The learner's latest published weights and their version (thread-safe).

    ``publish`` stores a CPU copy, so the learner can keep training while a worker loads it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._version = -1
        self._state: dict[str, torch.Tensor] | None = None

    def publish(self, model: torch.nn.Module, version: int) -> None:
        state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        with self._lock:
            if version < self._version:
                raise ValueError(f"policy version went back from {self._version} to {version}")
            self._version, self._state = version, state

    @property
    def version(self) -> int:
        with self._lock:
            return self._version

    def newer_than(self, version: int) -> tuple[int, dict[str, torch.Tensor]] | None:
        with self._lock:
            if self._state is None or self._version <= version:
                return None
            return self._version, self._state


# ------------------------------------------------------------------ workers ----
class RolloutWorker(threading.Thread):
    """One rollout thread: produces trajectories into ``out`` until ``stop_event`` is set; its
    policy follows ``box``.

    ``tasks`` is an iterator of tasks (the worker ends when it runs dry); ``rollout`` (a
    :class:`~mentorrl.rollout.Rollout`) gives the contract, the environments (one per episode,
    closed when it ends), the reward weights and the backend. A failure is kept in ``error``.

    It decodes with the rollout's generation backend (``rollout.backend``): under ``hf``, its own
    copy of the policy in the project's engine (token-level continuous batching; new weights are
    loaded before the next forward pass); under ``vllm``, the rollout's vLLM engine through the
    narrow interface (:func:`~mentorrl.rollout.backends.base.stream_episodes`:
    turn-level continuous batching; new weights are loaded before the next round, so each turn is
    sampled under one policy and every turn after a sync is prefilled again under the new weights,
    since a weight load resets the prefix cache). The engine is shared with the learner's
    evaluations; each caller decodes with its own weights (see :class:`VLLMBackend`).
    """

    def __init__(
        self,
        policy,
        rollout: Rollout,
        tasks: Iterator,
        box: WeightBox,
        slots: int,
        out: queue.Queue,
        stop_event: threading.Event,
        seed: int,
        recompute_kv: bool = False,
        name: str = "rollout-worker",
    ):
        super().__init__(name=name, daemon=True)
        self.rollout, self.contract, self.tasks, self.box = rollout, rollout.contract, tasks, box
        self.slots, self.seed, self.recompute_kv = slots, seed, recompute_kv
        self.out, self.stop_event = out, stop_event
        self.version = -1
        self.error: BaseException | None = None
        self.produced = 0
        self.syncs = 0
        self._state: dict[str, torch.Tensor] | None = None
        self._loaded = -1  # the version this thread last gave the shared backend
        if rollout.backend.streams_in_process:
            self.model = copy.deepcopy(policy).eval()
            for p in self.model.parameters():
                p.requires_grad_(False)
            self.engine = rollout.backend.rollout_engine(self.model, self.contract)
            self.backend = None
        else:
            self.model, self.engine = None, None
            self.backend = rollout.backend.for_model(policy, self.contract)  # built here, in the learner's thread
        self._sync()  # start from the published weights

    def _sync(self) -> bool:
        """Take newer published weights, if any; True asks the hf engine to recompute the live rows' KV cache.

        Without ``recompute_kv`` the live rows keep the keys and values the old weights computed;
        the log-probs recorded for their next tokens are still exactly what the sampler used."""
        newer = self.box.newer_than(self.version)
        if newer is None:
            return False
        self.version, self._state = newer
        self.syncs += 1
        if self.model is not None:
            self.model.load_state_dict(self._state)
        return self.recompute_kv

    def _sync_backend(self) -> None:
        """Before a round on the shared backend: newer weights, given to it from this thread."""
        self._sync()
        if self._loaded != self.version and self._state is not None:
            self.backend.set_weights(self.version, self._state)
            self._loaded = self.version

    def _next_episode(self) -> Episode | None:
        task = next(self.tasks, None)
        if task is None:
            return None
        return Episode(
            self.contract, self.rollout.make_env(), task, policy_version=self.version, weights=self.rollout.weights
        )

    def _emit(self, traj: Trajectory) -> None:
        while not self.stop_event.is_set():
            try:
                self.out.put(traj, timeout=0.1)
                self.produced += 1
                return
            except queue.Full:
                continue

    def run(self) -> None:
        try:
            if self.backend is None:
                self.engine.run_stream(
                    self._next_episode,
                    slots=self.slots,
                    seed=self.seed,
                    on_finish=self._emit,
                    before_step=self._sync,
                    stop=self.stop_event,
                    close_envs=True,
                )
            else:
                stream_episodes(
                    self.backend,
                    self._next_episode,
                    slots=self.slots,
                    seed=self.seed,
                    on_finish=self._emit,
                    before_round=self._sync_backend,
                    stop=self.stop_event,
                    close_envs=True,
                )
        except BaseException as e:  # noqa: BLE001 -- handed to the learner, which raises it
            self.error = e


def _locked(source: Iterator, lock: threading.Lock) -> Iterator:
    """A per-worker view of one shared task iterator (generators are not thread-safe)."""
    while True:
        with lock:
            item = next(source, None)
        if item is None:
            return
        yield item


class RolloutPool:
    """``workers`` rollout threads, ``slots`` episodes in flight each, sharing one task stream
    and one bounded queue of finished trajectories (the back-pressure on all of them); each rolls
    out with ``rollout`` (:class:`~mentorrl.rollout.Rollout`)."""

    def __init__(
        self,
        policy,
        rollout: Rollout,
        tasks: Iterator,
        box: WeightBox,
        slots: int,
        queue_size: int,
        seed: int,
        recompute_kv: bool = False,
        workers: int = 1,
    ):
        if workers < 1:
            raise ValueError("workers must be >= 1")
        self.out: queue.Queue[Trajectory] = queue.Queue(maxsize=queue_size)
        self.stop_event = threading.Event()
        lock = threading.Lock()
        self.workers = [
            RolloutWorker(
                policy,
                rollout,
                _locked(tasks, lock),
                box,
                slots,
                self.out,
                self.stop_event,
                seed=seed + 1_000_033 * i,
                recompute_kv=recompute_kv,
                name=f"rollout-worker-{i}",
            )
            for i in range(workers)
        ]

    def start(self) -> None:
        for w in self.workers:
            w.start()

    @property
    def produced(self) -> int:
        return sum(w.produced for w in self.workers)

    @property
    def syncs(self) -> int:
        return sum(w.syncs for w in self.workers)

    def is_alive(self) -> bool:
        return any(w.is_alive() for w in self.workers)

    def get(self, n: int, timeout_s: float) -> list[Trajectory]:
        """The next ``n`` finished trajectories, in finishing order; raises if a worker failed or all stalled."""
        got: list[Trajectory] = []
        waited = 0.0
        while len(got) < n:
            try:
                got.append(self.out.get(timeout=0.2))
                waited = 0.0
            except queue.Empty:
                waited += 0.2
                failed = next((w.error for w in self.workers if w.error is not None), None)
                if failed is not None:
                    raise RuntimeError(f"rollout worker failed: {failed!r}") from failed
                if not self.is_alive():
                    raise RuntimeError("rollout workers stopped: their task stream ran dry")
                if waited >= timeout_s:
                    raise TimeoutError(f"no trajectory from the rollout workers in {timeout_s:.0f}s")
        return got

    def close(self) -> None:
        self.stop_event.set()
        for w in self.workers:
            w.join(timeout=60)
