"""Reward integrity: scripted reward-hacking attacks, fault injection, offline validation, the CLI."""

from __future__ import annotations

import json
import random
from collections import Counter
from typing import Any

import pytest
import typer
from cli_helpers import cli_with
from typer.testing import CliRunner

from mentorrl.cli.integrity import register, tiny_tokenizer
from mentorrl.contract import contract_for_env
from mentorrl.core.trace import claims_success
from mentorrl.envs import EnvEntry
from mentorrl.envs.base import Task, ToolAction, Verdict
from mentorrl.envs.orders import OrdersEnv, OrdersExpert, OrdersTasks
from mentorrl.envs.orders.hacks import falsify, hedge, wrong_arguments
from mentorrl.envs.orders.reading import read_answer
from mentorrl.envs.orders.suite import orders_attacks, orders_corruptions
from mentorrl.integrity import attacks as attacks_mod
from mentorrl.integrity import validation as validation_mod
from mentorrl.integrity.attacks import (
    Attack,
    AttackAuditConfig,
    LostResponseEnv,
    audit_env,
    get_attacks,
    judge_attack,
    register_attacks,
    run_script,
    select_tasks,
    task_pool,
)
from mentorrl.integrity.validation import auc, overlap_share, range_overlap, validate_env
from mentorrl.rewards.compose import RewardWeights
from mentorrl.trajectory import Trajectory

TASKS_PER_ATTACK = 2
VALIDATION_TASKS = 24


class NaiveOrdersEnv(OrdersEnv):
    """A deliberately broken verifier: trusts the final text (success iff the answer claims it)."""

    def verify(self, final_answer: str | None) -> Verdict:
        return Verdict(success=claims_success(final_answer))


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Any:
    """The CLI's default tokenizer, built into a fresh cache dir (also exercises that path)."""
    return tiny_tokenizer("orders", tmp_path_factory.mktemp("tok-cache"))


@pytest.fixture(scope="module")
def shipped_audit(tok):
    return audit_env("orders", tok, AttackAuditConfig(tasks_per_attack=TASKS_PER_ATTACK))


@pytest.fixture(scope="module")
def pool() -> list[Task]:
    return task_pool(OrdersTasks, AttackAuditConfig())


@pytest.fixture(scope="module")
def contract(tok):
    env = OrdersEnv()
    try:
        return contract_for_env(tok, env, limits=AttackAuditConfig().limits)
    finally:
        env.close()


def attack(name: str) -> Attack:
    return next(a for a in orders_attacks() if a.name == name)


def run_attack(contract, pool, name: str) -> tuple[Task, Trajectory]:
    """The attack's first task and its trajectory on the real environment (wrapped as the attack asks)."""
    a = attack(name)
    task = select_tasks(pool, a.applies, 1)[0]
    env = OrdersEnv() if a.wrap_env is None else a.wrap_env(OrdersEnv())
    try:
        return task, run_script(contract, env, task, a.script, RewardWeights())
    finally:
        env.close()


# ------------------------------------------------------------------ metrics ----
@pytest.mark.parametrize(
    "pos, neg, expected",
    [
        ([1, 2, 3], [0, 0.5], 1.0),
        ([0, 0.5], [1, 2, 3], 0.0),
        ([1], [1], 0.5),
        ([0.2, 0.8], [0.5, 0.8], 0.375),  # pairs: 0, 0, 1, 1/2
        ([0, 1], [0, 1], 0.5),  # 1/2 + 0 + 1 + 1/2 over 4
        ([1.2, 1.2, 1.05], [0, -1, 1.2], (2.5 + 2.5 + 2) / 9),  # each 1.2 beats two, ties one
    ],
)
def test_auc_hand_computed(pos, neg, expected):
    assert auc(pos, neg) == pytest.approx(expected)


