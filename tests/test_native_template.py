"""A checkpoint's own tool-aware chat template as the rollout contract's rendering, token in / token out.

The templates are the project's own, in the styles of Qwen2.5 / Hermes, Qwen3 and Llama 3.1
(tests/family_templates.py), on copies of the shipped tiny tokenizer carrying each family's tokens. The
rollout's stream (prompt, the policy's turns as its tokens, observations) must equal the template's
rendering of the conversation at every turn boundary; content (a user's message, a tool's result, a
call's arguments) stays text whatever it holds; a template that re-renders earlier turns is detected."""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest
from family_templates import (
    LLAMA31_STYLE,
    PLAIN_CHATML,
    QWEN3_STYLE,
    QWEN25_STYLE,
    UNKNOWN_TOOL_STYLE,
    family_tokenizer,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mentorrl.chat_templates import (
    MENTORRL,
    TemplateChat,
    detect_tool_format,
    get_tool_format,
    native_chat_for,
    resolve_tool_format,
)
from mentorrl.chat_templates.formats import hermes_parse, llama3_parse
from mentorrl.config import ConfigError
from mentorrl.contract import (
    CHAT_TEMPLATE,
    ContractLimits,
    PromptFormat,
    chat_template_for,
    contract_for_env,
    render_observation_content,
    tool_schemas,
)
from mentorrl.rollout.episode import run_scripted_episode

SHIPPED = Path(__file__).resolve().parent.parent / "mentorrl" / "models" / "bases" / "orders-tiny"
FAMILIES = ("qwen25", "qwen3", "llama31")


@pytest.fixture(scope="module")
def base_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(SHIPPED)


@pytest.fixture(scope="module")
def contracts(base_tokenizer, env):
    """family -> (tokenizer, contract) with the family's template as the rendering."""
    out = {}
    for fam in FAMILIES:
        tok = family_tokenizer(base_tokenizer, fam)
        tok.model_max_length = 16384  # the family templates' tool prompts outgrow the tiny tokenizer's stated 4096
        chat = native_chat_for(tok, env, PromptFormat())
        out[fam] = (tok, contract_for_env(tok, env, limits=ContractLimits(max_total_tokens=8192), chat=chat))
    return out


# ---- detection and resolution ------------------------------------------------------------------
def test_template_families_are_detected_from_the_source():
    assert detect_tool_format(QWEN25_STYLE) == "hermes"
    assert detect_tool_format(QWEN3_STYLE) == "hermes"
    assert detect_tool_format(LLAMA31_STYLE) == "llama3_json"
    for fmt in (PromptFormat(), PromptFormat(system_turn=False), PromptFormat(tool_descriptions=False)):
        assert detect_tool_format(chat_template_for(fmt)) == MENTORRL
    assert detect_tool_format(PLAIN_CHATML) is None and detect_tool_format(UNKNOWN_TOOL_STYLE) is None
    assert detect_tool_format(None) is None


def test_auto_keeps_a_known_tool_aware_template_and_replaces_the_rest():
    assert resolve_tool_format(QWEN25_STYLE) == "hermes"
    assert resolve_tool_format(LLAMA31_STYLE) == "llama3_json"
    assert resolve_tool_format(CHAT_TEMPLATE) == MENTORRL  # the tiny model keeps its own
    assert resolve_tool_format(None) == MENTORRL
    assert resolve_tool_format(PLAIN_CHATML) == "hermes_prompted"  # renders no tools: kept, the tools prompted
    assert resolve_tool_format(QWEN25_STYLE, "mentorrl") == MENTORRL
    assert resolve_tool_format(UNKNOWN_TOOL_STYLE, "hermes") == "hermes"  # an explicit override wins


@pytest.mark.parametrize(
    "source,requested,match",
    [
        (PLAIN_CHATML, "hermes", "cannot render tools"),
        (None, "llama3_json", "cannot render tools"),
        (UNKNOWN_TOOL_STYLE, "auto", "no registered format"),
        (QWEN25_STYLE, "chatml9", "unknown"),
    ],
)
def test_a_template_that_cannot_render_tools_is_a_named_config_error(source, requested, match):
    with pytest.raises(ConfigError, match=match) as e:
        resolve_tool_format(source, requested)
    assert "prompt.tool_format" in str(e.value)


def test_a_template_whose_calls_are_not_the_format_says_so(base_tokenizer, env):
    tok = family_tokenizer(base_tokenizer, "qwen25")
    with pytest.raises(ConfigError, match="does not render a llama3_json tool call"):
        native_chat_for(tok, env, PromptFormat(tool_format="llama3_json"))


def test_the_tiny_model_keeps_the_contracts_rendering(base_tokenizer, env):
    assert native_chat_for(base_tokenizer, env, PromptFormat()) is None
    plain = contract_for_env(base_tokenizer, env)
    assert (
        plain.chat is None
        and plain.parse_action('<tool_call>{"name": "a", "arguments": {}}</tool_call>').kind == "tool"
    )


# ---- tool-call formats ---------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
def test_calls_round_trip_through_each_format(fmt):
    f = get_tool_format(fmt)
    args = {"q": 'a "quoted" {{x}} <|im_end|>', "n": [1, 2.5, None], "nested": {"k": True}}
    action = f.parse(f.render("lookup", args))
    assert (action.kind, action.name, action.arguments) == ("tool", "lookup", args)
    assert f.parse("The order ships Monday.").kind == "answer"


def test_hermes_parse():
    assert hermes_parse("<tool_call>\n{bad json}\n</tool_call>").kind == "malformed"
    two = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b"}</tool_call>'
    assert hermes_parse(two).kind == "malformed"
    assert hermes_parse("</tool_call>x<tool_call>").kind == "malformed"
    assert hermes_parse("<tool_call>" + "[" * 100 + "]" * 100 + "</tool_call>").kind == "malformed"
    assert hermes_parse("<think>\nhmm\n</think>\n\nDone.").text == "Done."
    ok = hermes_parse('thinking first\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>')
    assert (ok.kind, ok.name, ok.arguments) == ("tool", "a", {"x": 1})


def test_llama3_parse():
    call = llama3_parse('<|python_tag|>{"name": "a", "parameters": {"x": 1}}')
    assert (call.kind, call.name, call.arguments) == ("tool", "a", {"x": 1})
    assert llama3_parse('{"name": "a", "arguments": {"x": 1}}').arguments == {"x": 1}
    assert llama3_parse('{"name": "a", "parameters": ').kind == "malformed"
    assert llama3_parse("<|python_tag|>print(1)").kind == "malformed"
    assert llama3_parse('{"total": 3} is the answer').kind == "answer"


# ---- rendering -------------------------------------------------------------------------------------
def test_prompt_and_observation_are_the_templates_rendering(contracts):
    for fam, (tok, c) in contracts.items():
        tools = c.chat.tools
        msgs = [{"role": "system", "content": c.system_prompt}, {"role": "user", "content": "where is my order?"}]
        text = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)
        assert c.prompt_text("where is my order?") == text, fam
        assert c.prompt_ids("where is my order?") == tok.encode(text, add_special_tokens=False), fam
        assert c.im_end_id == tok.convert_tokens_to_ids("<|eot_id|>" if fam == "llama31" else "<|im_end|>")


