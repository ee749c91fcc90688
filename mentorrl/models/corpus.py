"""Text the tiny tokenizer is trained on: expert episodes on train tasks, rendered by the contract."""

from __future__ import annotations

from typing import Any, Iterator

from mentorrl.contract import (
    IM_END,
    PromptFormat,
    observation_text,
    parse_action,
    prompt_text,
    render_observation_content,
    system_text,
    tool_signatures,
)
from mentorrl.envs.base import ToolResult
from mentorrl.rollout.episode import drive_script


def expert_transcripts(env: Any, expert: Any, tasks: list, fmt: PromptFormat | None = None) -> Iterator[str]:
    """One rendered transcript per task (train split only; the wording generator shares one vocabulary across
    splits, so these cover the held-out words too: only novel_wording's words stay unseen)."""
    fmt = fmt or PromptFormat()
    system = system_text(env.system_prompt, tool_signatures(env, fmt)) if fmt.system_turn else None
    for task in tasks:
        parts = [prompt_text(system, env.reset(task))]

        def act(text: str) -> ToolResult | None:
            parts.append(text + IM_END)
            action = parse_action(text)
            if action.kind != "tool":
                return None
            result = env.step(action.name, action.arguments)
            parts.append(observation_text(render_observation_content(result.ok, result.content, result.error)))
            return result

        drive_script(expert, task, act)
        yield "".join(parts)
