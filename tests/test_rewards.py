"""Rewards come from environment state, hard constraints dominate, soft terms stay inside a tier."""

from __future__ import annotations

import itertools

import pytest

from mentorrl.contract import render_tool_call
from mentorrl.envs.base import Verdict
from mentorrl.rewards.compose import RewardWeights, compose_reward
from mentorrl.rollout.episode import run_scripted_episode, run_text_turns
from mentorrl.trajectory import ToolCall, Trajectory


def play(contract, env, task, turns: list[str], **kw) -> Trajectory:
    """Drive an Episode with scripted policy turn texts (what a model would have written)."""
    return run_text_turns(contract, env, task, turns, **kw)


@pytest.fixture
def orders_env(orders_entry):
    env = orders_entry.make_env(answer="free_text")  # these tests read free-text answers (typed: test_typed_answer.py)
    yield env
    env.close()


@pytest.fixture
def contract(make_contract, orders_env):
    return make_contract(env=orders_env, max_turns=8, max_total_tokens=2048)


# ------------------------------------------------------ state, not claims ----
def test_claimed_cancellation_without_db_change_gets_no_task_reward(find_task, orders_env, contract):
    task = find_task("cancel_order")
    email = task.reference["request"]["email"]
    traj = play(
        contract, orders_env, task, [render_tool_call("find_customer", {"email": email}), "Done, order cancelled."]
    )
    assert traj.tool_calls[0].ok and traj.final_answer == "Done, order cancelled."
    r = traj.reward
    assert r.task == 0.0 and r.success is False and not r.violations
    assert any("order" in d for d in r.details["diffs"])
    assert 0.0 <= r.total < 0.5  # the failure tier, however confident the answer
    # the expert, which really cancels, succeeds on the same task
    expert = run_scripted_episode(contract, orders_env, task, _expert())
    assert expert.reward.success and expert.reward.task == 1.0 and expert.reward.total > 1.0


def _expert():
    from mentorrl.envs.orders import OrdersExpert

    return OrdersExpert()


def test_claimed_order_without_create_gets_no_task_reward(find_task, orders_env, contract):
    task = find_task("place_order")
    email = task.reference["request"]["email"]
    traj = play(
        contract,
        orders_env,
        task,
        [render_tool_call("find_customer", {"email": email}), "Your order has been placed successfully."],
    )
    assert traj.reward.task == 0.0 and not traj.reward.success and traj.reward.total < 0.5


def test_duplicate_order_violates_hard_constraint(find_task, orders_env, contract):
    task = find_task("place_order")
    (_, find_args), (_, create_args) = task.reference["actions"]
    create = render_tool_call("create_order", create_args)
    dup = play(
        contract,
        orders_env,
        task,
        [render_tool_call("find_customer", find_args), create, create, "I placed your order."],
    )
    assert [c.ok for c in dup.tool_calls] == [True, True, True]  # both creates went through
    r = dup.reward
    assert any(v.startswith("extra order(s)") and v.endswith("(duplicate)") for v in r.violations), r.violations
    assert r.success is False and r.task == 0.0
    assert r.total < 0
    assert r.details["tier"] == -1.0

    # the single order succeeds; a plain failure without violation is above the violation
    once = play(
        contract, orders_env, task, [render_tool_call("find_customer", find_args), create, "I placed your order."]
    )
    assert once.reward.success and not once.reward.violations
    claim = play(contract, orders_env, task, [render_tool_call("find_customer", find_args), "I placed your order."])
    assert not claim.reward.success and not claim.reward.violations
    # the worst possible failure without a violation (all calls failed, truncated) still beats it
    worst_failure = compose_reward(Verdict(success=False), [_call(False)] * 9, "max_turns", RewardWeights())
    assert r.total < worst_failure.total <= claim.reward.total < once.reward.total


def test_refused_cancel_of_shipped_order_is_not_a_violation(find_task, orders_env, contract):
    """The tool refuses (policy error) so the state is unchanged: a refusal is no violation."""
    task = find_task("cancel_order", "bypass")
    email, oid = task.reference["request"]["email"], task.reference["request"]["order_id"]
    traj = play(
        contract,
        orders_env,
        task,
        [
            render_tool_call("find_customer", {"email": email}),
            render_tool_call("cancel_order", {"order_id": oid}),
            "Done, order cancelled.",
        ],
    )
    assert traj.tool_calls[1].error_kind == "policy"
    assert not traj.reward.violations  # the store policy held; no forbidden change happened
    assert not traj.reward.success  # the answer claims the wrong status


# --------------------------------------------------------------------- tiers ----
_CALL_IDS = itertools.count()


def _call(ok: bool, name: str = "t", arguments: dict | None = None) -> ToolCall:
    """A tool call; without ``arguments`` each call gets its own (so no two are identical)."""
    args = arguments if arguments is not None else {"i": next(_CALL_IDS)}
    return ToolCall(
        turn=1, name=name, arguments=args, raw="", error=None if ok else "bad", error_kind=None if ok else "timeout"
    )


