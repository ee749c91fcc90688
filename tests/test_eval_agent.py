"""Agent evaluation: metrics (pass@k, pass^k, tool / loop / recovery / judge agreement), the
transcript judge, evaluation sets (golden, hidden, regression, production) and `mentorrl eval`."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re

import pytest
import typer
from cli_helpers import cli_output, cli_with
from typer.testing import CliRunner

from mentorrl.cli.eval import agent_eval_config, parse_ks, parse_set_options, register
from mentorrl.envs.base import Task, ToolAction, final_answer_text
from mentorrl.envs.orders import FAMILIES, OrdersTasks
from mentorrl.envs.orders.tasks import ADVERSARIAL, GOLDEN_PAIRS, NOVEL_ADV_TEMPLATES, NOVEL_TEMPLATES
from mentorrl.eval.agent import (
    agent_metrics,
    cohen_kappa,
    group_metrics,
    judge_agreement,
    pass_at_k,
    pass_hat_k,
)
from mentorrl.eval.judge import (
    RUBRIC,
    Judge,
    TranscriptJudge,
    answer_facts,
    argument_grounding,
    attach_judgements,
    make_judge,
    transcript_features,
)
from mentorrl.eval.sets import (
    AgentEvalConfig,
    EvalSetSpec,
    HiddenSetError,
    assert_trainable,
    assert_trainable_splits,
    load_eval_set,
    looks_like_set,
    read_tasks_jsonl,
    tasks_from_trajectories,
    user_message,
    write_tasks_jsonl,
)
from mentorrl.rollout.episode import run_scripted_episode, run_text_turns
from mentorrl.trajectory import JudgeVerdict, RewardBreakdown, ToolCall, Trajectory, read_jsonl, write_jsonl

TASKS = OrdersTasks()


# ------------------------------------------------------------ synthetic trajectories ------
def call(name: str | None = "get_order", ok: bool = True, kind: str | None = None, **args) -> ToolCall:
    return ToolCall(
        turn=1,
        name=name,
        arguments=args if name else None,
        raw=json.dumps(args),
        result={"ok": True} if ok else None,
        error=None if ok else "failed",
        error_kind=None if ok else (kind or "tool_exception"),
    )


def traj(
    task_id: str,
    success: bool,
    family: str = "refund",
    difficulty: str = "normal",
    calls: list[ToolCall] | None = None,
    violations: list[str] | None = None,
    tokens: int = 10,
    policy_tokens: int = 4,
    turns: int = 2,
    latency: float = 1.0,
    judge_p: float | None = None,
    reward: float | None = None,
) -> Trajectory:
    mask = [1] * policy_tokens + [0] * (tokens - policy_tokens)
    return Trajectory(
        id=f"{task_id}-{hashlib.md5(str((task_id, success, judge_p, tokens, latency)).encode()).hexdigest()[:6]}",
        task_id=task_id,
        family=family,
        difficulty=difficulty,
        token_ids=list(range(tokens)),
        loss_mask=mask,
        logprobs=[0.0] * tokens,
        env_name="orders",
        env_version="1",
        tool_calls=calls or [],
        num_turns=turns,
        reward=RewardBreakdown(
            success=success, violations=violations or [], total=reward if reward is not None else float(success)
        ),
        timings={"total_s": latency},
        judge=None if judge_p is None else JudgeVerdict(judge="test", success_prob=judge_p),
    )


# ------------------------------------------------------------ pass@k and pass^k ------
def three_tasks() -> list[Trajectory]:
    """Task A: 4 samples, 2 successes; B: 4 samples, 1 success; C: 4 samples, 4 successes."""
    out = []
    for tid, c in (("A", 2), ("B", 1), ("C", 4)):
        out += [traj(tid, i < c, latency=float(i)) for i in range(4)]
    return out


def test_pass_at_k_hand_computed():
    # per task, pass@k = 1 - C(n-c, k) / C(n, k), with C(4, 2) = 6 and C(4, 3) = 4
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)  # C(2,2)=1
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # C(3,2)=3
    assert pass_at_k(4, 4, 2) == 1.0  # C(0,2)=0
    assert pass_at_k(4, 0, 3) == 0.0
    assert pass_at_k(4, 1, 3) == pytest.approx(1 - 1 / 4)  # C(3,3)=1
    assert pass_at_k(4, 2, 1) == pytest.approx(0.5)  # pass@1 is c/n
    m = group_metrics(three_tasks(), ks=[1, 2, 3, 4, 8])
    # pass@2 = mean(5/6, 1/2, 1) = (5/6 + 3/6 + 6/6) / 3 = 14/18 = 7/9
    assert m.pass_at_k[2] == pytest.approx(7 / 9)
    # pass@3 = mean(1 - 0/4, 1 - 1/4, 1) = (1 + 3/4 + 1) / 3 = 11/12
    assert m.pass_at_k[3] == pytest.approx(11 / 12)
    assert m.pass_at_k[4] == 1.0  # every task has at least one success among its 4 samples
    # pass@1 = mean(2/4, 1/4, 4/4) = 7/12; with equal samples per task it is the success rate
    assert m.pass_at_1 == m.pass_at_k[1] == pytest.approx(7 / 12) == pytest.approx(m.success)
    assert 8 not in m.pass_at_k and 8 not in m.pass_hat_k  # k beyond the 4 samples per task: skipped
    assert m.samples_per_task == 4 and m.n_tasks == 3 and m.n == 12


def test_pass_hat_k_hand_computed():
    # per task, pass^k = C(c, k) / C(n, k)
    assert pass_hat_k(4, 2, 2) == pytest.approx(1 / 6)  # C(2,2)/C(4,2) = 1/6
    assert pass_hat_k(4, 1, 2) == 0.0  # C(1,2) = 0
    assert pass_hat_k(4, 4, 2) == 1.0
    assert pass_hat_k(5, 3, 2) == pytest.approx(3 / 10)  # C(3,2)/C(5,2) = 3/10
    m = group_metrics(three_tasks(), ks=[2, 3, 4])
    # pass^2 = mean(1/6, 0, 1) = (7/6) / 3 = 7/18
    assert m.pass_hat_k[2] == pytest.approx(7 / 18)
    # pass^3 = mean(C(2,3)/4, C(1,3)/4, 4/4) = (0 + 0 + 1) / 3
    assert m.pass_hat_k[3] == pytest.approx(1 / 3)
    assert m.pass_hat_k[4] == pytest.approx(1 / 3)
    # reliability never exceeds pass@1, which never exceeds pass@k
    assert m.pass_hat_k[2] <= m.pass_at_1 <= m.pass_at_k[2]


def test_pass_k_rejects_bad_counts():
    with pytest.raises(ValueError, match="k must be"):
        pass_at_k(4, 1, 0)
    with pytest.raises(ValueError, match="exceeds"):
        pass_hat_k(2, 1, 3)
    with pytest.raises(ValueError, match="successes"):
        pass_at_k(2, 3, 1)
    with pytest.raises(ValueError, match="k must be"):
        group_metrics(three_tasks(), ks=[0])


def test_k_skipped_when_some_task_has_fewer_samples():
    trajs = [traj("A", True), traj("A", False), traj("B", True)]
    m = group_metrics(trajs, ks=[1, 2])
    assert m.samples_per_task == 1 and list(m.pass_at_k) == [1]
    assert m.pass_at_1 == pytest.approx((1 / 2 + 1) / 2)  # per-task average, not the trajectory rate
    assert m.success == pytest.approx(2 / 3)


# ------------------------------------------------------------ process, cost, safety ------
def test_tool_loop_recovery_violation_cost_metrics():
    trajs = [
        # an error, then a successful call and success: recovered
        traj(
            "t1", True, calls=[call(ok=False), call(order_id="O-1")], tokens=20, policy_tokens=8, turns=3, latency=2.0
        ),
        # an invalid call (bad arguments) and a malformed one, then nothing: not recovered
        traj(
            "t2",
            False,
            calls=[call(ok=False, kind="bad_arguments"), call(None, ok=False, kind="malformed")],
            tokens=10,
            policy_tokens=4,
            turns=3,
            latency=4.0,
        ),
        # the same call three times: a loop; a violation
        traj(
            "t3",
            False,
            calls=[call(order_id="O-2")] * 3,
            violations=["extra email"],
            tokens=30,
            policy_tokens=6,
            turns=4,
            latency=6.0,
        ),
        traj("t4", True, calls=[], tokens=20, policy_tokens=2, turns=1, latency=0.0),
    ]
    m = group_metrics(trajs)
    assert m.tool_calls == 7
    assert m.tool_success == pytest.approx(4 / 7)  # 1 + 0 + 3 ok calls
    assert m.invalid_call_rate == pytest.approx(2 / 7)  # bad_arguments + malformed; tool_exception is not invalid
    assert m.loop_rate == pytest.approx(1 / 4)
    assert m.n_with_error == 2 and m.recovery_rate == pytest.approx(1 / 2)
    assert m.violation_rate == pytest.approx(1 / 4)
    assert m.mean_total_tokens == pytest.approx(20) and m.mean_policy_tokens == pytest.approx(5)
    assert m.mean_steps == pytest.approx(11 / 4) and m.mean_latency_s == pytest.approx(3.0)
    assert m.success == 0.5 and m.success_ci95[0] < 0.5 < m.success_ci95[1]
    assert m.judge is None
    no_errors = group_metrics([traj("t4", True)])
    assert no_errors.recovery_rate is None and no_errors.n_with_error == 0 and no_errors.tool_success == 1.0


def test_breakdown_by_family_and_difficulty():
    trajs = [
        traj("a", True, family="refund"),
        traj("b", False, family="refund", difficulty="adversarial"),
        traj("c", True, family="place_order", difficulty="adversarial"),
    ]
    r = agent_metrics(trajs, ks=[1])
    assert r.overall.n == 3 and r.overall.success == pytest.approx(2 / 3)
    assert set(r.by_family) == {"refund", "place_order"} and r.by_family["refund"].success == 0.5
    assert r.by_difficulty["adversarial"].n == 2 and r.by_difficulty["normal"].success == 1.0
    again = type(r).model_validate_json(r.model_dump_json())  # JSON round trip (int keys of pass@k survive)
    assert again == r
    empty = agent_metrics([])
    assert empty.overall.n == 0 and empty.by_family == {} and empty.overall.success_ci95 == (0.0, 1.0)  # no data


def test_wilson_interval_edge_cases():
    """Issue 16: ``wilson_interval(0, 0)`` returned (0, 0), a certainty of failure; no trial tells nothing: (0, 1)."""
    from mentorrl.eval.metrics import summarize, wilson_interval

    assert wilson_interval(0, 0) == (0.0, 1.0)
    assert summarize([])["success_ci95"] == [0.0, 1.0]
    lo, hi = wilson_interval(0, 10)
    assert lo == 0.0 and 0.0 < hi < 0.35
    lo, hi = wilson_interval(10, 10)
    assert 0.65 < lo < 1.0 and hi == 1.0
    lo, hi = wilson_interval(5, 10)  # centre 0.5, half-width 1.96 * sqrt(0.025 + 0.0096) / 1.384 = 0.2366
    assert (lo, hi) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    for bad in [(-1, 5), (6, 5), (0, -1)]:
        with pytest.raises(ValueError, match="successes"):
            wilson_interval(*bad)


# ------------------------------------------------------------ judge agreement ------
def test_cohen_kappa_and_agreement_hand_computed():
    # (judge, verifier): 3x (T,T), 1x (T,F), 4x (F,F), 2x (F,T)
    pairs = [(True, True)] * 3 + [(True, False)] + [(False, False)] * 4 + [(False, True)] * 2
    # observed 7/10; judge yes 4/10, verifier yes 5/10 -> chance .4*.5 + .6*.5 = .5; kappa = (.7-.5)/.5 = .4
    assert cohen_kappa(pairs) == pytest.approx(0.4)
    assert cohen_kappa([(True, True)] * 3) is None  # both raters constant: undefined
    assert cohen_kappa([(True, True), (False, False)]) == pytest.approx(1.0)
    assert cohen_kappa([]) is None
    trajs = []
    for i, (j, v) in enumerate(pairs):
        trajs.append(traj(f"t{i}", v, judge_p=0.9 if j else 0.2))
    a = judge_agreement(trajs + [traj("unjudged", True)], threshold=0.5)
    assert a.n == 10 and a.agreement == pytest.approx(0.7) and a.kappa == pytest.approx(0.4)
    assert a.judge_pass_verifier_fail == 1 and a.judge_fail_verifier_pass == 2
    assert a.judge_success_rate == pytest.approx(0.4)
    assert judge_agreement([traj("x", True)]) is None
    # the threshold decides what "judge says success" means
    assert judge_agreement(trajs, threshold=0.95).judge_success_rate == 0.0
    assert group_metrics(trajs).judge.kappa == pytest.approx(0.4)


# ------------------------------------------------------------ transcript judge ------
@pytest.fixture(scope="module")
def orders_contract(make_contract):
    return make_contract(max_new_tokens=64, max_turns=6, max_total_tokens=2048)


@pytest.fixture(scope="module")
def golden_expert_trajs(orders_entry, orders_contract):
    env = orders_entry.make_env()
    try:
        tasks = TASKS.tasks("golden", len(GOLDEN_PAIRS), 0)
        return tasks, [run_scripted_episode(orders_contract, env, t, orders_entry.make_expert()) for t in tasks]
    finally:
        env.close()


def test_judge_protocol_and_registry():
    judge = make_judge("transcript")
    assert isinstance(judge, Judge) and isinstance(judge, TranscriptJudge) and judge.name == "transcript"
    assert make_judge("none") is None and make_judge(None) is None
    with pytest.raises(ValueError, match="unknown judge"):
        make_judge("gpt-judge")


def test_transcript_judge_passes_expert_work(golden_expert_trajs):
    tasks, trajs = golden_expert_trajs
    assert all(t.reward.success for t in trajs)  # the expert solves every golden pair
    attach_judgements(TranscriptJudge(), tasks, trajs)
    for t in trajs:
        v = t.judge
        assert v.judge == "transcript" and set(v.scores) == set(RUBRIC) and v.reason
        assert all(0.0 <= s <= 1.0 for s in v.scores.values())
        assert v.scores["task_success"] == v.success_prob
    probs = [t.judge.success_prob for t in trajs]
    assert sum(p >= 0.5 for p in probs) >= 0.9 * len(probs), sorted(zip(probs, [t.task_id for t in trajs]))[:3]
    assert all(t.judge.scores["tool_correctness"] > 0.9 for t in trajs)


def test_transcript_judge_fails_unbacked_claims(find_task, orders_entry, orders_contract):
    judge = TranscriptJudge()
    env = orders_entry.make_env()
    try:
        task = find_task("cancel_order")
        oid = task.reference["request"]["order_id"]
        # claims the cancellation without any tool call
        bare = run_text_turns(orders_contract, env, task, [f"Order {oid} is now cancelled."])
        # looks the order up with an id the user never gave, then claims success
        wrong = run_text_turns(
            orders_contract,
            env,
            task,
            [
                '<tool_call>{"name": "get_order", "arguments": {"order_id": "O-999"}}</tool_call>',
                f"Order {oid} is now cancelled.",
            ],
        )
        # invalid calls, then gives up
        broken = run_text_turns(
            orders_contract, env, task, ['<tool_call>{"name": "cancel", "arguments": {}}</tool_call>', "Done."]
        )
    finally:
        env.close()
    for t in (bare, wrong, broken):
        assert not t.reward.success
        v = judge.judge(task, t)
        assert v.success_prob < 0.5, (v, t.tool_calls)
    assert "without any tool call" in judge.judge(task, bare).reason
    assert judge.judge(task, wrong).scores["state_tracking"] < 0.5
    assert judge.judge(task, broken).scores["tool_correctness"] < 0.5


def test_transcript_judge_ignores_task_reference_and_env(golden_expert_trajs):
    tasks, trajs = golden_expert_trajs
    judge = TranscriptJudge()
    for task, t in list(zip(tasks, trajs))[:6]:
        blind = dataclasses.replace(task, reference={}, seed=-1)
        assert judge.judge(blind, t) == judge.judge(task, t)
        assert judge.judge(None, t).judge == "transcript"  # without a task it still judges


def test_grounding_helpers():
    calls = [
        call("find_customer", email="a@b.com"),
        ToolCall(turn=2, name="list_orders", arguments={"customer_id": "C-7"}, raw="", result={"count": 3}),
        ToolCall(
            turn=3,
            name="cancel_order",
            arguments={"order_id": "O-1"},
            raw="",
            result=None,
            error="no order",
            error_kind="tool_exception",
        ),
    ]
    # find_customer's email is in the request; C-7 appears nowhere before; O-1 is in the request
    assert argument_grounding("I'm a@b.com, cancel O-1", calls) == pytest.approx(2 / 3)
    assert answer_facts("You have 3 orders, $12.50 refunded on O-1.") == ["3", "$12.50", "O-1"]
    f = transcript_features("I'm a@b.com, cancel O-1", traj("x", False, calls=calls))
    assert f["last_ok"] == 0.0 and f["arg_grounding"] == pytest.approx(2 / 3) and f["answered"] == 0.0


def test_attach_judgements_by_task_id():
    class Fixed:
        name = "fixed"

        def __init__(self):
            self.seen: list[tuple[str | None, str]] = []

        def judge(self, task, t):
            self.seen.append((task.prompt if task else None, t.id))
            return JudgeVerdict(judge=self.name, success_prob=0.25, reason="fixed")

    judge = Fixed()
    trajs = [traj("A", True), traj("B", False)]
    out = attach_judgements(judge, [Task(id="A", family="refund", split="golden", prompt="pa", seed=1)], trajs)
    assert [t.judge.success_prob for t in out] == [0.25, 0.25]
    assert judge.seen == [("pa", trajs[0].id), (None, trajs[1].id)]


# ------------------------------------------------------------ task splits ------
def test_task_generation_pinned():
    # digest of the compositional wording generator (issue 17, envs/orders/phrasing.py), computed
    # once when it was introduced and pinned here: a change to the tables, the held-out rule or the
    # rng draws changes every split's prompts (and the meaning of past results), so it must be
    # deliberate; update the digest in the same commit, saying why
    h = hashlib.sha256()
    for split in ("train", "heldout", "hidden", "golden", "novel_wording"):
        for t in TASKS.tasks(split, 120, 3):
            h.update(json.dumps(dataclasses.asdict(t), sort_keys=True).encode())
    assert h.hexdigest() == "9298170927c1cf43560de1bfa5827e89a0c9304818b6e6fe2c48dcd788f4b213"


def test_hidden_split_disjoint_and_heldout_worded():
    hidden = TASKS.tasks("hidden", 150, 0)
    others = (
        TASKS.tasks("train", 150, 0)
        + TASKS.tasks("heldout", 150, 0)
        + TASKS.tasks("golden", 42, 0)
        + TASKS.tasks("novel_wording", 150, 0)
    )
    assert not {t.seed for t in hidden} & {t.seed for t in others}
    assert all(t.split == "hidden" and t.id.startswith("orders-hidden-0-") for t in hidden)
    assert len({t.id for t in hidden}) == 150 and TASKS.tasks("hidden", 150, 0) == hidden
    assert TASKS.tasks("hidden", 20, 1) != hidden[:20]
    # worded like the held-out split (held-out intent x frame combinations), never like train
    assert all(t.reference["wording"]["heldout"] for t in hidden)
    assert {t.family for t in hidden} == set(FAMILIES)
    with pytest.raises(ValueError, match="split must be one of"):
        TASKS.tasks("dev", 1, 0)


def test_novel_wording_split_is_the_old_unseen_vocabulary():
    novel = TASKS.tasks("novel_wording", 150, 0)
    others = TASKS.tasks("train", 150, 0) + TASKS.tasks("heldout", 150, 0) + TASKS.tasks("hidden", 150, 0)
    assert not {t.seed for t in novel} & {t.seed for t in others}
    assert all(t.split == "novel_wording" and t.id.startswith("orders-novel_wording-0-") for t in novel)
    for t in novel:
        table = NOVEL_ADV_TEMPLATES.get(t.reference["kind"], NOVEL_TEMPLATES[t.family])
        assert any(_template_regex(x).match(t.prompt) for x in table), t.prompt
    assert {t.family for t in novel} == set(FAMILIES)


def _template_regex(template: str) -> re.Pattern:
    parts = re.split(r"\{\w+\}", template)
    return re.compile("^" + ".+?".join(re.escape(p) for p in parts) + "$")


def test_golden_covers_every_family_and_kind(orders_entry):
    golden = TASKS.tasks("golden", len(GOLDEN_PAIRS), 0)
    pairs = {(t.family, t.reference["kind"]) for t in golden}
    assert pairs == set(GOLDEN_PAIRS) == {(f, "normal") for f in FAMILIES} | set(ADVERSARIAL)
    assert TASKS.golden_size == len(GOLDEN_PAIRS) == 21
    assert TASKS.tasks("golden", len(GOLDEN_PAIRS), 0) == golden  # deterministic
    two_rounds = TASKS.tasks("golden", 2 * len(GOLDEN_PAIRS), 0)
    assert two_rounds[: len(GOLDEN_PAIRS)] == golden
    # the second round of a pair uses the next phrasing
    assert two_rounds[0].prompt.split("O-")[0] != two_rounds[len(GOLDEN_PAIRS)].prompt.split("O-")[0]
    env = orders_entry.make_env()
    try:  # every golden, hidden and novel_wording task is solvable
        for t in golden + TASKS.tasks("hidden", 40, 0) + TASKS.tasks("novel_wording", 40, 0):
            env.reset(t)
            gen = orders_entry.make_expert().act(t)
            action = next(gen)
            while isinstance(action, ToolAction):
                action = gen.send(env.step(action.name, action.arguments))
            v = env.verify(final_answer_text(env, action))
            assert v.success and not v.violations, (t.id, action.text, v)
    finally:
        env.close()


# ------------------------------------------------------------ hidden-set guard ------
def test_hidden_tasks_are_never_trainable():
    assert_trainable(TASKS.tasks("train", 5, 0) + TASKS.tasks("golden", 3, 0))
    with pytest.raises(HiddenSetError, match="hidden"):
        assert_trainable(TASKS.tasks("train", 5, 0) + TASKS.tasks("hidden", 1, 0))
    assert_trainable_splits(["train", "heldout"])
    with pytest.raises(HiddenSetError, match="never used for training"):
        assert_trainable_splits(["train", "hidden"])
    # the novel_wording stress set is evaluation-only too
    with pytest.raises(HiddenSetError, match="refusing to train on 1 novel_wording-set task"):
        assert_trainable(TASKS.tasks("train", 5, 0) + TASKS.tasks("novel_wording", 1, 0))
    with pytest.raises(HiddenSetError, match="'novel_wording' is an evaluation-only stress set"):
        assert_trainable_splits(["novel_wording"])
    assert issubclass(HiddenSetError, ValueError)


# ------------------------------------------------------------ set specs and files ------
def test_task_jsonl_round_trip_and_errors(tmp_path):
    tasks = TASKS.tasks("train", 10, 0) + TASKS.tasks("golden", 21, 0)
    path = tmp_path / "reg.jsonl"
    assert write_tasks_jsonl(path, tasks) == 31
    assert read_tasks_jsonl(path) == tasks
    bad = tmp_path / "bad.jsonl"
    bad.write_text(path.read_text().splitlines()[0] + "\n" + json.dumps({"id": "x", "family": "refund"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: .*missing \['split', 'prompt', 'seed'\]"):
        read_tasks_jsonl(bad)
    bad.write_text("{not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        read_tasks_jsonl(bad)
    first = json.loads(path.read_text().splitlines()[0])
    bad.write_text(json.dumps({**first, "seed": "7"}) + "\n")
    with pytest.raises(ValueError, match="seed"):
        read_tasks_jsonl(bad)
    bad.write_text(json.dumps(first) + "\n" + json.dumps(first) + "\n")
    with pytest.raises(ValueError, match="more than once"):
        read_tasks_jsonl(bad)


def test_set_specs_and_config():
    assert EvalSetSpec.parse("golden").label == "golden"
    reg = EvalSetSpec.parse("regression:cases/old_bugs.jsonl")
    assert reg.kind == "regression" and reg.path == "cases/old_bugs.jsonl" and reg.label == "regression:old_bugs"
    for bad in ("train", "regression", "golden:x.jsonl", "prod:x"):
        with pytest.raises(ValueError):
            EvalSetSpec.parse(bad)
    assert looks_like_set("hidden") and looks_like_set("production:/a=b.jsonl")
    assert not looks_like_set("seed=3") and not looks_like_set("regression")
    cfg = AgentEvalConfig(k=[4, 1, 2, 2])
    assert cfg.k == [1, 2, 4] and [s.kind for s in cfg.sets] == ["golden", "hidden"]
    with pytest.raises(ValueError, match="unique"):
        AgentEvalConfig(sets=[EvalSetSpec(kind="golden"), EvalSetSpec(kind="golden")])
    AgentEvalConfig(sets=[EvalSetSpec(kind="golden"), EvalSetSpec(kind="golden", seed=1, name="golden-1")])
    with pytest.raises(ValueError):
        AgentEvalConfig(k=[0])
    with pytest.raises(ValueError):
        AgentEvalConfig(samples_per_task=0)
    specs = parse_set_options(["golden", "regression:r.jsonl"])
    assert [s.label for s in specs] == ["golden", "regression:r"]
    for bad in ("gold", "seed=3"):
        with pytest.raises(ValueError, match="is not an evaluation set"):
            parse_set_options([bad])
    assert parse_ks("1, 2,4") == [1, 2, 4] and parse_ks(None) is None
    with pytest.raises(ValueError):
        parse_ks("1,x")


def test_load_eval_sets(tmp_path):
    cfg = AgentEvalConfig()
    golden = load_eval_set(EvalSetSpec(kind="golden"), TASKS, cfg)
    assert len(golden.tasks) == 21  # the full coverage set by default
    hidden = load_eval_set(EvalSetSpec(kind="hidden", num_tasks=7, seed=4), TASKS, cfg)
    assert len(hidden.tasks) == 7 and hidden.seed == 4 and hidden.tasks == TASKS.tasks("hidden", 7, 4)
    novel = load_eval_set(EvalSetSpec.parse("novel_wording"), TASKS, cfg)
    assert novel.name == "novel_wording" and all(t.split == "novel_wording" for t in novel.tasks)
    assert looks_like_set("novel_wording") and [s.kind for s in parse_set_options(["novel_wording"])] == [
        "novel_wording"
    ]
    assert load_eval_set(EvalSetSpec(kind="heldout"), TASKS, AgentEvalConfig(num_tasks=3)).tasks == TASKS.tasks(
        "heldout", 3, 0
    )
    assert golden.task_fingerprint() == load_eval_set(EvalSetSpec(kind="golden"), TASKS, cfg).task_fingerprint()
    assert golden.task_fingerprint() != load_eval_set(EvalSetSpec(kind="golden", seed=1), TASKS, cfg).task_fingerprint()
    path = tmp_path / "reg.jsonl"
    write_tasks_jsonl(path, TASKS.tasks("train", 4, 9))
    reg = load_eval_set(EvalSetSpec.parse(f"regression:{path}"), TASKS, cfg)
    assert reg.name == "regression:reg" and reg.tasks == TASKS.tasks("train", 4, 9)
    with pytest.raises(FileNotFoundError):
        load_eval_set(EvalSetSpec.parse(f"regression:{tmp_path / 'nope.jsonl'}"), TASKS, cfg)
    prod = tmp_path / "prod.jsonl"
    write_jsonl(prod, three_tasks())
    p = load_eval_set(EvalSetSpec.parse(f"production:{prod}"), TASKS, cfg)
    assert p.tasks == [] and [t.id for t in p.recorded] == [t.id for t in three_tasks()]


def test_recorded_prompts(golden_expert_trajs, tokenizer):
    tasks, trajs = golden_expert_trajs
    rebuilt = tasks_from_trajectories(trajs, lambda ids: tokenizer.decode(ids, skip_special_tokens=False))
    assert [t.prompt for t in rebuilt] == [t.prompt for t in tasks]
    assert all(t.reference == {} for t in rebuilt)
    assert user_message("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi there<|im_end|>\n") == "hi there"


# ------------------------------------------------------------ `mentorrl eval` end to end ------
def _cli() -> typer.Typer:
    return cli_with(register)


_output = cli_output


TINY = ["--set", "limits.max_turns=2", "--set", "sampling.max_new_tokens=12", "--set", "eval.batch_size=16"]


def test_eval_cli_end_to_end(tiny_model_dir, tmp_path):
    reg = tmp_path / "reg.jsonl"
    write_tasks_jsonl(reg, TASKS.tasks("train", 2, 5))
    prod = tmp_path / "prod.jsonl"
    write_jsonl(prod, three_tasks())
    out = tmp_path / "out"
    args = [
        "eval",
        str(tiny_model_dir),
        "--on",
        "golden",
        "--on",
        f"regression:{reg}",
        "--on",
        f"production:{prod}",
        "--samples",
        "2",
        "--k",
        "1,2,4",
        "--num-tasks",
        "3",
        "--seed",
        "7",
        "--out",
        str(out),
        *TINY,
    ]
    res = CliRunner().invoke(_cli(), args)
    assert res.exit_code == 0, _output(res)
    for title in (
        "golden: outcome",
        "golden: tool use",
        "golden: cost",
        "golden: safety",
        "regression:reg: outcome",
        "production:prod: outcome",
    ):
        assert title in res.output
    summary = json.loads((out / "eval_summary.json").read_text())
    assert list(summary["sets"]) == ["golden", "regression:reg", "production:prod"]
    g = summary["sets"]["golden"]
    assert g["n_tasks"] == 3 and g["samples_per_task"] == 2 and g["seed"] == 7 and not g["recorded"]
    overall = g["metrics"]["overall"]
    assert overall["n"] == 6 and set(overall["pass_at_k"]) == {"1", "2"}  # k=4 > 2 samples: skipped
    assert overall["judge"]["n"] == 6  # the transcript judge ran on every rollout
    assert set(g["metrics"]["by_difficulty"]) <= {"normal", "adversarial"}
    trajs = list(read_jsonl(out / g["trajectories"]))
    assert len(trajs) == 6 and [t.task_id for t in trajs][:2] == ["orders-golden-7-00000"] * 2
    assert all(t.judge is not None for t in trajs)
    # samples of one task draw from their own generators: they differ
    assert any(trajs[2 * i].token_ids != trajs[2 * i + 1].token_ids for i in range(3))
    # production: metrics of the recorded trajectories, nothing rolled out again
    p = summary["sets"]["production:prod"]
    assert p["recorded"] and p["metrics"]["overall"]["n"] == 12
    assert p["metrics"]["overall"]["pass_at_k"]["2"] == pytest.approx(7 / 9)
    assert p["metrics"]["overall"]["pass_at_k"]["4"] == 1.0
    # the same command gives the same tasks, seeds and fingerprints
    again = tmp_path / "again"
    res2 = CliRunner().invoke(_cli(), [*args[: -len(TINY) - 2], "--out", str(again), *TINY, "--judge", "none"])
    assert res2.exit_code == 0, _output(res2)
    s2 = json.loads((again / "eval_summary.json").read_text())
    for name in summary["sets"]:
        assert s2["sets"][name]["fingerprint"] == summary["sets"][name]["fingerprint"]
        first, second = summary["sets"][name]["metrics"]["overall"], s2["sets"][name]["metrics"]["overall"]
        assert second["success"] == first["success"]
    assert s2["sets"]["golden"]["metrics"]["overall"]["judge"] is None


def test_eval_cli_bad_input(tiny_model_dir, tmp_path):
    runner = CliRunner()
    res = runner.invoke(_cli(), ["eval", str(tiny_model_dir), "--on", "golden:x", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "is not an evaluation set" in _output(res)
    res = runner.invoke(
        _cli(),
        [
            "eval",
            str(tiny_model_dir),
            "--on",
            f"regression:{tmp_path / 'no.jsonl'}",
            "--out",
            str(tmp_path),
            "--judge",
            "none",
        ],
    )
    assert res.exit_code == 2 and "no such file" in _output(res)
    res = runner.invoke(_cli(), ["eval", str(tiny_model_dir), "--judge", "oracle", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "unknown judge" in _output(res)
    res = runner.invoke(_cli(), ["eval", str(tiny_model_dir), "--set", "grpo.stepz=1", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "grpo.stepz" in _output(res)


def test_agent_eval_config_from_run_config():
    from mentorrl.config import load_config

    cfg = load_config(None, ["eval.temperature=0.3", "eval.batch_size=7"])
    ecfg = agent_eval_config(cfg, [EvalSetSpec(kind="heldout")], samples_per_task=3, k=None, judge="none")
    assert ecfg.temperature == 0.3 and ecfg.batch_size == 7 and ecfg.samples_per_task == 3
    assert ecfg.k == [1] and ecfg.judge == "none" and [s.kind for s in ecfg.sets] == ["heldout"]
    assert math.isclose(agent_eval_config(cfg, []).judge_threshold, 0.5)
