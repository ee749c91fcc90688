"""The narrow generation-backend interface and the turn-level episode driver over it.

A backend only generates: given token ids per row, it returns the sampled token ids and their
log-probabilities at the contract's temperature (``log_softmax(logits / T)`` of the chosen token,
the value the learner recomputes). Options: a seed per row, the stop ids and the most tokens to
generate. ``set_weights(version, state_dict)`` loads a policy version; ``close()`` frees it.

Episodes, tool calls and multi-turn stay in mentorrl: :func:`drive_episodes` (a list) and
:func:`stream_episodes` (continuous admission, for SAO's worker) run every live
episode's next policy turn as one ``generate`` call over the whole batch, run the tool calls in a
thread pool, and resubmit each row's full token ids for its next turn (a backend with prefix
caching reuses the context it has already computed).
"""

from __future__ import annotations

import concurrent.futures as cf
import queue
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from mentorrl.contract import RolloutContract
from mentorrl.rollout.episode import Episode, EpisodeSource
from mentorrl.trajectory import Trajectory


@dataclass(frozen=True)
class Generation:
    """One row's output: the sampled ids (ending with the stop id when ``stopped``) and their log-probs."""

    token_ids: list[int]
    logprobs: list[float]
    stopped: bool


class GenerationBackend(ABC):
    """Token ids in, sampled ids and their log-probs out, under one policy version."""

    name: str = "?"

    def __init__(self) -> None:
        self.version: int | None = None  # the policy version whose weights are loaded (None: as built)
        self.weight_syncs = 0
        self.last_sync_s = 0.0
        self.last_stats: dict[str, float] = {}  # counters of the last rollout

    @abstractmethod
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        temperature: float,
        max_tokens: Sequence[int],
        stop_ids: Sequence[int],
        seeds: Sequence[int],
    ) -> list[Generation]:
        """One turn per row: sample up to ``max_tokens[i]`` tokens after ``prompts[i]``, stopping
        after any of ``stop_ids``; row ``i`` draws its noise from ``seeds[i]`` alone."""

    @abstractmethod
    def set_weights(self, version: int, state_dict: Mapping[str, Any]) -> None:
        """Generate with these weights (a Hugging Face state dict of the policy) from now on."""

    def close(self) -> None:  # noqa: B027 (a backend without resources has nothing to free)
        """Free the backend's resources."""

    def run_episodes(self, episodes: list[Episode], seed: int = 0) -> list[Trajectory]:
        """Roll out ``episodes`` to completion; trajectories in input order."""
        return drive_episodes(self, episodes, seed=seed)


def backend_of(trajs: Sequence[Trajectory]) -> str:
    """The backend that sampled the policy's trajectories among ``trajs`` (demonstrations are not
    counted): its name, ``"mixed"``, or ``"none"``. A trajectory without a ``sampling["backend"]``
    stamp came from the project's engine (hf)."""
    names = {t.sampling.get("backend", "hf") for t in trajs if t.source == "policy"}
    return names.pop() if len(names) == 1 else ("mixed" if names else "none")


def turn_seed(seed: int, episode: int, turn: int) -> int:
    """The sampling seed of ``episode``'s ``turn``-th policy turn in a batch rolled out with ``seed``."""
    return (seed * 1_000_003 + episode * 7_919 + turn * 104_729) % (2**31 - 1)


def drive_episodes(
    backend: GenerationBackend,
    episodes: list[Episode],
    seed: int = 0,
    tool_workers: int | None = None,
    gather_s: float = 0.05,
) -> list[Trajectory]:
    """Multi-turn rollout over ``backend.generate``: each round generates the next policy turn of
    every episode that is not waiting on a tool, as one call (each row resubmits its whole context);
    tool calls run in a thread pool between rounds. Once one tool call has returned, the others get
    up to ``gather_s`` more to join the same round (fewer, fuller calls; a slow tool holds up only
    its own episode). Trajectories come back in input order."""
    if not episodes:
        return []
    source = iter(episodes)
    return stream_episodes(
        backend,
        lambda: next(source, None),
        slots=len(episodes),
        seed=seed,
        tool_workers=tool_workers,
        gather_s=gather_s,
    )


def put_unless_stopped(out: "queue.Queue", item: Any, stop: threading.Event, poll_s: float = 0.1) -> bool:
    """Put ``item`` in the bounded queue ``out``, waiting while it is full, unless ``stop`` is set first
    (a streaming worker's hand-off to its consumer); whether it went in."""
    while not stop.is_set():
        try:
            out.put(item, timeout=poll_s)
            return True
        except queue.Full:
            continue
    return False


