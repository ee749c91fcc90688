"""bench/vs_trl.py without trl: the bridge from mentorrl's tools, chat template and reward to TRL's
``environment_factory`` (tool methods whose schemas render the contract's signatures, the template's
``system_turn`` switch, observations, how a TRL rollout ends and is scored), mentorrl's task draw, and
the summary (per-rep figures, medians, paired ratios, targets)."""

from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers.utils.chat_template_utils import get_json_schema, render_jinja_template

from mentorrl.chat import prompt_text
from mentorrl.contract import (
    CHAT_TEMPLATE,
    ContractLimits,
    PromptFormat,
    SamplingParams,
    chat_template_for,
    contract_for_env,
    observation_text,
    tool_schemas,
)
from mentorrl.rewards.compose import RewardWeights
from mentorrl.rollout.episode import run_scripted_episode

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "vs_trl.py"
BASE = ROOT / "mentorrl" / "models" / "bases" / "orders-tiny"  # the demo's tokenizer and saved chat template


@pytest.fixture(scope="module")
def b():
    spec = importlib.util.spec_from_file_location("vs_trl", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["vs_trl"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def orders():
    from mentorrl.envs import get_env

    entry = get_env("orders")
    env = entry.make_env(answer="free_text")  # the bench reads free-text answers (vs_trl.ENV_ANSWER)
    try:
        yield entry, tool_schemas(env), env.system_prompt
    finally:
        env.close()


@pytest.fixture(scope="module")
def base_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(BASE)


def _render(template: str, messages, tools=None, **kw) -> str:
    return render_jinja_template([messages], tools=tools, chat_template=template, add_generation_prompt=True, **kw)[0][
        0
    ]


# ------------------------------------------------------------------------------ tools -------------
def test_tool_methods_render_the_contract_signatures(b, orders):
    entry, schemas, system_prompt = orders
    cls = b.environment_class(schemas)
    inst = cls.__new__(cls)  # no environment: only the methods' schemas are read
    methods = [getattr(inst, s["function"]["name"]) for s in schemas]
    for m, s in zip(methods, schemas):
        got, want = get_json_schema(m)["function"], s["function"]
        assert got["name"] == want["name"] and got["description"] == want["description"]
        assert list(got["parameters"]["properties"]) == list(want["parameters"]["properties"])
        assert [p["type"] for p in got["parameters"]["properties"].values()] == [
            p["type"] for p in want["parameters"]["properties"].values()
        ]
        assert got["parameters"]["required"] == want["parameters"]["required"]
    messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": "Where is order O-1?"}]
    for desc in (True, False):  # TRL passes bound methods as tools=; mentorrl's template renders its system turn
        assert _render(CHAT_TEMPLATE, messages, methods, tool_descriptions=desc) == prompt_text(
            messages, tools=schemas, tool_descriptions=desc
        )


def test_optional_and_untyped_arguments(b):
    m = b.tool_method(
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "description": "Find  a\nthing.",
                "parameters": {
                    "type": "object",
                    "properties": {"q": {"type": "string"}, "limit": {"type": "integer"}, "extra": {}},
                    "required": ["q"],
                },
            },
        }
    )
    sig = inspect.signature(m)
    assert list(sig.parameters) == ["self", "q", "limit", "extra"]
    assert sig.parameters["q"].default is inspect.Parameter.empty and sig.parameters["limit"].default is None
    schema = get_json_schema(m)["function"]
    assert schema["description"] == "Find a thing." and schema["parameters"]["required"] == ["q"]
    # rendered as the contract renders it: optional arguments with "?", a missing type as "any"
    text = _render(CHAT_TEMPLATE, [{"role": "user", "content": "x"}], [schema])
    assert "- lookup(q: string, limit?: integer, extra?: any) - Find a thing." in text
    seen = []
    env = SimpleNamespace(_call=lambda name, args: seen.append((name, args)) or "obs")
    assert m(env, q="a", bogus=[1]) == "obs" and seen == [("lookup", {"q": "a", "bogus": [1]})]


