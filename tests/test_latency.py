"""Seeded heavy-tailed tool latency: deterministic per episode, heavy-tailed, inside the tool timeout."""

from __future__ import annotations

import statistics
import time

import pytest

from mentorrl.config import load_config
from mentorrl.envs.latency import LatencyModel, LatencySampler
from mentorrl.envs.orders import OrdersEnv, OrdersExpert, OrdersTasks
from mentorrl.envs.orders.world import snapshot


def draws(model: LatencyModel, episode_seed: int, n: int, tool: str = "get_order") -> list[float]:
    s = LatencySampler(model)
    s.reset(episode_seed)
    return [s(tool) for _ in range(n)]


def test_same_episode_same_delays_other_episode_other_delays():
    m = LatencyModel(kind="pareto", median_s=0.01, seed=3)
    assert draws(m, 7, 20) == draws(m, 7, 20)
    assert draws(m, 7, 20) != draws(m, 8, 20)
    assert draws(m, 7, 20) != draws(m.model_copy(update={"seed": 4}), 7, 20)


@pytest.mark.parametrize(
    "model",
    [
        LatencyModel(kind="lognormal", median_s=0.01, sigma=1.0, max_s=1e9),
        LatencyModel(kind="pareto", median_s=0.01, alpha=1.5, max_s=1e9),
    ],
)
def test_empirical_quantiles_match_the_model(model):
    xs = sorted(draws(model, 0, 20000))
    p50, p99 = xs[len(xs) // 2], xs[int(0.99 * len(xs))]
    assert p50 == pytest.approx(model.median_s, rel=0.05)
    assert p99 == pytest.approx(model.quantile(0.99), rel=0.15)
    assert p99 / p50 > 9  # heavy tail: P99 an order of magnitude above the median
    assert statistics.mean(xs) > p50  # right-skewed


def test_per_tool_multiplier_and_cap():
    m = LatencyModel(median_s=0.01, per_tool={"create_order": 10.0}, max_s=0.05, seed=1)
    a, b = draws(m, 5, 50, "get_order"), draws(m, 5, 50, "create_order")
    assert all(min(0.05, x * 10) == pytest.approx(y) for x, y in zip(a, b))
    assert max(b) <= 0.05


def test_orders_env_sleeps_inside_the_call():
    m = LatencyModel(kind="lognormal", median_s=0.03, sigma=0.1, seed=0)
    env = OrdersEnv(tool_timeout_s=5.0, latency=m)
    task = OrdersTasks().tasks("train", 1, 0)[0]
    try:
        env.reset(task)
        r = env.step("check_inventory", {"product": "widget"})
        assert r.latency_s >= 0.02
    finally:
        env.close()


def test_a_delay_past_the_timeout_times_out_and_never_commits():
    task = next(t for t in OrdersTasks().tasks("train", 200, 0) if t.family == "place_order" and t.reference["actions"])
    m = LatencyModel(kind="lognormal", median_s=1.0, sigma=0.01, per_tool={"find_customer": 0.0}, seed=0)
    env = OrdersEnv(tool_timeout_s=0.2, latency=m)
    try:
        env.reset(task)
        before = snapshot(env._conn)
        gen = OrdersExpert().act(task)
        action = next(gen)
        results = []
        while hasattr(action, "name"):
            r = env.step(action.name, action.arguments)
            results.append((action.name, r))
            if not r.ok:
                break
            action = gen.send(r)
        name, last = results[-1]
        assert name in ("check_inventory", "create_order") and last.error_kind == "timeout"
        time.sleep(1.2)  # long enough for the injected delay to have run out
        assert snapshot(env._conn).orders == before.orders  # the abandoned call did not run late
    finally:
        env.close()


def test_latency_is_configured_per_run():
    cfg = load_config(None, ["env.latency={kind: pareto, median_s: 0.005, alpha: 1.2}"])
    assert cfg.env.latency.kind == "pareto" and cfg.env.latency.alpha == 1.2
    assert load_config(None).env.latency is None


def test_episodes_of_one_task_draw_independent_delays_unless_told_otherwise():
    """GRPO's group members each get their own delays (reproducibly: the k-th episode of a task
    uses stream k); ``repeats: same`` gives every episode of a task the same delays."""
    m = LatencyModel(kind="pareto", median_s=0.01, seed=11)

    def episodes(model, n):
        out = []
        for _ in range(n):
            s = LatencySampler(model)
            s.start_episode(42)
            out.append([s("get_order") for _ in range(5)])
        return out

    ind = episodes(m, 3)
    assert ind[0] != ind[1] and ind[1] != ind[2] and ind[0] != ind[2]
    s = LatencySampler(m)
    s.reset(42, occurrence=1)
    assert [s("get_order") for _ in range(5)] in ind  # the same stream, whoever drew it
    same = episodes(m.model_copy(update={"repeats": "same"}), 3)
    assert same[0] == same[1] == same[2]


def test_whether_an_injected_delay_times_out_is_decided_by_its_value_not_the_clock(monkeypatch):
    """A draw at or past the timeout is a timeout however fast the machine; a draw just under it never
    is, however slow (the tool itself still gets the whole timeout)."""
    from mentorrl.envs.base import Tool, ToolRegistry

    ran: list[str] = []
    tool = Tool(name="get", description="", parameters={"type": "object", "properties": {}}, fn=lambda: ran.append("x"))
    slept: list[float] = []
    monkeypatch.setattr("mentorrl.envs.base.time.sleep", slept.append)  # the timeout is not waited for real
    at = ToolRegistry([tool], timeout_s=0.05, delay=lambda name: 0.05).call("get", {})
    assert (at.ok, at.error_kind, ran, slept) == (False, "timeout", [], [0.05])
    monkeypatch.undo()
    under = ToolRegistry([tool], timeout_s=0.05, delay=lambda name: 0.049)
    slow_tool = Tool(name="get", description="", parameters=tool.parameters, fn=lambda: time.sleep(0.03) or "ok")
    under.tools["get"] = slow_tool  # 0.049 s of injected delay + 0.03 s of work: past 0.05 s in wall time
    r = under.call("get", {})
    assert r.ok and r.content == "ok", r
