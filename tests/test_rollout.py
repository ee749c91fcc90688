"""Rollout: malformed tool calls never crash, limits end episodes, the batched engine."""

from __future__ import annotations

import threading
import time

import pytest
from engine_helpers import engine_run

from mentorrl.contract import IM_END, IM_START, render_tool_call
from mentorrl.rewards.compose import RewardWeights
from mentorrl.rollout.engine import RolloutEngine
from mentorrl.rollout.episode import Episode, run_text_turns
from mentorrl.trajectory import Trajectory

W = RewardWeights()


def play(contract, env, task, turns: list[str], **kw) -> Trajectory:
    """Drive an Episode with scripted policy turn texts (what a model would have written)."""
    return run_text_turns(contract, env, task, turns, **kw)


def observation_bodies(traj: Trajectory, tokenizer) -> list[str]:
    head, tail = f"\n{IM_START}tool\n", f"{IM_END}\n{IM_START}assistant\n"
    out = []
    for s in traj.segments:
        if s.role == "observation":
            text = tokenizer.decode(traj.token_ids[s.start : s.end], skip_special_tokens=False)
            assert text.startswith(head) and text.endswith(tail), text
            out.append(text[len(head) : -len(tail)])
    return out


ECHO = render_tool_call("echo", {"text": "hello"})
ECHO2 = render_tool_call("echo", {"text": "again"})

BAD_CALLS = {
    "malformed": '<tool_call>{"name": "echo", "arguments": {"text": </tool_call>',
    "unknown_tool": render_tool_call("launch_rockets", {"count": 3}),
    "bad_arguments": render_tool_call("echo", {"text": 5}),
    "tool_exception": render_tool_call("boom", {}),
    "timeout": render_tool_call("slow", {"seconds": 0.6}),
}
ERROR_SNIPPETS = {
    "malformed": "malformed tool call: invalid JSON",
    "unknown_tool": "unknown tool 'launch_rockets'",
    "bad_arguments": "bad arguments for echo",
    "tool_exception": "kaboom",
    "timeout": "timed out after 0.2s",
}


# ------------------------------------------------------ the five failure kinds ----
@pytest.mark.parametrize("kind", list(BAD_CALLS))
def test_bad_tool_call_becomes_error_observation_and_penalty(kind, toy_env, toy_task, make_contract):
    contract = make_contract(env=toy_env, max_total_tokens=1024)
    good = play(contract, toy_env, toy_task, [ECHO, ECHO2, "ok, done"])
    bad = play(contract, toy_env, toy_task, [ECHO, BAD_CALLS[kind], ECHO2, "ok, done"])

    # the good run: no errors, no penalty
    assert [c.ok for c in good.tool_calls] == [True, True]
    assert good.reward.runtime == 0.0 and good.reward.success

    # the bad call is recorded with its kind; the episode went on and ended normally
    assert [c.error_kind for c in bad.tool_calls] == [None, kind, None]
    call = bad.tool_calls[1]
    assert not call.ok and call.result is None and ERROR_SNIPPETS[kind] in call.error
    assert call.turn == 2
    assert bad.finish_reason == "answer" and bad.final_answer == "ok, done" and bad.num_turns == 4
    assert bad.tool_calls[2].result == {"echo": "again"}  # the registry recovers (also after a timeout)

    bodies = observation_bodies(bad, contract.tokenizer)
    assert len(bodies) == 3
    assert bodies[0] == '{"echo": "hello"}'
    assert bodies[1].startswith("error:") and bodies[1] == f"error: {call.error}"
    assert not bodies[2].startswith("error:")

    r = bad.reward
    assert r.runtime == pytest.approx(-W.error_penalty) and r.runtime < 0
    assert r.tool == pytest.approx(2 / 3)
    assert r.details["tool_errors"] == 1
    assert r.total == pytest.approx(1.0 + W.tool * 2 / 3 + W.format * 1.0 - W.runtime * W.error_penalty)
    assert r.total < good.reward.total
    assert r.success  # a failed call lowers the soft terms, not the tier


def test_timeout_is_enforced_quickly(toy_env, toy_task, make_contract):
    contract = make_contract(env=toy_env)
    traj = play(contract, toy_env, toy_task, [render_tool_call("slow", {"seconds": 5.0}), "ok"])
    call = traj.tool_calls[0]
    assert call.error_kind == "timeout"
    assert 0.15 < call.latency_s < 2.0  # cut at the 0.2 s limit, not after the tool's 5 s


