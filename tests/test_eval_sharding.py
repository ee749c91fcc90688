"""A data-parallel launch deals its evaluation batches over the ranks (``eval_trajectories``): the gathered
trajectories are the ones a single process rolls out, token for token, because each batch is rolled out
alone with the seed of its offset, as ``Rollout.run`` seeds it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mentorrl.rollout import Rollout
from mentorrl.train.workspace import eval_batches, eval_trajectories


@given(n=st.integers(0, 400), bs=st.integers(1, 64), world=st.integers(1, 8))
def test_eval_batches_deal_every_batch_to_exactly_one_rank(n, bs, world):
    dealt = [lo for r in range(world) for lo in eval_batches(n, bs, r, world)]
    assert sorted(dealt) == list(range(0, n, bs))
    sizes = [len(eval_batches(n, bs, r, world)) for r in range(world)]
    assert max(sizes) - min(sizes) <= 1  # round-robin: no rank has two batches more than another


class _Ranks:
    """Two ranks of a DDP launch, run one after the other in this process: ``all_gather`` returns what
    every rank has put so far (rank 1 runs first, so rank 0 sees both)."""

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


def test_dealt_evaluation_equals_the_single_process_rollout(model, make_contract, orders_entry, orders_tasks):
    rollout = Rollout(make_contract(max_new_tokens=16, max_turns=3), orders_entry.make_env)
    tasks, bs = orders_tasks[:7], 2  # 4 batches (2, 2, 2, 1) over 2 ranks
    one = eval_trajectories(_ws(rollout, None, bs), model, tasks)
    ranks = _Ranks(2)
    seen: list[int] = []
    with pytest.raises(KeyError):  # rank 1, run first here, cannot see rank 0's batches yet
        eval_trajectories(_ws(rollout, ranks.rank(1), bs), model, tasks)
    dealt = eval_trajectories(_ws(rollout, ranks.rank(0), bs), model, tasks, on_batch=seen.append)
    assert [t.task_id for t in dealt] == [t.task_id for t in one] == [t.id for t in tasks]
    assert [t.token_ids for t in dealt] == [t.token_ids for t in one]
    assert [t.logprobs for t in dealt] == [t.logprobs for t in one]
    assert sorted(ranks.store[0]) == [0, 4] and sorted(ranks.store[1]) == [2, 6]  # each rank rolled out its own
    assert sum(seen) == len(tasks)  # rank 0's progress reaches every task
