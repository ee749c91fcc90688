"""Batched multi-turn rollout: every live trajectory advances in one forward pass per step.

Each step feeds, per row, whatever that row needs next: its prompt (first step), the one
token it sampled last step, or the observation ids of a tool call that has just returned.
A decoder (:mod:`mentorrl.rollout.decoders`) runs the step: per-row KV slots with the
step's real tokens packed together (Qwen2 / Llama checkpoints), or the model's own forward
over left-padded rows; either way every real token sees exactly the context it would see
alone. A row whose tool call is still running is not fed (it is paused) while the others
decode; tools run in a thread pool, so a slow tool holds up only its own trajectory.
Finished rows leave the batch and the cache.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from typing import Callable

import torch

from mentorrl.contract import RolloutContract
from mentorrl.rollout.episode import Episode, EpisodeSource
from mentorrl.rollout.decoders import make_decoder
from mentorrl.rollout.dispatch import INLINE_TOOL_S, Dispatch, tool_kind, verify_kind
from mentorrl.rollout.kvcache import common_prefix_len
from mentorrl.rollout.sampling import sample_tokens
from mentorrl.trajectory import Trajectory


class RolloutEngine:
    def __init__(
        self,
        model,
        contract: RolloutContract,
        tool_workers: int | None = None,
        prefill_batch_frac: float = 0.25,
        compact_ratio: float = 1.25,
        decoder: str = "auto",
        inline_tool_s: float = INLINE_TOOL_S,
    ):
        """``tool_workers``: threads running tool calls; None gives one per slot, so no call ever
        queues behind another (tool calls wait on I/O; cap it for CPU-heavy tools).
        ``prefill_batch_frac`` (the left-padded decoder only, where a multi-token chunk widens the
        pass for every row): an observation is fed once this share of live rows has one ready (or
        nothing else is decoding), gathering observations into fewer, fuller wide passes. The slot
        decoder feeds each observation as soon as it is back.
        ``compact_ratio``: squeeze pads out of the cache once its width exceeds this multiple
        of the longest real context (the left-padded decoder).
        ``decoder``: how the model runs (:func:`mentorrl.rollout.decoders.make_decoder`): ``auto``
        (per-row KV slots and packed tokens where the model supports it), ``slots`` or ``hf``.
        ``inline_tool_s``: a kind of tool call (or verification) whose recent calls took at most this
        long (median CPU and wall time, none stalled past 10x) runs inline in the decode loop instead
        of the pool (:mod:`mentorrl.rollout.dispatch`; 0: always the pool)."""
        self.model = model
        self.contract = contract
        self.tool_workers = tool_workers
        self.prefill_batch_frac = prefill_batch_frac
        self.compact_ratio = compact_ratio
        self.decoder = decoder
        self.inline_tool_s = inline_tool_s

    @torch.no_grad()
    def run(
        self,
        episodes: list[Episode],
        seed: int = 0,
        on_finish: Callable[[Trajectory], None] | None = None,
    ) -> list[Trajectory]:
        """Roll out all episodes to completion; returns trajectories in input order."""
        if not episodes:
            return []
        source = iter(episodes)
        return self.run_stream(lambda: next(source, None), slots=len(episodes), seed=seed, on_finish=on_finish)

    @torch.no_grad()
    def run_stream(
        self,
        next_episode: Callable[[], Episode | None],
        slots: int,
        seed: int = 0,
        on_finish: Callable[[Trajectory], None] | None = None,
        before_step: Callable[[], bool] | None = None,
        stop: threading.Event | None = None,
        close_envs: bool = False,
    ) -> list[Trajectory]:
        """Continuous batching: keep up to ``slots`` episodes in flight, admitting the next one
        from ``next_episode()`` as soon as a row finishes, until it returns None and every row is done.

        Trajectories come back in admission order. Episode ``i`` (in admission order) samples
        with its own generator seeded from ``(seed, i)``. ``before_step()`` runs before every
        forward pass; when it returns True (the model's weights changed) the KV cache is dropped
        and every live row's context is prefilled again under the new weights, so each token is
        sampled from one policy (the one that recorded its log-prob). Setting ``stop`` abandons
        the rows in flight and returns what has finished. ``close_envs`` closes each episode's
        environment once it is finished (or abandoned).
        """
        contract = self.contract
        stop_ids = set(contract.stop_token_ids)
        max_new = contract.sampling.max_new_tokens
        decoder = make_decoder(self.model, self.decoder, self.compact_ratio, contract.pad_token_id,
                               max_len=contract.limits.max_total_tokens + 1)

        t_start = time.perf_counter()
        episodes: list[Episode] = []
        gens: list[torch.Generator] = []
        pending: list[list[int]] = []  # ids to feed next, per episode
        turn_ids: list[list[int]] = []
        turn_lp: list[list[float]] = []
        waiting: dict[int, cf.Future] = {}
        results: list[Trajectory | None] = []
        rows: list[int] = []  # batch row -> episode index
        stats = {"forward_passes": 0, "generated_tokens": 0, "shared_prefix": 0, "admitted": 0, "weight_syncs": 0,
                 "max_rows": 0, "fed_tokens": 0}
        source = EpisodeSource(next_episode, stop)

        def admit() -> list[int]:
            """Start episodes until every slot is busy or the source is dry; returns their indices."""
            new: list[int] = []
            for ep in source.take(slots - len(rows)):
                e = len(episodes)
                episodes.append(ep)
                gens.append(torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + e))
                pending.append(ep.start())
                turn_ids.append([])
                turn_lp.append([])
                results.append(None)
                new.append(e)
            stats["admitted"] += len(new)
            return new

        ended: set[int] = set()  # episodes whose last turn is in (their verdict may still be running)
        verdicts: dict[int, cf.Future] = {}

        def _verify(e: int) -> Trajectory:
            traj = episodes[e].finish()
            traj.timings["rollout_s"] = time.perf_counter() - t_start
            if close_envs:
                episodes[e].env.close()
            return traj

        def finish(e: int) -> None:
            """The verifier runs in the tool pool beside the decoding of the other rows, or inline
            once verifications have measured cheap (:mod:`mentorrl.rollout.dispatch`)."""
            ended.add(e)
            verdicts[e] = dispatch.submit(verify_kind(episodes[e]), _verify, e)

        def collect(block: bool = False) -> None:
            for e in [e for e, f in verdicts.items() if block or f.done()]:
                results[e] = traj = verdicts.pop(e).result()
                if on_finish is not None:
                    on_finish(traj)

        pool = cf.ThreadPoolExecutor(max_workers=self.tool_workers or max(slots, 1), thread_name_prefix="rollout-tool")
        dispatch = Dispatch(pool, self.inline_tool_s)
        rows = admit()
        decoder.reset(len(rows))
        # All prompts usually share the system turn: prefill it once and broadcast it.
        if len(rows) > 1:
            shared = common_prefix_len([pending[e] for e in rows])
            shared = min(shared, min(len(pending[e]) for e in rows) - 1)
            if shared >= 8 and decoder.prefill_shared(pending[rows[0]][:shared]):
                for e in rows:
                    pending[e] = pending[e][shared:]
                stats["shared_prefix"] = shared
                stats["forward_passes"] += 1

        aborted = False
        try:
            while rows:
                if stop is not None and stop.is_set():
                    aborted = True
                    break
                # 1. collect tool results that have come back; wait if every row is paused
                if waiting and all(e in waiting for e in rows):
                    cf.wait([*waiting.values(), *verdicts.values()], timeout=0.05 if stop is not None else None,
                            return_when=cf.FIRST_COMPLETED)
                collect()
                for e in [e for e, f in waiting.items() if f.done()]:
                    obs = episodes[e].add_observation(waiting.pop(e).result())
                    if obs is None:
                        finish(e)
                    else:
                        pending[e] = pending[e] + obs  # the unfed stop token, then the observation
                # 2. drop finished rows from the batch and the cache; admit new episodes into free slots
                keep = [i for i, e in enumerate(rows) if e not in ended]
                if len(keep) < len(rows):
                    rows = [rows[i] for i in decoder.drop(keep)]
                new = admit() if not source.exhausted else []
                if new:
                    decoder.add_rows(len(new))
                    rows = rows + new
                if not rows:
                    break
                # 3. new weights: drop the cache and feed every live row its whole context again
                if before_step is not None and before_step():
                    stats["weight_syncs"] += 1
                    decoder.reset(len(rows))
                    for e in rows:
                        pending[e] = episodes[e].ids + turn_ids[e]  # == everything fed so far + what is pending
                if all(e in waiting for e in rows):
                    continue
                # 4. one forward pass over every row's next chunk
                fed = [i for i, e in enumerate(rows) if e not in waiting]
                wide = [i for i in fed if len(pending[rows[i]]) > 1]
                if (decoder.pads_wide and wide and len(wide) < len(fed)
                        and len(wide) < self.prefill_batch_frac * len(rows)):
                    fed = [i for i in fed if len(pending[rows[i]]) == 1]  # hold observations back a step
                    stats["deferred_prefills"] = stats.get("deferred_prefills", 0) + len(wide)
                fed_set = set(fed)
                chunks = [pending[e] if i in fed_set else [] for i, e in enumerate(rows)]
                logits = decoder.forward(chunks)
                stats["forward_passes"] += 1
                stats["max_rows"] = max(stats["max_rows"], len(rows))
                stats["fed_tokens"] += sum(len(c) for c in chunks)
                tokens, logps = sample_tokens(logits, contract.sampling, [gens[rows[i]] for i in fed])
                # 5. advance each row that was fed
                for j, i in enumerate(fed):
                    e = rows[i]
                    ep = episodes[e]
                    tok = int(tokens[j])
                    turn_ids[e].append(tok)
                    turn_lp[e].append(float(logps[j]))
                    pending[e] = [tok]
                    stats["generated_tokens"] += 1
                    stopped = tok in stop_ids
                    budget = min(max_new, ep.tokens_left())
                    if not stopped and len(turn_ids[e]) < budget:
                        continue
                    action = ep.add_policy_turn(turn_ids[e], turn_lp[e], stopped=stopped)
                    turn_ids[e], turn_lp[e] = [], []  # pending[e] keeps the stop token until the observation
                    if action is None:
                        finish(e)
                    else:
                        waiting[e] = dispatch.submit(tool_kind(ep, action.name), ep.run_tool, action)
            collect(block=True)  # an abandoned run keeps the trajectories that had finished
        finally:
            decoder.close()
            pool.shutdown(wait=not aborted, cancel_futures=aborted)
            if close_envs:
                for e in rows:
                    if e not in ended and e not in waiting:
                        episodes[e].env.close()  # a row whose tool is still running keeps its env open
        stats.update(decoder.stats)
        stats.update(dispatch.stats)
        self.last_stats = {**stats, "wall_s": time.perf_counter() - t_start, "aborted": float(aborted)}
        return [r for r in results if r is not None]
