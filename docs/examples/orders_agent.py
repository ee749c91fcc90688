"""An orders-support agent written outside mentorrl's loop: the official ``openai`` client, its own
tools (JSON schemas, executed against its own copy of the orders database), its own loop, and its
own reward from the final database state, posted to the trainer. ``stage: external`` runs it once
per episode with the variables below; any OpenAI-compatible agent that sends the episode header and
posts a reward trains the same way (docs/bring-your-agent.md).

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
    client: OpenAI, env, task: Task, headers: dict, system: bool, max_turns: int
) -> tuple[str | None, list]:
    """The agent's loop: ask the model, run the tools it calls, until it answers (or runs out of
    turns). Returns the final answer (None without one) and the tool results."""
    messages = [{"role": "system", "content": env.system_prompt}] if system else []
    messages.append({"role": "user", "content": env.reset(task)})
    results = []
    for _ in range(max_turns):
        reply = client.chat.completions.create(
            model="policy", messages=messages, tools=tool_schemas(env), extra_headers=headers
        )
        msg = reply.choices[0].message
        if not msg.tool_calls:
            return msg.content, results
        calls = [{"id": c.id, "type": "function", "function": c.function.model_dump()} for c in msg.tool_calls]
        messages.append({"role": "assistant", "content": msg.content, "tool_calls": calls})
        for c in msg.tool_calls:
            try:
                args = json.loads(c.function.arguments)
            except json.JSONDecodeError:
                args = None
            results.append(env.step(c.function.name, args))
            messages.append({"role": "tool", "tool_call_id": c.id, "content": observation(results[-1])})
    return None, results


def reward_of(verdict, results: list) -> tuple[float, dict]:
    """The harness's reward, from the final database state: 1 for a verified success, -1 for a
    broken rule, plus 0.2 times the share of tool calls that worked (a little signal before the
    first success)."""
    tools = sum(r.ok for r in results) / len(results) if results else 0.0
    task = 1.0 if verdict.success and not verdict.violations else (-1.0 if verdict.violations else 0.0)
    return task + 0.2 * tools, {"success": bool(verdict.success), "violations": list(verdict.violations)}


def post_reward(reward: float, details: dict) -> None:
    """Post the episode's reward to the URL mentorrl gave, with the reward key (not the API key)."""
    r = httpx.post(
        os.environ["MENTORRL_REWARD_URL"],
        json={"reward": reward, "details": details},
        headers={"Authorization": f"Bearer {os.environ['MENTORRL_REWARD_KEY']}"},
        timeout=30,
    )
    r.raise_for_status()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-system", action="store_true", help="send no system message (a run with system_turn: false)")
    ap.add_argument("--max-turns", type=int, default=6)
    args = ap.parse_args(argv)
    episode = os.environ["MENTORRL_EPISODE_ID"]
    task = Task(**json.loads(os.environ["MENTORRL_TASK"]))
    headers = {"X-Mentorrl-Episode": episode, "X-Mentorrl-Task": os.environ["MENTORRL_TASK_ID"]}
    env = get_env("orders").make_env()
    try:
        client = OpenAI(max_retries=2, timeout=120)
        answer, results = run_episode(client, env, task, headers, not args.no_system, args.max_turns)
        reward, details = reward_of(env.verify(answer), results)
    finally:
        env.close()
    post_reward(reward, details)
    return 0


if __name__ == "__main__":
    sys.exit(main())