def stream_episodes(
    backend: GenerationBackend,
    next_episode: Callable[[], Episode | None],
    slots: int,
    seed: int = 0,
    on_finish: Callable[[Trajectory], None] | None = None,
    before_round: Callable[[], Any] | None = None,
    stop: threading.Event | None = None,
    close_envs: bool = False,
    tool_workers: int | None = None,
    gather_s: float = 0.05,
) -> list[Trajectory]:
    """Continuous batching at turn level: up to ``slots`` episodes in flight, the next one admitted
    from ``next_episode()`` as soon as one finishes, until it returns None and every episode is done.

    Each round is one ``backend.generate`` call over every admitted episode that is not waiting on
    a tool. Episode ``e`` (admission order) samples its ``t``-th turn with ``turn_seed(seed, e, t)``.
    ``before_round()`` runs before every call: a policy that changes there (new weights) applies from
    the next turn on, so every turn is sampled, and its log-probs recorded, under one policy.
    Setting ``stop`` abandons the episodes in flight and returns what has finished; ``close_envs``
    closes each episode's environment once it is finished or abandoned. Trajectories come back in
    admission order."""
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    run = TurnScheduler(backend, EpisodeSource(next_episode, stop), slots, seed, on_finish, close_envs)
    pool = cf.ThreadPoolExecutor(max_workers=tool_workers or slots, thread_name_prefix="rollout-tool")
    aborted = False
    try:
        run.admit()
        while run.live:
            if stop is not None and stop.is_set():
                aborted = True
                break
            if run.ready:
                if before_round is not None:
                    before_round()
                run.round(pool)
            if run.waiting:
                run.collect_tools(gather_s, poll=stop is not None)
            run.admit()
    finally:
        pool.shutdown(wait=not aborted, cancel_futures=aborted)
        run.close_abandoned()
    backend.last_stats = {**run.stats, "wall_s": time.perf_counter() - run.t0, "aborted": float(aborted)}
    return [sl.result for sl in run.slots if sl.result is not None]


@dataclass(eq=False)
class TurnSlot:
    """One admitted episode of :func:`stream_episodes` and where it stands."""

    index: int  # admission order: its turns' seeds and its place in the output
    episode: Episode
    turns: int = 0  # policy turns sampled so far
    result: Trajectory | None = None


class TurnScheduler:
    """The state of one :func:`stream_episodes` run: :meth:`admit` fills free slots, :meth:`round`
    samples the next turn of every ready episode in one ``generate`` call, :meth:`collect_tools`
    takes tool results back, :meth:`finish` closes an episode."""

    def __init__(
        self,
        backend: GenerationBackend,
        source: EpisodeSource,
        slots: int,
        seed: int,
        on_finish: Callable[[Trajectory], None] | None,
        close_envs: bool,
    ):
        self.backend, self.source, self.capacity, self.seed = backend, source, slots, seed
        self.on_finish, self.close_envs = on_finish, close_envs
        self.t0 = time.perf_counter()
        self.slots: list[TurnSlot] = []  # every admitted episode, in admission order
        self.live: set[int] = set()
        self.ready: list[TurnSlot] = []  # due for their next policy turn
        self.waiting: dict[int, tuple[TurnSlot, cf.Future]] = {}  # on a tool call, by index
        self.stats = {"generate_calls": 0, "generated_tokens": 0, "admitted": 0}

    def admit(self) -> None:
        for ep in self.source.take(self.capacity - len(self.live)):
            sl = TurnSlot(len(self.slots), ep)
            self.slots.append(sl)
            ep.start()
            self.live.add(sl.index)
            self.ready.append(sl)
            self.stats["admitted"] += 1

    def finish(self, sl: TurnSlot) -> None:
        traj = sl.episode.finish()
        traj.timings["rollout_s"] = time.perf_counter() - self.t0
        traj.sampling["backend"] = self.backend.name  # which engine sampled it (absent: the project's own)
        sl.result = traj
        self.live.discard(sl.index)
        if self.close_envs:
            sl.episode.env.close()
        if self.on_finish is not None:
            self.on_finish(traj)

    def round(self, pool: cf.Executor) -> None:
        """One ``generate`` call over every ready episode; each turn's tool call goes to ``pool``."""
        ready, self.ready = self.ready, []
        contract: RolloutContract = ready[0].episode.contract
        max_new = contract.sampling.max_new_tokens
        outs = self.backend.generate(
            [sl.episode.ids for sl in ready],
            temperature=contract.sampling.temperature,
            max_tokens=[min(max_new, sl.episode.tokens_left()) for sl in ready],
            stop_ids=list(contract.stop_token_ids),
            seeds=[turn_seed(self.seed, sl.index, sl.turns) for sl in ready],
        )
        self.stats["generate_calls"] += 1
        for sl, out in zip(ready, outs):
            sl.turns += 1
            self.stats["generated_tokens"] += len(out.token_ids)
            action = sl.episode.add_policy_turn(list(out.token_ids), list(out.logprobs), stopped=out.stopped)
            if action is None:
                self.finish(sl)
            else:
                self.waiting[sl.index] = (sl, pool.submit(sl.episode.run_tool, action))

    def collect_tools(self, gather_s: float, poll: bool) -> None:
        """Wait for one tool, give the rest ``gather_s`` to join; take every result that is back
        (at most a moment's wait with ``poll``, so a stop is seen)."""
        futures = [f for _, f in self.waiting.values()]
        first = cf.wait(futures, timeout=0.1 if poll else None, return_when=cf.FIRST_COMPLETED)
        if first.done:
            cf.wait(futures, timeout=gather_s)
        for e in sorted(e for e, (_, f) in self.waiting.items() if f.done()):
            sl, f = self.waiting.pop(e)
            if sl.episode.add_observation(f.result()) is None:
                self.finish(sl)
            else:
                self.ready.append(sl)

    def close_abandoned(self) -> None:
        if self.close_envs:
            for e in self.live:
                if e not in self.waiting:
                    self.slots[e].episode.env.close()  # an episode whose tool is still running keeps its env open
