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
from dataclasses import dataclass, field
from typing import Callable

import torch

from mentorrl.contract import RolloutContract
from mentorrl.rollout.decoders import make_decoder
from mentorrl.rollout.dispatch import INLINE_TOOL_S, Dispatch, tool_kind, verify_kind
from mentorrl.rollout.episode import Episode, EpisodeSource, close_env
from mentorrl.rollout.kvcache import common_prefix_len
from mentorrl.rollout.sampling import sample_tokens
from mentorrl.trajectory import Trajectory

TOOL_SYNC = ("next_step", "asap")


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
        tool_sync: str = "next_step",
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
        of the pool (:mod:`mentorrl.rollout.dispatch`; 0: always the pool).
        ``tool_sync``: when a tool's result joins the batch. ``next_step`` (the default): every call made
        in a step is awaited before the next forward pass, so which rows a pass feeds depends on the
        episodes alone, never on timing (where a call ran, how long it took): a fixed seed rolls out the
        same trajectories bit for bit. ``asap``: a result joins the first pass after it is back, so a slow
        tool holds up only its own row (tools of 0.1 s and more, e.g. sandboxed code)."""
        if tool_sync not in TOOL_SYNC:
            raise ValueError(f"tool_sync {tool_sync!r}: expected one of {', '.join(TOOL_SYNC)}")
        self.model = model
        self.contract = contract
        self.tool_workers = tool_workers
        self.prefill_batch_frac = prefill_batch_frac
        self.compact_ratio = compact_ratio
        self.decoder = decoder
        self.inline_tool_s = inline_tool_s
        self.tool_sync = tool_sync

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
        with its own generator seeded from ``(seed, i)``, or ``(seed, episode.seed_index)`` when it has one. ``before_step()`` runs before every
        forward pass; when it returns True (the model's weights changed) the KV cache is dropped
        and every live row's context is prefilled again under the new weights, so each token is
        sampled from one policy (the one that recorded its log-prob). Setting ``stop`` abandons
        the rows in flight and returns what has finished. ``close_envs`` closes each episode's
        environment once it is finished (or abandoned).
        """
        run = StreamScheduler(self, EpisodeSource(next_episode, stop), slots, seed, on_finish, close_envs)
        aborted = False
        try:
            run.start()
            while run.rows:
                if stop is not None and stop.is_set():
                    aborted = True
                    break
                run.collect_tools(poll=stop is not None)
                if not run.refill():
                    break
                if before_step is not None and before_step():
                    run.resync()
                if run.all_paused():
                    continue
                run.step()
            run.collect(block=True)  # an abandoned run keeps the trajectories that had finished
        finally:
            run.close(aborted)
        self.last_stats = {**run.final_stats(), "aborted": float(aborted)}
        return [sl.result for sl in run.slots if sl.result is not None]


@dataclass(eq=False)
class EpisodeSlot:
    """One admitted episode of a streaming run and where it stands."""

    index: int  # admission order: its generator's seed and its place in the output
    episode: Episode
    gen: torch.Generator
    pending: list[int]  # ids to feed next
    turn_ids: list[int] = field(default_factory=list)  # the policy turn being sampled
    turn_lp: list[float] = field(default_factory=list)
    tool: cf.Future | None = None  # its running tool call (the row is paused meanwhile)
    verdict: cf.Future | None = None  # its running verification (its last turn is in)
    ended: bool = False
    result: Trajectory | None = None