def test_environment_class_refuses_clashing_or_bad_names(b):
    def schema(name):
        return {"type": "function", "function": {"name": name, "description": "d", "parameters": {}}}

    with pytest.raises(ValueError, match="clashes"):
        b.environment_class([schema("reset")])
    with pytest.raises(ValueError, match="clashes"):
        b.environment_class([schema("a"), schema("a")])
    with pytest.raises(ValueError, match="identifier"):
        b.tool_method(schema("get-order"))
    cls = b.environment_class([schema("ping")])
    # TRL takes every public function of the class as a tool and calls reset(): only the tools are public
    public = [n for n, _ in inspect.getmembers(cls, inspect.isfunction) if not n.startswith("_")]
    assert sorted(public) == ["ping", "reset"]


# ---------------------------------------------------------------------------- template ------------
def test_the_recipes_template_renders_the_trl_prompt(orders):
    """TRL always passes tools=: the template a system_turn: false recipe saves renders no system turn."""
    _, schemas, system_prompt = orders
    tpl = chat_template_for(PromptFormat(system_turn=False))
    user = [{"role": "user", "content": "Cancel O-7 please."}]
    with_system = [{"role": "system", "content": system_prompt}, *user]
    # an explicit system_turn=True: exactly the default template
    assert _render(tpl, with_system, schemas, system_turn=True) == _render(CHAT_TEMPLATE, with_system, schemas)
    # tools given (TRL always passes them) but no system turn, as the demo contract renders
    assert _render(tpl, user, schemas) == prompt_text(user)
    # a tool result after a tool call renders as the contract's observation
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"type": "function", "function": {"name": "get_order", "arguments": {"order_id": "O-7"}}}],
    }
    before = render_jinja_template([[*user, call]], chat_template=tpl)[0][0]
    after = _render(
        tpl, [*user, call, {"role": "tool", "name": "get_order", "content": '{"status": "shipped"}'}], schemas
    )
    assert before.endswith("<|im_end|>\n")
    assert after == before.removesuffix("\n") + observation_text('{"status": "shipped"}')


# -------------------------------------------------------------------------- episode end -----------
def _call(name, args):
    return {"type": "function", "function": {"name": name, "arguments": args}}


def test_trl_episode_end(b):
    tool = {"role": "tool", "name": "get_order", "content": "{}"}
    ask = {"role": "assistant", "content": "", "tool_calls": [_call("get_order", {"order_id": "O-1"})]}
    answer = {"role": "assistant", "content": "It shipped."}
    assert b.trl_episode_end([ask, tool, answer], "  It shipped. ", True, 6)[:2] == ("It shipped.", "answer")
    assert b.trl_episode_end([ask, tool, answer], "It ship", False, 6)[:2] == (None, "length")
    assert b.trl_episode_end([ask, tool] * 5 + [ask], "<tool_call>...", True, 6)[:2] == (None, "max_turns")
    assert b.trl_episode_end([ask, tool, ask], "<tool_call>...", True, 6)[:2] == (None, "max_tokens")
    # TRL's parser fell back to text where mentorrl reads a (malformed) tool call: no answer
    final, reason, action = b.trl_episode_end(
        [ask, tool, {"role": "assistant", "content": "x"}], '<tool_call>{"name": "get_order", "arguments": {}', True, 6
    )
    assert (final, reason, action.kind) == (None, "unparsed", "malformed")


def test_last_turn_text(b):
    text = (
        '<tool_call>{"name": "a"}</tool_call><|im_end|>\n<|im_start|>tool\n{}<|im_end|>\n'
        "<|im_start|>assistant\nDone.<|im_end|>"
    )
    assert b.last_turn_text(text, True) == "Done."
    assert b.last_turn_text("Done, cut", False) == "Done, cut"


def test_refused_calls(b):
    names = {"get_order"}
    msgs = [
        {"role": "assistant", "tool_calls": [_call("nope", {}), _call("get_order", [1]), _call("get_order", {})]},
        {"role": "tool", "content": "x"},
        {"role": "assistant", "tool_calls": [_call("nope", {})]},
    ]
    assert b.refused_calls(msgs, names, max_turns=6) == [("nope", {}), ("get_order", [1]), ("nope", {})]
    # the max_turns-th turn's calls never ran
    assert b.refused_calls(msgs, names, max_turns=2) == [("nope", {}), ("get_order", [1])]


