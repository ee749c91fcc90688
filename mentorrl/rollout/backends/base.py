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
    def generate(self, prompts: Sequence[Sequence[int]], *, temperature: float, max_tokens: Sequence[int],
                 stop_ids: Sequence[int], seeds: Sequence[int]) -> list[Generation]:
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


def drive_episodes(backend: GenerationBackend, episodes: list[Episode], seed: int = 0,
                   tool_workers: int | None = None, gather_s: float = 0.05) -> list[Trajectory]:
    """Multi-turn rollout over ``backend.generate``: each round generates the next policy turn of
    every episode that is not waiting on a tool, as one call (each row resubmits its whole context);
    tool calls run in a thread pool between rounds. Once one tool call has returned, the others get
    up to ``gather_s`` more to join the same round (fewer, fuller calls; a slow tool holds up only
    its own episode). Trajectories come back in input order."""
    if not episodes:
        return []
    source = iter(episodes)
    return stream_episodes(backend, lambda: next(source, None), slots=len(episodes), seed=seed,
                           tool_workers=tool_workers, gather_s=gather_s)


def stream_episodes(backend: GenerationBackend, next_episode: Callable[[], Episode | None], slots: int,
                    seed: int = 0, on_finish: Callable[[Trajectory], None] | None = None,
                    before_round: Callable[[], Any] | None = None, stop: threading.Event | None = None,
                    close_envs: bool = False, tool_workers: int | None = None,
                    gather_s: float = 0.05) -> list[Trajectory]:
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
    t0 = time.perf_counter()
    episodes: list[Episode] = []
    results: list[Trajectory | None] = []
    turns: list[int] = []
    ready: list[int] = []
    waiting: dict[int, cf.Future] = {}
    live: set[int] = set()
    stats = {"generate_calls": 0, "generated_tokens": 0, "admitted": 0}
    source = EpisodeSource(next_episode, stop)

    def admit() -> None:
        for ep in source.take(slots - len(live)):
            e = len(episodes)
            episodes.append(ep)
            results.append(None)
            turns.append(0)
            ep.start()
            live.add(e)
            ready.append(e)
            stats["admitted"] += 1

    def finish(e: int) -> None:
        traj = episodes[e].finish()
        traj.timings["rollout_s"] = time.perf_counter() - t0
        traj.sampling["backend"] = backend.name  # which engine sampled it (absent: the project's own)
        results[e] = traj
        live.discard(e)
        if close_envs:
            episodes[e].env.close()
        if on_finish is not None:
            on_finish(traj)

    pool = cf.ThreadPoolExecutor(max_workers=tool_workers or slots, thread_name_prefix="rollout-tool")
    aborted = False
    try:
        admit()
        while live:
            if stop is not None and stop.is_set():
                aborted = True
                break
            if ready:
                if before_round is not None:
                    before_round()
                contract: RolloutContract = episodes[ready[0]].contract
                max_new = contract.sampling.max_new_tokens
                outs = backend.generate(
                    [episodes[e].ids for e in ready], temperature=contract.sampling.temperature,
                    max_tokens=[min(max_new, episodes[e].tokens_left()) for e in ready],
                    stop_ids=list(contract.stop_token_ids),
                    seeds=[turn_seed(seed, e, turns[e]) for e in ready])
                stats["generate_calls"] += 1
                for e, out in zip(ready, outs):
                    turns[e] += 1
                    stats["generated_tokens"] += len(out.token_ids)
                    action = episodes[e].add_policy_turn(list(out.token_ids), list(out.logprobs), stopped=out.stopped)
                    if action is None:
                        finish(e)
                    else:
                        waiting[e] = pool.submit(episodes[e].run_tool, action)
                ready = []
            if waiting:  # wait for one tool, give the rest gather_s to join; take every result that is back
                first = cf.wait(list(waiting.values()), timeout=0.1 if stop is not None else None,
                                return_when=cf.FIRST_COMPLETED)
                if first.done:
                    cf.wait(list(waiting.values()), timeout=gather_s)
                for e in sorted(e for e, f in waiting.items() if f.done()):
                    if episodes[e].add_observation(waiting.pop(e).result()) is None:
                        finish(e)
                    else:
                        ready.append(e)
            admit()
    finally:
        pool.shutdown(wait=not aborted, cancel_futures=aborted)
        if close_envs:
            for e in live:
                if e not in waiting:
                    episodes[e].env.close()  # an episode whose tool is still running keeps its env open
    backend.last_stats = {**stats, "wall_s": time.perf_counter() - t0, "aborted": float(aborted)}
    return [r for r in results if r is not None]