def test_malformed_kinds_on_orders_env_then_success(find_task, orders_entry, make_contract):
    """Malformed JSON, an unknown tool and bad arguments on the real environment: three error
    observations, then the correct calls still succeed; reward is exactly the composed value."""
    task = find_task("cancel_order")
    env = orders_entry.make_env()
    contract = make_contract(env=env, max_turns=8, max_total_tokens=2048)
    email, oid = task.reference["request"]["email"], task.reference["request"]["order_id"]
    try:
        traj = play(
            contract,
            env,
            task,
            [
                '<tool_call>{"name": "find_customer", "arguments": {"email": "x"</tool_call>',
                render_tool_call("delete_customer", {"email": email}),
                render_tool_call("find_customer", {"mail": email}),
                render_tool_call("find_customer", {"email": email}),
                render_tool_call("cancel_order", {"order_id": oid}),
                render_tool_call("final_answer", {"outcome": "cancelled", "order_id": oid}),
            ],
        )
    finally:
        env.close()
    assert [c.error_kind for c in traj.tool_calls] == ["malformed", "unknown_tool", "bad_arguments", None, None]
    assert [c.name for c in traj.tool_calls][1:] == [
        "delete_customer",
        "find_customer",
        "find_customer",
        "cancel_order",
    ]
    assert traj.tool_calls[0].name is None and traj.tool_calls[0].arguments is None
    bodies = observation_bodies(traj, contract.tokenizer)
    assert [b.startswith("error:") for b in bodies] == [True, True, True, False, False]
    r = traj.reward
    assert r.success and r.task == 1.0 and not r.violations
    assert r.runtime == pytest.approx(-0.75)
    assert r.total == pytest.approx(1.0 + W.tool * 2 / 5 + W.format - W.runtime * 0.75)


def test_runtime_penalty_saturates(toy_env, toy_task, make_contract):
    contract = make_contract(env=toy_env, max_turns=10, max_total_tokens=2048)
    traj = play(contract, toy_env, toy_task, [ECHO] + [BAD_CALLS["unknown_tool"]] * 6 + ["ok"])
    assert traj.reward.runtime == -1.0
    assert traj.reward.success and traj.reward.total == pytest.approx(1.0 + W.tool * 1 / 7 + W.format - W.runtime)


# ------------------------------------------------------------------- limits ----
def test_max_turns_ends_episode(toy_env, toy_task, make_contract):
    contract = make_contract(env=toy_env, max_turns=2)
    traj = play(contract, toy_env, toy_task, [ECHO, ECHO2, ECHO, "ok"])
    assert traj.finish_reason == "max_turns"
    assert traj.num_turns == 2
    assert len(traj.tool_calls) == 1  # the tool call in the last allowed turn is not run
    assert traj.final_answer is None
    assert [s.role for s in traj.segments] == ["prompt", "policy", "observation", "policy"]
    r = traj.reward
    assert r.format == 0.0 and r.runtime == pytest.approx(-W.truncation_penalty) and not r.success


def test_answer_in_last_allowed_turn_is_an_answer(toy_env, toy_task, make_contract):
    contract = make_contract(env=toy_env, max_turns=2)
    traj = play(contract, toy_env, toy_task, [ECHO, "ok"])
    assert traj.finish_reason == "answer" and traj.reward.success and traj.reward.runtime == 0.0


def test_max_total_tokens_boundary(toy_env, toy_task, make_contract):
    """An observation that does not fit ends the episode with max_tokens; one more token of
    budget and it fits."""
    probe = make_contract(env=toy_env)
    P = len(probe.prompt_ids(toy_task.prompt))
    L = len(probe.policy_turn_ids(ECHO))
    O = len(probe.observation_ids('{"echo": "hello"}'))

    # the system turn is outside limits.max_total_tokens (tests/test_prompt_budget.py)
    tight = make_contract(env=toy_env, max_total_tokens=P + L + O - probe.system_tokens)
    traj = play(tight, toy_env, toy_task, [ECHO, "ok"])
    assert traj.finish_reason == "max_tokens"
    assert len(traj.token_ids) == P + L <= tight.max_total_tokens
    assert [s.role for s in traj.segments] == ["prompt", "policy"]
    assert len(traj.tool_calls) == 1 and traj.tool_calls[0].ok  # the call ran; its result did not fit
    assert traj.reward.runtime == pytest.approx(-W.truncation_penalty) and traj.reward.format == 0.0

    roomy = make_contract(env=toy_env, max_total_tokens=P + L + O + 1 - probe.system_tokens)
    ep = Episode(roomy, toy_env, toy_task)
    ep.start()
    ids = roomy.policy_turn_ids(ECHO)
    action = ep.add_policy_turn(ids, [0.0] * len(ids), stopped=True)
    assert ep.add_observation(ep.run_tool(action)) is not None
    assert ep.tokens_left() == 1 and not ep.done


