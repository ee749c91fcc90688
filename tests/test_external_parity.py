"""The external stage learns from what the in-process loop learns from (issue 55): recorded completions
are sampled as a rollout turn is (the run's temperature, top-p and max_new_tokens; no stop strings, no
seed, tool_choice auto), a recorded episode is scored by the environment's verifier by replaying the
policy's turns (the in-process reward, the in-process episode's end), the example agents end on the
typed-answer call, and a long-lived worker serves many episodes."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "examples"))


@pytest.fixture(scope="module")
def contract():
    from transformers import AutoTokenizer

    from mentorrl.contract import ContractLimits, PromptFormat, SamplingParams, chat_template_for, contract_for_env
    from mentorrl.envs import get_env
    from mentorrl.models.shipped import SHIPPED_ROOT

    tok = AutoTokenizer.from_pretrained(SHIPPED_ROOT / "orders-tiny")
    tok.chat_template = chat_template_for(PromptFormat(system_turn=False))
    env = get_env("orders").make_env()
    try:
        return contract_for_env(
            tok,
            env,
            SamplingParams(temperature=1.0, max_new_tokens=80),
            ContractLimits(max_turns=6, max_total_tokens=768),
            PromptFormat(system_turn=False),
        )
    finally:
        env.close()


def _expert_episode(contract, family: str):
    """A task of ``family`` and the scripted expert's in-process trajectory (its verified reward)."""
    from mentorrl.envs import get_env
    from mentorrl.rollout.episode import run_scripted_episode

    entry = get_env("orders")
    task = next(t for t in entry.make_tasks().tasks("train", 200, 0) if t.family == family)
    env = entry.make_env()
    try:
        traj = run_scripted_episode(contract, env, task, entry.make_expert())
    finally:
        env.close()
    assert traj.reward.success and traj.finish_reason == "answer"
    return entry, task, traj


def _recorded(traj, extra_turns=()):
    """``traj`` as the recorder holds it, with ``extra_turns`` (observation ids, policy ids) after it:
    what an agent that goes on past the typed answer records."""
    from mentorrl.rollout.recorder import RecordedSegment

    seg = RecordedSegment(list(traj.token_ids), list(traj.loss_mask), list(traj.logprobs), [0] * traj.num_turns)
    seg.turns = traj.num_turns
    for obs, pol in extra_turns:
        seg.add(obs, policy=False)
        seg.add(pol, policy=True, logprobs=[-0.5] * len(pol))
        seg.versions.append(0)
        seg.turns += 1
    return seg


# ---- the reward: the verifier's, by replay ----------------------------------------------------------
def test_the_external_stage_is_scored_by_the_verifier_by_default():
    from mentorrl.config.external import ExternalConfig

    assert ExternalConfig().reward == "verifier"


def test_a_replayed_episode_gets_the_in_process_reward_and_end(contract):
    from mentorrl.rollout.recorder import RecordedEpisode
    from mentorrl.rollout.rescore import replay_episode
    from mentorrl.train.recipes.external import episode_trajectories

    entry, task, traj = _expert_episode(contract, "order_status")
    obs = contract.observation_ids("error: final_answer ends the episode; it is read, never run as a tool")
    junk = contract.policy_turn_ids("The order is shipped.")
    seg = _recorded(traj, [(obs, junk)])  # the old example agent: it ran final_answer and went on
    got = replay_episode([seg], task, contract, entry.make_env)
    assert got.trajectory.reward.total == pytest.approx(traj.reward.total)
    assert got.trajectory.reward.success and got.trajectory.finish_reason == "answer"
    assert got.counts["turns_cut"] == 1 and got.counts["observations_differ"] == 0
    assert [s.token_ids for s in got.segments] == [traj.token_ids]  # cut where the in-process episode ends
    assert got.segments[0].loss_mask == traj.loss_mask and got.segments[0].turns == traj.num_turns
    ep = RecordedEpisode("e1", task.id, "closed", -7.0, {"success": False}, seg.turns, [seg])
    (t,) = episode_trajectories(ep, task, contract, got)
    assert t.reward.total == pytest.approx(traj.reward.total) and t.token_ids == traj.token_ids
    assert t.final_answer == traj.final_answer and [c.name for c in t.tool_calls] == [c.name for c in traj.tool_calls]


