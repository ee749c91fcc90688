"""Who plays the customer in a τ²-bench episode.

The agent speaks to the user through the adapter's ``message_user`` tool (the observation is the
user's answer) and ends the conversation with its final message. Two users:

* :class:`ScriptedUser` (the default): deterministic, built from the task's scenario. It opens
  with the reason for the call and what the user knows; it answers a confirmation question
  (yes/no, "shall I", "do you confirm" ...) with a yes, any other question with what it knows
  (and what it does not), and a message without a question by ending the conversation. It
  leaves after ``max_turns`` answers. Like every scripted user it cannot negotiate: the tasks
  whose scenario asks for that are solved by the gold path only.
* :class:`LLMUser` (``env.user: llm``): a served model through the project's OpenAI-compatible
  client (:class:`~mentorrl.clients.openai_api.TeacherClient`), prompted with the scenario; it
  ends the conversation by writing ``###STOP###``.
"""

from __future__ import annotations

import re
from typing import Any

from mentorrl.contract import clip_text

from .records import Instructions, UserScenario

STOP = "###STOP###"
ENDED = "The user has ended the conversation."
MAX_USER_CHARS = 4000
_CONFIRM = re.compile(
    r"\b(confirm|proceed|go ahead|shall i|should i|would you like( me)? to|do you want( me)? to|is that (correct|"
    r"right|ok)|can you confirm|yes or no|\(yes/no\)|yes/no)\b",
    re.IGNORECASE,
)


def scenario_parts(scenario: UserScenario) -> Instructions:
    ins = scenario.instructions
    return ins if isinstance(ins, Instructions) else Instructions(reason_for_call=ins)


def opening_message(scenario: UserScenario) -> str:
    """The scripted user's first message: the reason for the call and what the user knows."""
    ins = scenario_parts(scenario)
    parts = [ins.reason_for_call.strip(), (ins.known_info or "").strip()]
    body = "\n".join(p for p in parts if p)
    return 'A customer contacts you. Their situation, in the benchmark\'s words ("you" is the customer):\n' + body


class ScriptedUser:
    """The deterministic user (see the module docstring)."""

    def __init__(self, scenario: UserScenario, max_turns: int = 10):
        self.ins = scenario_parts(scenario)
        self.scenario = scenario
        self.max_turns = max_turns
        self.turns = 0
        self.ended = False

    def opening(self) -> str:
        return opening_message(self.scenario)

    def reply(self, message: str) -> str:
        if self.ended:
            return ENDED
        self.turns += 1
        if "?" not in message or self.turns > self.max_turns:
            self.ended = True
            return f"Thank you, that is all I needed. {STOP}"
        if _CONFIRM.search(message):
            return "Yes, I confirm. Please go ahead."
        known = (self.ins.known_info or "").strip()
        unknown = (self.ins.unknown_info or "").strip()
        answer = " ".join(p for p in (known, f"(I can't tell you more: {unknown})" if unknown else "") if p)
        return answer or "I don't know more than what I told you."


USER_SYSTEM = (
    "You play a customer talking to a customer-service agent. Stay in character, write short messages "
    "as the customer, never as the agent, and reveal information only when asked. When your request is "
    "handled or cannot be handled, write {stop} alone to end the conversation.\n\nYour scenario:\n{scenario}"
)


class LLMUser:
    """A served model plays the user (``env.user: llm``); ``client`` is a TeacherClient."""

    def __init__(self, scenario: UserScenario, client: Any, max_turns: int = 10):
        ins = scenario_parts(scenario)
        text = "\n".join(
            f"{k}: {v}" for k, v in ins.model_dump().items() if isinstance(v, str) and v.strip() and k != "domain"
        )
        if scenario.persona:
            text = f"persona: {scenario.persona}\n{text}"
        self.client, self.max_turns, self.turns, self.ended = client, max_turns, 0, False
        self.messages: list[dict[str, str]] = [
            {"role": "system", "content": USER_SYSTEM.format(stop=STOP, scenario=text)}
        ]
        self.scenario = scenario

    def _say(self) -> str:
        # roles are flipped for the user model: the agent's messages are its "user" turns
        text = self.client.chat(self.messages)
        if not isinstance(text, str) or not text.strip():
            self.ended = True
            return f"(the user model gave no answer) {STOP}"
        text = clip_text(text.strip(), MAX_USER_CHARS)
        self.messages.append({"role": "assistant", "content": text})
        if STOP in text:
            self.ended = True
        return text

    def opening(self) -> str:
        self.messages.append({"role": "user", "content": "Hi! How can I help you today?"})
        return self._say()

    def reply(self, message: str) -> str:
        if self.ended:
            return ENDED
        self.turns += 1
        if self.turns > self.max_turns:
            self.ended = True
            return f"I have to go now. {STOP}"
        self.messages.append({"role": "user", "content": clip_text(message, MAX_USER_CHARS)})
        return self._say()


__all__ = ["ENDED", "LLMUser", "STOP", "ScriptedUser", "opening_message", "scenario_parts"]