def test_prompt_over_budget_raises(toy_env, toy_task, make_contract):
    probe = make_contract(env=toy_env)
    P = len(probe.prompt_ids(toy_task.prompt))
    with pytest.raises(ValueError, match="max_total_tokens"):
        Episode(make_contract(env=toy_env, max_total_tokens=P - probe.system_tokens), toy_env, toy_task).start()


def test_unstopped_turn_finish_reasons(toy_env, toy_task, make_contract):
    contract = make_contract(env=toy_env, max_total_tokens=1024)
    ep = Episode(contract, toy_env, toy_task)
    ep.start()
    assert ep.add_policy_turn([5, 6, 7], [-1.0, -1.0, -1.0], stopped=False) is None
    assert ep.finish_reason == "length"
    ep2 = Episode(contract, toy_env, toy_task)
    ep2.start()
    n = ep2.tokens_left()
    assert ep2.add_policy_turn([5] * n, [-1.0] * n, stopped=False) is None
    assert ep2.finish_reason == "max_tokens"
    with pytest.raises(RuntimeError):
        Episode(contract, toy_env, toy_task).finish()


def test_engine_respects_token_and_turn_limits(tool_happy_model, make_contract, orders_entry, orders_tasks):
    tasks = orders_tasks[20:30]
    probe = make_contract()
    budget = max(len(probe.prompt_ids(t.prompt)) for t in tasks) + 40
    contract = make_contract(max_new_tokens=16, max_turns=3, max_total_tokens=budget - probe.system_tokens)
    _, trajs = engine_run(tool_happy_model, contract, orders_entry, tasks, seed=3)
    reasons = {t.finish_reason for t in trajs}
    assert "max_tokens" in reasons, reasons
    for t in trajs:
        assert len(t.token_ids) <= budget
        assert t.num_turns <= 3
        last = t.segments[-1]
        turn_len = last.end - last.start
        if t.finish_reason == "max_tokens":
            assert last.role == "policy"
            if t.token_ids[-1] in contract.stop_token_ids:
                # a complete tool-call turn whose observation did not fit in what was left
                obs = contract.observation_ids(f"error: {t.tool_calls[-1].error}")
                assert t.tool_calls[-1].turn == t.num_turns and len(obs) >= budget - len(t.token_ids)
            else:
                assert len(t.token_ids) == budget  # the turn was cut exactly at the budget
        if t.finish_reason == "length":
            assert last.role == "policy" and turn_len == 16
            assert contract.im_end_id not in t.token_ids[last.start : last.end]
        if t.finish_reason == "max_turns":
            assert t.num_turns == 3 and last.role == "policy"
        if t.finish_reason == "answer":
            assert t.token_ids[-1] in contract.stop_token_ids

    contract = make_contract(max_new_tokens=24, max_turns=2, max_total_tokens=1024)
    _, trajs = engine_run(tool_happy_model, contract, orders_entry, orders_tasks[:12], seed=0)
    assert any(t.finish_reason == "max_turns" for t in trajs)
    assert all(t.num_turns <= 2 for t in trajs)