# --------------------------------------------------------------------- bridge end to end -----------
def _trl_messages_of(traj) -> list[dict]:
    """The completion TRL would hold for a mentorrl trajectory: assistant turns and tool results."""
    out = []
    for c in traj.tool_calls:
        out += [
            {"role": "assistant", "content": "", "tool_calls": [_call(c.name, c.arguments)]},
            {"role": "tool", "name": c.name, "content": None},
        ]
    return out + [{"role": "assistant", "content": traj.final_answer}]


def test_bridge_scores_like_mentorrl(b, orders, base_tokenizer):
    """Replaying the scripted expert through the TRL environment: the same observations, the same reward."""
    entry, schemas, _ = orders
    env = b.bench_env_factory(entry)()
    try:
        contract = contract_for_env(
            base_tokenizer,
            env,
            SamplingParams(max_new_tokens=64),
            ContractLimits(max_turns=6, max_total_tokens=768),
            PromptFormat(system_turn=False),
        )
    finally:
        env.close()
    tasks = entry.make_tasks().tasks("train", n=12, seed=3)
    ctx = SimpleNamespace(
        make_env=b.bench_env_factory(entry),
        contract=contract,
        weights=RewardWeights(),
        tasks=tasks,
        max_turns=6,
        tool_names=[s["function"]["name"] for s in schemas],
    )
    cls = b.environment_class(schemas)
    trl_env, ref_env = cls(ctx), b.bench_env_factory(entry)()
    checked = 0
    try:
        for i, task in enumerate(tasks):
            ref = run_scripted_episode(contract, ref_env, task, entry.make_expert())
            if not ref.tool_calls or ref.finish_reason != "answer":
                continue
            assert trl_env.reset(task_index=i) == task.prompt
            msgs = _trl_messages_of(ref)
            for c, m in zip(ref.tool_calls, msgs[1::2]):
                m["content"] = getattr(trl_env, c.name)(**c.arguments)  # what TRL's tool loop does
                assert m["content"] in base_tokenizer.decode(ref.token_ids, skip_special_tokens=False)
            prompt_end = ref.segments[0].end
            assert trl_env._score(msgs, ref.token_ids[prompt_end:]) == pytest.approx(ref.reward.total)
            assert trl_env._last["success"] == ref.reward.success and trl_env._last["finish_reason"] == "answer"
            checked += 1
        assert checked >= 3
        # a call TRL refused itself (unknown tool) is charged as mentorrl's registry answers it
        task = tasks[0]
        trl_env.reset(task_index=0)
        msgs = [
            {"role": "assistant", "content": "", "tool_calls": [_call("delete_everything", {})]},
            {"role": "tool", "name": "delete_everything", "content": "{'error': 'Tool not found'}"},
            {"role": "assistant", "content": "Done."},
        ]
        ids = contract.policy_turn_ids("Done.")
        trl_env._score(msgs, ids)
        assert trl_env._last["refused_calls"] == 1
        assert trl_env._ep.tool_calls[-1].error_kind == "unknown_tool"
    finally:
        trl_env._env.close()
        ref_env.close()


# --------------------------------------------------------------------------- task draw ------------
def test_task_draw_is_mentorrls(b, orders):
    from mentorrl.train.loop import StepBatch, StepSeeds
    from mentorrl.train.recipes.grpo import GRPOStage

    entry, _, _ = orders
    seed, steps, per_step = 4, 3, 5
    ws = SimpleNamespace(
        cfg=SimpleNamespace(seed=seed), train_tasks=lambda n, s: entry.make_tasks().tasks(split="train", n=n, seed=s)
    )
    stage = GRPOStage.__new__(GRPOStage)  # only the pool and the tasks hook (no learner, no rollout)
    stage.ws, stage.seeds, stage.hard = ws, StepSeeds(seed, "grpo"), None
    stage.cfg = SimpleNamespace(tasks_per_step=per_step, steps=steps)
    pool = stage.pool = stage.make_pool()
    drawn = b.grpo_step_tasks(entry, seed, steps, per_step)
    assert len(drawn) == steps and all(len(d) == per_step for d in drawn)
    ids = {t.id for t in pool}
    assert all(t.id in ids for d in drawn for t in d)
    b = StepBatch(2, stage.seeds.at(2))
    stage.tasks(b)  # the GRPO stage's own draw at step 3
    assert [t.id for t in drawn[2]] == [t.id for t in b.tasks]


