"""The orders agent on the OpenAI Agents SDK (``pip install openai-agents``): the SDK's own loop and
``FunctionTool`` s over its own copy of the orders database, a Chat Completions model pointed at the
recording endpoint with the episode headers, tracing off (nothing leaves the machine). The harness part
(the world, the verdict, the reward post) is the plain agent's (orders_agent.py, beside this file).
One episode per process, or (``external.mode: worker``, ``MENTORRL_WORKER=1``) every episode read from
stdin, run side by side as asyncio tasks on one ``AsyncOpenAI`` client."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import httpx
from agents import Agent, FunctionTool, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
from agents.exceptions import MaxTurnsExceeded
from openai import AsyncOpenAI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from orders_agent import answer_text, observation, post_reward, reward_of  # noqa: E402  (the same harness: world, verdict, reward)

from mentorrl.envs import get_env  # noqa: E402
from mentorrl.envs.base import Task  # noqa: E402


class TimedModel(OpenAIChatCompletionsModel):
    """The Chat Completions model, its calls' seconds added to ``timings["model_s"]``."""

    def __init__(self, *args, timings: dict, **kwargs):
        super().__init__(*args, **kwargs)
        self.timings = timings

    async def get_response(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return await super().get_response(*args, **kwargs)
        finally:
            self.timings["model_s"] = self.timings.get("model_s", 0.0) + time.perf_counter() - t0


def sdk_tools(env, results: list, timings: dict | None = None) -> list[FunctionTool]:
    """The environment's tools as the SDK's function tools, run against ``env``; results kept for the
    reward, their seconds added to ``timings["tools_s"]``."""
    timings = {} if timings is None else timings

    def invoker(name: str):
        async def invoke(ctx, arguments: str) -> str:
            if name == getattr(env, "answer_tool", None):  # the typed answer ends the run (stop_at_tool_names)
                return answer_text(name, arguments)
            try:
                args = json.loads(arguments) if arguments else {}
            except json.JSONDecodeError:
                args = None
            t0 = time.perf_counter()
            results.append(env.step(name, args))  # synchronous and cheap: run inline
            timings["tools_s"] = timings.get("tools_s", 0.0) + time.perf_counter() - t0
            return observation(results[-1])

        return invoke

    return [
        FunctionTool(t.name, t.description, t.parameters, invoker(t.name), strict_json_schema=False)
        for t in env.registry.tools.values()
    ]


async def episode(client: AsyncOpenAI, v: dict, args, http: httpx.Client | None = None) -> dict:
    """One episode, from its variables ``v`` (the ``MENTORRL_*`` of docs/bring-your-agent.md): the SDK's
    loop with the episode's headers, the harness's reward posted; returns its timings."""
    t0 = time.perf_counter()
    task = Task(**json.loads(v["MENTORRL_TASK"]))
    headers = {"X-Mentorrl-Episode": v["MENTORRL_EPISODE_ID"], "X-Mentorrl-Task": task.id}
    timings: dict = {"model_s": 0.0, "tools_s": 0.0}
    env = get_env("orders").make_env()
    results: list = []
    try:
        user = env.reset(task)
        agent = Agent(
            name="orders",
            instructions=None if args.no_system else env.system_prompt,
            tools=sdk_tools(env, results, timings),
            model=TimedModel(model="policy", openai_client=client, timings=timings),
            model_settings=ModelSettings(extra_headers=headers),  # per episode, on the shared client
            # the environment's typed-answer call ends the episode, its record the final output
            tool_use_behavior={"stop_at_tool_names": [env.answer_tool]} if env.answer_tool else "run_llm_again",
        )
        try:
            answer = (await Runner.run(agent, user, max_turns=args.max_turns)).final_output
        except MaxTurnsExceeded:
            answer = None
        reward, details = reward_of(env.verify(answer), results)
    finally:
        env.close()
    url, key = v["MENTORRL_REWARD_URL"], v["MENTORRL_REWARD_KEY"]
    await asyncio.to_thread(post_reward, reward, details, url, key, http)
    timings["episode_s"] = time.perf_counter() - t0
    return timings


async def serve_worker(args) -> int:
    """Worker mode (``external.mode: worker``): one process, one ``AsyncOpenAI`` client (its connections
    kept alive), every episode mentorrl sends on stdin (a JSON line ``{"episode_id", "env": {...}}``
    each) run as an asyncio task, up to ``MENTORRL_CONCURRENCY`` at once; one JSON line per finished
    episode on stdout (``{"episode_id", "ok", "error"?, "timings"}``). Ends when stdin closes."""
    concurrency = int(os.environ.get("MENTORRL_CONCURRENCY", "4"))
    slots = asyncio.Semaphore(concurrency)
    running: set[asyncio.Task] = set()

    async def one(client: AsyncOpenAI, http: httpx.Client, job: dict) -> None:
        eid = job.get("episode_id") if isinstance(job, dict) else None
        async with slots:
            try:
                out = {"episode_id": eid, "ok": True, "timings": await episode(client, job["env"], args, http)}
            except Exception as e:  # noqa: BLE001 - one episode's failure, reported, never the worker's
                out = {"episode_id": eid, "ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        sys.stdout.write(json.dumps(out) + "\n")  # the event loop's thread only: whole lines
        sys.stdout.flush()

    # a keep-alive slot for every connection the episodes can hold: none is ever closed as surplus
    # (encode/httpcore#1110: a connection closed that way can be one just handed to a waiting request)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    pool = httpx.AsyncClient(limits=limits, timeout=120)
    async with AsyncOpenAI(max_retries=2, timeout=120, http_client=pool) as client:
        with httpx.Client(timeout=30) as http:
            while line := await asyncio.to_thread(sys.stdin.readline):  # stdin read off the event loop
                if not line.strip():
                    continue
                try:
                    job = json.loads(line)
                except json.JSONDecodeError:
                    print(f"not a job line: {line[:200]!r}", file=sys.stderr)
                    continue
                t = asyncio.create_task(one(client, http, job))
                running.add(t)
                t.add_done_callback(running.discard)
            await asyncio.gather(*running)
    return 0


async def one_episode(args) -> None:
    """The per-process mode (``external.mode: episode``): the episode of this process's variables."""
    async with AsyncOpenAI(max_retries=2, timeout=120) as client:
        await episode(client, dict(os.environ), args)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-system", action="store_true", help="no instructions (a run with system_turn: false)")
    ap.add_argument("--max-turns", type=int, default=6)
    args = ap.parse_args(argv)
    set_tracing_disabled(True)
    if os.environ.get("MENTORRL_WORKER") == "1":
        return asyncio.run(serve_worker(args))
    asyncio.run(one_episode(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