SAME = {"order_id": "O-1"}
CALL_SETS = [
    [],
    [_call(True)],
    [_call(False)],
    [_call(True), _call(False)],
    [_call(False)] * 5,
    [_call(True)] * 3,
    [_call(True, arguments=SAME)] * 6,
    [_call(False, arguments=SAME), _call(True, arguments=SAME)],
]
REASONS = ["answer", "max_turns", "max_tokens", "length"]
ANSWERS = [None, "", "Order O-1 is shipped.", "x" * 201, "y" * 5000]


@pytest.mark.parametrize(
    "weights",
    [
        RewardWeights(),
        RewardWeights(
            tool=0.25, format=0.2499, runtime=0.4999, verbosity=0.0, error_penalty=1.0, truncation_penalty=1.0
        ),
        RewardWeights(
            tool=0.25,
            format=0.2499,
            runtime=0.2499,
            verbosity=0.25,
            error_penalty=1.0,
            redundant_penalty=1.0,
            truncation_penalty=1.0,
            answer_budget_chars=1,
            verbosity_scale_chars=1,
        ),
        RewardWeights(tool=0.0, format=0.0, runtime=0.0, verbosity=0.0),
    ],
)
def test_reward_tiers_never_cross(weights):
    def totals(verdict):
        return [
            compose_reward(verdict, calls, reason, weights, final_answer=answer).total
            for calls, reason, answer in itertools.product(CALL_SETS, REASONS, ANSWERS)
        ]

    success = totals(Verdict(success=True))
    failure = totals(Verdict(success=False))
    violation = totals(Verdict(success=False, violations=["x"])) + totals(Verdict(success=True, violations=["x"]))
    assert min(success) > max(failure)
    assert min(failure) > max(violation)
    assert all(0.5 < s < 1.5 for s in success)
    assert all(-0.5 < f < 0.5 for f in failure)
    assert all(-1.5 < v < -0.5 for v in violation)


def test_violation_overrides_success():
    r = compose_reward(Verdict(success=True, violations=["extra refund(s)"]), [], "answer", RewardWeights())
    assert r.success is False and r.task == 0.0 and r.violations == ["extra refund(s)"]
    assert r.total == -1.0  # soft terms are paid on successes only


def test_failures_earn_no_soft_reward():
    """Answering at once without any tool call (no failed calls, a clean ending) must not beat
    a failed attempt: the hack GRPO found when soft terms were paid on failures."""
    w = RewardWeights()
    do_nothing = compose_reward(Verdict(success=False), [], "answer", w)
    tried = compose_reward(Verdict(success=False), [_call(True), _call(False)], "answer", w)
    assert do_nothing.total == tried.total == 0.0
    assert (do_nothing.tool, do_nothing.format) == (0.0, 1.0)  # still recorded; no calls earn no tool credit
    assert tried.runtime < 0


def test_reward_terms_exact():
    w = RewardWeights()
    r = compose_reward(Verdict(success=True), [_call(True), _call(False), _call(True), _call(True)], "answer", w)
    assert (r.task, r.tool, r.format, r.runtime) == (1.0, 0.75, 1.0, -0.25)
    assert r.total == pytest.approx(1.0 + 0.1 * 0.75 + 0.1 - 0.2 * 0.25)
    r = compose_reward(Verdict(success=False), [], "length", w)
    assert (r.task, r.tool, r.format, r.runtime) == (0.0, 0.0, 0.0, -0.5)
    assert r.total == 0.0
    r = compose_reward(Verdict(success=False), [_call(False)] * 3, "max_tokens", w)
    assert r.runtime == -1.0  # clipped at -1


@pytest.mark.parametrize(
    "kw",
    [
        dict(tool=0.3, format=0.3),
        dict(tool=0.25, format=0.25),
        dict(runtime=0.5),
        dict(tool=-0.1),
        dict(error_penalty=1.5),
        dict(runtime=0.4, verbosity=0.1),
        dict(verbosity=0.5, runtime=0.0),
        dict(verbosity=-0.1),
        dict(redundant_penalty=1.5),
        dict(answer_budget_chars=0),
        dict(verbosity_scale_chars=0),
    ],
)
def test_bad_reward_weights_rejected(kw):
    with pytest.raises(ValueError):
        RewardWeights(**kw)


def test_reward_weight_error_message_is_explicit():
    with pytest.raises(ValueError, match="tool \\+ format"):
        RewardWeights(tool=0.3, format=0.3)
    with pytest.raises(ValueError, match="runtime \\+ verbosity"):
        RewardWeights(runtime=0.3, verbosity=0.2)


