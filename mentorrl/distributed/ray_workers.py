"""Ray rollout workers (``distributed: {backend: ray, rollout_workers: N, env_workers: M, address: ...}``).

What runs where::

    driver (the learner's process)          Ray actors (any node of the cluster)
    ------------------------------          ------------------------------------
    config, learner, optimiser,             RolloutActor x N: a copy of the policy, its own Rollout
    checkpoints, replay buffer, metrics       (built from the driver's RolloutSpec), and the
      |  ray.put(weights) once per update      environments, unless env_workers > 0:
      |  -> one object, every actor reads   EnvActor x M: the environments (reset / step / verify /
      |     it (a versioned broadcast)        close over Ray calls), shared round-robin by the workers
      '<- one object per worker per step (a batch of trajectories, never one object each)

- **What an actor gets**: everything explicitly, never a global or the workspace: the policy spec
  (:func:`policy_spec`) and the run rollout's picklable parts (:class:`~mentorrl.rollout.RolloutSpec`:
  contract, environment factory -- :func:`mentorrl.envs.env_factory`, the one the workspace uses --,
  reward weights, ``rollout:`` section); each actor builds its own :class:`~mentorrl.rollout.Rollout`.
- **GRPO** (:class:`RayRollouts`, owned by the workspace: ``ws.ray_rollouts(model)``, called from
  ``train/stage_helpers.py:rollout_shared``): a step's task list
  is split into contiguous shares, one per worker, exactly as the data-parallel learner splits it
  (:func:`shares`); worker ``i`` rolls its share out with ``seed + offset`` of the share, so the
  trajectories are a pure function of (weights, task list, seed, number of workers). With one
  worker they are the single-process run's; with N they are a 2-rank torchrun's.
- **SAO** (:class:`RayRolloutPool`, the :class:`~mentorrl.train.async_rl.RolloutPool` interface):
  each actor streams episodes (continuous batching) from tasks the driver hands out, into a bounded
  outbox (back-pressure) that the driver drains in batches; each trajectory carries the policy
  version that started it, so SAO's staleness rule works across processes unchanged.
- **Weights**: the driver puts the policy's ``state_dict`` into the object store once per new
  version (:class:`WeightBroadcast`); each actor loads it before its next rollout (GRPO) or its
  next forward pass (SAO), and tags its trajectories with that version.
- **Faults**: a rollout actor that dies mid-step (killed, OOM, node lost) is replaced by a fresh
  one that loads the current weights and re-runs the dead actor's share with the same seed, so no
  trajectory is lost or duplicated; under SAO the tasks it held are handed to its replacement. An
  unreachable actor is killed before it is replaced (its CPU freed, nothing more collected from it).
  A dead environment actor is replaced and the share that needed it is re-run. After
  ``distributed.actor_restarts`` replacements in one step the step fails. Under SAO, an actor that
  is still starting (a new process: imports, policy copy) does not count against the "no trajectory"
  timeout, and the driver keeps collecting from the others meanwhile (``ACTOR_START_TIMEOUT_S``).

Actors are reused: a closed pool's rollout actors stay idle (holding their CPU) and the next pool
of this process reconfigures them instead of starting processes (:func:`kill_idle_actors` ends them;
at exit Ray does). The SAO stage first closes the workspace's GRPO actors, so ``recipe: [grpo, sao]``
fits a small cluster.

Threads: each actor runs torch with one intra-op thread (``OMP_NUM_THREADS=1``,
``OMP_WAIT_POLICY=PASSIVE`` in its runtime environment). ``address: null`` starts a local Ray
(``ray.init``) unless one is already initialised in this process; ``address: auto`` (or
``ray://...``/``host:port``) joins an existing cluster, whose nodes must have mentorrl installed.
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import itertools
import os
import queue
import threading
import time
from types import MappingProxyType
from typing import Any, Callable, Iterator, Sequence

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from mentorrl.config import ConfigError, DistributedConfig
from mentorrl.rollout import Rollout, RolloutSpec
from mentorrl.rollout.backends import put_unless_stopped
from mentorrl.rollout.episode import Episode
from mentorrl.trajectory import Trajectory

ACTOR_ENV = MappingProxyType(
    {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
)
ROLLOUT_ACTOR_CPUS = 1.0  # a rollout actor decodes with one torch thread
ACTOR_START_TIMEOUT_S = 900.0  # a new actor (process, imports, policy copy) may take this long on a busy node
ENV_PING_TIMEOUT_S = 120.0  # an environment actor that does not answer a ping this long is replaced
ENV_ACTOR_CONCURRENCY = 64  # environment calls served at once by one environment actor (each env is used serially)


# ------------------------------------------------------------------ plumbing ----
def init_ray(dist: DistributedConfig) -> None:
    """Start (``address: null``) or join (``address: auto`` / an address) Ray, once per process."""
    if ray.is_initialized():
        return
    if dist.address is None:
        ray.init(
            num_cpus=max(os.cpu_count() or 1, dist.rollout_workers), include_dashboard=False, logging_level="warning"
        )
    else:
        ray.init(address=dist.address, logging_level="warning")


def _require_cpus(workers: int) -> None:
    have = ray.cluster_resources().get("CPU", 0.0)
    if have < workers * ROLLOUT_ACTOR_CPUS:
        raise ConfigError(
            f"distributed.rollout_workers: {workers} rollout actors need {workers * ROLLOUT_ACTOR_CPUS:g} "
            f"CPUs, the Ray cluster has {have:g}"
        )


def shares(n: int, workers: int) -> list[range]:
    """Contiguous shares of ``n`` items over ``workers`` (sizes differ by at most one; a share may be empty);
    the same split as the data-parallel learner's ranks (``DataParallel.shard``)."""
    return [range(i * n // workers, (i + 1) * n // workers) for i in range(workers)]


def weights_payload(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A CPU copy of the model's ``state_dict`` (what goes into the object store)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def policy_spec(model: torch.nn.Module) -> Any:
    """What an actor needs to build its copy of the policy: ``(class, HF config, dtype)`` when the
    class built from the config has exactly the model's parameters and buffers (an empty skeleton,
    filled by the first weight broadcast), else a CPU copy of the module itself."""
    cls, config, dtype = type(model), getattr(model, "config", None), next(model.parameters()).dtype
    if config is not None:
        try:
            with torch.device("meta"):
                skeleton = cls(config)
            if set(skeleton.state_dict()) == set(model.state_dict()):
                return cls, config, dtype
        except Exception:  # noqa: BLE001 -- not constructible from its config: ship the module
            pass
    return copy.deepcopy(model).to("cpu")


def _build_policy(spec: Any) -> torch.nn.Module:
    if isinstance(spec, torch.nn.Module):
        model = spec
    else:
        cls, config, dtype = spec
        model = cls(config).to(dtype)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


# ------------------------------------------------------------------ environment actors ----
@ray.remote(num_cpus=0, max_concurrency=ENV_ACTOR_CONCURRENCY)
class EnvActor:
    """Hosts environments for the rollout actors; every call is ``(env id, method, args)``."""

    def __init__(self, make_env: Callable[[], Any]):
        torch.set_num_threads(1)
        self.make_env = make_env
        self.envs: dict[int, Any] = {}
        self.ids = itertools.count(1)
        self.lock = threading.Lock()

    def open(self) -> int:
        env = self.make_env()
        with self.lock:
            i = next(self.ids)
            self.envs[i] = env
        return i

    def call(self, env_id: int, method: str, *args: Any) -> Any:
        return getattr(self.envs[env_id], method)(*args)

    def close_env(self, env_id: int) -> None:
        with self.lock:
            env = self.envs.pop(env_id, None)
        if env is not None:
            env.close()

    def ping(self) -> int:
        return len(self.envs)


class RemoteEnv:
    """The :class:`~mentorrl.envs.base.Environment` protocol over an environment hosted by an :class:`EnvActor`."""

    def __init__(self, actor):
        self.actor = actor
        self.env_id = ray.get(actor.open.remote())

    def _call(self, method: str, *args: Any) -> Any:
        return ray.get(self.actor.call.remote(self.env_id, method, *args))

    def reset(self, task):
        return self._call("reset", task)

    def step(self, name, arguments):
        return self._call("step", name, arguments)

    def verify(self, final_answer):
        return self._call("verify", final_answer)

    def close(self) -> None:
        try:
            ray.get(self.actor.close_env.remote(self.env_id))
        except RayActorError:
            pass  # the environment actor is gone, and its environments with it


class RemoteEnvFactory:
    """``make_env`` for a rollout actor: environments opened round-robin on the environment actors."""

    def __init__(self, actors: Sequence[Any]):
        self.actors = list(actors)
        self.count = itertools.count()

    def __call__(self) -> RemoteEnv:
        return RemoteEnv(self.actors[next(self.count) % len(self.actors)])

    def __getstate__(self):
        return {"actors": self.actors}

    def __setstate__(self, state):
        self.actors, self.count = state["actors"], itertools.count()


# ------------------------------------------------------------------ rollout actors ----
@ray.remote(num_cpus=ROLLOUT_ACTOR_CPUS)
class RolloutActor:
    """A policy copy and a :class:`~mentorrl.rollout.Rollout` built from the driver's
    :class:`~mentorrl.rollout.RolloutSpec`. ``rollout`` runs a share of a step (GRPO); ``start_stream`` /
    ``poll`` run continuous batching fed by the driver (SAO). Weights arrive through ``load`` /
    ``set_weights`` as ``(key, version, [object ref])``: the list keeps Ray from fetching the
    weights for a call whose key the actor already holds. A closed pool's actors are kept idle and
    ``configure``-d for the next pool of this process (a new actor costs a process and its imports)."""

    def __init__(self, spec, rollout: RolloutSpec):
        torch.set_num_threads(1)
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.rollout_: Rollout | None = None
        self.configure(spec, rollout)

    def configure(self, spec, rollout: RolloutSpec) -> None:
        """Start afresh for a new pool: stop any stream, a new policy copy (filled by the next weights), and
        a rollout built from ``rollout`` (under ``rollout.backend: vllm``, a vLLM engine in this actor, built on
        first use; the previous pool's engine is kept when the ``rollout:`` section is the same, else closed)."""
        self.stop_stream()
        self.thread = None
        old = self.rollout_
        if old is not None and old.backend.config == rollout.config:
            self.rollout_ = Rollout(rollout.contract, rollout.make_env, rollout.weights, old.backend)
        else:
            if old is not None:
                old.close()
            self.rollout_ = rollout.build()
        self.model = _build_policy(spec)
        self.key: int | None = None
        self.version = -1
        self.loads = 0
        self.pending: tuple[int, int, dict] | None = None

    def ping(self) -> int:
        return os.getpid()

    def set_env_factory(self, make_env: Callable[[], Any]) -> None:
        """The environments are on new environment actors now (same rollout, same backend)."""
        self.rollout_ = dataclasses.replace(self.rollout_, make_env=make_env)

    def _apply(self, key: int, version: int, state: dict) -> None:
        self.model.load_state_dict(state)
        self.key, self.version = key, version
        self.loads += 1

    # ---- GRPO: one share of a step
    def rollout(
        self, key: int, version: int, box: list, tasks: list, seed: int, token_budgets: list | None = None
    ) -> list[Trajectory]:
        if key != self.key:
            self._apply(key, version, ray.get(box[0]))
        return self.rollout_.run(self.model, tasks, policy_version=version, seed=seed, token_budgets=token_budgets)

    # ---- SAO: a stream of episodes
    def set_weights(self, key: int, version: int, box: list) -> None:
        """New weights; a streaming actor loads them before its next forward pass."""
        state = ray.get(box[0])
        if self.thread is None:
            self._apply(key, version, state)
            return
        with self.lock:
            self.pending = (key, version, state)

    def _sync(self) -> bool:
        with self.lock:
            p, self.pending = self.pending, None
        if p is None:
            return False
        self._apply(*p)
        self.syncs += 1
        return self.recompute_kv

    def _next_episode(self) -> Episode | None:
        while not self.stop.is_set():
            try:
                task = self.inbox.get(timeout=0.1)
            except queue.Empty:
                continue
            if task is None:  # the driver's task stream ran dry: finish the live rows and stop
                return None
            r = self.rollout_
            return Episode(r.contract, r.make_env(), task, policy_version=self.version, weights=r.weights)
        return None

    def _emit(self, traj: Trajectory) -> None:
        if put_unless_stopped(self.outbox, traj, self.stop):
            self.produced += 1

    def _stream(self) -> None:
        choice, contract = self.rollout_.backend, self.rollout_.contract
        try:
            # the actor's vLLM engine (not streaming in process): turn-level batching, weights loaded between rounds
            backend = None if choice.streams_in_process else choice.for_model(self.model, contract, self.version)

            def before_round() -> None:
                self._sync()
                backend.follow(self.model, self.version)

            choice.stream(
                self.model,
                contract,
                self._next_episode,
                self._emit,
                sync=self._sync,
                slots=self.slots,
                seed=self.seed,
                stop=self.stop,
                backend=backend,
                before_round=before_round,
            )
        except BaseException as e:  # noqa: BLE001 -- reported to the driver by poll(), which raises it
            self.error = repr(e)

    def start_stream(self, seed: int, slots: int, outbox_size: int, recompute_kv: bool) -> None:
        self.seed, self.slots, self.recompute_kv = seed, slots, recompute_kv
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: queue.Queue = queue.Queue(maxsize=outbox_size)
        self.stop = threading.Event()
        self.error: str | None = None
        self.produced = self.syncs = 0
        self.ended = False
        self.thread = threading.Thread(target=self._stream, name="ray-rollout-stream", daemon=True)
        self.thread.start()

    def poll(self, tasks: list, max_items: int, end: bool = False) -> dict[str, Any]:
        """Take more tasks (``end``: there will be no more); hand back up to ``max_items`` finished
        trajectories (one batch)."""
        for t in tasks:
            self.inbox.put(t)
        if end and not self.ended:
            self.inbox.put(None)
            self.ended = True
        out: list[Trajectory] = []
        while len(out) < max_items:
            try:
                out.append(self.outbox.get_nowait())
            except queue.Empty:
                break
        return {
            "trajs": out,
            "error": self.error,
            "produced": self.produced,
            "syncs": self.syncs,
            "alive": self.thread is not None and self.thread.is_alive(),
        }

    def stop_stream(self) -> None:
        if self.thread is not None:
            self.stop.set()
            self.thread.join(timeout=30)


def kill_actor(actor) -> None:
    """``ray.kill`` an actor that may be gone already (frees its CPU now if it was only unreachable)."""
    if actor is None:
        return
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 -- already gone
        pass


def actor_options() -> dict[str, Any]:
    return {"runtime_env": {"env_vars": dict(ACTOR_ENV)}}


# ------------------------------------------------------------------ actor reuse ----
# Rollout actors released by a closed pool, kept (with their CPU) for this process's next pool:
# starting one costs a process and its imports (torch, transformers: about 6 s of CPU). Keyed by
# the cluster, so a new ray.init never sees a previous cluster's handles.
class IdleActors:
    """The idle rollout actors of this process, and the cluster they live in."""

    def __init__(self) -> None:
        self.cluster: str | None = None
        self.actors: list[Any] = []

    def take(self, cluster: str) -> Any | None:
        """An idle actor of ``cluster`` (no longer idle), or None."""
        if self.cluster == cluster and self.actors:
            return self.actors.pop()
        return None

    def put(self, cluster: str, actor: Any) -> None:
        if self.cluster != cluster:
            self.cluster, self.actors = cluster, []
        self.actors.append(actor)

    def drain(self) -> list[Any]:
        """Every idle actor (no longer idle)."""
        actors, self.actors = self.actors, []
        return actors


_IDLE = IdleActors()


def _cluster() -> str:
    return ray.get_runtime_context().gcs_address


def _acquire_actor(spec, rollout: RolloutSpec):
    """A rollout actor for the policy ``spec`` and ``rollout``: an idle one, reconfigured (the call is
    queued before any other, so nothing waits here), else a new one. An idle actor that died meanwhile
    fails its next call and is replaced like any dead actor."""
    a = _IDLE.take(_cluster())
    if a is not None:
        a.configure.remote(spec, rollout)
        return a
    return RolloutActor.options(**actor_options()).remote(spec, rollout)


def _with_env(spec: RolloutSpec, make_env: Callable[[], Any]) -> RolloutSpec:
    """``spec`` with its environments built by ``make_env`` (e.g. on the environment actors)."""
    return RolloutSpec(spec.contract, make_env, spec.weights, spec.config, spec.placement)


def _release_actor(actor) -> None:
    """Stop the actor's stream (if any) and keep it for the next pool."""
    if actor is None or not ray.is_initialized():
        return
    cluster = _cluster()
    actor.stop_stream.remote()
    _IDLE.put(cluster, actor)


def kill_idle_actors() -> None:
    """Kill the idle rollout actors (their CPUs go back to the cluster); before ``ray.shutdown``."""
    actors = _IDLE.drain()
    if ray.is_initialized():
        for a in actors:
            kill_actor(a)


# ------------------------------------------------------------------ weights ----
class WeightBroadcast:
    """The driver's side of the versioned broadcast: one object-store copy per change of the weights.

    A change is a new policy version or any in-place write to a parameter since the last broadcast
    (torch's per-tensor version counters), so a stage that restarts its version count still broadcasts."""

    def __init__(self) -> None:
        self.key = 0
        self.version = -1
        self.ref = None
        self._seen: tuple | None = None
        self.broadcasts = 0
        self.last_put_s = 0.0

    def current(self, model: torch.nn.Module, version: int) -> tuple[int, int, list]:
        seen = (version, id(model), tuple(p._version for p in model.parameters()))
        if seen != self._seen:
            t0 = time.perf_counter()
            self.ref = ray.put(weights_payload(model))
            self.last_put_s = time.perf_counter() - t0
            self.key += 1
            self.version, self._seen = version, seen
            self.broadcasts += 1
        return self.key, self.version, [self.ref]

    def publish_state(self, state: dict[str, torch.Tensor], version: int) -> tuple[int, int, list]:
        self.ref = ray.put(state)
        self.key += 1
        self.version = version
        self.broadcasts += 1
        return self.key, self.version, [self.ref]


def gather_shares(
    parts: Sequence[tuple[int, range]],
    submit: Callable[[int, range], Any],
    retryable: Callable[[int, BaseException], None],
    replace: Callable[[int, BaseException], None],
    max_restarts: int,
    what: str,
) -> dict[int, Any]:
    """Each share's result, by actor index: ``submit(i, share)`` for every share, then ``ray.get`` them in
    order. A call that fails (the actor died, or raised) goes to ``retryable(i, e)``, which raises to give up;
    past ``max_restarts`` failures in this call the step fails; else ``replace(i, e)`` replaces what failed and
    the share is submitted again."""
    refs = {i: submit(i, p) for i, p in parts}
    out: dict[int, Any] = {}
    restarts = 0
    for i, part in parts:
        while i not in out:
            try:
                out[i] = ray.get(refs[i])
            except (RayActorError, RayTaskError) as e:
                retryable(i, e)
                restarts += 1
                if restarts > max_restarts:
                    raise RuntimeError(
                        f"{what}: more than distributed.actor_restarts={max_restarts} actor failures in one step"
                    ) from e
                replace(i, e)
                refs[i] = submit(i, part)
    return out


# ------------------------------------------------------------------ GRPO: a step's rollouts ----
class RayRollouts:
    """``rollout_workers`` rollout actors (and ``env_workers`` environment actors) that roll out a
    step's task list, one contiguous share per actor, with faults handled (see the module docstring).
    ``rollout``: what each actor rolls out with (the run rollout's :meth:`~mentorrl.rollout.Rollout.spec`)."""

    def __init__(self, dist: DistributedConfig, model: torch.nn.Module, rollout: RolloutSpec):
        init_ray(dist)
        _require_cpus(dist.rollout_workers)
        self.dist, self.model, self.rollout_spec = dist, model, rollout
        self.spec = policy_spec(model)
        self.env_actors = [self._new_env_actor() for _ in range(dist.env_workers)]
        self.actors = [self._new_actor() for _ in range(dist.rollout_workers)]
        self.weights = WeightBroadcast()
        self.replaced = 0
        self.env_replaced = 0
        self.in_flight = threading.Event()  # set while a step's shares are submitted and not all back

    def _worker_env(self) -> Callable[[], Any]:
        return RemoteEnvFactory(self.env_actors) if self.env_actors else self.rollout_spec.make_env

    def _new_env_actor(self):
        return EnvActor.options(**actor_options()).remote(self.rollout_spec.make_env)

    def _new_actor(self):
        return _acquire_actor(self.spec, _with_env(self.rollout_spec, self._worker_env()))

    def _heal_env_actors(self) -> bool:
        """Replace environment actors that no longer answer; True when any was replaced."""
        dead = []
        for i, a in enumerate(self.env_actors):
            try:
                ray.get(a.ping.remote(), timeout=ENV_PING_TIMEOUT_S)
            except (RayActorError, GetTimeoutError):
                dead.append(i)
        for i in dead:
            kill_actor(self.env_actors[i])
            self.env_actors[i] = self._new_env_actor()
            self.env_replaced += 1
        if dead:
            ray.get([a.set_env_factory.remote(self._worker_env()) for a in self.actors])
        return bool(dead)

    def rollout(
        self, tasks: Sequence, policy_version: int, seed: int, token_budgets: Sequence[int | None] | None = None
    ) -> list[Trajectory]:
        """Trajectories in task order; worker ``i`` rolls out share ``i`` with ``seed + share.start``."""
        key, version, box = self.weights.current(self.model, policy_version)
        tasks = list(tasks)

        def submit(i: int, part: range):
            budgets = list(token_budgets[part.start : part.stop]) if token_budgets is not None else None
            return self.actors[i].rollout.remote(
                key, version, box, tasks[part.start : part.stop], seed + part.start, budgets
            )

        def retryable(i: int, e: BaseException) -> None:
            if isinstance(e, RayTaskError):  # raised inside its call: retried only if an environment actor died
                healed = bool(self.env_actors) and self._heal_env_actors()
                if not healed and not (self.env_actors and isinstance(e, RayActorError)):
                    raise e  # an error in mentorrl's own code: re-running would fail the same way

        def replace(i: int, e: BaseException) -> None:
            if not isinstance(e, RayTaskError):  # the rollout actor itself is gone
                kill_actor(self.actors[i])  # dead, or unreachable: then its CPU is freed for the new one
                self.actors[i] = self._new_actor()
                self.replaced += 1

        parts = [(i, p) for i, p in enumerate(shares(len(tasks), len(self.actors))) if len(p)]
        self.in_flight.set()
        try:  # a re-run share has the same seed: the same episodes
            out = gather_shares(parts, submit, retryable, replace, self.dist.actor_restarts, "rollout")
        finally:
            self.in_flight.clear()
        return [t for i, _ in parts for t in out[i]]

    def close(self) -> None:
        """Release the rollout actors for the next pool (:func:`kill_idle_actors` ends them); kill the
        environment actors."""
        for a in self.actors:
            _release_actor(a)
        for a in self.env_actors:
            kill_actor(a)
        self.actors, self.env_actors = [], []


atexit.register(kill_idle_actors)


# ------------------------------------------------------------------ SAO: a stream ----
class _Depth:
    def __init__(self, pool: "RayRolloutPool"):
        self.pool = pool

    def qsize(self) -> int:
        return len(self.pool.spill)


class RayRolloutPool:
    """:class:`~mentorrl.train.async_rl.RolloutPool` on Ray actors: ``distributed.rollout_workers``
    actors stream episodes (``slots`` in flight each) from one task stream the driver deals out,
    each into an outbox of ``queue_size / workers`` finished trajectories (the back-pressure).
    ``box`` is the learner's :class:`~mentorrl.train.async_rl.WeightBox`: each :meth:`get` first
    broadcasts a newer published version. ``workers`` is ignored (``distributed.rollout_workers``
    counts the actors). The actors get ``rollout``'s picklable parts (:meth:`~mentorrl.rollout.Rollout.spec`:
    its environment factory must pickle). A GRPO stage's actors must be closed first on a small
    cluster (the workspace's: ``ws.close_ray_rollouts()``)."""

    def __init__(
        self,
        policy,
        rollout: Rollout,
        tasks: Iterator,
        box,
        slots: int,
        queue_size: int,
        seed: int,
        recompute_kv: bool = False,
        workers: int = 1,
        *,
        dist: DistributedConfig,
    ):
        init_ray(dist)
        _require_cpus(dist.rollout_workers)
        self.dist, self.rollout_spec, self.tasks, self.box = dist, rollout.spec(), tasks, box
        self.slots, self.seed, self.recompute_kv = slots, seed, recompute_kv
        self.spec = policy_spec(policy)
        n = dist.rollout_workers
        self.outbox_size = max(1, queue_size // n)
        self.target = slots + self.outbox_size + 1  # tasks held per actor: never starved before back-pressure
        self.weights = WeightBroadcast()
        self.sent_version = -1
        self.env_actors = [
            EnvActor.options(**actor_options()).remote(self.rollout_spec.make_env) for _ in range(dist.env_workers)
        ]
        self.actors: list[Any] = [None] * n
        self.starting: list[Any] = [None] * n  # the first ping of an actor that has not answered yet
        self.started_at = [0.0] * n
        self.end_sent = [False] * n
        self.given: list[list] = [[] for _ in range(n)]
        self.syncs_of = [0] * n
        self.alive = [True] * n
        self.spill: list[Trajectory] = []
        self.produced = 0
        self.replaced = 0
        self.out = _Depth(self)
        self.dry = False

    @property
    def syncs(self) -> int:
        return sum(self.syncs_of)

    def _start_actor(self, i: int) -> None:
        env = RemoteEnvFactory(self.env_actors) if self.env_actors else self.rollout_spec.make_env
        a = _acquire_actor(self.spec, _with_env(self.rollout_spec, env))
        if self.weights.ref is not None:
            a.set_weights.remote(self.weights.key, self.weights.version, [self.weights.ref])
        a.start_stream.remote(
            self.seed + 1_000_033 * i + 7_919 * self.replaced, self.slots, self.outbox_size, self.recompute_kv
        )
        if self.given[i]:
            a.poll.remote(list(self.given[i]), 0)  # the tasks its predecessor held
        self.actors[i] = a
        self.starting[i], self.started_at[i], self.end_sent[i] = a.ping.remote(), time.monotonic(), False

    def start(self) -> None:
        self._publish()
        for i in range(len(self.actors)):
            self._start_actor(i)

    def _publish(self) -> None:
        newer = self.box.newer_than(self.sent_version)
        if newer is None:
            return
        version, state = newer
        key, version, box = self.weights.publish_state(state, version)
        self.sent_version = version
        for a in self.actors:
            if a is not None:
                a.set_weights.remote(key, version, box)

    def _deal(self, i: int) -> list:
        new = []
        while not self.dry and len(self.given[i]) < self.target:
            t = next(self.tasks, None)
            if t is None:
                self.dry = True
                break
            new.append(t)
            self.given[i].append(t)
        return new

    def _received(self, i: int, trajs: list[Trajectory]) -> None:
        for t in trajs:
            k = next((j for j, task in enumerate(self.given[i]) if task.id == t.task_id), None)
            if k is not None:
                del self.given[i][k]
        self.produced += len(trajs)

    def is_alive(self) -> bool:
        return any(self.alive)

    def _replace(self, i: int) -> None:
        """Replace actor ``i`` (dead, or unreachable: it is killed first, so its CPU is free for the
        replacement and nothing it still sends is ever collected); the replacement gets its tasks."""
        kill_actor(self.actors[i])
        self.replaced += 1
        self._start_actor(i)

    def _check_starting(self) -> list[int]:
        """Actors that answered their first ping become ready; one that died starting is returned for
        replacement; one that has not started in ``ACTOR_START_TIMEOUT_S`` fails the pool."""
        failed = []
        for i, ref in enumerate(self.starting):
            if ref is None:
                continue
            if ray.wait([ref], timeout=0)[0]:
                try:
                    ray.get(ref)
                    self.starting[i] = None
                except RayActorError:
                    failed.append(i)
            elif time.monotonic() - self.started_at[i] > ACTOR_START_TIMEOUT_S:
                raise TimeoutError(
                    f"rollout actor {i} did not start in {ACTOR_START_TIMEOUT_S:.0f}s "
                    f"(does the Ray cluster have a free CPU? `ray status`)"
                )
        return failed

    def get(self, n: int, timeout_s: float) -> list[Trajectory]:
        """The next ``n`` finished trajectories (in the order their batches arrived); raises if an
        actor's stream failed, all ran dry, or none came for ``timeout_s`` while every actor was up
        (an actor still starting -- a new process, its imports, its policy copy -- stops that clock;
        it has ``ACTOR_START_TIMEOUT_S`` to start). A dead or unreachable actor is replaced and its
        replacement gets the tasks it held (in flight or finished but not collected): every task
        comes back exactly once."""
        got, self.spill = self.spill[:n], self.spill[n:]
        last = time.monotonic()
        restarts = 0

        def replace(i: int, e: BaseException) -> None:
            nonlocal restarts
            restarts += 1
            if restarts > self.dist.actor_restarts:
                raise RuntimeError(
                    f"rollout: more than distributed.actor_restarts="
                    f"{self.dist.actor_restarts} actor failures in one step"
                ) from e
            self._replace(i)

        while len(got) < n:
            self._publish()
            for i in self._check_starting():
                replace(i, RuntimeError(f"rollout actor {i} died while starting"))
            refs = {}
            for i, a in enumerate(self.actors):
                new = self._deal(i)
                if self.starting[i] is None:
                    refs[i] = a.poll.remote(new, n - len(got), self.dry)
                elif new or (self.dry and not self.end_sent[i]):  # queued behind its start; collects nothing
                    a.poll.remote(new, 0, self.dry)
                self.end_sent[i] = self.dry
            before = len(got)
            for i, ref in refs.items():  # a poll only moves queue items: it returns at once
                try:
                    res = ray.get(ref)
                except RayActorError as e:
                    replace(i, e)
                    continue
                if res["error"] is not None:
                    raise RuntimeError(f"rollout worker failed: {res['error']}")
                self._received(i, res["trajs"])
                self.syncs_of[i], self.alive[i] = res["syncs"], res["alive"]
                got.extend(res["trajs"])
            if len(got) > before or any(ref is not None for ref in self.starting):
                last = time.monotonic()
            else:
                if self.dry and not any(self.given):
                    raise RuntimeError("rollout workers stopped: their task stream ran dry")
                if time.monotonic() - last >= timeout_s:
                    raise TimeoutError(f"no trajectory from the rollout workers in {timeout_s:.0f}s")
            if len(got) == before:
                time.sleep(0.05)
        got, extra = got[:n], got[n:]
        self.spill = extra + self.spill
        return got

    def close(self) -> None:
        """Release the rollout actors for the next pool; kill the environment actors."""
        for a in self.actors:
            _release_actor(a)
        for a in self.env_actors:
            kill_actor(a)
        self.actors = [None] * len(self.actors)


__all__ = [
    "EnvActor",
    "RayRolloutPool",
    "RayRollouts",
    "RemoteEnv",
    "RemoteEnvFactory",
    "RolloutActor",
    "WeightBroadcast",
    "actor_options",
    "init_ray",
    "kill_actor",
    "kill_idle_actors",
    "shares",
    "weights_payload",
]