# ----------------------------------------------------------------------------- summary ------------
def _step(step, cpu, rollout_cpu, traj=128, tokens=7000, success=0.5):
    return {
        "step": step,
        "step_cpu_s": cpu,
        "step_wall_s": cpu * 1.1,
        "rollout_cpu_s": rollout_cpu,
        "rollout_wall_s": rollout_cpu * 1.1,
        "update_cpu_s": cpu - rollout_cpu,
        "update_wall_s": (cpu - rollout_cpu) * 1.1,
        "trajectories": traj,
        "policy_tokens": tokens,
        "success": success,
        "reward_mean": success,
    }


def test_rep_metrics_skips_warmup_and_sums_before_dividing(b):
    res = {
        "arm": "trl",
        "rep": 0,
        "peak_rss_mib": 900.0,
        "steps": [
            _step(0, 100.0, 90.0),
            _step(1, 20.0, 8.0, tokens=6000),
            _step(2, 30.0, 12.0, tokens=8000, success=0.25),
        ],
    }
    m = b.rep_metrics(res, warmup=1)
    assert m["steps"] == 2 and m["step_cpu_s_per_step"] == 25.0 and m["rollout_cpu_s_per_step"] == 10.0
    assert m["update_cpu_s_per_step"] == 15.0
    assert m["trajectories_per_cpu_s"] == pytest.approx(256 / 50)
    assert m["rollout_tokens_per_cpu_s"] == pytest.approx(14000 / 20)
    assert m["success"] == pytest.approx(0.375) and m["peak_rss_mib"] == 900.0
    assert m["rollout_cores_busy"] == pytest.approx(1 / 1.1) and m["step_cores_busy"] == pytest.approx(1 / 1.1)
    with pytest.raises(ValueError, match="no timed steps"):
        b.rep_metrics(res, warmup=3)


def test_summary_medians_paired_ratios_and_targets(b):
    def run(arm, rep, cpu, rollout, rss):
        return {"arm": arm, "rep": rep, "peak_rss_mib": rss, "steps": [_step(0, 1.0, 1.0), _step(1, cpu, rollout)]}

    results = {
        "trl": [run("trl", 0, 20.0, 8.0, 1000), run("trl", 1, 40.0, 16.0, 1000), run("trl", 2, 22.0, 8.0, 1000)],
        "mentorrl": [
            run("mentorrl", 0, 10.0, 4.0, 500),
            run("mentorrl", 1, 5.0, 2.0, 600),
            run("mentorrl", 2, 11.0, 2.0, 700),
        ],
    }
    s = b.summarize(results, warmup=1)
    assert s["arms"]["trl"]["step_cpu_s_per_step"] == 22.0 and s["arms"]["mentorrl"]["step_cpu_s_per_step"] == 10.0
    # per-rep ratios 2, 8, 2 -> median 2 (the ratio of the medians would be 2.2)
    assert s["ratios"]["trajectories_per_cpu_s"] == pytest.approx(2.0)
    # rollout: 8/4, 16/2, 8/2 -> 2, 8, 4 -> 4
    assert s["ratios"]["rollout_tokens_per_cpu_s"] == pytest.approx(4.0)
    assert s["ratios"]["peak_rss_mib"] == pytest.approx(0.6)
    t = s["targets"]["rollout_tokens_per_cpu_s"]
    assert (t["target"], t["ratio"], t["met"], t["reps"]) == (2.0, pytest.approx(4.0), True, 3)
    assert s["targets"]["trajectories_per_cpu_s"]["met"] is False
    table = b.markdown_table(s)
    assert "| trajectories / step CPU-s | 5.82 | 12.80 | 2.00x |" in table
    assert len(table.splitlines()) == 2 + len(b.TABLE_ROWS)
    assert any("NOT met" in line for line in b.target_lines(s))
    # one arm only: medians, no ratios
    one = b.summarize({"mentorrl": results["mentorrl"]}, warmup=1)
    assert one["ratios"] == {} and one["targets"]["trajectories_per_cpu_s"]["ratio"] is None
    assert "–" in b.markdown_table(one)


