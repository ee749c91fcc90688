"""Tool use through a chat template that renders no tools (SmolLM2's plain ChatML): ``hermes_prompted``.

The checkpoint's template is kept as it is; the tool schemas go in the system message (a ``<tools>`` block),
a call stays the assistant turn's content (``<tool_call>{json}</tool_call>``) and a tool result is a ``tool``
message the template renders. Token in / token out: the rollout's ids equal ``apply_chat_template`` of the
same conversation at every turn boundary."""

from __future__ import annotations

import copy

import pytest
from family_templates import PLAIN_CHATML

from mentorrl.chat_templates import native_chat_for
from mentorrl.chat_templates.formats import HERMES_PROMPTED, prompted_system
from mentorrl.config import PromptFormat
from mentorrl.contract import ContractLimits, contract_for_env, render_observation_content, tool_schemas
from mentorrl.models.shipped import SHIPPED_ROOT
from mentorrl.rollout.episode import run_scripted_episode, run_text_turns


@pytest.fixture(scope="module")
def plain_tok():
    from transformers import AutoTokenizer

    tok = copy.deepcopy(AutoTokenizer.from_pretrained(SHIPPED_ROOT / "orders-tiny"))
    tok.chat_template = PLAIN_CHATML
    return tok


@pytest.fixture(scope="module")
def contract(plain_tok, env):
    chat = native_chat_for(plain_tok, env, PromptFormat())
    assert chat is not None and chat.name == HERMES_PROMPTED
    return contract_for_env(plain_tok, env, limits=ContractLimits(max_total_tokens=8192), chat=chat)


def _messages(system: str, user: str, turns: list[tuple[str, str]]) -> list[dict]:
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    for text, result in turns:
        msgs += [{"role": "assistant", "content": text}, {"role": "tool", "content": result}]
    return msgs


def test_the_template_is_kept_and_the_tools_are_in_the_system_text(contract, plain_tok, env):
    assert plain_tok.chat_template == PLAIN_CHATML
    system = contract.chat.system
    assert system.startswith(env.system_prompt) and "<tools>" in system and "final_answer" in system
    assert contract.chat.tools is None  # the template would ignore tools=
    assert system == prompted_system(env.system_prompt, tool_schemas(env))


def test_scripted_episodes_equal_the_template_at_every_turn_boundary(contract, plain_tok, env, orders_entry):
    for task in orders_entry.make_tasks().tasks("train", 6, 7):
        traj = run_scripted_episode(contract, env, task, orders_entry.make_expert())
        assert traj.finish_reason == "answer" and traj.reward.success, task.id
        user = env.reset(task)
        texts = [
            plain_tok.decode(traj.token_ids[s.start : s.end - 1], skip_special_tokens=False)
            for s in traj.segments
            if s.role == "policy"
        ]
        starts = [s.start for s in traj.segments if s.role == "policy"]
        for k, start in enumerate(starts):
            turns = [
                (texts[j], render_observation_content(c.error is None, c.result, c.error))
                for j, c in enumerate(traj.tool_calls[:k])
            ]
            text = plain_tok.apply_chat_template(
                _messages(contract.chat.system, user, turns), add_generation_prompt=True, tokenize=False
            )
            assert traj.token_ids[:start] == plain_tok.encode(text, add_special_tokens=False), (task.id, k)


@pytest.mark.parametrize(
    "turn",
    [
        '<tool_call>\n{"name": "find_customer", "arguments": {"email": "x"\n</tool_call>',  # truncated JSON
        '<tool_call>\n{"name": "delete_everything", "arguments": {}}\n</tool_call>',  # unknown tool
        'Let me check. <tool_call>\n{"name": "get_order", "arguments": {"order_id": "O-1"}}\n</tool_call> ok',
    ],
)
def test_malformed_calls_from_a_real_model_are_observations_not_crashes(contract, env, orders_entry, turn):
    task = orders_entry.make_tasks().tasks("train", 1, 3)[0]
    traj = run_text_turns(contract, env, task, [turn, "I could not do it."])
    assert traj.tool_calls and traj.finish_reason == "answer" and not traj.reward.success


@pytest.mark.parametrize("system_turn", [False, True])
def test_serve_renders_a_saved_checkpoint_as_its_run_trained_it(plain_tok, tmp_path, system_turn):
    """The run's prompt settings travel in the checkpoint's tokenizer_config.json (``PROMPT_RECORD``): a
    SmolLM2-style checkpoint trained with ``system_turn: false`` saw no tools block, so ``mentorrl serve``
    renders a request's tools nowhere (they still name the functions a reply may call) and the served
    prompt is the training prompt token for token; one trained with the system turn gets the tools block."""
    from transformers import AutoTokenizer

    from mentorrl.config import RunConfig
    from mentorrl.serve.render import ChatRenderer
    from mentorrl.train.workspace import open_workspace

    tok = copy.deepcopy(plain_tok)
    ws = open_workspace(
        RunConfig(
            run_dir=str(tmp_path / "run"), prompt={"system_turn": system_turn}, limits={"max_total_tokens": 4096}
        ),
        show_progress=False,
    )
    ws.bind_tokenizer(tok)
    tok.save_pretrained(tmp_path / "ckpt")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "ckpt")
    assert loaded.chat_template == PLAIN_CHATML  # never edited
    env = ws.make_env()
    try:
        task = ws.eval_tasks("heldout", 1)[0]
        user = env.reset(task)
        tools = tool_schemas(env)
        system = [{"role": "system", "content": env.system_prompt}] if system_turn else []
        renderer = ChatRenderer(loaded)
        served = renderer.prompt_pieces([*system, {"role": "user", "content": user}], tools)
        if system_turn:  # the text; this tokenizer has <tool_call> as a token, which serve's tools block spells out
            assert "".join(served) == "".join(ws.contract.chat.prompt_pieces(user))
        else:
            assert renderer.encoder.pieces(served) == ws.contract.prompt_ids(user)
        assert ("<tools>" in "".join(served)) is system_turn
    finally:
        env.close()