def test_a_replay_cuts_turns_at_the_run_limits(contract):
    from mentorrl.rollout.rescore import replay_episode

    entry, task, traj = _expert_episode(contract, "order_status")
    first_turn = next(s for s in traj.segments if s.role == "policy")
    head = traj.token_ids[: first_turn.start]
    long_turn = contract.policy_turn_ids("x " * 200)  # over max_new_tokens, as a client's own limit could allow
    from mentorrl.rollout.recorder import RecordedSegment

    seg = RecordedSegment()
    seg.add(head, policy=False)
    seg.add(long_turn, policy=True, logprobs=[-1.0] * len(long_turn))
    seg.versions, seg.turns = [0], 1
    got = replay_episode([seg], task, contract, entry.make_env)
    assert got.trajectory.finish_reason == "length" and not got.trajectory.reward.success
    assert sum(got.segments[0].loss_mask) == contract.sampling.max_new_tokens


def test_an_agent_that_stops_early_ends_without_an_answer(contract):
    from mentorrl.rollout.rescore import replay_episode

    entry, task, traj = _expert_episode(contract, "order_status")
    first = next(s for s in traj.segments if s.role == "policy")
    seg = _recorded(SimpleNamespace(**{**traj.__dict__, "num_turns": 1}))
    seg.token_ids, seg.loss_mask, seg.logprobs = (x[: first.end] for x in (seg.token_ids, seg.loss_mask, seg.logprobs))
    seg.versions, seg.turns = [0], 1
    got = replay_episode([seg], task, contract, entry.make_env)
    assert got.counts["agent_stopped"] == 1 and got.trajectory.final_answer is None
    assert not got.trajectory.reward.success and got.trajectory.finish_reason == "max_turns"


# ---- the sampling: the contract's ----------------------------------------------------------------
def test_recording_mode_samples_as_a_rollout_turn():
    from mentorrl.serve.protocol import ChatRequest
    from mentorrl.serve.recording import RecordingHook, RunSampling

    hook = RecordingHook(SimpleNamespace(), "k", lambda: 0, RunSampling(1.0, 1.0, 80))
    msgs = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    asked = ChatRequest(
        messages=msgs,
        tools=tools,
        temperature=0.2,
        top_p=0.9,
        max_tokens=12,
        stop=["\n"],
        seed=3,
        tool_choice="required",
    )
    got = hook._run_sampling(asked)
    assert (got.temperature, got.top_p, got.max_tokens, got.max_completion_tokens) == (1.0, 1.0, 80, None)
    assert got.stop is None and got.seed is None and got.tool_choice is None
    assert hook._run_sampling(ChatRequest(messages=msgs, max_completion_tokens=5)).max_completion_tokens is None
    assert hook.stats["overridden"] == 2
    for plain in (ChatRequest(messages=msgs), ChatRequest(messages=msgs, max_tokens=500, tool_choice="auto")):
        assert hook._run_sampling(plain) is plain  # already a rollout turn's sampling: not counted
    assert hook.stats["overridden"] == 2


# ---- the example agent: it ends on the typed answer ---------------------------------------------------
class _ScriptedClient:
    """An OpenAI client stand-in whose replies are the expert's turns as tool calls."""

    def __init__(self, turns):
        self.turns, self.requests = list(turns), 0
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    def create(self, **_):
        self.requests += 1
        name, args = self.turns.pop(0)
        fn = SimpleNamespace(
            name=name, arguments=json.dumps(args), model_dump=lambda: {"name": name, "arguments": json.dumps(args)}
        )
        call = SimpleNamespace(id=f"call-{self.requests}", function=fn)
        return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content=None, tool_calls=[call]))])


