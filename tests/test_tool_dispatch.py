"""Where the rollout engine runs tool calls and verifications (``mentorrl.rollout.dispatch``):
cheap kinds inline in the decode loop, slow or CPU-heavy ones in the pool, decided by measurement,
with the same trajectories either way."""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest
from engine_helpers import engine_run

from mentorrl.rollout import dispatch as D


@pytest.fixture(autouse=True)
def _fresh():
    D.forget()
    yield
    D.forget()


def _calls(disp: D.Dispatch, kind, fn, n: int) -> list:
    return [disp.submit(kind, fn).result(timeout=10) for _ in range(n)]


def test_a_cheap_kind_moves_inline_after_its_first_pool_calls():
    with cf.ThreadPoolExecutor(2) as pool:
        disp = D.Dispatch(pool, inline_s=0.005)
        assert _calls(disp, "k", lambda: 7, D.MIN_SAMPLES) == [7] * D.MIN_SAMPLES
        assert disp.stats == {"inline_calls": 0, "pool_calls": D.MIN_SAMPLES}
        fut = disp.submit("k", lambda: 8)
        assert fut.done() and fut.result() == 8 and disp.stats["inline_calls"] == 1


def test_waiting_and_cpu_heavy_kinds_stay_in_the_pool():
    def sleeps():  # little CPU, long wall time: a network call or a subprocess
        time.sleep(0.06)

    def burns():  # 20 ms of CPU
        t = time.thread_time()
        while time.thread_time() - t < 0.02:
            pass

    with cf.ThreadPoolExecutor(2) as pool:
        disp = D.Dispatch(pool, inline_s=0.005)
        for fn, kind in ((sleeps, "sleep"), (burns, "burn")):
            _calls(disp, kind, fn, D.MIN_SAMPLES + 3)
        assert disp.stats["inline_calls"] == 0
        assert not D.runs_inline("sleep", 0.005) and not D.runs_inline("burn", 0.005)


def test_a_kind_that_turns_slow_goes_back_to_the_pool():
    slow = {"on": False}

    def call():
        if slow["on"]:
            time.sleep(0.08)

    with cf.ThreadPoolExecutor(1) as pool:
        disp = D.Dispatch(pool, inline_s=0.005)
        _calls(disp, "k", call, D.MIN_SAMPLES + 2)
        assert D.runs_inline("k", 0.005)
        slow["on"] = True
        _calls(disp, "k", call, D.WINDOW // 2 + 1)  # measured inline: wall time is the call's own
        assert not D.runs_inline("k", 0.005)


def test_zero_threshold_always_uses_the_pool_and_errors_surface_the_same_way():
    def boom():
        raise ValueError("bad call")

    with cf.ThreadPoolExecutor(1) as pool:
        never = D.Dispatch(pool, inline_s=0.0)
        _calls(never, "k", lambda: 1, D.MIN_SAMPLES + 2)
        assert never.stats["inline_calls"] == 0
        disp = D.Dispatch(pool, inline_s=0.005)
        for _ in range(D.MIN_SAMPLES + 2):  # in the pool first, inline after: the same ValueError from result()
            with pytest.raises(ValueError, match="bad call"):
                disp.submit("boom", boom).result(timeout=10)
        assert disp.stats["inline_calls"] >= 1


def test_model_written_tool_names_cannot_grow_the_measurements_without_bound():
    for i in range(D.MAX_KINDS + 50):
        D.record(("tool", "Env", f"name-{i}"), 0.0, 0.0)
    assert len(D._COSTS) == D.MAX_KINDS
    assert not D.runs_inline(("tool", "Env", f"name-{D.MAX_KINDS + 10}"), 0.005)


def test_the_engine_samples_the_same_trajectories_inline_or_in_the_pool(
    tool_happy_model, make_contract, orders_entry, orders_tasks
):
    contract = make_contract()
    tasks = [t for t in orders_tasks[30:36] for _ in range(3)]

    def run(inline_s):
        return engine_run(tool_happy_model, contract, orders_entry, tasks, seed=5, inline_tool_s=inline_s)

    pool_eng, a = run(0.0)
    D.forget()
    run(10.0)  # a first rollout measures each kind (its first calls go to the pool)
    inline_eng, b = run(10.0)
    assert pool_eng.last_stats["inline_calls"] == 0
    assert inline_eng.last_stats["inline_calls"] > inline_eng.last_stats["pool_calls"]
    assert sum(len(t.tool_calls) for t in a) >= 10
    assert [t.token_ids for t in a] == [t.token_ids for t in b]
    assert [t.reward.total for t in a] == [t.reward.total for t in b]
    assert [t.reward.success for t in a] == [t.reward.success for t in b]


def test_the_run_config_sets_the_threshold(model, make_contract):
    from pydantic import ValidationError

    from mentorrl.config import RolloutConfig
    from mentorrl.rollout import BackendChoice

    contract = make_contract()
    assert BackendChoice(RolloutConfig(inline_tool_ms=0)).for_model(model, contract).inline_tool_s == 0.0
    assert BackendChoice(RolloutConfig()).for_model(model, contract).inline_tool_s == pytest.approx(0.005)
    with pytest.raises(ValidationError):
        RolloutConfig(inline_tool_ms=-1)


class _Clock:
    """A stand-in for the ``time`` module :mod:`mentorrl.rollout.dispatch` measures with: every reading
    advances by ``tick`` seconds, so each call measures ``tick`` (0: instant; 1.0: a second, wall and CPU)."""

    def __init__(self, tick: float):
        self.tick, self.now = tick, 0.0

    def _read(self) -> float:
        self.now += self.tick
        return self.now

    perf_counter = thread_time = _read


def test_fake_fast_or_slow_clocks_change_where_calls_run_and_nothing_in_the_rollout(
    tool_happy_model, make_contract, orders_entry, orders_tasks, monkeypatch
):
    """The one decision the engine takes from measured time: under a clock that says every call was
    instant, each kind runs inline after its first calls; under one that says each took a second,
    every call stays in the pool. The trajectories (tokens, log-probs, rewards) are the same, bit for bit."""
    contract = make_contract()
    tasks = [t for t in orders_tasks[30:36] for _ in range(3)]
    out = {}
    for name, tick in (("fast", 0.0), ("slow", 1.0)):
        D.forget()
        monkeypatch.setattr(D, "time", _Clock(tick))
        engine, trajs = engine_run(tool_happy_model, contract, orders_entry, tasks, seed=11)
        out[name] = (engine.last_stats, trajs)
    (fast, a), (slow, b) = out["fast"], out["slow"]
    assert fast["inline_calls"] > fast["pool_calls"] and slow["inline_calls"] == 0
    assert sum(len(t.tool_calls) for t in a) >= 10
    assert [t.token_ids for t in a] == [t.token_ids for t in b]
    assert [t.logprobs for t in a] == [t.logprobs for t in b]
    assert [t.reward.model_dump() for t in a] == [t.reward.model_dump() for t in b]
    assert [[c.model_dump(exclude={"latency_s"}) for c in t.tool_calls] for t in a] == [
        [c.model_dump(exclude={"latency_s"}) for c in t.tool_calls] for t in b
    ]
