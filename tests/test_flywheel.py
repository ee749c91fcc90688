"""Bad-case flywheel: review sampling, failure attribution, routing, corrections, hard-task pool, CLI.

Failure trajectories are built the way a model would produce them: scripted policy-turn
texts played through the real orders environment, so the verifier details, tool errors and
token ids are the real ones.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from typing import Callable

import pytest
import typer
from cli_helpers import cli_with
from typer.testing import CliRunner

from mentorrl.cli.flywheel import register
from mentorrl.contract import (
    EFFECTIVE_BUDGET_KEY,
    ContractLimits,
    PromptFormat,
    SamplingParams,
    contract_for_env,
    render_tool_call,
)
from mentorrl.core import trace
from mentorrl.envs.base import FinalAnswer, Task
from mentorrl.envs.orders import OrdersExpert
from mentorrl.flywheel import (
    PRECEDENCE,
    AttributionConfig,
    FailureType,
    HardPoolConfig,
    HardTaskPool,
    ReviewConfig,
    RoutingTable,
    TrainingMethod,
    attribute,
    build_corrections,
    build_review_queue,
    contract_for_trajectory,
    expert_reference_calls,
    failure_distribution,
    find_tasks,
    load_tasks_jsonl,
    write_review_queue,
    write_tasks_jsonl,
)
from mentorrl.flywheel.corrections import parse_task_id, prompt_ids, read_pairs_jsonl
from mentorrl.flywheel.review import DISAGREEMENT, bucket_key, read_review_queue
from mentorrl.rollout.episode import Episode, run_scripted_episode, run_text_turns
from mentorrl.trajectory import JudgeVerdict, RewardBreakdown, ToolCall, Trajectory, read_jsonl, write_jsonl

T = render_tool_call
F = FailureType


# ------------------------------------------------------------------ fixtures ----
@pytest.fixture(scope="module")
def contract(make_contract):
    return make_contract(max_turns=8, max_total_tokens=2048)


@pytest.fixture(scope="module")
def play(contract, orders_entry) -> Callable[[Task, list[str]], Trajectory]:
    def run(task: Task, turns: list[str]) -> Trajectory:
        env = orders_entry.make_env()
        try:
            return run_text_turns(contract, env, task, turns)
        finally:
            env.close()

    return run


@pytest.fixture(scope="module")
def expert_run(contract, orders_entry) -> Callable[[Task], Trajectory]:
    def run(task: Task) -> Trajectory:
        env = orders_entry.make_env()
        try:
            return run_scripted_episode(contract, env, task, OrdersExpert())
        finally:
            env.close()

    return run


def _other_status(status: str) -> str:
    return "delivered" if status != "delivered" else "pending"


def _cases(find_task) -> dict[FailureType, tuple[Task, list[str]]]:
    """One scripted failure per type: (task, the policy's turn texts)."""
    cancel = find_task("cancel_order")
    c_req = cancel.reference["request"]
    count = find_task("order_count")
    status = find_task("order_status")
    s_oid = status.reference["request"]["order_id"]
    place = find_task("place_order")
    (_, find_args), (_, create_args) = place.reference["actions"]
    return {
        # an unparsable tool call, then a refusal
        F.FORMAT_ERROR: (
            cancel,
            ['<tool_call>{"name": "find_customer", "arguments": {"email": </tool_call>', "Sorry, I can't do that."],
        ),
        # the same lookup three times
        F.LOOP: (cancel, [T("find_customer", {"email": c_req["email"]})] * 3 + ["Sorry, I can't do that."]),
        # claims the cancellation after only identifying the customer
        F.REWARD_HACK: (cancel, [T("find_customer", {"email": c_req["email"]}), "Done, order cancelled."]),
        # get_order (never used by the reference) instead of list_orders
        F.TOOL_SELECTION: (
            count,
            [
                T("find_customer", {"email": count.reference["request"]["email"]}),
                T("get_order", {"order_id": count.reference["customer_id"]}),
                "Sorry, I couldn't find your orders.",
            ],
        ),
        # the right tool on the wrong order
        F.ARGUMENT_ERROR: (
            cancel,
            [
                T("find_customer", {"email": c_req["email"]}),
                T("cancel_order", {"order_id": "O-999"}),
                "Sorry, I couldn't cancel it.",
            ],
        ),
        # looked the order up, then reported another status
        F.STATE_TRACKING: (
            status,
            [T("get_order", {"order_id": s_oid}), f"Order {s_oid} is {_other_status(status.reference['expected'])}."],
        ),
        # cancel before identifying: a policy error, then gives up
        F.ERROR_RECOVERY: (
            cancel,
            [
                T("cancel_order", {"order_id": c_req["order_id"]}),
                f"Sorry, I couldn't cancel order {c_req['order_id']}.",
            ],
        ),
        # identifies the customer and stops with a refusal
        F.PREMATURE_STOP: (cancel, [T("find_customer", {"email": c_req["email"]}), "Sorry, I can't help with that."]),
        # skips the stock check and places the order twice
        F.PLANNING: (
            place,
            [
                T("find_customer", find_args),
                T("create_order", create_args),
                T("create_order", create_args),
                "I placed your order.",
            ],
        ),
    }


# evidence each case must name (what the rule saw)
EVIDENCE = {
    F.FORMAT_ERROR: "malformed tool call",
    F.LOOP: "repeat an earlier identical call",
    F.REWARD_HACK: "claims an action",
    F.TOOL_SELECTION: "instead of ['list_orders']",
    F.ARGUMENT_ERROR: "O-999",
    F.STATE_TRACKING: "answer",
    F.ERROR_RECOVERY: "not identified",
    F.PREMATURE_STOP: "cancel_order",
    F.PLANNING: "duplicate",
}


@pytest.fixture(scope="module")
def cases(find_task, play, expert_run) -> dict[FailureType, tuple[Trajectory, Trajectory]]:
    """type -> (failed trajectory, expert reference trajectory for the same task)."""
    out = {}
    for ft, (task, turns) in _cases(find_task).items():
        ref = expert_run(task)
        assert ref.reward.success, f"expert failed on {task.id}"
        out[ft] = (play(task, turns), ref)
    return out


# -------------------------------------------------------------- attribution ----
@pytest.mark.parametrize("ft", list(FailureType), ids=lambda f: f.value)
def test_one_constructed_trajectory_per_failure_type(ft, cases):
    traj, ref = cases[ft]
    assert not traj.reward.success
    att = attribute(traj, ref)
    assert att is not None and att.failure_type is ft, (att and att.failure_type, att and att.evidence)
    assert att.used_reference and att.trajectory_id == traj.id and att.family == traj.family
    assert any(EVIDENCE[ft] in e for e in att.evidence), att.evidence
    assert ft not in att.also
    assert att.also == [t for t in PRECEDENCE if t in att.also]  # in precedence order


@pytest.mark.parametrize("ft", list(FailureType), ids=lambda f: f.value)
def test_tokenizer_free_expert_reference_agrees(ft, cases, find_task, orders_entry):
    """The reference the CLI uses (expert calls without tokens) gives the same verdict."""
    traj, ref_traj = cases[ft]
    task = _cases(find_task)[ft][0]
    ref_calls = expert_reference_calls(orders_entry.make_env, OrdersExpert(), task)
    assert [(c.name, c.arguments) for c in ref_calls] == [(c.name, c.arguments) for c in ref_traj.tool_calls]
    assert attribute(traj, ref_calls).failure_type is ft


def test_rules_without_reference(cases):
    """Without a reference the comparison rules are skipped: the wrong-but-valid id becomes a
    recovery failure, the others keep their type."""
    for ft in (F.FORMAT_ERROR, F.LOOP, F.REWARD_HACK, F.STATE_TRACKING, F.ERROR_RECOVERY, F.PREMATURE_STOP, F.PLANNING):
        att = attribute(cases[ft][0])
        assert att.failure_type is ft and not att.used_reference, (ft, att.failure_type, att.evidence)
    assert attribute(cases[F.ARGUMENT_ERROR][0]).failure_type is F.ERROR_RECOVERY


def test_unknown_tool_and_schema_errors_need_no_reference(find_task, play):
    count = find_task("order_count")
    unknown = play(count, [T("count_orders", {"email": count.reference["request"]["email"]}), "Sorry, I couldn't."])
    att = attribute(unknown)
    assert att.failure_type is F.TOOL_SELECTION and "unknown tool 'count_orders'" in att.evidence[0]
    refund = find_task("refund")
    req = refund.reference["request"]
    bad = play(
        refund,
        [
            T("find_customer", {"email": req["email"]}),
            T("issue_refund", {"order_id": req["order_id"], "amount": -5}),
            "Sorry, I couldn't refund it.",
        ],
    )
    assert bad.tool_calls[1].error_kind == "bad_arguments"
    assert attribute(bad).failure_type is F.ARGUMENT_ERROR


def test_unterminated_turn_is_a_format_error(find_task, contract, orders_entry):
    """A turn that ran out of tokens before its stop token (finish_reason 'length')."""
    env = orders_entry.make_env()
    try:
        ep = Episode(contract, env, find_task("cancel_order"))
        ep.start()
        ids = contract.encode('<tool_call>{"name": "find_customer", "argu')
        assert ep.add_policy_turn(ids, [0.0] * len(ids), stopped=False) is None
        traj = ep.finish()
    finally:
        env.close()
    assert traj.finish_reason == "length"
    att = attribute(traj)
    assert att.failure_type is F.FORMAT_ERROR and "unterminated" in att.evidence[0]


def test_reward_hack_from_reward_and_from_gaming_violations(cases):
    failed = cases[F.PREMATURE_STOP][0]
    misaligned = failed.model_copy(update={"reward": failed.reward.model_copy(update={"total": 0.9})})
    att = attribute(misaligned)
    assert att.failure_type is F.REWARD_HACK and "misaligned" in att.evidence[0]
    gamed = failed.model_copy(
        update={"reward": failed.reward.model_copy(update={"violations": ["refunds on O-1 exceed its total"]})}
    )
    assert attribute(gamed).failure_type is F.REWARD_HACK
    # the pattern list is configurable: without patterns the same violation is a planning failure
    assert attribute(gamed, config=AttributionConfig(gaming_violation_patterns=[])).failure_type is F.PREMATURE_STOP


def test_claimed_result_without_any_call_is_a_hack(find_task, play, expert_run):
    count = find_task("order_count")
    guess = play(count, ["You have 3 orders."])
    if guess.reward.success:  # the guess happened to be right; make it wrong
        guess = play(count, ["You have 9999 orders."])
    att = attribute(guess, expert_run(count))
    assert att.failure_type is F.REWARD_HACK and "without a single successful tool call" in att.evidence[0]


def test_a_lookup_that_fails_for_the_reference_too_counts_as_done(find_task, play, expert_run):
    """The order does not exist: the expert's get_order fails as well, and then answers so."""
    task = find_task("order_status", "unknown_order")
    oid = task.reference["request"]["order_id"]
    ref = expert_run(task)
    assert [c.ok for c in ref.tool_calls] == [False] and ref.reward.success
    lookup = T("get_order", {"order_id": oid})
    expect = {
        F.REWARD_HACK: [f"Order {oid} is pending."],  # a status made up without looking
        F.STATE_TRACKING: [lookup, f"Order {oid} is pending."],  # looked, was told it does not exist
        F.PREMATURE_STOP: ["Sorry, I can't look orders up right now."],
    }
    for ft, turns in expect.items():
        traj = play(task, turns)
        assert not traj.reward.success
        assert attribute(traj, ref).failure_type is ft, (ft, attribute(traj, ref).evidence)


def test_successful_trajectory_has_no_failure_type(cases):
    assert attribute(cases[F.LOOP][1]) is None


def test_failure_distribution_counts_shares_and_families(cases):
    atts = [attribute(t, r) for t, r in cases.values()]
    extra = attribute(cases[F.LOOP][0], cases[F.LOOP][1])
    dist = failure_distribution(atts + [extra])
    assert dist.overall.n == len(FailureType) + 1
    assert dist.overall.counts["LOOP"] == 2 and all(dist.overall.counts[ft.value] >= 1 for ft in FailureType)
    assert sum(dist.overall.counts.values()) == dist.overall.n
    assert sum(dist.overall.shares.values()) == pytest.approx(1.0)
    assert dist.overall.shares["LOOP"] == pytest.approx(2 / dist.overall.n)
    assert list(dist.overall.counts) == [ft.value for ft in PRECEDENCE]
    fams = Counter(a.family for a in atts + [extra])
    assert {f: s.n for f, s in dist.by_family.items()} == dict(fams)
    assert dist.by_family["cancel_order"].counts["LOOP"] == 2
    assert failure_distribution([]).overall.n == 0


# ------------------------------------------------------------------ routing ----
def test_default_routing_follows_the_notes():
    table = RoutingTable()
    assert set(table.routes) == set(FailureType)
    sft = {ft for ft, m in table.routes.items() if m is TrainingMethod.TARGETED_SFT}
    assert sft == {F.FORMAT_ERROR, F.ARGUMENT_ERROR, F.TOOL_SELECTION}
    assert table.method(F.PLANNING) is TrainingMethod.PREFERENCE_OR_RL
    assert table.method(F.STATE_TRACKING) is TrainingMethod.LONG_HORIZON_RL
    assert table.method(F.REWARD_HACK) is TrainingMethod.REWARD_FIX


def test_routing_overrides_and_validation():
    table = RoutingTable.with_overrides(["tool_selection=preference_or_rl"])
    assert table.method(F.TOOL_SELECTION) is TrainingMethod.PREFERENCE_OR_RL
    assert table.method(F.FORMAT_ERROR) is TrainingMethod.TARGETED_SFT
    for bad in ("TOOL_SELECTION", "NOPE=targeted_sft", "LOOP=dance"):
        with pytest.raises(ValueError, match="bad route"):
            RoutingTable.with_overrides([bad])
    with pytest.raises(ValueError, match="no method for"):
        RoutingTable(routes={F.LOOP: TrainingMethod.REWARD_FIX})


def test_route_groups_attributions(cases):
    atts = [attribute(t, r) for t, r in cases.values()]
    groups = RoutingTable().route(atts)
    assert set(groups) == set(TrainingMethod)
    assert {a.failure_type for a in groups[TrainingMethod.REWARD_FIX]} == {F.REWARD_HACK}
    assert sum(len(v) for v in groups.values()) == len(atts)


# ------------------------------------------------------------ review sampling ----
def _call(i: int, name: str = "get_order", ok: bool = True, same_args: bool = False) -> ToolCall:
    return ToolCall(
        turn=i + 1,
        name=name,
        arguments={"order_id": "O-1" if same_args else f"O-{i}"},
        raw="",
        error=None if ok else "boom",
        error_kind=None if ok else "tool_exception",
    )


def synth(
    tid: str,
    family: str = "order_status",
    success: bool = True,
    answer: str | None = "Order O-1 is pending.",
    calls: list[ToolCall] | None = None,
    tokens: int = 60,
    judge: float | None = None,
    violations: tuple[str, ...] = (),
) -> Trajectory:
    """A recorded trajectory with chosen facts (the sampler reads only the record)."""
    calls = [_call(0)] if calls is None else calls
    return Trajectory(
        id=tid,
        task_id=f"task-{tid}",
        family=family,
        token_ids=[1] * tokens,
        loss_mask=[0] * tokens,
        logprobs=[0.0] * tokens,
        env_name="orders",
        env_version="1.0",
        tool_calls=calls,
        final_answer=answer,
        num_turns=len(calls) + 1,
        reward=RewardBreakdown(
            success=success, task=float(success), total=1.0 if success else 0.0, violations=list(violations)
        ),
        judge=JudgeVerdict(judge="rubric", success_prob=judge) if judge is not None else None,
    )


def _batch() -> list[Trajectory]:
    rng = random.Random(7)
    out = []
    fams = ["order_status", "stock_check", "order_count", "refund"]
    for i in range(160):  # mostly easy successes
        out.append(synth(f"ok-{i:03d}", family=fams[i % 4], tokens=rng.randint(40, 90)))
    for i in range(12):  # claimed success, verifier failed
        out.append(
            synth(
                f"claim-{i:02d}",
                family=fams[i % 2],
                success=False,
                answer="Done, order O-7 is cancelled.",
                calls=[_call(0, "find_customer")],
            )
        )
    for i in range(10):  # honest failures (refusals)
        out.append(
            synth(
                f"refuse-{i:02d}",
                family="refund",
                success=False,
                answer="Sorry, I can't refund that.",
                calls=[_call(0, "find_customer"), _call(1, "issue_refund", ok=False)],
            )
        )
    out.append(synth("lonely", family="email_receipt", calls=[_call(0, "send_email")]))  # a bucket of one
    out.append(synth("unsure", judge=0.5))
    out.append(synth("sure", judge=0.97))
    out.append(synth("loopy", calls=[_call(i, same_args=True) for i in range(3)]))
    out.append(
        synth(
            "errors",
            success=False,
            answer="Sorry, it failed.",
            calls=[_call(0, ok=False), _call(1, ok=False), _call(2)],
        )
    )
    out.append(synth("huge", tokens=5000))
    return out


def test_review_queue_has_all_disagreements_and_bucket_minimums():
    trajs = _batch()
    cfg = ReviewConfig(seed=0, budget=40, per_bucket_min=2)
    queue = build_review_queue(trajs, cfg)
    ids = [e.trajectory_id for e in queue]
    assert len(ids) == len(set(ids))
    claims = {t.id for t in trajs if t.id.startswith("claim-")}
    assert claims <= set(ids)
    for e in queue:
        if e.trajectory_id in claims:
            assert e.reasons[0] == DISAGREEMENT
    assert not any(DISAGREEMENT in e.reasons for e in queue if e.trajectory_id.startswith("refuse-"))
    # every stratum has its minimum; a stratum smaller than it is taken whole
    sizes = Counter(bucket_key(t, cfg) for t in trajs)
    chosen = Counter(e.bucket for e in queue)
    for bucket, size in sizes.items():
        assert chosen[bucket] >= min(2, size), bucket
    assert "lonely" in ids and sizes[bucket_key(next(t for t in trajs if t.id == "lonely"), cfg)] == 1
    assert any(r.startswith("bucket_minimum:") for e in queue for r in e.reasons)
    assert any(r.startswith("risk_sample(weight=") for e in queue for r in e.reasons)
    # mandatory items and minimums fit the budget here, so the queue is exactly the budget
    assert len(queue) == 40
    # deterministic: same seed, any input order -> same queue; another seed -> another draw
    shuffled = trajs[:]
    random.Random(1).shuffle(shuffled)
    assert [e.model_dump() for e in build_review_queue(shuffled, cfg)] == [e.model_dump() for e in queue]
    other = build_review_queue(trajs, cfg.model_copy(update={"seed": 1}))
    assert claims <= {e.trajectory_id for e in other}
    assert [e.trajectory_id for e in other] != ids


def test_disagreements_are_queued_past_the_budget():
    trajs = _batch()
    queue = build_review_queue(trajs, ReviewConfig(budget=0, per_bucket_min=0))
    assert {e.trajectory_id for e in queue} == {t.id for t in trajs if t.id.startswith("claim-")}
    # bucket minimums are a guarantee too, so they may exceed a small budget
    small = build_review_queue(trajs, ReviewConfig(budget=3, per_bucket_min=1))
    assert len({e.bucket for e in small}) == len({bucket_key(t, ReviewConfig()) for t in trajs})


def test_uncertainty_and_anomaly_flags():
    trajs = _batch()
    queue = {e.trajectory_id: e for e in build_review_queue(trajs, ReviewConfig(budget=60, per_bucket_min=1))}
    assert "judge_uncertain(p=0.50)" in queue["unsure"].reasons
    assert "low_judge_confidence" in queue["unsure"].risk_factors
    assert "anomaly:repeated_calls" in queue["loopy"].reasons
    assert "anomaly:consecutive_tool_errors" in queue["errors"].reasons
    assert "anomaly:tokens_above_p99" in queue["huge"].reasons
    assert "sure" not in queue or not any(r.startswith("judge_uncertain") for r in queue["sure"].reasons)
    # with flags_mandatory the flagged ones are queued even with no budget
    strict = {
        e.trajectory_id
        for e in build_review_queue(trajs, ReviewConfig(budget=0, per_bucket_min=0, flags_mandatory=True))
    }
    assert {"unsure", "loopy", "errors", "huge"} <= strict and "sure" not in strict


def test_risk_weights_favour_failures():
    trajs = [synth(f"ok-{i:03d}") for i in range(100)]
    trajs += [synth(f"bad-{i:03d}", success=False, answer="Sorry, I couldn't.") for i in range(100)]
    picked = Counter()
    for seed in range(20):
        for e in build_review_queue(trajs, ReviewConfig(seed=seed, budget=20, per_bucket_min=0)):
            picked[e.trajectory_id.split("-")[0]] += 1
            assert e.reasons[-1].startswith("risk_sample(weight=")
    assert picked["bad"] > 3 * picked["ok"]  # weight 5 vs 1: about 4.7 to 1 expected
    entry = build_review_queue(trajs, ReviewConfig(budget=1, per_bucket_min=0))[0]
    assert entry.risk_score == 5.0 and entry.risk_factors == ["failure"]


def test_review_queue_jsonl(tmp_path):
    queue = build_review_queue(_batch(), ReviewConfig(budget=30))
    path = tmp_path / "queue.jsonl"
    assert write_review_queue(path, queue) == len(queue)
    back = read_review_queue(path)
    assert back == queue
    line = json.loads(path.read_text().splitlines()[0])
    assert {"trajectory_id", "task_id", "family", "reasons", "risk_score", "summary"} <= set(line)
    assert {"final_answer", "tools", "reward"} <= set(line["summary"])


def test_review_config_validation():
    with pytest.raises(ValueError):
        ReviewConfig(uncertainty_band=(0.7, 0.3))
    with pytest.raises(ValueError):
        ReviewConfig(budget=-1)
    with pytest.raises(ValueError):
        build_review_queue([synth("a"), synth("a")])


# ------------------------------------------------------------- hard-task pool ----
def _outcomes(tasks: list[Task], failed: set[str]) -> list[Trajectory]:
    return [
        synth(f"t{i}", success=t.id not in failed).model_copy(update={"task_id": t.id}) for i, t in enumerate(tasks)
    ]


def test_hard_pool_samples_failed_tasks_more_often(orders_tasks):
    tasks = orders_tasks[:40]
    failed = {t.id for t in tasks[::8]}  # 5 tasks
    pool = HardTaskPool(HardPoolConfig(boost=4.0, max_share=0.5))
    pool.update(_outcomes(tasks, failed))
    assert set(pool.hard_task_ids()) == failed
    rng = random.Random(0)
    counts = Counter(t.id for _ in range(300) for t in pool.sample(tasks, 8, rng))
    hard_rate = sum(counts[i] for i in failed) / len(failed)
    other_rate = sum(counts[t.id] for t in tasks if t.id not in failed) / (len(tasks) - len(failed))
    assert hard_rate > 2.5 * other_rate
    # an empty pool samples uniformly-weighted and never fails
    assert len(HardTaskPool().sample(tasks, 8, 0)) == 8


def test_hard_pool_share_cap_and_determinism(orders_tasks):
    tasks = orders_tasks[:30]
    failed = {t.id for t in tasks[:10]}
    pool = HardTaskPool(HardPoolConfig(boost=50.0, max_share=0.2))
    pool.update(_outcomes(tasks, failed))
    for seed in range(20):
        draw = pool.sample(tasks, 10, seed)
        assert sum(t.id in failed for t in draw) <= 2
        assert len({t.id for t in draw}) == 10  # distinct when n <= len(tasks)
    assert [t.id for t in pool.sample(tasks, 10, 3)] == [t.id for t in pool.sample(tasks, 10, 3)]
    with_repl = pool.sample(tasks, 50, random.Random(1))
    assert len(with_repl) == 50 and sum(t.id in failed for t in with_repl) <= 10
    # only pooled tasks available: the cap yields rather than returning fewer tasks
    assert len(pool.sample(tasks[:10], 5, 0)) == 5


def test_hard_pool_decay_relief_and_checkpoint(orders_tasks):
    tasks = orders_tasks[:6]
    cfg = HardPoolConfig(decay=0.5, success_relief=0.5, min_score=0.1)
    pool = HardTaskPool(cfg)
    pool.update(_outcomes(tasks, {tasks[0].id, tasks[1].id}))
    pool.update(_outcomes(tasks, {tasks[0].id}))  # task 0 fails again, task 1 succeeds
    assert pool.score(tasks[0].id) == pytest.approx(0.5 + 1.0)
    assert pool.score(tasks[1].id) == pytest.approx(0.5 * 0.5)
    assert pool.entries[tasks[0].id].failures == 2 and pool.entries[tasks[1].id].attempts == 2
    state = json.loads(json.dumps(pool.state_dict()))  # JSON-serialisable
    restored = HardTaskPool.from_state_dict(state)
    assert restored.state_dict() == pool.state_dict()
    assert [t.id for t in restored.sample(tasks, 4, 9)] == [t.id for t in pool.sample(tasks, 4, 9)]
    for _ in range(3):  # old failures fade out of the pool
        pool.update([])
    assert tasks[1].id not in pool and tasks[0].id in pool
    with pytest.raises(ValueError, match="version"):
        HardTaskPool().load_state_dict({**state, "version": 99})


# --------------------------------------------------------------- corrections ----
class _CountingEnvs:
    def __init__(self, entry):
        self.entry, self.made = entry, 0

    def __call__(self):
        self.made += 1
        return self.entry.make_env()


class _WrongTeacher:
    """A teacher that answers at once, without doing anything: the verifier rejects it."""

    def act(self, task: Task):
        yield FinalAnswer("Done, all taken care of.")


def test_correction_is_a_fresh_verified_episode(cases, find_task, contract, orders_entry, expert_run):
    failed, ref = cases[F.ARGUMENT_ERROR]  # routed to targeted SFT
    task = _cases(find_task)[F.ARGUMENT_ERROR][0]
    att = attribute(failed, ref)
    before = failed.model_dump()
    envs = _CountingEnvs(orders_entry)
    corr = build_corrections([(failed, att)], {task.id: task}, contract, envs, OrdersExpert())
    assert envs.made == 1 and len(corr.sft) == 1 and not corr.pairs and not corr.discarded
    fixed = corr.sft[0]
    assert fixed.reward.success and fixed.source == "expert" and fixed.task_id == failed.task_id
    assert fixed.id != failed.id and fixed.token_ids != failed.token_ids
    assert failed.model_dump() == before  # the failed trajectory is left as it was
    # it is the expert's own episode, not an edit of the failed one
    independent = expert_run(task)
    assert fixed.token_ids == independent.token_ids
    assert [(c.name, c.arguments) for c in fixed.tool_calls] == [(c.name, c.arguments) for c in independent.tool_calls]
    # garbling the failed trajectory's tokens and calls changes nothing in the correction
    n_prompt = len(prompt_ids(failed))
    garbled = failed.model_copy(
        update={"token_ids": failed.token_ids[:n_prompt] + [0] * (len(failed.token_ids) - n_prompt), "tool_calls": []}
    )
    again = build_corrections([(garbled, att)], {task.id: task}, contract, envs, OrdersExpert())
    assert again.sft[0].token_ids == fixed.token_ids and again.sft[0].id != fixed.id


def test_preference_pairs_share_the_prompt(cases, find_task, contract, orders_entry):
    failed, ref = cases[F.PREMATURE_STOP]  # routed to preference / RL
    task = _cases(find_task)[F.PREMATURE_STOP][0]
    att = attribute(failed, ref)
    corr = build_corrections([(failed, att)], {task.id: task}, contract, orders_entry.make_env, OrdersExpert())
    assert not corr.sft and len(corr.pairs) == 1
    pair = corr.pairs[0]
    assert pair.rejected.id == failed.id and pair.chosen.id != failed.id
    assert pair.chosen.reward.success and not pair.rejected.reward.success
    assert (
        pair.prompt_ids
        == prompt_ids(pair.chosen)
        == prompt_ids(pair.rejected)
        == failed.token_ids[: len(pair.prompt_ids)]
    )
    assert pair.failure_type is F.PREMATURE_STOP


def test_rejected_corrections_are_discarded(cases, find_task, contract, orders_entry):
    items, tasks = [], {}
    for ft in (F.ARGUMENT_ERROR, F.PREMATURE_STOP, F.REWARD_HACK, F.LOOP):
        failed, ref = cases[ft]
        items.append((failed, attribute(failed, ref)))
        task = _cases(find_task)[ft][0]
        tasks[task.id] = task
    corr = build_corrections(items, tasks, contract, orders_entry.make_env, _WrongTeacher(), source="teacher")
    assert not corr.sft and not corr.pairs
    # reward-fix and long-horizon failures get no correction; the two others are rejected by the verifier
    assert sorted(d.trajectory_id for d in corr.discarded) == sorted(t.id for t, a in items[:2])
    assert {d.reason for d in corr.discarded} == {"verifier rejected the correction"}
    missing = build_corrections(items[:1], {}, contract, orders_entry.make_env, OrdersExpert())
    assert missing.discarded[0].reason == "task not found"


# ------------------------------------------------------------- task recovery ----
def test_task_generation_is_sequential_so_ids_recover_tasks(orders_entry):
    src = orders_entry.make_tasks()
    short, long = src.tasks("train", 5, 3), src.tasks("train", 12, 3)
    assert [t.__dict__ for t in short] == [t.__dict__ for t in long[:5]]
    wanted = [long[4].id, long[11].id, src.tasks("heldout", 3, 8)[2].id]
    found = find_tasks(orders_entry, wanted + ["orders-bogus-1-00001", "not-a-task", "orders-train-3-99999999"])
    assert set(found) == set(wanted)
    assert found[long[11].id].__dict__ == long[11].__dict__
    assert parse_task_id("orders-train-3-00011") == ("train", 3, 11) and parse_task_id("x") is None


def test_tasks_jsonl_round_trip(tmp_path, orders_tasks):
    path = tmp_path / "tasks.jsonl"
    write_tasks_jsonl(path, orders_tasks[:4])
    back = load_tasks_jsonl(path)
    assert [t.__dict__ for t in back.values()] == [t.__dict__ for t in orders_tasks[:4]]
    path.write_text('{"id": "x", "bogus": 1}\n')
    with pytest.raises(ValueError, match="tasks.jsonl:1"):
        load_tasks_jsonl(path)


def test_contract_is_rebuilt_from_the_fingerprint(cases, tokenizer, orders_entry, contract):
    traj = cases[F.LOOP][0]
    env = orders_entry.make_env()
    try:
        rebuilt = contract_for_trajectory(tokenizer, env, traj)
        assert rebuilt is not None and rebuilt.fingerprint() == contract.fingerprint() == traj.contract_fingerprint
        assert (
            contract_for_trajectory(tokenizer, env, traj.model_copy(update={"contract_fingerprint": "0" * 16})) is None
        )
    finally:
        env.close()


@pytest.mark.parametrize("system_turn", [True, False], ids=["system-turn", "no-system-turn"])
def test_a_contract_rebuilt_from_its_trajectory_equals_the_original(system_turn, tokenizer, orders_entry, find_task):
    """The trajectory records the configured limit (``max_total_tokens``) and the episode's whole budget
    (``EFFECTIVE_BUDGET_KEY``: the limit plus the system turn) apart; the rebuild reads the limit as configured."""
    env = orders_entry.make_env()
    try:
        fmt = PromptFormat(tool_descriptions=True, system_turn=system_turn)
        sampling = SamplingParams(temperature=0.7, max_new_tokens=24)
        original = contract_for_env(tokenizer, env, sampling, ContractLimits(max_turns=8, max_total_tokens=1000), fmt)
        assert (original.system_tokens > 0) == system_turn
        traj = run_scripted_episode(original, env, find_task("stock_check"), OrdersExpert())
        assert traj.sampling["max_total_tokens"] == 1000
        assert traj.sampling[EFFECTIVE_BUDGET_KEY] == original.max_total_tokens == 1000 + original.system_tokens
        rebuilt = contract_for_trajectory(tokenizer, env, traj)
        assert rebuilt is not None
        assert rebuilt.fingerprint() == original.fingerprint() == traj.contract_fingerprint
        assert (rebuilt.sampling, rebuilt.limits, rebuilt.system_turn) == (
            original.sampling,
            original.limits,
            system_turn,
        )
        assert (rebuilt.system_prompt, rebuilt.tool_signatures) == (original.system_prompt, original.tool_signatures)
        assert (rebuilt.system_tokens, rebuilt.max_total_tokens) == (original.system_tokens, original.max_total_tokens)
        # a trajectory written before the budget had its own key recorded the budget as max_total_tokens
        old = dict(traj.sampling)
        old["max_total_tokens"] = old.pop(EFFECTIVE_BUDGET_KEY)
        legacy = contract_for_trajectory(tokenizer, env, traj.model_copy(update={"sampling": old}))
        assert legacy is not None and legacy.fingerprint() == original.fingerprint()
    finally:
        env.close()


# ----------------------------------------------------------------------- CLI ----
def _app() -> typer.Typer:
    return cli_with(register)


@pytest.fixture(scope="module")
def traj_file(tmp_path_factory, cases, find_task, expert_run):
    """All failure cases, the expert's successes on three more tasks, one trajectory per line."""
    trajs = [t for t, _ in cases.values()]
    trajs += [expert_run(find_task(f)) for f in ("stock_check", "update_address", "email_receipt")]
    path = tmp_path_factory.mktemp("flywheel") / "trajs.jsonl"
    write_jsonl(path, trajs)
    return path, trajs


def test_cli_writes_queue_report_pool_and_corrections(tmp_path, traj_file, tiny_model_dir, cases):
    path, trajs = traj_file
    out = tmp_path / "out"
    args = ["flywheel", str(path), "--out", str(out), "--seed", "3", "--budget", "8", "--model", str(tiny_model_dir)]
    res = CliRunner().invoke(_app(), args)
    assert res.exit_code == 0, res.output
    assert "Failure types" in res.output and "REWARD_HACK" in res.output

    queue = read_review_queue(out / "review_queue.jsonl")
    claims = {t.id for t in trajs if trace.claims_success(t.final_answer) and not t.reward.success}
    assert claims and claims <= {e.trajectory_id for e in queue}

    report = json.loads((out / "failure_report.json").read_text())
    assert report["n_failed"] == len(cases) and report["tasks"]["missing"] == []
    assert report["tasks"]["with_reference"] == len({t.task_id for t, _ in cases.values()})
    assert report["distribution"]["overall"]["counts"] == {ft.value: 1 for ft in PRECEDENCE}
    routes = {ft.value: m.value for ft, m in RoutingTable().routes.items()}
    assert {r["failure_type"]: r["method"] for r in report["routing"]} == routes
    atts = [json.loads(line) for line in (out / "attributions.jsonl").read_text().splitlines()]
    assert {a["trajectory_id"]: a["failure_type"] for a in atts} == {t.id: ft.value for ft, (t, _) in cases.items()}

    # the pool holds every failure except the reward-fix one (kept out of training)
    pool = HardTaskPool.from_state_dict(json.loads((out / "hard_pool.json").read_text()))
    expected = Counter(t.task_id for ft, (t, _) in cases.items() if ft is not F.REWARD_HACK)
    assert {k: e.failures for k, e in pool.entries.items()} == dict(expected)

    sft = list(read_jsonl(out / "corrections_sft.jsonl"))
    pairs = read_pairs_jsonl(out / "preference_pairs.jsonl")
    assert sft and all(t.reward.success for t in sft)
    assert len({t.task_id for t in sft}) == len(sft)  # one correction per task
    sft_tasks = {t.task_id for ft, (t, _) in cases.items() if RoutingTable().method(ft) is TrainingMethod.TARGETED_SFT}
    assert {t.task_id for t in sft} == sft_tasks
    pref = {t.id for ft, (t, _) in cases.items() if RoutingTable().method(ft) is TrainingMethod.PREFERENCE_OR_RL}
    assert {p.rejected.id for p in pairs} == pref
    assert all(p.chosen.reward.success and p.prompt_ids == prompt_ids(p.rejected) for p in pairs)
    assert report["corrections"] == {"sft": len(sft), "pairs": len(pairs), "discarded": 0, "discarded_reasons": {}}

    # same seed, same queue
    res2 = CliRunner().invoke(_app(), args[:3] + [str(tmp_path / "again")] + args[4:])
    assert res2.exit_code == 0, res2.output
    assert (tmp_path / "again" / "review_queue.jsonl").read_text() == (out / "review_queue.jsonl").read_text()


def test_cli_without_model_uses_tasks_file_and_skips_corrections(tmp_path, traj_file, cases, find_task):
    path, _ = traj_file
    tasks_file = tmp_path / "tasks.jsonl"
    write_tasks_jsonl(tasks_file, [_cases(find_task)[ft][0] for ft in (F.LOOP, F.STATE_TRACKING)])
    out = tmp_path / "out"
    res = CliRunner().invoke(
        _app(), ["flywheel", str(path), "--out", str(out), "--tasks", str(tasks_file), "--route", "LOOP=reward_fix"]
    )
    assert res.exit_code == 0, res.output
    assert "corrections skipped" in res.output
    assert not (out / "corrections_sft.jsonl").exists()
    report = json.loads((out / "failure_report.json").read_text())
    assert report["routes"]["LOOP"] == "reward_fix"
    assert report["tasks"]["missing"]  # the other failed tasks were not in the file
    assert report["tasks"]["recovered"] == 2


def test_cli_bad_input_exits_2(tmp_path, traj_file):
    path, _ = traj_file
    res = CliRunner().invoke(_app(), ["flywheel", str(path), "--out", str(tmp_path), "--route", "LOOP=nap"])
    assert res.exit_code == 2 and "bad route" in res.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1}\n')
    res = CliRunner().invoke(_app(), ["flywheel", str(bad), "--out", str(tmp_path)])
    assert res.exit_code == 2 and "bad.jsonl:1" in res.output