# ------------------------------------------------------------ batched engine ----
@pytest.mark.parametrize("decoder", ["slots", "hf"])
def test_engine_one_forward_pass_per_step(tool_happy_model, make_contract, orders_entry, orders_tasks, decoder):
    N = 24
    tasks = orders_tasks[40 : 40 + N]
    contract = make_contract()
    passes: list[int] = []  # the token embedding runs once per forward pass, in either decoder
    handle = tool_happy_model.get_input_embeddings().register_forward_hook(lambda mod, args, out: passes.append(1))
    try:
        engine, trajs = engine_run(tool_happy_model, contract, orders_entry, tasks, seed=1, decoder=decoder)
    finally:
        handle.remove()
    stats = engine.last_stats
    assert [t.task_id for t in trajs] == [t.id for t in tasks]  # input order
    total = sum(t.num_policy_tokens for t in trajs)
    assert stats["generated_tokens"] == total
    assert stats["forward_passes"] == len(passes)
    # one-at-a-time decoding needs at least one pass per generated token; batched is far below
    assert stats["forward_passes"] * 3 < total, stats
    # each pass gives every live row at most one token: the longest trajectory bounds it below
    decode_passes = stats["forward_passes"] - (1 if stats["shared_prefix"] else 0)
    assert decode_passes >= max(t.num_policy_tokens for t in trajs)
    assert stats["max_rows"] == N  # the first decode step carries every episode
    assert engine.run([], seed=0) == []


def test_engine_is_deterministic_given_seed(tool_happy_model, make_contract, orders_entry, orders_tasks):
    """Same seed, same trajectories, even when tool latency varies between runs."""
    contract = make_contract()
    tasks = orders_tasks[:6]

    def jittery(delays):
        class JitterEpisode(Episode):
            def run_tool(self, action):
                time.sleep(delays.pop(0) if delays else 0.0)
                return super().run_tool(action)

        return JitterEpisode

    _, a = engine_run(tool_happy_model, contract, orders_entry, tasks, episode_cls=jittery([0.0] * 50), seed=5)
    _, b = engine_run(tool_happy_model, contract, orders_entry, tasks, episode_cls=jittery([0.03, 0.0] * 25), seed=5)
    # tool_sync next_step (the default): every pass feeds the same rows whatever the tools' timing, so the
    # same seed gives the same trajectories bit for bit (issue 41, item 5)
    assert [t.token_ids for t in a] == [t.token_ids for t in b]
    assert [t.logprobs for t in a] == [t.logprobs for t in b]
    _, c = engine_run(
        tool_happy_model, contract, orders_entry, tasks, episode_cls=jittery([0.03, 0.0] * 25), seed=5, tool_sync="asap"
    )
    assert [t.token_ids for t in a] == [t.token_ids for t in c]
    # asap: log-probs agree to float noise (the batch layout of each step follows the tools' timing)
    for ta, tc in zip(a, c):
        assert max((abs(x - y) for x, y in zip(ta.logprobs, tc.logprobs)), default=0.0) < 1e-4


def test_an_unknown_tool_sync_is_refused(tool_happy_model, make_contract):
    with pytest.raises(ValueError, match="tool_sync 'later'"):
        RolloutEngine(tool_happy_model, make_contract(), tool_sync="later")


class _Gate:
    def __init__(self, n: int):
        self.n = n
        self.lock = threading.Lock()
        self.slow_id: str | None = None
        self.finished: list[str] = []
        self.others_done = threading.Event()
        self.unfinished_at_block: int | None = None
        self.released: bool | None = None
        self.finished_while_blocked: list[str] = []

    def on_finish(self, traj: Trajectory) -> None:
        with self.lock:
            self.finished.append(traj.task_id)
            others = [f for f in self.finished if f != self.slow_id]
            if self.slow_id is not None and len(others) == self.n - 1:
                self.others_done.set()


def test_slow_tool_does_not_block_other_trajectories(tool_happy_model, make_contract, orders_entry, orders_tasks):
    """The first tool call of the batch blocks until every *other* trajectory has finished.
    A rollout that waited on tools would deadlock here (the gate times out); the batched
    engine keeps decoding the others while that row is paused."""
    N = 6
    gate = _Gate(N)

    class GatedEpisode(Episode):
        def run_tool(self, action):
            with gate.lock:
                first = gate.slow_id is None
                if first:
                    gate.slow_id = self.task.id
                    gate.unfinished_at_block = N - len(gate.finished)
                    if len(gate.finished) == N - 1:
                        gate.others_done.set()
            if first:
                gate.released = gate.others_done.wait(timeout=15)
                gate.finished_while_blocked = list(gate.finished)
            return super().run_tool(action)

    contract = make_contract()
    tasks = orders_tasks[60 : 60 + N]
    engine, trajs = engine_run(
        tool_happy_model,
        contract,
        orders_entry,
        tasks,
        episode_cls=GatedEpisode,
        seed=2,
        on_finish=gate.on_finish,
        tool_sync="asap",  # next_step waits for every call of a step: this gate would hold the batch
    )
    assert gate.slow_id is not None, "no trajectory made a tool call"
    assert gate.unfinished_at_block >= 2, "others had already finished: nothing was tested"
    assert gate.released is True, "other trajectories stopped decoding while one tool was running"
    assert sorted(gate.finished_while_blocked) == sorted(t.id for t in tasks if t.id != gate.slow_id)
    assert gate.finished[-1] == gate.slow_id
    assert [t.task_id for t in trajs] == [t.id for t in tasks]
    slow = next(t for t in trajs if t.task_id == gate.slow_id)
    assert len(slow.tool_calls) >= 1


