"""An episode's token budget follows the schemas and the model: the system turn (system prompt and tool
schemas) is outside ``limits.max_total_tokens``, and the whole is capped by the model's context.

Invariant: for a fixed ``limits.max_total_tokens``, the room an episode has after its prompt does not depend
on how many tools the system turn lists; with no system turn (the demo's recipes) nothing changes."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from family_templates import PLAIN_CHATML, family_tokenizer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mentorrl.chat_templates import native_chat_for
from mentorrl.contract import ContractLimits, PromptFormat, contract_for_env

SHIPPED = Path(__file__).resolve().parent.parent / "mentorrl" / "models" / "bases" / "orders-tiny"
USER = "Where is order 1234?"


@pytest.fixture(scope="module")
def base_tokenizer():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(SHIPPED)
    tok.model_max_length = int(1e30)  # transformers' "unset" sentinel: no context cap
    return tok


class FewTools:
    """``env`` seen through a registry holding only its first ``n`` tools."""

    def __init__(self, env, n: int):
        self._env = env
        self.registry = copy.copy(env.registry)
        self.registry.tools = dict(list(env.registry.tools.items())[:n])

    def __getattr__(self, name):
        return getattr(self._env, name)


def contract(tok, env, fmt: PromptFormat, limit: int = 1024):
    chat = native_chat_for(tok, env, fmt)
    return contract_for_env(tok, env, limits=ContractLimits(max_total_tokens=limit), prompt=fmt, chat=chat)


def room(c) -> int:
    return c.max_total_tokens - len(c.prompt_ids(USER))


FORMATS = {
    "mentorrl system turn": (None, PromptFormat()),
    "hermes native tools": ("qwen25", PromptFormat()),
    "hermes native, no system prompt": ("qwen25", PromptFormat(system_turn=False)),
    "llama3 native tools": ("llama31", PromptFormat()),
    "prompted (plain ChatML)": ("plain", PromptFormat()),
}


def tokenizer_for(base, family):
    if family is None:
        return base
    if family == "plain":
        tok = copy.deepcopy(base)
        tok.chat_template = PLAIN_CHATML
        return tok
    return family_tokenizer(base, family)


@pytest.mark.parametrize("name", list(FORMATS))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(min_value=0, max_value=6), limit=st.integers(min_value=300, max_value=4096))
def test_the_episode_room_does_not_shrink_as_tools_are_added(base_tokenizer, env, name, n, limit):
    family, fmt = FORMATS[name]
    tok = tokenizer_for(base_tokenizer, family)
    few, full = contract(tok, FewTools(env, n), fmt, limit), contract(tok, env, fmt, limit)
    assert full.system_tokens > 0
    assert len(full.prompt_ids(USER)) > len(few.prompt_ids(USER)) or n >= len(env.registry.tools)
    assert room(full) == room(few)  # the schemas are paid by the system turn, not the episode
    assert full.max_total_tokens == limit + full.system_tokens


def test_without_a_system_turn_the_budget_is_the_limit(base_tokenizer, env):
    """The demo's recipes (prompt.system_turn false, the contract's ChatML): exactly as before."""
    c = contract(base_tokenizer, env, PromptFormat(system_turn=False), 768)
    assert c.system_tokens == 0 and c.max_total_tokens == 768


def test_the_model_context_caps_the_budget(base_tokenizer, env):
    tok = copy.deepcopy(base_tokenizer)
    tok.model_max_length = 700
    c = contract(tok, env, PromptFormat(), 4096)
    assert c.context_tokens == 700 and c.max_total_tokens == 700
    unset = contract(base_tokenizer, env, PromptFormat(), 4096)
    assert unset.context_tokens is None and unset.max_total_tokens == 4096 + unset.system_tokens


def test_an_episode_runs_to_the_budget_not_past_it(base_tokenizer, env, orders_tasks):
    """The rollout's episode takes its cap from the contract's budget."""
    from mentorrl.rollout.episode import Episode

    c = contract(base_tokenizer, env, PromptFormat(), 64)
    ep = Episode(c, env, orders_tasks[0])
    ids = ep.start()
    assert ep.max_total_tokens == c.max_total_tokens and len(ids) < ep.max_total_tokens
    assert ep.tokens_left() == c.max_total_tokens - len(ids)


def test_preflight_names_the_field_and_the_system_turn(base_tokenizer, env):
    from mentorrl.train.pipeline import budget_problem

    tok = copy.deepcopy(base_tokenizer)
    tok.model_max_length = 100
    c = contract(tok, env, PromptFormat(), 1024)
    msg = budget_problem(c, 120, "the prompt of train task t1")
    assert "limits.max_total_tokens=1024" in msg and "context is 100" in msg
    c = contract(base_tokenizer, env, PromptFormat(), 16)
    msg = budget_problem(c, c.system_tokens + 40, "the prompt of train task t1")
    assert "above 40" in msg and f"system turn's {c.system_tokens}" in msg