# ------------------------------------------------------- redundancy, verbosity ----
def test_repeating_a_successful_call_is_penalised_like_a_failed_one():
    w = RewardWeights()
    read = _call(True, "get_order", SAME)
    once = compose_reward(Verdict(success=True), [read], "answer", w)
    spam = compose_reward(Verdict(success=True), [read] * 5, "answer", w)
    assert once.details["redundant_calls"] == 0 and once.runtime == 0.0
    assert spam.details["redundant_calls"] == 4
    assert spam.tool == 1.0 and spam.runtime == -1.0  # 4 x 0.25, clipped at -1
    assert spam.total == pytest.approx(1.0 + w.tool + w.format - w.runtime)
    assert spam.success and once.total > spam.total
    # a different argument or tool is not a repeat
    other = compose_reward(
        Verdict(success=True),
        [read, _call(True, "get_order", {"order_id": "O-2"}), _call(True, "list_orders", SAME)],
        "answer",
        w,
    )
    assert other.details["redundant_calls"] == 0 and other.runtime == 0.0


def test_retry_after_a_failed_call_is_charged_once():
    """A retry of a call that failed is not redundant: the failure is already charged."""
    w = RewardWeights()
    r = compose_reward(
        Verdict(success=True), [_call(False, "get_order", SAME), _call(True, "get_order", SAME)], "answer", w
    )
    assert r.details["redundant_calls"] == 0 and r.details["tool_errors"] == 1
    assert r.runtime == pytest.approx(-w.error_penalty)
    # ... but repeating it after it succeeded is
    r = compose_reward(
        Verdict(success=True), [_call(False, "get_order", SAME)] + [_call(True, "get_order", SAME)] * 2, "answer", w
    )
    assert r.details["redundant_calls"] == 1
    assert r.runtime == pytest.approx(-(w.error_penalty + w.redundant_penalty))


def test_redundant_penalty_weight_is_used():
    calls = [_call(True, "get_order", SAME)] * 3
    assert compose_reward(
        Verdict(success=True), calls, "answer", RewardWeights(redundant_penalty=0.1)
    ).runtime == pytest.approx(-0.2)
    assert compose_reward(Verdict(success=True), calls, "answer", RewardWeights(redundant_penalty=0.0)).runtime == 0.0


@pytest.mark.parametrize(
    "length, expected", [(0, 0.0), (120, 0.0), (200, 0.0), (201, -1 / 400), (400, -0.5), (600, -1.0), (5000, -1.0)]
)
def test_verbosity_term(length, expected):
    w = RewardWeights()
    r = compose_reward(Verdict(success=True), [_call(True)], "answer", w, final_answer="a" * length)
    assert r.details["verbosity"] == pytest.approx(expected)
    assert r.details["answer_chars"] == length
    assert r.total == pytest.approx(1.0 + w.tool + w.format + w.verbosity * expected)


def test_verbosity_ignores_surrounding_whitespace_and_is_not_paid_on_failures():
    w = RewardWeights(answer_budget_chars=10, verbosity_scale_chars=10)
    r = compose_reward(Verdict(success=True), [], "answer", w, final_answer="  " + "a" * 15 + "\n\n")
    assert r.details["verbosity"] == pytest.approx(-0.5) and r.details["answer_chars"] == 15
    failed = compose_reward(Verdict(success=False), [], "answer", w, final_answer="a" * 1000)
    assert failed.details["verbosity"] == -1.0 and failed.total == 0.0  # recorded, not paid


def test_expert_answers_fit_the_answer_budget(orders_entry):
    """The scripted expert never pays the verbosity term (its answers are short)."""
    from mentorrl.contract import parse_action
    from mentorrl.rollout.episode import drive_script

    env, expert = orders_entry.make_env(), orders_entry.make_expert()
    answers: list[str] = []
    try:
        for task in orders_entry.make_tasks().tasks(split="train", n=150, seed=3):
            env.reset(task)

            def act(text: str):
                action = parse_action(text)
                if action.kind != "tool":
                    answers.append(action.text)
                    return None
                return env.step(action.name, action.arguments)

            drive_script(expert, task, act)
    finally:
        env.close()
    assert len(answers) == 150
    assert max(map(len, answers)) < 120 < RewardWeights().answer_budget_chars


def test_padded_correct_answer_ranks_below_the_plain_one(find_task, orders_env, contract):
    """Length padding keeps the task reward (the core is right) but loses to the plain answer."""
    task = find_task("order_status")
    oid = task.reference["request"]["order_id"]
    call = render_tool_call("get_order", {"order_id": oid})
    plain = play(contract, orders_env, task, [call, f"Order {oid} is {task.reference['expected']}."])
    padded = play(contract, orders_env, task, [call, plain.final_answer + " Thank you for your patience!" * 20])
    assert plain.reward.success and padded.reward.success
    assert padded.reward.details["verbosity"] < 0 == plain.reward.details["verbosity"]
    assert padded.reward.total < plain.reward.total