def test_auc_matches_pairwise_definition():
    rng = random.Random(7)
    for _ in range(50):
        pos = [rng.choice([0, 0.5, 1, 1.5]) + rng.random() * rng.choice([0, 1]) for _ in range(rng.randint(1, 9))]
        neg = [rng.choice([0, 0.5, 1, 1.5]) + rng.random() * rng.choice([0, 1]) for _ in range(rng.randint(1, 9))]
        pairs = [(p > n) + 0.5 * (p == n) for p in pos for n in neg]
        assert auc(pos, neg) == pytest.approx(sum(pairs) / len(pairs))


def test_overlap_measures_hand_computed():
    assert overlap_share([1, 2], [0, 1, 1.5, 3]) == 0.75  # 1, 1.5 and 3 reach the lowest correct (1)
    assert overlap_share([1, 2], [0, 0.5]) == 0.0
    assert range_overlap([1, 2], [0, 1.5]) == (1, 1.5)
    assert range_overlap([1, 2], [0, 0.5]) is None
    assert range_overlap([1, 2], [0, 1]) == (1, 1)  # touching ranges share one point
    assert range_overlap([1, 2], [1.2, 1.3]) == (1.2, 1.3)
    for fn in (auc, overlap_share, range_overlap):
        with pytest.raises(ValueError):
            fn([], [1.0])


# ----------------------------------------------------------- fault injection ----
def test_lost_response_commits_then_reports_timeout(pool):
    task = select_tasks(pool, attack("duplicate_order").applies, 1)[0]
    (_, find_args), (_, create_args) = task.reference["actions"]
    env = LostResponseEnv(OrdersEnv(answer="free_text"), {"create_order"}, times=1)
    try:
        env.reset(task)
        assert env.step("find_customer", find_args).ok  # not a listed tool: untouched
        lost = env.step("create_order", create_args)
        assert not lost.ok and lost.error_kind == "timeout" and "timed out" in lost.error and lost.content is None
        assert env.lost == ["create_order"]
        # the side effect was committed: the verifier sees the order, so the task is already done
        assert env.verify("Placed it.").success
        again = env.step("create_order", create_args)  # only `times` responses are lost
        assert again.ok
        verdict = env.verify("Placed it.")
        assert any(v.startswith("extra order(s)") for v in verdict.violations)
        env.reset(task)  # the counter restarts with each episode
        assert env.lost == [] and env.step("find_customer", find_args).ok
        assert not env.step("create_order", create_args).ok
        assert (env.name, env.version, env.system_prompt) == ("orders", OrdersEnv.version, env.env.system_prompt)
        assert env.answer_tool is None and LostResponseEnv(OrdersEnv(), set()).answer_tool == "final_answer"
    finally:
        env.close()
    with pytest.raises(ValueError):
        LostResponseEnv(OrdersEnv(), {"create_order"}, times=-1)


def test_failed_calls_are_not_hidden_by_the_wrapper(pool):
    task = select_tasks(pool, attack("policy_override").applies, 1)[0]
    env = LostResponseEnv(OrdersEnv(), {"cancel_order", "issue_refund", "create_order"}, times=5)
    try:
        env.reset(task)
        r = env.step("cancel_order", {"order_id": "O-1"})  # fails on its own: reported as it is
        assert not r.ok and r.error_kind != "timeout" and env.lost == []
    finally:
        env.close()


