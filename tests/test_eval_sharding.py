"""Evaluations stream (``Rollout.stream``: continuous batching, each task's generator seeded by its place
in the set) and a data-parallel launch deals the tasks over its ranks (``eval_trajectories``): the gathered
trajectories are the ones a single process rolls out."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mentorrl.rollout import Rollout
from mentorrl.train.workspace import eval_trajectories


class _Ranks:
    """The ranks of a DDP launch, run one after the other in this process: ``all_gather`` returns what
    every rank has put so far (the last rank run sees them all)."""

    def __init__(self, world: int):
        self.world, self.store = world, {}

    def rank(self, r: int):
        outer = self

        class DP:
            rank, world_size, strategy, is_main = r, outer.world, "ddp", r == 0

            def all_gather(self, obj):
                outer.store[r] = obj
                return [outer.store.get(k, {}) for k in range(outer.world)]

            def on_main(self, fn):
                return fn()

        return DP()


def _ws(rollout, dp, batch_size):
    cfg = SimpleNamespace(eval=SimpleNamespace(seed=777, batch_size=batch_size, temperature=None))
    ws = SimpleNamespace(cfg=cfg, rollout=rollout, dp=dp)
    ws.on_main = lambda fn: fn()
    return ws


@pytest.fixture(scope="module")
def rollout(make_contract, orders_entry):
    return Rollout(make_contract(max_new_tokens=16, max_turns=3), orders_entry.make_env)


def test_a_stream_is_in_task_order_reproducible_and_seeded_by_place(model, rollout, orders_tasks):
    tasks = orders_tasks[:7]
    a = rollout.stream(model, tasks, seed=5, slots=3)
    assert [t.task_id for t in a] == [t.id for t in tasks]
    b = rollout.stream(model, tasks, seed=5, slots=3)
    assert [t.token_ids for t in a] == [t.token_ids for t in b]
    # a share of the set streamed with its places draws what those tasks drew in the whole set
    share = [1, 4, 6]
    c = rollout.stream(model, [tasks[i] for i in share], seed=5, slots=3, indices=share)
    assert [t.token_ids for t in c] == [a[i].token_ids for i in share]
    # without their places they are other draws (the seed is what the places carry)
    d = rollout.stream(model, [tasks[i] for i in share], seed=5, slots=3)
    assert [t.token_ids for t in d] != [t.token_ids for t in c]


def test_dealt_evaluation_equals_the_single_process_rollout(model, rollout, orders_tasks):
    tasks = orders_tasks[:7]
    one = eval_trajectories(_ws(rollout, None, 2), model, tasks)
    ranks = _Ranks(2)
    with pytest.raises(KeyError):  # rank 1, run first here, cannot see rank 0's tasks yet
        eval_trajectories(_ws(rollout, ranks.rank(1), 2), model, tasks)
    seen: list[int] = []
    dealt = eval_trajectories(_ws(rollout, ranks.rank(0), 2), model, tasks, on_batch=seen.append)
    assert [t.task_id for t in dealt] == [t.task_id for t in one] == [t.id for t in tasks]
    assert [t.token_ids for t in dealt] == [t.token_ids for t in one]
    assert sorted(ranks.store[0]) == [0, 2, 4, 6] and sorted(ranks.store[1]) == [1, 3, 5]
    assert sum(seen) == len(tasks)  # rank 0's progress reaches every task
