"""The project's own error observations carry no template control string (issue 54, item 8): a re-render of
the same conversation with ``apply_chat_template`` (serve, vLLM, TRL) would tokenise one as the control token."""

from __future__ import annotations

import pytest

from mentorrl.chat_templates.formats import hermes_parse, llama3_parse
from mentorrl.contract import SPECIAL_TOKENS, parse_action

CONTROLS = [*SPECIAL_TOKENS, "<|python_tag|>", "<think>", "</think>"]
MALFORMED_TURNS = [
    "<tool_call>",
    "</tool_call>",
    "</tool_call> x <tool_call>",
    "<tool_call>{}</tool_call><tool_call>{}</tool_call>",
    '<tool_call>{"name": "x", "arguments": {"a": </tool_call>',
    "<tool_call>" + "[" * 100 + "</tool_call>",
    '<tool_call>["not", "an", "object"]</tool_call>',
    '<tool_call>{"arguments": {}}</tool_call>',
]


@pytest.mark.parametrize("parse", [parse_action, hermes_parse, llama3_parse], ids=["contract", "hermes", "llama3"])
@pytest.mark.parametrize("turn", MALFORMED_TURNS + ['<|python_tag|>{"name": 1}', '{"name": "x", "parameters": [}'])
def test_no_malformed_call_error_names_a_control_string(parse, turn):
    action = parse(turn)
    if action.kind == "malformed":
        assert not any(c in action.error for c in CONTROLS), action.error