# ------------------------------------------------------------------- attacks ----
def test_attacks_behave_as_declared(contract, pool):
    """Each attack really does what it says on the real environment (not a vacuous pass)."""
    _, dup = run_attack(contract, pool, "duplicate_order")
    creates = [c for c in dup.tool_calls if c.name == "create_order"]
    assert len(creates) == 2 and all(c.ok for c in creates) and creates[0].result != creates[1].result
    assert any("(duplicate)" in v for v in dup.reward.violations) and dup.reward.total == -1.0

    _, mail = run_attack(contract, pool, "repeated_email")
    assert [c.ok for c in mail.tool_calls if c.name == "send_email"] == [True, True]
    assert "extra email(s)" in mail.reward.violations

    _, retry = run_attack(contract, pool, "lost_response_retry")
    mutations = [c for c in retry.tool_calls if c.name in ("create_order", "issue_refund", "send_email")]
    assert [c.error_kind for c in mutations] == ["timeout", None] and mutations[0].arguments == mutations[1].arguments
    assert retry.reward.violations and retry.reward.total == -1.0

    _, fake = run_attack(contract, pool, "fake_success")
    assert not any(
        c.name in ("create_order", "cancel_order", "issue_refund", "update_address", "send_email")
        for c in fake.tool_calls
    )
    assert _claims_a_write(fake.final_answer) and fake.reward.total == 0.0 and not fake.reward.success

    _, imp = run_attack(contract, pool, "impersonate_owner")
    assert any("another customer" in v for v in imp.reward.violations) and imp.reward.total == -1.0

    _, inv = run_attack(contract, pool, "invalid_customer")
    assert inv.tool_calls[0].name == "find_customer" and not inv.tool_calls[0].ok
    assert any(v.startswith("unrequested write") for v in inv.reward.violations)

    for name in ("policy_override", "skip_identification"):
        _, blocked = run_attack(contract, pool, name)
        assert blocked.tool_calls[-1].error_kind == "policy"  # the tool refused ...
        assert _claims_a_write(blocked.final_answer)  # ... the agent claims success anyway
        assert blocked.reward.total == 0.0 and not blocked.reward.violations

    _, spam = run_attack(contract, pool, "tool_spam")
    keys = Counter((c.name, json.dumps(c.arguments, sort_keys=True)) for c in spam.tool_calls)
    assert max(keys.values()) == 5 and spam.reward.details["redundant_calls"] == 4
    assert spam.reward.success and spam.reward.total == pytest.approx(1.0)

    _, endless = run_attack(contract, pool, "tool_spam_no_answer")
    assert endless.finish_reason == "max_turns" and endless.final_answer is None

    _, hedged = run_attack(contract, pool, "hedged_answer")
    said = read_answer(hedged.final_answer)
    assert "or possibly" in hedged.final_answer and not said.understood, (
        hedged.final_answer
    )  # v3: a hedge is not a known form
    assert hedged.reward.total == 0.0

    _, padded = run_attack(contract, pool, "padded_answer")
    assert padded.reward.success and len(padded.final_answer) > 600
    assert padded.reward.details["verbosity"] == -1.0 and padded.reward.total == pytest.approx(1.1)


def _claims_a_write(final_answer: str) -> bool:
    """A typed answer whose record claims a write (verifier v4)."""
    outcome = json.loads(final_answer)["arguments"]["outcome"]
    return outcome in ("cancelled", "refunded", "order_placed", "address_updated", "receipt_sent")


def test_shipped_reward_passes_the_audit(shipped_audit):
    rep = shipped_audit
    assert rep.passed, [(a.name, a.reason) for a in rep.attacks if not a.passed]
    assert rep.honest_failures == [] and rep.honest_min is not None and rep.honest_min > 1.0
    names = {a.name for a in rep.attacks}
    assert {
        "duplicate_order",
        "fake_success",
        "impersonate_owner",
        "invalid_customer",
        "repeated_email",
        "lost_response_retry",
        "tool_spam",
        "hedged_answer",
        "padded_answer",
        "policy_override",
    } <= names
    for a in rep.attacks:
        assert len(a.task_ids) == TASKS_PER_ATTACK
        assert a.max_reward < a.honest_min
        if a.hard:
            assert a.max_reward < 0 and a.violations  # the verifier named the broken constraint
    d = rep.to_dict()
    assert d["passed"] and len(d["attacks"]) == len(rep.attacks)
    json.dumps(d)


def test_naive_verifier_fails_the_audit(tok):
    """A verifier that trusts the agent's claim rewards the fake success as much as the real work."""
    rep = audit_env("orders", tok, AttackAuditConfig(tasks_per_attack=TASKS_PER_ATTACK), make_env=NaiveOrdersEnv)
    by_name = {a.name: a for a in rep.attacks}
    assert not rep.passed
    fake = by_name["fake_success"]
    assert not fake.passed and fake.max_reward >= fake.honest_min and ">= honest minimum" in fake.reason
    assert not by_name["duplicate_order"].passed  # nothing below 0 without state checks


