"""``stage: external``: an agent outside mentorrl's loop (docs/examples/orders_agent.py, the official
``openai`` client), served and recorded over HTTP by ``mentorrl serve``'s recording mode.

(a) its recorded tokens equal an in-process rollout's for the same conversation (ids, loss mask,
log-probs within 1e-5); (b) a diverged history (edited, truncated, re-templated) is detected, counted
and never mixed; (c) a missing reward, a timeout, a crash, a non-zero exit are dropped and counted;
(d) ``mentorrl train`` with ``recipe: [external]`` trains the real agent end to end; (e) the reward
endpoint refuses a wrong key."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
AGENT = ROOT / "docs" / "examples" / "orders_agent.py"
MAX_TURNS = 3


@pytest.fixture(scope="module")
def shipped():
    """The shipped tiny base with its own tokenizer (its chat template set for ``system_turn: false``)."""
    from mentorrl.contract import PromptFormat, chat_template_for
    from mentorrl.models.build import load_policy
    from mentorrl.models.shipped import SHIPPED_ROOT

    tok, model = load_policy(SHIPPED_ROOT / "orders-tiny")
    tok.chat_template = chat_template_for(PromptFormat(system_turn=False))
    model.eval()
    return tok, model


@pytest.fixture(scope="module")
def contract(shipped):
    from mentorrl.contract import ContractLimits, PromptFormat, SamplingParams, contract_for_env
    from mentorrl.envs import get_env

    env = get_env("orders").make_env()
    try:
        return contract_for_env(
            shipped[0],
            env,
            SamplingParams(temperature=0.0, max_new_tokens=48),
            ContractLimits(max_turns=MAX_TURNS, max_total_tokens=2048),
            PromptFormat(system_turn=False),
        )
    finally:
        env.close()


@contextlib.contextmanager
def recording(tmp_path, shipped, contract, version=lambda: 0):
    from mentorrl.rollout.recorder import Recorder
    from mentorrl.serve.recording import RunSampling, start_recording_server

    tok, model = shipped
    rec = Recorder(
        tmp_path / "rec.sqlite",
        close_id=contract.im_end_id,
        stop_ids=contract.stop_token_ids,
        decode=lambda ids: tok.decode(ids, skip_special_tokens=False),
    )
    s = contract.sampling
    server, hook = start_recording_server(
        tok, model, rec, RunSampling(s.temperature, s.top_p, s.max_new_tokens), version, "api-key", "reward-key"
    )
    try:
        yield server, hook, rec
    finally:
        server.stop()
        rec.close()


def agent_env_for(server, eid, task):
    from mentorrl.train.recipes.external import agent_env

    return {**agent_env(server.url, "api-key", "reward-key", eid, task), "PYTHONPATH": str(ROOT)}


def test_external_episode_records_what_the_in_process_rollout_records(tmp_path, shipped, contract):
    from mentorrl.envs import get_env
    from mentorrl.rollout.runner import rollout_tasks
    from mentorrl.train.agents import AgentJob, run_agents

    entry = get_env("orders")
    tasks = entry.make_tasks().tasks("train", 2, 0)
    trajs = rollout_tasks(shipped[1], contract, entry.make_env, tasks)
    assert all(not any(c.error_kind == "malformed" for c in t.tool_calls) for t in trajs)
    with recording(tmp_path, shipped, contract) as (server, hook, rec):
        hook.resume()
        jobs = []
        for task in tasks:
            eid = f"eq-{uuid.uuid4().hex[:8]}"
            rec.open_episode(eid, task.id)
            jobs.append(AgentJob(eid, agent_env_for(server, eid, task)))
        argv = [sys.executable, str(AGENT), "--no-system", "--max-turns", str(MAX_TURNS)]
        outcomes = run_agents(argv, jobs, concurrency=2, timeout_s=300)
        assert [o.status for o in outcomes] == ["ok", "ok"], [o.stderr_tail for o in outcomes]
        for job, traj in zip(jobs, trajs):
            ep = rec.episode(job.episode_id)
            assert ep.reward is not None and "success" in ep.details  # the agent's own verdict, posted
            assert len(ep.segments) == 1 and ep.completions == traj.num_turns
            seg = ep.segments[0]
            assert seg.token_ids == traj.token_ids
            assert seg.loss_mask == traj.loss_mask
            gap = (torch.tensor(seg.logprobs) - torch.tensor(traj.logprobs)).abs().max().item()
            assert gap < 1e-5, gap
            assert [(r, a, b) for r, a, b in seg.spans()] == [(s.role, s.start, s.end) for s in traj.segments]
        assert rec.counters()["diverged_edited"] == 0


def test_divergence_over_http_is_counted_and_never_mixed(tmp_path, shipped, contract):
    from openai import APIStatusError, OpenAI

    with recording(tmp_path, shipped, contract) as (server, hook, rec):
        hook.resume()
        client = OpenAI(base_url=server.url, api_key="api-key", max_retries=0)
        rec.open_episode("div", "t1")
        head = {"X-Mentorrl-Episode": "div", "X-Mentorrl-Task": "t1"}
        user = {"role": "user", "content": "Where is order O-557?"}

        def ask(messages):
            r = client.chat.completions.create(model="p", messages=messages, extra_headers=head, temperature=0.7)
            m = r.choices[0].message
            if m.tool_calls:
                calls = [{"id": c.id, "type": "function", "function": c.function.model_dump()} for c in m.tool_calls]
                return {"role": "assistant", "content": m.content, "tool_calls": calls}
            return {"role": "assistant", "content": m.content}

        first = ask([user])
        tool = {"role": "tool", "tool_call_id": "x", "content": '{"order_id": "O-557"}'}
        ask([user, first, tool])  # faithful: the same segment
        assert len(rec.episode("div").segments) == 1
        ask([user])  # truncated: the history cut back to the first prompt
        ask([{"role": "user", "content": "Where is order O-558?"}, first, tool])  # edited
        ask([{"role": "system", "content": "Be brief."}, user, first, tool])  # re-templated (a system turn)
        c = rec.counters()
        assert c["diverged_edited"] == 2 and c["diverged_truncated"] == 1, c
        assert hook.stats["overridden"] == 5  # the run's temperature, not the request's
        segs = rec.episode("div").segments
        assert len(segs) == 4
        for seg in segs:  # every segment is one prompt and what the policy sampled after it, nothing else
            assert seg.loss_mask[0] == 0 and seg.spans()[0][0] == "prompt"
        with pytest.raises(APIStatusError) as e:  # recording mode needs an episode id
            client.chat.completions.create(model="p", messages=[user])
        assert e.value.status_code == 400
        with pytest.raises(APIStatusError) as e:
            client.chat.completions.create(model="p", messages=[user], extra_headers={"X-Mentorrl-Episode": "nope"})
        assert e.value.status_code == 404
        hook.pause()
        with pytest.raises(APIStatusError) as e:  # the learner is updating: retry later
            client.chat.completions.create(model="p", messages=[user], extra_headers=head)
        assert e.value.status_code == 503


def test_reward_endpoint_refuses_a_wrong_key(tmp_path, shipped, contract):
    with recording(tmp_path, shipped, contract) as (server, hook, rec):
        rec.open_episode("e1", "t1")
        root = server.url[: -len("/v1")]
        url = f"{root}/mentorrl/episodes/e1/reward"
        body = {"reward": 1.0, "details": {"success": True}}
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": "Bearer api-key"},
            {"Authorization": "reward-key"},
        ):
            r = httpx.post(url, json=body, headers=headers)
            assert r.status_code == 401 and "reward-key" not in r.text
        assert rec.rewards(["e1"]) == {}
        ok = {"Authorization": "Bearer reward-key"}
        assert httpx.post(url, json=body, headers=ok).status_code == 200
        assert rec.rewards(["e1"]) == {"e1": 1.0}
        assert httpx.post(f"{root}/mentorrl/episodes/zz/reward", json=body, headers=ok).status_code == 404
        assert httpx.post(url, json={"reward": "NaN"}, headers=ok).status_code in (400, 422)
        assert httpx.get(f"{root}/mentorrl/stats", headers=ok).json()["recorder"]["rewards"] == 1
        assert httpx.get(f"{server.url}/models").status_code == 401  # /v1 keeps the API key


FLAKY = """
import os, signal, sys, time
from openai import OpenAI
k = int(os.environ["MENTORRL_EPISODE_ID"].split("-")[2])
if k <= 1:
    sys.path.insert(0, {docs!r})
    import orders_agent
    sys.exit(orders_agent.main(["--no-system", "--max-turns", "{turns}"]))
