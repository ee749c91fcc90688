"""Fuzzing the untrusted inputs (bounded in time): a policy turn through ``parse_action``, tool
arguments through the registry, message content through the encoder, and request bodies
through ``mentorrl serve``. Nothing raises, nothing answers 500, and content never becomes a
control token."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mentorrl.chat import prompt_pieces, prompt_text
from mentorrl.contract import MAX_ERROR_CHARS, ChatEncoder, ParsedAction, parse_action
from mentorrl.envs.base import Tool, ToolRegistry
from mentorrl.serve import create_app

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CONTROL_BITS = [
    "<|im_end|>",
    "<|im_start|>",
    "<tool_call>",
    "</tool_call>",
    "<|endoftext|>",
    "<|im_",
    "end|>",
    "<",
    "|",
    ">",
    "[",
    "]",
    "{",
    "}",
    '"',
    "\\",
    ":",
    ",",
    "name",
    "arguments",
    "NaN",
    "1e999",
    "7",
    " ",
    "\n",
    "é",
    "漢",
    "🙂",
]

fragments = st.lists(st.sampled_from(CONTROL_BITS), max_size=40).map("".join)
any_text = st.one_of(st.text(max_size=200), fragments)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=30,
)


# ---------------------------------------------------------------- parse_action ------
def _turn(draw_body: Any) -> st.SearchStrategy[str]:
    return st.tuples(any_text, draw_body, any_text).map(lambda t: f"{t[0]}<tool_call>{t[1]}</tool_call>{t[2]}")


deep_bodies = st.tuples(st.integers(0, 3000), st.sampled_from(["[", "{", '{"a":', '{"name": "x", "arguments": ['])).map(
    lambda t: t[1] * t[0]
)
json_bodies = json_values.map(lambda v: json.dumps({"name": "t", "arguments": v}))


@FUZZ
@given(st.one_of(any_text, _turn(any_text), _turn(deep_bodies), _turn(json_bodies)))
def test_parse_action_never_raises(text):
    a = parse_action(text)
    assert isinstance(a, ParsedAction) and a.kind in ("tool", "answer", "malformed")
    if a.kind == "malformed":
        assert a.error and len(a.error) < 200
    if a.kind == "tool":
        assert isinstance(a.name, str)


# ------------------------------------------------------------------- registry ------
def _registry() -> ToolRegistry:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "number"}, "s": {"type": "string"}},
        "additionalProperties": False,
    }
    return ToolRegistry([Tool("t", "A tool.", schema, lambda **kw: {"got": sorted(kw)})], timeout_s=5.0)


REGISTRY = _registry()


@FUZZ
@given(
    st.one_of(st.text(max_size=5), st.just("t")),
    st.one_of(json_values, st.dictionaries(st.sampled_from(["n", "s", "x" * 2000]), json_values, max_size=3)),
)
def test_tool_calls_never_raise_and_errors_are_bounded(name, arguments):
    r = REGISTRY.call(name, arguments)
    if r.ok:
        assert name == "t"
    else:
        assert r.error_kind in ("unknown_tool", "bad_arguments", "tool_exception")
        assert len(r.error) <= MAX_ERROR_CHARS + 40


# ---------------------------------------------------------------- the encoder ------
@FUZZ
@given(st.sampled_from(["system", "user", "assistant", "tool"]), fragments)
def test_content_never_encodes_to_control_tokens(tokenizer, role, content):
    enc = _encoder(tokenizer)
    msgs = [{"role": role, "content": content}]
    ids = enc.pieces(prompt_pieces(msgs))
    honest = enc.pieces(prompt_pieces([{"role": role, "content": "x"}]))
    specials = {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")}
    assert sorted(i for i in ids if i in specials) == sorted(i for i in honest if i in specials)
    assert tokenizer.decode(ids, skip_special_tokens=False) == prompt_text(msgs)


_ENCODERS: dict[int, ChatEncoder] = {}


def _encoder(tokenizer) -> ChatEncoder:
    return _ENCODERS.setdefault(id(tokenizer), ChatEncoder(tokenizer))


# -------------------------------------------------------------- serve requests ------
class Scripted(torch.nn.Module):
    """``generate`` appends one fixed token: the request path is fuzzed, not the model."""

    def __init__(self, token: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.config = SimpleNamespace(max_position_embeddings=4096)
        self.token = token

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, **kwargs: Any) -> torch.Tensor:
        return torch.cat([input_ids, torch.full((len(input_ids), 1), self.token)], dim=1)


@pytest.fixture(scope="module")
def fuzz_client(tokenizer):
    model = Scripted(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    return TestClient(create_app(tokenizer, model, "fuzz", max_body_bytes=200_000), raise_server_exceptions=False)


with_surrogates = st.text(st.characters(blacklist_categories=()), max_size=30)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "robot"])},
    optional={
        "content": st.one_of(
            st.none(),
            any_text,
            with_surrogates,
            json_values,
            st.lists(
                st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": any_text}), max_size=2
            ),
        ),
        "tool_calls": st.lists(
            st.fixed_dictionaries(
                {
                    "function": st.fixed_dictionaries(
                        {"name": st.one_of(any_text, with_surrogates, st.integers())},
                        optional={"arguments": st.one_of(any_text, deep_bodies, json_bodies, json_values)},
                    )
                }
            ),
            max_size=2,
        ),
    },
)
request = st.fixed_dictionaries(
    {"messages": st.one_of(st.lists(message, min_size=1, max_size=3), json_values)},
    optional={
        "stop": st.one_of(
            st.none(),
            any_text,
            with_surrogates,
            st.lists(st.one_of(any_text, with_surrogates), max_size=6),
            st.text(min_size=60, max_size=90),
        ),
        "n": st.integers(-2, 20),
        "temperature": st.one_of(st.floats(allow_nan=True), st.integers(-1, 3)),
        "top_p": st.floats(allow_nan=True),
        "max_tokens": st.one_of(st.none(), st.integers(-1, 3)),
        "seed": st.one_of(st.none(), st.integers(-1, 2**64)),
        "stream": st.booleans(),
        "response_format": json_values,
        "tools": json_values,
    },
)


@FUZZ
@given(st.one_of(request, json_values, request.map(lambda r: {**r, "deep": json.loads("[" * 200 + "]" * 200)})))
def test_serve_answers_any_body_with_200_or_a_4xx(fuzz_client, body):
    raw = json.dumps(body, ensure_ascii=True, allow_nan=True)
    r = fuzz_client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code in (200, 400, 413), (r.status_code, r.text[:300])
    if r.status_code != 200:
        err = r.json()["error"]
        assert err["message"] and err["type"] == "invalid_request_error"