class StreamScheduler:
    """The state of one :meth:`RolloutEngine.run_stream`: the admitted episodes (:class:`EpisodeSlot`),
    the batch rows, the decoder, the tool pool. :meth:`admit` fills free slots, :meth:`step` runs one
    forward pass and advances every fed row, :meth:`finish` hands an episode to its verifier."""

    def __init__(
        self,
        engine: RolloutEngine,
        source: EpisodeSource,
        slots: int,
        seed: int,
        on_finish: Callable[[Trajectory], None] | None,
        close_envs: bool,
    ):
        contract = engine.contract
        self.engine, self.contract, self.source, self.capacity, self.seed = engine, contract, source, slots, seed
        self.on_finish, self.close_envs = on_finish, close_envs
        self.stop_ids = set(contract.stop_token_ids)
        self.decoder = make_decoder(
            engine.model,
            engine.decoder,
            engine.compact_ratio,
            contract.pad_token_id,
            max_len=contract.max_total_tokens + 1,
        )
        self.t_start = time.perf_counter()
        self.slots: list[EpisodeSlot] = []  # every admitted episode, in admission order
        self.rows: list[EpisodeSlot] = []  # the batch rows, in decoder order
        self.waiting: dict[int, EpisodeSlot] = {}  # paused on a tool call, by index (in submission order)
        self.verdicts: dict[int, EpisodeSlot] = {}  # being verified, by index (in submission order)
        self.stats = {
            "forward_passes": 0,
            "generated_tokens": 0,
            "shared_prefix": 0,
            "admitted": 0,
            "weight_syncs": 0,
            "max_rows": 0,
            "fed_tokens": 0,
            "env_errors": 0,  # environment exceptions in step / verify, each its episode's failure
        }
        self.pool = cf.ThreadPoolExecutor(
            max_workers=engine.tool_workers or max(slots, 1), thread_name_prefix="rollout-tool"
        )
        self.dispatch = Dispatch(self.pool, engine.inline_tool_s)

    # ---- admission
    def admit(self) -> list[EpisodeSlot]:
        """Start episodes until every slot is busy or the source is dry; returns their slots."""
        new: list[EpisodeSlot] = []
        for ep in self.source.take(self.capacity - len(self.rows)):
            e = len(self.slots)
            k = e if ep.seed_index is None else ep.seed_index  # its generator's index: admission order, or its own
            sl = EpisodeSlot(e, ep, torch.Generator(device="cpu").manual_seed(self.seed * 1_000_003 + k), ep.start())
            self.slots.append(sl)
            new.append(sl)
        self.stats["admitted"] += len(new)
        return new

    def start(self) -> None:
        """The first rows; all prompts usually share the system turn: prefill it once and broadcast it."""
        self.rows = self.admit()
        self.decoder.reset(len(self.rows))
        rows = self.rows
        if len(rows) > 1:
            shared = common_prefix_len([sl.pending for sl in rows])
            shared = min(shared, min(len(sl.pending) for sl in rows) - 1)
            if shared >= 8 and self.decoder.prefill_shared(rows[0].pending[:shared]):
                for sl in rows:
                    sl.pending = sl.pending[shared:]
                self.stats["shared_prefix"] = shared
                self.stats["forward_passes"] += 1

    def refill(self) -> bool:
        """Drop finished rows from the batch and the cache; admit new episodes into free slots.
        False when no row is left."""
        keep = [i for i, sl in enumerate(self.rows) if not sl.ended]
        if len(keep) < len(self.rows):
            self.rows = [self.rows[i] for i in self.decoder.drop(keep)]
        new = self.admit() if not self.source.exhausted else []
        if new:
            self.decoder.add_rows(len(new))
            self.rows = self.rows + new
        return bool(self.rows)

    # ---- tools and verdicts
    def all_paused(self) -> bool:
        return all(sl.index in self.waiting for sl in self.rows)

    def collect_tools(self, poll: bool) -> None:
        """Take the tool results that are back (waiting for one when every row is paused: at most
        a moment with ``poll``, so a stop is seen) and the finished verdicts."""
        if self.waiting and self.engine.tool_sync == "next_step":
            pending = [sl.tool for sl in self.waiting.values()]
            stop = self.source.stop
            while cf.wait(pending, timeout=0.05 if poll else None).not_done:  # a moment at a time: a stop is seen
                if stop is not None and stop.is_set():
                    break
        elif self.waiting and self.all_paused():
            futures = [sl.tool for sl in self.waiting.values()] + [sl.verdict for sl in self.verdicts.values()]
            cf.wait(futures, timeout=0.05 if poll else None, return_when=cf.FIRST_COMPLETED)
        self.collect()
        for sl in [sl for sl in self.waiting.values() if sl.tool.done()]:
            del self.waiting[sl.index]
            fut, sl.tool = sl.tool, None
            obs = sl.episode.add_observation(fut.result())
            if obs is None:
                self.finish(sl)
            else:
                sl.pending = sl.pending + obs  # the unfed stop token, then the observation

    def _verify(self, sl: EpisodeSlot) -> Trajectory:
        try:
            traj = sl.episode.finish()  # an environment error becomes this episode's failure
            traj.timings["rollout_s"] = time.perf_counter() - self.t_start
            return traj
        finally:
            if self.close_envs:
                close_env(sl.episode.env)

    def finish(self, sl: EpisodeSlot) -> None:
        """The verifier runs in the tool pool beside the decoding of the other rows, or inline
        once verifications have measured cheap (:mod:`mentorrl.rollout.dispatch`)."""
        sl.ended = True
        sl.verdict = self.dispatch.submit(verify_kind(sl.episode), self._verify, sl)
        self.verdicts[sl.index] = sl

    def collect(self, block: bool = False) -> None:
        for sl in [sl for sl in self.verdicts.values() if block or sl.verdict.done()]:
            del self.verdicts[sl.index]
            sl.result = traj = sl.verdict.result()
            self.stats["env_errors"] += len(sl.episode.env_errors)
            if self.on_finish is not None:
                self.on_finish(traj)

    # ---- decoding
    def resync(self) -> None:
        """New weights: drop the cache and feed every live row its whole context again."""
        self.stats["weight_syncs"] += 1
        self.decoder.refresh_weights()
        self.decoder.reset(len(self.rows))
        for sl in self.rows:
            sl.pending = sl.episode.ids + sl.turn_ids  # == everything fed so far + what is pending

    def _fed_rows(self) -> list[int]:
        """The rows fed this step: every row not paused on a tool; with the left-padded decoder,
        observations are held back a step until enough rows have one (``prefill_batch_frac``)."""
        fed = [i for i, sl in enumerate(self.rows) if sl.index not in self.waiting]
        wide = [i for i in fed if len(self.rows[i].pending) > 1]
        if (
            self.decoder.pads_wide
            and wide
            and len(wide) < len(fed)
            and len(wide) < self.engine.prefill_batch_frac * len(self.rows)
        ):
            fed = [i for i in fed if len(self.rows[i].pending) == 1]
            self.stats["deferred_prefills"] = self.stats.get("deferred_prefills", 0) + len(wide)
        return fed

    def step(self) -> None:
        """One forward pass over every fed row's next chunk, a token sampled for each, and each advanced."""
        fed = self._fed_rows()
        fed_set = set(fed)
        chunks = [sl.pending if i in fed_set else [] for i, sl in enumerate(self.rows)]
        logits = self.decoder.forward(chunks)
        self.stats["forward_passes"] += 1
        self.stats["max_rows"] = max(self.stats["max_rows"], len(self.rows))
        self.stats["fed_tokens"] += sum(len(c) for c in chunks)
        tokens, logps = sample_tokens(logits, self.contract.sampling, [self.rows[i].gen for i in fed])
        for i, tok, logp in zip(fed, tokens.tolist(), logps.tolist()):  # one conversion, not two a row
            self.advance(self.rows[i], tok, logp)

    def advance(self, sl: EpisodeSlot, tok: int, logp: float) -> None:
        """``tok`` sampled for ``sl``; at the turn's end, its tool call starts or the episode finishes."""
        ep = sl.episode
        sl.turn_ids.append(tok)
        sl.turn_lp.append(logp)
        sl.pending = [tok]
        self.stats["generated_tokens"] += 1
        stopped = tok in self.stop_ids
        if not stopped and len(sl.turn_ids) < min(self.contract.sampling.max_new_tokens, ep.tokens_left()):
            return
        action = ep.add_policy_turn(sl.turn_ids, sl.turn_lp, stopped=stopped)
        sl.turn_ids, sl.turn_lp = [], []  # pending keeps the stop token until the observation
        if action is None:
            self.finish(sl)
        else:
            sl.tool = self.dispatch.submit(tool_kind(ep, action.name), ep.run_tool, action)
            self.waiting[sl.index] = sl

    # ---- the end
    def close(self, aborted: bool) -> None:
        self.decoder.close()
        self.pool.shutdown(wait=not aborted, cancel_futures=aborted)
        if self.close_envs:
            for sl in self.rows:
                if not sl.ended and sl.index not in self.waiting:
                    close_env(sl.episode.env)  # a row whose tool is still running keeps its env open

    def final_stats(self) -> dict[str, float]:
        return {**self.stats, **self.decoder.stats, **self.dispatch.stats, "wall_s": time.perf_counter() - self.t_start}