def test_slow_tool_wall_time(make_contract, orders_entry, orders_tasks, tool_happy_model):
    """A 0.3 s sleep inside one trajectory's tool call delays that trajectory, and the engine
    does not serialise it with the others' tool calls (they ran in parallel threads)."""
    N = 24
    calls: list[tuple[str, float, float]] = []
    lock = threading.Lock()

    class SleepyEpisode(Episode):
        def run_tool(self, action):
            t0 = time.perf_counter()
            time.sleep(0.3)
            res = super().run_tool(action)
            with lock:
                calls.append((self.task.id, t0, time.perf_counter()))
            return res

    contract = make_contract()
    tasks = orders_tasks[60 : 60 + N]
    engine, trajs = engine_run(
        tool_happy_model, contract, orders_entry, tasks, episode_cls=SleepyEpisode, seed=2, tool_sync="asap"
    )
    assert len(calls) >= 8
    # some tool calls of different trajectories overlapped in time
    overlaps = sum(
        1 for i, a in enumerate(calls) for b in calls[i + 1 :] if a[0] != b[0] and a[1] < b[2] and b[1] < a[2]
    )
    assert overlaps >= 1
    # the engine's wall time is well below running every sleep back to back
    assert engine.last_stats["wall_s"] < 0.3 * len(calls)


# ------------------------------------------------------- continuous batching ----
def _stream(model, contract, orders_entry, tasks, slots, decoder="auto", **kw):
    it = iter(tasks)

    def next_episode():
        t = next(it, None)
        return None if t is None else Episode(contract, orders_entry.make_env(), t)

    engine = RolloutEngine(model, contract, decoder=decoder)
    return engine, engine.run_stream(next_episode, slots=slots, close_envs=True, **kw)


@pytest.mark.parametrize("decoder", ["slots", "hf"])
def test_stream_admits_into_free_slots_and_matches_a_full_batch(
    tool_happy_model, make_contract, orders_entry, orders_tasks, decoder
):
    """Rows admitted mid-run (into a cache other rows have filled) see exactly their own context:
    the same seeds give the same trajectories as decoding all of them in one batch."""
    contract = make_contract()
    tasks = orders_tasks[80:88]
    engine, streamed = _stream(tool_happy_model, contract, orders_entry, tasks, slots=3, seed=4, decoder=decoder)
    _, batched = engine_run(tool_happy_model, contract, orders_entry, tasks, seed=4, decoder=decoder)
    assert engine.last_stats["admitted"] == len(tasks) and engine.last_stats["max_rows"] <= 3
    assert [t.task_id for t in streamed] == [t.id for t in tasks]  # admission order
    assert [t.token_ids for t in streamed] == [t.token_ids for t in batched]
    for a, b in zip(streamed, batched):
        assert max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0.0) < 1e-4


@pytest.mark.parametrize("decoder", ["slots", "hf"])
def test_stream_weight_sync_refills_the_cache_exactly(
    tool_happy_model, make_contract, orders_entry, orders_tasks, decoder
):
    """A sync (``before_step`` -> True) drops the KV cache and prefills every live row again; with
    unchanged weights the trajectories are the ones an uninterrupted run samples."""
    contract = make_contract()
    tasks = orders_tasks[90:96]
    calls = {"n": 0}

    def before_step() -> bool:
        calls["n"] += 1
        return calls["n"] % 7 == 0

    engine, synced = _stream(
        tool_happy_model, contract, orders_entry, tasks, slots=4, seed=9, before_step=before_step, decoder=decoder
    )
    _, plain = _stream(tool_happy_model, contract, orders_entry, tasks, slots=4, seed=9, decoder=decoder)
    assert engine.last_stats["weight_syncs"] >= 2
    assert [t.token_ids for t in synced] == [t.token_ids for t in plain]
    for a, b in zip(synced, plain):
        assert max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0.0) < 1e-4


