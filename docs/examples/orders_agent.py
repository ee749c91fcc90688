"""An orders-support agent written outside mentorrl's loop: the official ``openai`` client, its own
tools (JSON schemas, executed against its own copy of the orders database), its own loop, and its
own reward from the final database state, posted to the trainer. ``stage: external`` runs it once
per episode with the variables below, or (``external.mode: worker``, ``MENTORRL_WORKER=1``) once for
all episodes, which it reads from stdin; any OpenAI-compatible agent that sends the episode header
trains the same way (docs/bring-your-agent.md).

    OPENAI_BASE_URL, OPENAI_API_KEY   the endpoint and its key (the official client reads them)
    MENTORRL_EPISODE_ID               sent with every request as the X-Mentorrl-Episode header
    MENTORRL_TASK_ID, MENTORRL_TASK   the task's id and its JSON (the harness builds its world from it)
    MENTORRL_REWARD_URL, MENTORRL_REWARD_KEY   where the harness posts the episode's reward
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from openai import OpenAI

from mentorrl.envs import get_env  # the orders world and its verifier: the harness owns the reward
from mentorrl.envs.base import Task


def observation(result) -> str:
    """A tool result as the agent shows it to the model (the same text mentorrl's own rollouts show)."""
    if result.ok:
        return json.dumps(result.content, separators=(", ", ": "), ensure_ascii=False)
    error = str(result.error)
    return "error: " + (error if len(error) <= 500 else f"{error[:500]}... [{len(error) - 500} more characters]")


def tool_schemas(env) -> list[dict]:
    return [
        {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
        for t in env.registry.tools.values()
    ]


def run_episode(
    client: OpenAI, env, task: Task, headers: dict, system: bool, max_turns: int, timings: dict | None = None
) -> tuple[str | None, list]:
    """The agent's loop: ask the model, run the tools it calls, until it answers (a text reply, or a
    call of the environment's typed-answer tool, which ends the episode and is never run) or runs out
    of turns. Returns the final answer (None without one) and the tool results; ``timings``, if given,
    gets the seconds spent waiting on the model (``model_s``) and in the tools (``tools_s``)."""
    timings = {} if timings is None else timings
    timings.setdefault("model_s", 0.0)
    timings.setdefault("tools_s", 0.0)
    messages = [{"role": "system", "content": env.system_prompt}] if system else []
    messages.append({"role": "user", "content": env.reset(task)})
    results = []
    answer_tool = getattr(env, "answer_tool", None)  # the typed answer: a call that ends the episode
    for _ in range(max_turns):
        t0 = time.perf_counter()
        reply = client.chat.completions.create(
            model="policy", messages=messages, tools=tool_schemas(env), extra_headers=headers
        )
        timings["model_s"] += time.perf_counter() - t0
        msg = reply.choices[0].message
        if not msg.tool_calls:
            return msg.content, results
        ends = [c for c in msg.tool_calls if c.function.name == answer_tool]
        if ends:  # the record is the answer, as the verifier reads it; never run as a tool
            return answer_text(ends[0].function.name, ends[0].function.arguments), results
        calls = [{"id": c.id, "type": "function", "function": c.function.model_dump()} for c in msg.tool_calls]
        messages.append({"role": "assistant", "content": msg.content, "tool_calls": calls})
        for c in msg.tool_calls:
            try:
                args = json.loads(c.function.arguments)
            except json.JSONDecodeError:
                args = None
            t0 = time.perf_counter()
            results.append(env.step(c.function.name, args))
            timings["tools_s"] += time.perf_counter() - t0
            messages.append({"role": "tool", "tool_call_id": c.id, "content": observation(results[-1])})
    return None, results


def answer_text(name: str, arguments: str) -> str:
    """A typed-answer call as the verifier reads it: the call's JSON, as the policy wrote it."""
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    return json.dumps({"name": name, "arguments": args}, ensure_ascii=False)


def reward_of(verdict, results: list) -> tuple[float, dict]:
    """The harness's reward, from the final database state: 1 for a verified success, -1 for a
    broken rule, plus 0.2 times the share of tool calls that worked (a little signal before the
    first success)."""
    tools = sum(r.ok for r in results) / len(results) if results else 0.0
    task = 1.0 if verdict.success and not verdict.violations else (-1.0 if verdict.violations else 0.0)
    return task + 0.2 * tools, {"success": bool(verdict.success), "violations": list(verdict.violations)}


def post_reward(reward: float, details: dict, url: str, key: str, http: httpx.Client | None = None) -> None:
    """Post the episode's reward to the URL mentorrl gave, with the reward key (not the API key)."""
    r = (http or httpx).post(
        url, json={"reward": reward, "details": details}, headers={"Authorization": f"Bearer {key}"}, timeout=30
    )
    r.raise_for_status()


def episode(client: OpenAI, v: dict, args, http: httpx.Client | None = None) -> dict:
    """One episode, from its variables ``v`` (the ``MENTORRL_*`` of docs/bring-your-agent.md): the
    agent's loop, its own reward posted; returns its timings."""
    t0 = time.perf_counter()
    task = Task(**json.loads(v["MENTORRL_TASK"]))
    headers = {"X-Mentorrl-Episode": v["MENTORRL_EPISODE_ID"], "X-Mentorrl-Task": v["MENTORRL_TASK_ID"]}
    env = get_env("orders").make_env()
    timings: dict = {}
    try:
        answer, results = run_episode(client, env, task, headers, not args.no_system, args.max_turns, timings)
        reward, details = reward_of(env.verify(answer), results)
    finally:
        env.close()
    post_reward(reward, details, v["MENTORRL_REWARD_URL"], v["MENTORRL_REWARD_KEY"], http)
    timings["episode_s"] = time.perf_counter() - t0
    return timings


def worker_clients(concurrency: int) -> tuple[OpenAI, httpx.Client]:
    """The worker's two clients, shared by its ``concurrency`` threads, each with a pool that keeps every
    connection those threads can hold alive. With fewer keep-alive slots than threads (openai's default is
    100, httpx's 20), httpcore 1.0.9's sync pool closes "surplus" idle connections, and can close one it has
    just handed to a waiting request: that request's reply is never read and it hangs for the whole read
    timeout (encode/httpcore#1110; it stalled one rollout step of 128 episodes for 120 s here). Sized to
    the threads, no connection is ever surplus."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    client = OpenAI(max_retries=2, timeout=120, http_client=httpx.Client(limits=limits, timeout=120))
    return client, httpx.Client(limits=limits, timeout=30)


def serve_worker(args) -> int:
    """Worker mode (``external.mode: worker``): one process, one client (its connections kept alive),
    every episode mentorrl sends on stdin (a JSON line ``{"episode_id", "env": {...}}`` each), up to
    ``MENTORRL_CONCURRENCY`` at once; one JSON line per finished episode on stdout
    (``{"episode_id", "ok", "error"?, "timings"}``). Ends when stdin closes."""
    concurrency = int(os.environ.get("MENTORRL_CONCURRENCY", "4"))
    client, http = worker_clients(concurrency)
    lock = threading.Lock()

    def one(job: dict) -> None:
        try:
            out = {"episode_id": job["episode_id"], "ok": True, "timings": episode(client, job["env"], args, http)}
        except Exception as e:  # noqa: BLE001 - one episode's failure, reported, never the worker's
            out = {"episode_id": job["episode_id"], "ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        with lock:
            sys.stdout.write(json.dumps(out) + "\n")
            sys.stdout.flush()

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for line in sys.stdin:
            if line.strip():
                pool.submit(one, json.loads(line))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-system", action="store_true", help="send no system message (a run with system_turn: false)")
    ap.add_argument("--max-turns", type=int, default=6)
    args = ap.parse_args(argv)
    if os.environ.get("MENTORRL_WORKER") == "1":
        return serve_worker(args)
    episode(OpenAI(max_retries=2, timeout=120), dict(os.environ), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