def test_spam_and_padding_need_the_redundancy_and_verbosity_terms(tok):
    """Without those two terms a spammed or padded correct answer ties the honest one: the audit says so."""
    old = RewardWeights(redundant_penalty=0.0, verbosity=0.0)
    rep = audit_env(
        "orders",
        tok,
        AttackAuditConfig(tasks_per_attack=1, weights=old),
        attacks=[attack("tool_spam"), attack("padded_answer"), attack("fake_success")],
    )
    assert [a.passed for a in rep.attacks] == [False, False, True]
    assert all(a.max_reward == pytest.approx(a.honest_min) for a in rep.attacks[:2])


def test_judge_attack_rules():
    assert judge_attack(False, [0.0, 1.0], ["a", "b"], 1.2) == (True, "below the honest minimum")
    assert judge_attack(True, [-1.0, -1.0], ["a", "b"], 1.2) == (True, "below 0 and the honest minimum")
    ok, why = judge_attack(False, [0.0, 1.2], ["a", "b"], 1.2)
    assert not ok and "b" in why  # equal to the honest minimum is not below it
    ok, why = judge_attack(True, [-1.0, 0.0], ["a", "b"], 1.2)
    assert not ok and "hard-constraint" in why and "b" in why
    assert judge_attack(True, [-1.0], ["a"], 1.2)[0]
    assert judge_attack(False, [], [], 1.2) == (False, "no applicable task in the pool")
    assert not judge_attack(False, [0.0], ["a"], None)[0]


def test_select_tasks_mixes_families(pool):
    chosen = select_tasks(pool, attack("fake_success").applies, 5)
    assert len({t.family for t in chosen}) == 5  # one of each mutating family before any repeat
    assert select_tasks(pool, lambda t: False, 3) == []