if k == 2:
    sys.exit(3)
if k == 3:  # one completion, then no reward
    OpenAI().chat.completions.create(model="p", messages=[{{"role": "user", "content": "hi"}}],
        extra_headers={{"X-Mentorrl-Episode": os.environ["MENTORRL_EPISODE_ID"]}})
    sys.exit(0)
if k == 4:
    time.sleep(120)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _ws(tmp_path, tok, *overrides):
    from mentorrl.config import load_config
    from mentorrl.train.workspace import open_workspace

    cfg = load_config(
        None,
        [
            f"run_dir={tmp_path / 'run'}",
            "threads=1",
            "recipe=[external]",
            "prompt.system_turn=false",
            "sampling.max_new_tokens=48",
            f"limits.max_turns={MAX_TURNS}",
            "audit.preflight=false",
            "eval.num_tasks=0",
            *overrides,
        ],
    )
    ws = open_workspace(cfg, show_progress=False)
    ws.bind_tokenizer(tok)
    return ws


def test_failed_episodes_are_dropped_and_counted(tmp_path, shipped, monkeypatch):
    from mentorrl.train.registry import get_stage, resolve_runner

    script = tmp_path / "flaky.py"
    script.write_text(FLAKY.format(docs=str(AGENT.parent), turns=MAX_TURNS))
    tok, model = shipped
    ws = _ws(
        tmp_path,
        copy.deepcopy(tok),
        f"external.agent=[{sys.executable}, {script}]",
        "external.steps=1",
        "external.tasks_per_step=1",
        "external.samples_per_task=6",
        "external.concurrency=6",
        "external.episode_timeout_s=30",  # the sleeping agent is timed out after this
        "external.reward_timeout_s=1",
        "external.reward=agent",  # the harness's rewards: a missing one drops its episode
    )
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # the agents import mentorrl from this checkout
    final = resolve_runner(get_stage("external"))(ws, copy.deepcopy(model))
    assert (final / "model.safetensors").exists()
    rec = json.loads((ws.run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert rec["agent_ok"] == 3 and rec["agent_nonzero"] == 1 and rec["agent_timeout"] == 1, rec
    assert rec["agent_crashed"] == 1 and rec["dropped_failed"] == 3
    assert rec["dropped_no_reward"] == 1 and rec["episodes_used"] == 2 and rec["rollouts"] >= 2
    fails = (ws.run_dir / "external" / "failures-step-000001.jsonl").read_text()
    assert "api-key" not in fails and "OPENAI_API_KEY" not in fails


@pytest.mark.slow
def test_mentorrl_train_external_trains_the_real_agent(tmp_path):
    """``mentorrl train`` with ``recipe: [external]``: the agent script for three steps, SIGKILLed after
    its first checkpoint and resumed with ``--resume``; every step logged once, the weights move."""
    import signal
    import time

    from safetensors.torch import load_file

    from mentorrl.models.shipped import SHIPPED_ROOT

    run = tmp_path / "run"
    recipe = tmp_path / "external.yaml"
    recipe.write_text(
        f"""
run_dir: {run}
threads: 1
recipe: [external]
model: {{path: {SHIPPED_ROOT / "orders-tiny"}}}
prompt: {{system_turn: false}}
sampling: {{max_new_tokens: 48}}
limits: {{max_turns: {MAX_TURNS}}}
audit: {{preflight: false}}
eval: {{num_tasks: 0}}
external:
  agent: [{sys.executable}, {AGENT}, --no-system, --max-turns, "{MAX_TURNS}"]
  steps: 3
  tasks_per_step: 2
  samples_per_task: 3
  concurrency: 3
  checkpoint_every: 1
  reward: agent  # the harness's own reward: the tiny untrained model fails every task the verifier scores
  optim: {{lr: 1.0e-3}}
"""
    )
    cmd = [sys.executable, "-m", "mentorrl.cli", "train", str(recipe)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    with open(tmp_path / "first.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while not (run / "external" / "checkpoints" / "step-000001").exists() and proc.poll() is None:
            assert time.monotonic() < deadline, "no first checkpoint"
            time.sleep(0.5)
        time.sleep(3)  # inside step 2: agents running
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL  # killed mid-run, not finished
    done = subprocess.run(cmd + ["--resume"], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if r["stage"] == "external"] == [1, 2, 3]
    assert sum(r["episodes_used"] for r in recs) > 0 and recs[-1]["policy_version"] >= 1
    before = load_file(SHIPPED_ROOT / "orders-tiny" / "model.safetensors")
    after = load_file(run / "external" / "final" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before if k in after)
    import sqlite3

    with contextlib.closing(sqlite3.connect(run / "external" / "recordings.sqlite")) as db:
        by_step = {}
        for (eid,) in db.execute("SELECT id FROM episodes WHERE reward IS NOT NULL"):
            (versions,) = db.execute("SELECT versions FROM segments WHERE episode_id = ?", (eid,)).fetchone()
            by_step.setdefault(int(eid.split("-")[0]), set()).update(json.loads(versions))
    assert by_step[1] == {0}
    for step in (2, 3):  # each round is served by the weights the updates before it wrote
        assert by_step[step] == {int(recs[step - 2]["policy_version"])}, (by_step, [r["policy_version"] for r in recs])


def test_mentorrl_serve_record_records_a_standalone_server(tmp_path):
    """``mentorrl serve --record DB``: episodes opened by their first request, rewards with the reward key."""
    from openai import OpenAI

    from mentorrl.models.shipped import SHIPPED_ROOT
    from mentorrl.rollout.recorder import Recorder
    from mentorrl.serve import serve_subprocess

    db = tmp_path / "rec.sqlite"
    args = ["--record", str(db), "--reward-key-env", "RK", "--temperature", "0", "--max-tokens-cap", "16"]
    with serve_subprocess(SHIPPED_ROOT / "orders-tiny", extra_args=args, env={"RK": "rk"}) as url:
        client = OpenAI(base_url=url, api_key="none", max_retries=0)
        head = {"X-Mentorrl-Episode": "ep-1", "X-Mentorrl-Task": "task-1"}
        client.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}], extra_headers=head)
        root = url[: -len("/v1")]
        reward = httpx.post(
            f"{root}/mentorrl/episodes/ep-1/reward", json={"reward": 0.5}, headers={"Authorization": "Bearer rk"}
        )
        assert reward.status_code == 200
    rec = Recorder(db)
    ep = rec.episode("ep-1")
    assert ep.task_id == "task-1" and ep.reward == 0.5 and len(ep.segments) == 1
    assert 0 < sum(ep.segments[0].loss_mask) <= 16
    done = subprocess.run(
        [sys.executable, "-m", "mentorrl.cli", "serve", str(SHIPPED_ROOT / "orders-tiny"), "--record", str(db)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 2 and "--reward-key-env" in done.stderr + done.stdout


SDK_AGENT = AGENT.parent / "orders_agent_sdk.py"


def sdk_pythonpath() -> str:
    """The ``PYTHONPATH`` of an OpenAI Agents SDK agent (``MENTORRL_AGENTS_SDK_PATH``, a ``pip install
    --target`` directory, then this checkout); the test is skipped where the SDK does not import."""
    path = os.pathsep.join(p for p in (os.environ.get("MENTORRL_AGENTS_SDK_PATH", ""), str(ROOT)) if p)
    probe = subprocess.run([sys.executable, "-c", "import agents"], env={**os.environ, "PYTHONPATH": path})
    if probe.returncode != 0:
        pytest.skip("the OpenAI Agents SDK (openai-agents) is not installed")
    return path


@contextlib.contextmanager
def sdk_worker(server, path):
    """The SDK agent started once in worker mode against ``server``, 2 episodes at once."""
    from mentorrl.train.agents import AgentWorker

    base = {"OPENAI_BASE_URL": server.url, "OPENAI_API_KEY": "api-key", "MENTORRL_REWARD_KEY": "reward-key"}
    argv = [sys.executable, str(SDK_AGENT), "--no-system", "--max-turns", str(MAX_TURNS)]
    worker = AgentWorker(argv, {**base, "PYTHONPATH": path}, concurrency=2)
    try:
        yield worker
    finally:
        worker.close()


def test_an_openai_agents_sdk_agent_is_recorded_like_the_rollout(tmp_path, shipped, contract):
    """4b: the same agent on the OpenAI Agents SDK (its own loop and tool plumbing), offline against the
    local endpoint: recorded as one segment equal to the in-process rollout. Skipped without the SDK
    (``pip install openai-agents``; ``MENTORRL_AGENTS_SDK_PATH``: a ``pip install --target`` directory)."""
    from mentorrl.envs import get_env
    from mentorrl.rollout.runner import rollout_tasks
    from mentorrl.train.agents import AgentJob, run_agents

    path = sdk_pythonpath()
    entry = get_env("orders")
    task = entry.make_tasks().tasks("train", 1, 0)[0]
    traj = rollout_tasks(shipped[1], contract, entry.make_env, [task])[0]
    with recording(tmp_path, shipped, contract) as (server, hook, rec):
        hook.resume()
        rec.open_episode("sdk", task.id)
        job = AgentJob("sdk", {**agent_env_for(server, "sdk", task), "PYTHONPATH": path})
        out = run_agents([sys.executable, str(SDK_AGENT), "--no-system", "--max-turns", str(MAX_TURNS)], [job], 1, 300)[
            0
        ]
        assert out.status == "ok", out.stderr_tail
        ep = rec.episode("sdk")
        assert ep.reward is not None and len(ep.segments) == 1, rec.counters()
        seg = ep.segments[0]
        assert seg.token_ids == traj.token_ids and seg.loss_mask == traj.loss_mask
        assert (torch.tensor(seg.logprobs) - torch.tensor(traj.logprobs)).abs().max().item() < 1e-5


def test_the_sdk_agent_as_a_worker_records_every_episode_like_the_rollout(tmp_path, shipped, contract):
    """The SDK agent in worker mode (one process, its episodes side by side as asyncio tasks on one
    client, the episode headers per request): each episode recorded as one segment equal to the
    in-process rollout, rewarded, and reported with its timings; one process for two rounds."""
    from mentorrl.envs import get_env
    from mentorrl.rollout.runner import rollout_tasks
    from mentorrl.train.agents import AgentJob
    from mentorrl.train.recipes.external import agent_env

    path = sdk_pythonpath()
    entry = get_env("orders")
    tasks = entry.make_tasks().tasks("train", 2, 0)
    trajs = rollout_tasks(shipped[1], contract, entry.make_env, tasks)
    with recording(tmp_path, shipped, contract) as (server, hook, rec), sdk_worker(server, path) as worker:
        hook.resume()
        for rnd in range(2):
            jobs = []
            for k, task in enumerate(tasks):
                eid = f"sdk-{rnd}-{k}"
                rec.open_episode(eid, task.id)
                jobs.append(AgentJob(eid, agent_env(server.url, "api-key", "reward-key", eid, task)))
            outcomes = worker.run(jobs, timeout_s=300)
            assert [o.status for o in outcomes] == ["ok", "ok"], [o.stderr_tail for o in outcomes]
            for job, traj, out in zip(jobs, trajs, outcomes):
                assert {"model_s", "tools_s", "episode_s"} <= out.timings.keys(), out.timings
                assert 0 < out.timings["model_s"] <= out.timings["episode_s"]
                ep = rec.episode(job.episode_id)
                assert ep.reward is not None and "success" in ep.details, rec.counters()
                assert ep.task_id == traj.task_id and len(ep.segments) == 1 and ep.completions == traj.num_turns
                seg = ep.segments[0]
                assert seg.token_ids == traj.token_ids and seg.loss_mask == traj.loss_mask
                assert (torch.tensor(seg.logprobs) - torch.tensor(traj.logprobs)).abs().max().item() < 1e-5
        assert worker.starts == 1 and rec.counters()["diverged_edited"] == 0


def test_a_bad_job_fails_its_episode_not_the_sdk_worker(tmp_path, shipped, contract):
    """A job whose ``MENTORRL_TASK`` is not JSON is reported ``ok: false`` with its error (``nonzero``);
    the episode beside it is recorded and rewarded, and the worker lives on."""
    from mentorrl.envs import get_env
    from mentorrl.train.agents import AgentJob
    from mentorrl.train.recipes.external import agent_env

    path = sdk_pythonpath()
    task = get_env("orders").make_tasks().tasks("train", 1, 0)[0]
    with recording(tmp_path, shipped, contract) as (server, hook, rec), sdk_worker(server, path) as worker:
        hook.resume()
        for eid in ("bad", "good"):
            rec.open_episode(eid, task.id)
        bad = {**agent_env(server.url, "api-key", "reward-key", "bad", task), "MENTORRL_TASK": "{not json"}
        good = agent_env(server.url, "api-key", "reward-key", "good", task)
        outcomes = worker.run([AgentJob("bad", bad), AgentJob("good", good)], timeout_s=300)
        assert [o.status for o in outcomes] == ["nonzero", "ok"], [o.stderr_tail for o in outcomes]
        assert "JSONDecodeError" in outcomes[0].stderr_tail and outcomes[0].timings is None
        assert rec.episode("bad").completions == 0 and rec.episode("bad").reward is None
        assert rec.episode("good").reward is not None and len(rec.episode("good").segments) == 1
        assert worker.alive()


def idle(hook, timeout_s: float = 30.0) -> bool:
    """Whether the hook's generations in flight drop to none within ``timeout_s``."""
    import time

    deadline = time.monotonic() + timeout_s
    while hook._in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    return hook._in_flight == 0


def test_a_streamed_completion_is_recorded_like_a_plain_one(tmp_path, shipped, contract):
    """``stream: true`` in recording mode: the reply's tokens are recorded as a plain reply's are (the
    same ids and log-probs); the gate counts a stream until it ends, or until the client drops it."""
    from openai import OpenAI

    user = {"role": "user", "content": "Where is order O-557?"}
    with recording(tmp_path, shipped, contract) as (server, hook, rec):
        hook.resume()
        client = OpenAI(base_url=server.url, api_key="api-key", max_retries=0)
        for eid in ("plain", "streamed"):
            rec.open_episode(eid, "t")
        head = {"X-Mentorrl-Episode": "plain"}
        plain = client.chat.completions.create(model="p", messages=[user], extra_headers=head)
        stream = client.chat.completions.create(
            model="p", messages=[user], extra_headers={"X-Mentorrl-Episode": "streamed"}, stream=True
        )
        assert list(stream)
        assert idle(hook)  # the gate is released once the stream has ended
        a, b = rec.episode("plain").segments, rec.episode("streamed").segments
        assert len(a) == len(b) == 1 and a[0].token_ids == b[0].token_ids  # greedy: the same turn
        assert (torch.tensor(a[0].logprobs) - torch.tensor(b[0].logprobs)).abs().max().item() < 1e-5
        msg = plain.choices[0].message
        turn = {"role": "assistant", "content": msg.content}
        if msg.tool_calls:
            calls = [{"id": c.id, "type": "function", "function": c.function.model_dump()} for c in msg.tool_calls]
            turn = {"role": "assistant", "content": msg.content, "tool_calls": calls}
        nxt = [user, turn, {"role": "tool", "tool_call_id": "x", "content": "{}"}]
        client.chat.completions.create(
            model="p", messages=nxt, extra_headers={"X-Mentorrl-Episode": "streamed"}, stream=True
        ).close()  # dropped before its end: the gate is released all the same
        assert idle(hook) and hook.pause(timeout_s=5)


def test_worker_mode_trains_the_real_agent_on_the_verifiers_reward(tmp_path, shipped, monkeypatch):
    """One agent process for every episode of the stage (external.mode: worker), each episode scored by
    replaying it through the environment (the agent's own posted reward is not what trains)."""
    from mentorrl.train.registry import get_stage, resolve_runner

    tok, model = shipped
    ws = _ws(
        tmp_path,
        copy.deepcopy(tok),
        f"external.agent=[{sys.executable}, {AGENT}, --no-system, --max-turns, '{MAX_TURNS}']",
        "external.mode=worker",
        "external.steps=2",
        "external.tasks_per_step=2",
        "external.samples_per_task=2",
        "external.concurrency=4",
        "external.episode_timeout_s=120",
    )
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    stage = get_stage("external")
    final = resolve_runner(stage)(ws, copy.deepcopy(model))
    assert (final / "model.safetensors").exists()
    recs = [json.loads(x) for x in (ws.run_dir / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if r.get("stage") == "external"]
    assert len(recs) == 2 and all(r["agent_ok"] == 4 and r["episodes_used"] == 4 for r in recs), recs
    assert all(r["time_worker_start_s"] >= 0 and "time_http_json_s" in r and r["gen_calls"] >= 1 for r in recs)
    assert sum(r["time_worker_start_s"] > 0 for r in recs) == 1  # one process for both steps
    assert all("replay_turns_cut" in r and r["server_overridden"] == 0 for r in recs)