def test_ratio_intervals_and_merged_runs(b, tmp_path):
    """Targets carry the per-rep range and a 95% interval of the geometric mean; ``--summarize`` pools the
    reps of several runs, pairing arms within each run only."""

    def run(arm, rep, cpu, rollout):
        return {"arm": arm, "rep": rep, "peak_rss_mib": 1.0, "steps": [_step(0, 1.0, 1.0), _step(1, cpu, rollout)]}

    def doc(ratios):
        return {
            "settings": {"warmup": 1},
            "runs": {
                "trl": [run("trl", r, 20.0, 8.0) for r in range(len(ratios))],
                "mentorrl": [run("mentorrl", r, 20.0 / x, 8.0 / x) for r, x in enumerate(ratios)],
            },
        }

    one = b.summarize(doc([4.0, 5.0, 6.0])["runs"], warmup=1)["targets"]["trajectories_per_cpu_s"]
    assert one["ratio"] == pytest.approx(5.0) and one["met"] and (one["min"], one["max"]) == pytest.approx((4.0, 6.0))
    assert one["geo_mean"] == pytest.approx(120 ** (1 / 3))
    lo, hi = one["ci95"]
    assert lo < 4.0 < 6.0 < hi and not one["interval_above"]  # 3 reps: wide
    paths = []
    for i, ratios in enumerate(([4.4, 4.6, 4.5], [4.5, 4.7, 4.6])):
        paths.append(str(tmp_path / f"run{i}.json"))
        (tmp_path / f"run{i}.json").write_text(__import__("json").dumps(doc(ratios)))
    merged = b.summarize_files(paths)["targets"]["trajectories_per_cpu_s"]
    assert merged["reps"] == 6 and merged["interval_above"] and merged["ratio"] == pytest.approx(4.55)
    one_rep = b.summarize(doc([4.2])["runs"], warmup=1)["targets"]["trajectories_per_cpu_s"]
    assert one_rep["ci95"] is None and not one_rep["interval_above"]
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(SystemExit, match="bad.json"):
        b.summarize_files([str(tmp_path / "bad.json")])


def test_child_command_carries_every_setting(b, tmp_path):
    args = b.parse_args(["--model", str(BASE), "--seed", "5", "--trl-micro-batch", "16", "--steps", "4"])
    args.model = BASE
    cmd = b.child_command(args, "trl", 2, tmp_path / "o.json", tmp_path)
    child = b.parse_args(cmd[2:])
    assert child.arm == "trl" and child.rep == 2 and child.seed == 7 and child.trl_micro_batch == 16
    assert child.steps == 4 and child.lr == args.lr and child.eps_high == 0.28 and child.max_turns == 6
    ov = b.mentorrl_overrides(child, tmp_path / "run")
    for want in (
        "grpo.eps_low=0.2",
        "grpo.eps_high=0.28",
        "grpo.optim.lr=0.0001",
        "grpo.guide=none",
        "grpo.steps=5",
        "grpo.tasks_per_step=16",
        "grpo.samples_per_task=8",
        "sampling.max_new_tokens=64",
        "limits.max_turns=6",
        "eval.num_tasks=0",
        "seed=7",
    ):
        assert want in ov
    kw = b.trl_config_kwargs(child, 700, False, True, str(tmp_path))
    assert (kw["per_device_train_batch_size"], kw["gradient_accumulation_steps"], kw["steps_per_generation"]) == (
        16,
        4,
        8,
    )
    assert kw["per_device_train_batch_size"] * kw["steps_per_generation"] == 128  # one rollout batch per generation
    assert kw["max_steps"] == 10 and kw["max_tool_calling_iterations"] == 5 and kw["epsilon_high"] == 0.28
    assert kw["chat_template_kwargs"] == {"system_turn": False, "tool_descriptions": True}
    args.trl_micro_batch = 48
    with pytest.raises(SystemExit, match="must divide"):
        b.trl_config_kwargs(args, 700, False, True, str(tmp_path))