def test_stream_stop_abandons_rows_in_flight(tool_happy_model, make_contract, orders_entry, orders_tasks):
    contract = make_contract()
    stop = threading.Event()
    produced: list[Trajectory] = []

    def on_finish(t: Trajectory) -> None:
        produced.append(t)
        if len(produced) == 3:
            stop.set()

    tasks = orders_tasks[:40]
    engine, out = _stream(
        tool_happy_model, contract, orders_entry, tasks, slots=4, seed=1, on_finish=on_finish, stop=stop
    )
    assert engine.last_stats["aborted"] == 1.0
    assert 3 <= len(out) < len(tasks) and engine.last_stats["admitted"] < len(tasks)


# ------------------------------------------------------------- untrusted values ----
@pytest.mark.parametrize("amount", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_numbers_are_bad_arguments(amount, find_task, orders_entry, make_contract):
    """``issue_refund(amount=NaN)`` passed the schema and the policy checks and only a NOT NULL
    constraint stopped it (with SQL text in the observation): it is refused before the tool runs."""
    task = find_task("refund")
    env = orders_entry.make_env()
    contract = make_contract(env=env, max_turns=8, max_total_tokens=2048)
    req = task.reference["request"]
    try:
        traj = play(
            contract,
            env,
            task,
            [
                render_tool_call("find_customer", {"email": req["email"]}),
                f'<tool_call>{{"name": "issue_refund", "arguments": {{"order_id": "{req["order_id"]}", '
                f'"amount": {amount}}}}}</tool_call>',
                "I could not refund that.",
            ],
        )
        refunds = env.step("get_order", {"order_id": req["order_id"]})
    finally:
        env.close()
    call = traj.tool_calls[1]
    assert call.name == "issue_refund" and call.error_kind == "bad_arguments"
    assert "amount: must be a finite number" in call.error and "NULL" not in call.error
    assert "must be a finite number" in observation_bodies(traj, contract.tokenizer)[1]
    assert refunds.ok and refunds.content["refunded"] == 0


def test_error_observations_do_not_echo_a_huge_value(toy_env, toy_task, make_contract):
    huge = "z" * 1_000_000
    for name, args in (("slow", {"seconds": huge}), ("echo", {"text": huge, huge: 1}), (huge, {})):
        r = toy_env.registry.call(name, args)  # jsonschema quotes the bad value; an unknown name is quoted too
        assert not r.ok and len(r.error) < 700 and "more characters" in r.error, r.error[:200]
    contract = make_contract(env=toy_env, max_total_tokens=8192)
    big = "z" * 3000
    traj = play(contract, toy_env, toy_task, [render_tool_call("slow", {"seconds": big}), ECHO, "ok, done"])
    assert [c.error_kind for c in traj.tool_calls] == ["bad_arguments", None] and traj.reward.success
    body = observation_bodies(traj, contract.tokenizer)[0]
    assert len(body) < 800 and body.startswith("error: bad arguments for slow: seconds:")


def test_deep_nesting_is_a_malformed_or_bad_call_never_a_crash(toy_env, toy_task, make_contract):
    contract = make_contract(env=toy_env, max_total_tokens=4096)
    traj = play(contract, toy_env, toy_task, ["<tool_call>" + "[" * 1000 + "</tool_call>", ECHO, "ok, done"])
    assert [c.error_kind for c in traj.tool_calls] == ["malformed", None] and traj.reward.success
    assert "nested deeper" in observation_bodies(traj, contract.tokenizer)[0]
    deep: list = []
    for _ in range(5000):  # nesting Python's json and jsonschema would recurse into
        deep = [deep]
    r = toy_env.registry.call("echo", {"text": deep})
    assert not r.ok and r.error_kind == "bad_arguments" and "nested deeper" in r.error
    r = toy_env.registry.call("slow", {"seconds": float("nan")})
    assert not r.ok and r.error_kind == "bad_arguments" and "seconds: must be a finite number" in r.error
