"""Turn-level continuous batching over the narrow backend interface (``stream_episodes``), which SAO's
worker uses under ``rollout.backend: vllm``; tested here with the hf backend's one-turn ``generate``
(the vLLM side is in ``test_vllm_backend.py``).

- more episodes than slots: never more than ``slots`` in flight, every episode comes back once, in
  admission order, each with its environment closed;
- a weight change between rounds: every turn is sampled under exactly one of the two policies (its
  recorded log-probs equal that policy's recomputed ones), turns after the change under the new one;
- ``stop`` abandons the episodes in flight and closes their environments;
- the seeds depend on (seed, admission index, turn) only, so a list run through ``drive_episodes``
  and the same list streamed through fewer slots sample from the same per-turn noise.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from mentorrl.rollout.backends import drive_episodes, stream_episodes
from mentorrl.rollout.backends.hf import HFBackend
from mentorrl.rollout.episode import Episode

T = 1.0


@pytest.fixture(scope="module")
def contract(make_contract):
    return make_contract(temperature=T, max_new_tokens=12, max_turns=4)


class CountingEnvs:
    """make_env that counts environments made and closed, and wraps the real orders environment."""

    def __init__(self, entry):
        self.entry, self.made, self.closed = entry, 0, 0

    def __call__(self):
        env = self.entry.make_env()
        self.made += 1
        real_close = env.close

        def close():
            self.closed += 1
            real_close()

        env.close = close
        return env


@torch.no_grad()
def turn_logprobs(model, traj) -> list[list[float]]:
    """The model's log-probs (at T) of each policy turn's tokens, recomputed on the whole trajectory."""
    x = torch.tensor([traj.token_ids])
    lp = torch.log_softmax(model(x).logits[0].float() / T, dim=-1)
    out = []
    for seg in traj.segments:
        if seg.role == "policy":
            out.append([lp[i - 1, traj.token_ids[i]].item() for i in range(seg.start, seg.end)])
    return out


def recorded_turns(traj) -> list[list[float]]:
    return [traj.logprobs[seg.start : seg.end] for seg in traj.segments if seg.role == "policy"]


def test_more_episodes_than_slots_come_back_once_in_admission_order(
    tool_happy_model, contract, orders_entry, orders_tasks
):
    be = HFBackend(tool_happy_model, contract)
    envs = CountingEnvs(orders_entry)
    tasks = orders_tasks[:7]
    source = iter(tasks)
    in_flight, peak = [0], [0]

    def next_episode():
        t = next(source, None)
        if t is None:
            return None
        in_flight[0] += 1
        peak[0] = max(peak[0], in_flight[0])
        return Episode(contract, envs(), t)

    finished = []

    def on_finish(traj):
        in_flight[0] -= 1
        finished.append(traj.task_id)

    trajs = stream_episodes(be, next_episode, slots=3, seed=4, on_finish=on_finish, close_envs=True)
    assert [t.task_id for t in trajs] == [t.id for t in tasks]
    assert sorted(finished) == sorted(t.id for t in tasks) and len(finished) == len(tasks)
    assert peak[0] == 3  # the slots were filled, never overfilled
    assert envs.made == envs.closed == len(tasks)
    assert be.last_stats["admitted"] == len(tasks)
    assert max(t.num_turns for t in trajs) >= 2  # multi-turn: tool calls came back and the rows went on
    for t in trajs:  # the recorded log-probs are the policy's
        for got, want in zip(recorded_turns(t), turn_logprobs(tool_happy_model, t)):
            assert got == pytest.approx(want, abs=1e-4)


def test_each_turn_is_sampled_under_one_policy_across_a_weight_change(
    tool_happy_model, contract, orders_entry, orders_tasks
):
    old = tool_happy_model
    policy = copy.deepcopy(old)
    new = copy.deepcopy(old)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.3)
    be = HFBackend(policy, contract)
    rounds = [0]

    def before_round():
        rounds[0] += 1
        if rounds[0] == 2:
            be.set_weights(1, copy.deepcopy(new.state_dict()))

    envs = [orders_entry.make_env() for _ in range(6)]
    try:
        source = iter([Episode(contract, env, t) for env, t in zip(envs, orders_tasks[10:16])])
        trajs = stream_episodes(be, lambda: next(source, None), slots=6, seed=2, before_round=before_round)
    finally:
        for env in envs:
            env.close()
    assert rounds[0] >= 2 and be.version == 1  # round 2 on samples under the new weights
    under = {"old": 0, "new": 0}
    for t in trajs:
        seen_new = False
        for got, lp_old, lp_new in zip(recorded_turns(t), turn_logprobs(old, t), turn_logprobs(new, t)):
            is_old = got == pytest.approx(lp_old, abs=1e-4)
            is_new = got == pytest.approx(lp_new, abs=1e-4)
            assert is_old != is_new, "a turn's log-probs must come from exactly one policy"
            assert not (seen_new and is_old), "no turn after the change is sampled under the old policy"
            seen_new = seen_new or is_new
            under["new" if is_new else "old"] += 1
    assert under["old"] >= 6 and under["new"] >= 1


def test_stop_abandons_the_episodes_in_flight(tool_happy_model, contract, orders_entry, orders_tasks):
    be = HFBackend(tool_happy_model, contract)
    envs = CountingEnvs(orders_entry)
    stop = threading.Event()
    source = iter(orders_tasks[:50])
    done = []

    def next_episode():
        t = next(source, None)
        return None if t is None else Episode(contract, envs(), t)

    def on_finish(traj):
        done.append(traj)
        if len(done) == 2:
            stop.set()

    trajs = stream_episodes(be, next_episode, slots=4, seed=0, on_finish=on_finish, stop=stop, close_envs=True)
    assert len(trajs) == len(done) >= 2 and len(trajs) < 50
    assert be.last_stats["aborted"] == 1.0
    assert envs.closed == envs.made  # finished and abandoned episodes alike


def test_streaming_through_fewer_slots_uses_the_same_per_turn_seeds(
    tool_happy_model, contract, orders_entry, orders_tasks
):
    """The seed of a turn is a function of (seed, admission index, turn): the same episodes through 2
    slots or all at once draw the same noise. With the same logits (up to float noise from batch
    composition) they sample the same tokens; at least the first turns, which see identical prompts,
    must agree token for token."""
    be = HFBackend(tool_happy_model, contract)
    tasks = orders_tasks[20:26]

    def run(slots):
        envs = [orders_entry.make_env() for _ in tasks]
        try:
            eps = [Episode(contract, env, t) for env, t in zip(envs, tasks)]
            if slots is None:
                return drive_episodes(be, eps, seed=9)
            source = iter(eps)
            return stream_episodes(be, lambda: next(source, None), slots=slots, seed=9)
        finally:
            for env in envs:
                env.close()

    a, b = run(None), run(2)
    for x, y in zip(a, b):
        first_x = next(s for s in x.segments if s.role == "policy")
        first_y = next(s for s in y.segments if s.role == "policy")
        assert x.token_ids[first_x.start : first_x.end] == y.token_ids[first_y.start : first_y.end]


def test_slots_must_be_positive(tool_happy_model, contract):
    with pytest.raises(ValueError, match="slots"):
        stream_episodes(HFBackend(tool_happy_model, contract), lambda: None, slots=0)