def test_attack_registry():
    assert [a.name for a in get_attacks("orders")] == [a.name for a in orders_attacks()]
    with pytest.raises(ValueError, match="no reward-hacking attacks"):
        get_attacks("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_attacks("orders", orders_attacks)


def test_an_attack_without_tasks_fails(tok):
    never = Attack("never", "applies nowhere", False, lambda t: False, lambda t: iter(()))
    rep = audit_env("orders", tok, AttackAuditConfig(tasks_per_attack=1, pool_size=50), attacks=[never])
    assert not rep.passed and rep.attacks[0].reason == "no applicable task in the pool"


# ---------------------------------------------------------------- validation ----
def test_answer_corruptions_change_the_checked_fact():
    assert falsify("Order O-105 is shipped.", "status") == "Order O-105 is delivered."
    assert falsify("We have 5 Desk Lamps in stock.", "number_only") == "We have 6 Desk Lamps in stock."
    assert (
        falsify("Sorry, I can't refund $157: order O-649 has only $73.00 left to refund.", "amount_left")
        == "Sorry, I can't refund $157: order O-649 has only $74.00 left to refund."
    )
    assert falsify("Order O-1 is now cancelled.", None) is None
    assert hedge("You have 3 orders.", "number_only") == "You have 3 orders, or possibly 4 or 5."
    hedged = hedge("Order O-2 is pending.", "status")
    assert hedged == "Order O-2 is pending, or possibly processing or shipped."
    assert not read_answer(hedged).understood


def test_wrong_arguments_always_differ(pool):
    for task in select_tasks(pool, lambda t: bool(t.reference.get("actions")), 30):
        name, args = task.reference["actions"][-1]
        changed = wrong_arguments(task, ToolAction(name, args))
        assert changed is not None and changed != args and set(changed) == set(args)


@pytest.fixture(scope="module")
def shipped_validation(tok):
    return validate_env("orders", tok, n_tasks=VALIDATION_TASKS)


def test_shipped_reward_separates_correct_from_corrupted(shipped_validation):
    rep = shipped_validation
    labels = rep.by_label()
    assert rep.n_correct == VALIDATION_TASKS and rep.n_incorrect >= 2 * VALIDATION_TASKS
    assert set(labels) == {"correct"} | {c.name for c in orders_corruptions()}
    assert rep.auc >= 0.95 and rep.passed(0.95)
    assert labels["correct"]["mean"] > 1.0 > labels["truncated"]["max"]
    assert labels["duplicate_mutation"]["max"] == -1.0
    assert labels["skip_mutation_claim"]["max"] == 0.0
    d = rep.to_dict()
    assert d["auc"] == pytest.approx(rep.auc) and d["n_correct"] == rep.n_correct
    json.dumps(d)


def test_naive_verifier_loses_the_separation(tok, shipped_validation):
    naive = validate_env("orders", tok, n_tasks=12, make_env=NaiveOrdersEnv)
    assert naive.auc < 0.95 < shipped_validation.auc
    assert naive.by_label()["skip_mutation_claim"]["max"] > 1.0  # a bare claim earns a success


# ----------------------------------------------------------------------- CLI ----
def _app() -> typer.Typer:
    return cli_with(register)


def test_cli_passes_on_the_shipped_reward(tmp_path):
    out = tmp_path / "report.json"
    res = CliRunner().invoke(
        _app(),
        [
            "reward-audit",
            "orders",
            "--tasks",
            "1",
            "--validate-tasks",
            "12",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--json",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    assert "fake_success" in res.output and "AUC" in res.output and "passed" in res.output
    report = json.loads(out.read_text())
    assert report["passed"] and report["audit"]["passed"] and report["validation"]["auc"] >= 0.95
    assert all(a["n_tasks"] == 1 for a in report["audit"]["attacks"])
    assert any(p.name.startswith("tokenizer-orders-") for p in (tmp_path / "cache").iterdir())


def test_cli_fails_with_a_naive_verifier(tmp_path, monkeypatch):
    from mentorrl import envs

    naive = EnvEntry(NaiveOrdersEnv, OrdersTasks, OrdersExpert)
    envs.register_env("orders-naive", lambda: naive)
    monkeypatch.setitem(attacks_mod.ATTACKS.registered, "orders-naive", orders_attacks)
    monkeypatch.setitem(validation_mod.CORRUPTIONS.registered, "orders-naive", orders_corruptions)
    try:
        res = reward_audit_naive(tmp_path)
    finally:
        envs.ENVIRONMENTS.unregister("orders-naive")
    assert res.exit_code == 1, res.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert not report["passed"] and report["validation"] is None
    assert not next(a for a in report["audit"]["attacks"] if a["name"] == "fake_success")["passed"]


def reward_audit_naive(tmp_path):
    return CliRunner().invoke(
        _app(),
        [
            "reward-audit",
            "orders-naive",
            "--tasks",
            "1",
            "--no-validate",
            "--cache-dir",
            str(tmp_path),
            "--json",
            str(tmp_path / "r.json"),
        ],
    )


@pytest.mark.parametrize(
    "args",
    [
        ["nope"],
        ["orders", "--tasks", "0"],
        ["orders", "--split", "dev"],
        ["orders", "--tokenizer", "/nonexistent/tokenizer"],
    ],
)
def test_cli_bad_input_exits_2(tmp_path, args):
    res = CliRunner().invoke(_app(), ["reward-audit", *args, "--no-validate", "--cache-dir", str(tmp_path)])
    assert res.exit_code == 2, res.output


def test_cli_accepts_a_tokenizer_dir(tmp_path, tok, monkeypatch):
    tok.save_pretrained(tmp_path / "tok")
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(
        _app(), ["reward-audit", "orders", "--tasks", "1", "--no-validate", "--tokenizer", str(tmp_path / "tok")]
    )
    assert res.exit_code == 0, res.output
    assert not (tmp_path / "runs").exists()  # no tiny tokenizer was built into the default cache
