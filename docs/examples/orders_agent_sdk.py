"""The orders agent on the OpenAI Agents SDK (``pip install openai-agents``): the SDK's own loop and
``FunctionTool`` s over its own copy of the orders database, a Chat Completions model pointed at the
recording endpoint with the episode header, tracing off (nothing leaves the machine). The harness part
(the world, the verdict, the reward post) is the plain agent's (orders_agent.py, beside this file)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from agents import Agent, FunctionTool, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
from agents.exceptions import MaxTurnsExceeded
from openai import AsyncOpenAI

sys.path.insert(0, str(Path(__file__).resolve().parent))
from orders_agent import answer_text, observation, post_reward, reward_of  # noqa: E402  (the same harness: world, verdict, reward)

from mentorrl.envs import get_env  # noqa: E402
from mentorrl.envs.base import Task  # noqa: E402


def sdk_tools(env, results: list) -> list[FunctionTool]:
    """The environment's tools as the SDK's function tools, run against ``env``; results kept for the reward."""

    def invoker(name: str):
        async def invoke(ctx, arguments: str) -> str:
            if name == getattr(env, "answer_tool", None):  # the typed answer ends the run (stop_at_tool_names)
                return answer_text(name, arguments)
            try:
                args = json.loads(arguments) if arguments else {}
            except json.JSONDecodeError:
                args = None
            results.append(env.step(name, args))
            return observation(results[-1])

        return invoke

    return [
        FunctionTool(t.name, t.description, t.parameters, invoker(t.name), strict_json_schema=False)
        for t in env.registry.tools.values()
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-system", action="store_true", help="no instructions (a run with system_turn: false)")
    ap.add_argument("--max-turns", type=int, default=6)
    args = ap.parse_args(argv)
    set_tracing_disabled(True)
    task = Task(**json.loads(os.environ["MENTORRL_TASK"]))
    headers = {"X-Mentorrl-Episode": os.environ["MENTORRL_EPISODE_ID"], "X-Mentorrl-Task": task.id}
    client = AsyncOpenAI(default_headers=headers, max_retries=2, timeout=120)
    env = get_env("orders").make_env()
    results: list = []
    try:
        user = env.reset(task)
        agent = Agent(
            name="orders",
            instructions=None if args.no_system else env.system_prompt,
            tools=sdk_tools(env, results),
            model=OpenAIChatCompletionsModel(model="policy", openai_client=client),
            # the environment's typed-answer call ends the episode, its record the final output
            tool_use_behavior={"stop_at_tool_names": [env.answer_tool]} if env.answer_tool else "run_llm_again",
        )
        try:
            answer = Runner.run_sync(agent, user, max_turns=args.max_turns).final_output
        except MaxTurnsExceeded:
            answer = None
        reward, details = reward_of(env.verify(answer), results)
    finally:
        env.close()
    post_reward(reward, details, os.environ["MENTORRL_REWARD_URL"], os.environ["MENTORRL_REWARD_KEY"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