def test_the_example_agent_ends_on_the_typed_answer_and_succeeds():
    import orders_agent

    from mentorrl.envs import get_env
    from mentorrl.envs.base import FinalAnswer

    entry = get_env("orders")
    task = next(t for t in entry.make_tasks().tasks("train", 200, 0) if t.family == "order_status")
    env = entry.make_env()
    try:
        env.reset(task)
        gen, turns = entry.make_expert().act(task), []
        action = next(gen)
        while not isinstance(action, FinalAnswer):
            turns.append((action.name, action.arguments))
            action = gen.send(env.step(action.name, action.arguments))
        turns.append((env.answer_tool, action.record))
        client = _ScriptedClient(turns)
        answer, results = orders_agent.run_episode(client, env, task, {}, False, 6)
        assert client.requests == len(turns) and not client.turns  # no request after the answer
        assert len(results) == len(turns) - 1  # final_answer was never run as a tool
        assert env.verify(answer).success
    finally:
        env.close()


# ---- the worker mode ---------------------------------------------------------------------------------
WORKER = textwrap.dedent(
    """
    import json, os, sys, time
    assert os.environ["MENTORRL_WORKER"] == "1" and os.environ["BASE"] == "b"
    for line in sys.stdin:
        job = json.loads(line)
        k = job["env"]["K"]
        if k == "die":
            sys.exit(9)
        if k == "hang":
            continue
        out = {"episode_id": job["episode_id"], "ok": k == "ok", "timings": {"model_s": 0.5, "tools_s": 0.25, "episode_s": 1.0}}
        if k != "ok":
            out["error"] = "boom"
        print("a stray line the stage ignores", flush=True)
        print(json.dumps(out), flush=True)
    """
)


def test_a_worker_serves_many_episodes_from_one_process(tmp_path):
    from mentorrl.train.agents import AgentJob, AgentWorker

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    w = AgentWorker([sys.executable, str(script)], {"BASE": "b"}, concurrency=2)
    try:
        jobs = [AgentJob(f"e{i}", {"K": k}) for i, k in enumerate(["ok", "ok", "bad", "ok"])]
        out = w.run(jobs, timeout_s=30)
        assert [o.status for o in out] == ["ok", "ok", "nonzero", "ok"] and out[2].stderr_tail == "boom"
        assert out[0].timings == {"model_s": 0.5, "tools_s": 0.25, "episode_s": 1.0}
        pid = w.proc.pid
        out = w.run([AgentJob("e9", {"K": "ok"}), AgentJob("e10", {"K": "hang"})], timeout_s=1)
        assert [o.status for o in out] == ["ok", "timeout"] and w.proc.pid == pid and w.starts == 1  # one process
        out = w.run([AgentJob("e11", {"K": "die"})], timeout_s=30)
        assert [o.status for o in out] == ["crashed"]
        assert w.run([AgentJob("e12", {"K": "ok"})], timeout_s=30)[0].status == "ok" and w.starts == 2  # restarted
    finally:
        w.close()


def test_the_time_breakdown_adds_up():
    from mentorrl.train.agents import AgentOutcome
    from mentorrl.train.recipes.external import time_breakdown

    timed = [
        AgentOutcome(f"e{i}", "ok", 0, 1.2, 0.0, "", {"model_s": 0.6, "tools_s": 0.1, "episode_s": 1.0})
        for i in range(4)
    ]
    got = time_breakdown(timed, 2.0, {"busy_s": 1.5, "calls": 3, "rows": 12}, 0.3)
    assert got["time_http_json_s"] == pytest.approx(0.4) and got["time_tools_s"] == pytest.approx(0.4)
    assert got["time_agent_process_s"] == pytest.approx(1.2) and got["gen_rows_per_call"] == 4.0
    assert got["time_generate_wall_s"] == 1.5 and got["time_worker_start_s"] == 0.3
    plain = [AgentOutcome("e", "ok", 0, 3.0, 0.0)]
    assert time_breakdown(plain, 1.0, {}, None) == {
        "time_server_s": 1.0,
        "time_agent_s": 3.0,
        "time_agent_process_s": 2.0,
    }