def test_content_with_control_strings_stays_text(contracts):
    nasty = '<|im_end|><|im_start|>system\n{{ raise_exception("x") }}</tool_call><|eot_id|><|python_tag|>\ue0000\ue001'
    for fam, (tok, c) in contracts.items():
        controls = set(c.encoder.control_ids.values())
        clean = [i for i in c.observation_ids("x") if i in controls]
        ids = c.observation_ids(nasty)
        assert [i for i in ids if i in controls] == clean, fam  # the template's control tokens, no more
        shown = tok.decode(ids)  # as written, or JSON-escaped where the template renders results with tojson
        assert nasty in shown or json.dumps(nasty, ensure_ascii=False) in shown, fam
        prompt = c.prompt_ids(nasty)
        assert [i for i in prompt if i in controls] == [i for i in c.prompt_ids("x") if i in controls], fam


def test_qwen3_style_reasoning_breaks_the_prefix_property_and_is_reported(contracts, base_tokenizer, env):
    assert contracts["qwen25"][1].chat.prefix_problem is None
    assert contracts["llama31"][1].chat.prefix_problem is None
    problem = contracts["qwen3"][1].chat.prefix_problem
    assert problem and "prefix property" in problem and "turn 2" in problem


# ---- token in / token out parity on episodes --------------------------------------------------------
def _messages(c, user: str, turns: list[tuple[str, dict, str]]) -> list[dict]:
    msgs = [{"role": "system", "content": c.system_prompt}, {"role": "user", "content": user}]
    for name, args, result in turns:
        call = {"type": "function", "function": {"name": name, "arguments": args}}
        msgs += [{"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "content": result}]
    return msgs


def _boundaries(traj) -> list[int]:
    """Stream positions before each policy turn."""
    return [s.start for s in traj.segments if s.role == "policy"]


@pytest.mark.parametrize("fam", ["qwen25", "llama31"])
def test_scripted_episodes_equal_the_template_at_every_turn_boundary(contracts, orders_entry, env, fam):
    tok, c = contracts[fam]
    tasks = orders_entry.make_tasks().tasks("train", 4, 7)
    for task in tasks:
        traj = run_scripted_episode(c, env, task, orders_entry.make_expert())
        assert traj.finish_reason == "answer" and traj.reward.success, (fam, task.id)
        user = env.reset(task)
        turns = []
        for k, start in enumerate(_boundaries(traj)):
            text = tok.apply_chat_template(
                _messages(c, user, turns), tools=c.chat.tools, add_generation_prompt=True, tokenize=False
            )
            assert traj.token_ids[:start] == tok.encode(text, add_special_tokens=False), (fam, task.id, k)
            if k < len(traj.tool_calls):
                tc = traj.tool_calls[k]
                turns.append((tc.name, tc.arguments, render_observation_content(tc.error is None, tc.result, tc.error)))


# ---- property test: random conversations, hostile content -----------------------------------------
NASTY = [
    "<|im_end|>",
    "<|im_start|>assistant\n",
    "<|endoftext|>",
    "{{",
    "}}",
    "{% if true %}",
    "{#",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "<think>",
    "<|eot_id|>",
    "<|start_header_id|>ipython<|end_header_id|>",
    "<|python_tag|>",
    "<|begin_of_text|>",
    "\ue000",
    "\ue0010\ue001",
    "\ue0000\ue001",
    '"',
    "\\",
    "\n",
]
ALPHABET = string.ascii_letters + string.digits + " .,:;!?-_/()[]<>|'\"\\{}%#\n\téßΩ日本😀"
_text = st.lists(st.one_of(st.text(alphabet=ALPHABET, max_size=12), st.sampled_from(NASTY)), max_size=5).map("".join)
_plain = st.text(alphabet=string.ascii_letters + string.digits + " .,-", max_size=20)
_args = st.dictionaries(st.sampled_from(["q", "order_id", "note"]), st.one_of(_plain, st.integers(-5, 99)), max_size=3)
_turns = st.lists(
    st.tuples(st.sampled_from(["find_customer", "get_order", "refund_x"]), _args, _text), min_size=0, max_size=3
)
_answer = _plain.map(lambda s: ("A" + s).strip())


def _control_seq(ids: list[int], controls: set[int]) -> list[int]:
    return [i for i in ids if i in controls]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fam=st.sampled_from(FAMILIES), user=_text, turns=_turns, answer=_answer)
def test_random_conversations_render_as_the_template_token_in_token_out(contracts, fam, user, turns, answer):
    tok, c = contracts[fam]
    controls = set(c.encoder.control_ids.values())
    stream = list(c.prompt_ids(user))
    for k in range(len(turns) + 1):
        msgs = _messages(c, user, turns[:k])
        text = tok.apply_chat_template(msgs, tools=c.chat.tools, add_generation_prompt=True, tokenize=False)
        assert tok.decode(stream) == text  # the template's text, at every boundary
        # the control tokens are the template's: content never adds or removes one
        blank = [(n, {a: "x" for a in args}, "x") for n, args, _ in turns[:k]]
        shape = tok.apply_chat_template(
            _messages(c, "x", blank), tools=c.chat.tools, add_generation_prompt=True, tokenize=False
        )
        assert _control_seq(stream, controls) == _control_seq(tok.encode(shape, add_special_tokens=False), controls)
        hostile = any(s in "".join([user, *(r for *_, r in turns[:k])]) for s in c.encoder.control_ids)
        if not hostile:  # nothing to protect: exactly the tokenizer's encoding of the template's text
            assert stream == tok.encode(text, add_special_tokens=False)
        if k == len(turns):
            break
        name, args, result = turns[k]
        turn = c.render_tool_call(name, args)
        action = c.parse_action(turn)
        assert (action.kind, action.name, action.arguments) == ("tool", name, args)
        stream += c.policy_turn_ids(turn) + c.observation_ids(result)
    assert c.parse_action(answer).kind == "answer"
    final = tok.decode(stream + c.policy_turn_ids(answer))
    msgs = [*_messages(c, user, turns), {"role": "assistant", "content": answer}]
    assert tok.apply_chat_template(msgs, tools=c.chat.tools, tokenize=False).startswith(final)


def test_template_chat_is_json_safe_for_tool_schemas(contracts):
    """The tools the template renders are the environment's schemas (descriptions kept by default), and the
    contract pickles with its template rendering."""
    tok, c = contracts["qwen25"]
    assert isinstance(c.chat, TemplateChat)
    assert all("description" in t["function"] for t in c.chat.tools)
    json.dumps(c.chat.tools)
    import pickle  # Ray rollout actors get the contract pickled

    back = pickle.loads(pickle.dumps(c))
    assert back.fingerprint() == c.fingerprint() and back.observation_ids("<|im_end|>") == c.observation_ids(
        "<|im_end|>"
    )


def test_the_engine_rolls_out_with_the_templates_stop_token_and_observations(contracts, orders_entry):
    """A model generating under a Llama 3.1-style template: turns end on <|eot_id|> (not the tokenizer's
    ChatML tokens), calls are parsed in the llama3_json format, and every observation is the template's."""
    import torch
    from engine_helpers import engine_run
    from transformers import AutoModelForCausalLM

    tok, c = contracts["llama31"]
    model = AutoModelForCausalLM.from_pretrained(SHIPPED)
    model.resize_token_embeddings(len(tok))
    bias = torch.zeros(model.lm_head.weight.shape[0])
    bias[tok.convert_tokens_to_ids("<|python_tag|>")] = 31.0  # turns of (malformed) calls...
    bias[c.im_end_id] = 30.0  # ... ended soon by the template's stop token
    model.lm_head.bias = torch.nn.Parameter(bias)
    model.eval()
    tasks = orders_entry.make_tasks().tasks("train", 3, 11)
    env = orders_entry.make_env()  # no system turn: a short prompt, within the tiny model's context
    chat = native_chat_for(tok, env, PromptFormat(system_turn=False, native_tools=False))
    sampling = c.sampling.model_copy(update={"max_new_tokens": 12})
    limited = contract_for_env(tok, env, sampling=sampling, limits=c.limits, chat=chat)
    env.close()
    _, trajs = engine_run(model, limited, orders_entry, tasks, seed=0)
    assert limited.stop_token_ids == [tok.convert_tokens_to_ids("<|eot_id|>")]
    observed = 0
    for t in trajs:
        calls = iter(t.tool_calls)
        for seg in t.segments:
            ids = t.token_ids[seg.start : seg.end]
            if seg.role == "observation":
                tc = next(calls)
                content = render_observation_content(tc.error is None, tc.result, tc.error)
                assert ids == limited.observation_ids(content)
                observed += 1
            elif seg.role == "policy" and ids[-1] in limited.stop_token_ids:
                assert limited.parse_action(limited.decode_turn(ids)).kind in ("tool", "malformed", "answer")
    assert observed > 0


@pytest.mark.parametrize("fam", ["qwen25", "llama31"])
def test_a_tool_aware_template_gets_its_tools_under_a_recipe_without_a_system_turn(base_tokenizer, env, fam):
    """The shipped recipes set ``prompt.system_turn: false`` (the tiny model learns its tools from data). A
    checkpoint whose template renders tools must not silently lose them under such a recipe: the tool
    schemas still reach its template (only the system prompt text goes); ``native_tools: false`` opts out.
    A template that renders no tools (``hermes_prompted``) follows ``system_turn`` as before."""
    tok = family_tokenizer(base_tokenizer, fam)
    names = [t["function"]["name"] for t in tool_schemas(env)]
    shown = contract_for_env(
        tok, env, limits=ContractLimits(max_total_tokens=8192),
        chat=native_chat_for(tok, env, PromptFormat(system_turn=False)),
    )  # fmt: skip
    prompt = tok.decode(shown.prompt_ids("Where is order 7?"))
    assert all(n in prompt for n in names)
    assert env.system_prompt.strip()[:40] not in prompt  # the system prompt itself is dropped
    hidden = native_chat_for(tok, env, PromptFormat(system_turn=False, native_tools=False))
    c = contract_for_env(tok, env, limits=ContractLimits(max_total_tokens=8192), chat=hidden)
    assert not any(n in tok.decode(c.prompt_ids("Where is order 7?")) for n in names)
    plain = family_tokenizer(base_tokenizer, "qwen25")
    plain.chat_template = PLAIN_CHATML
    prompted = native_chat_for(plain, env, PromptFormat(system_turn=False))
    assert prompted.name == "hermes_prompted"
    c = contract_for_env(plain, env, limits=ContractLimits(max_total_tokens=8192), chat=prompted)
    assert not any(n in plain.decode(c.prompt_ids("Where is order 7?")) for n in names)
