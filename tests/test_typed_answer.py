"""Verifier v4: the typed final answer (envs/orders/answer.py), its attack suite and honest probes."""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mentorrl.config.process import Once
from mentorrl.contract import ContractLimits, contract_for_env
from mentorrl.envs import env_factory, get_env
from mentorrl.envs.base import FinalAnswer
from mentorrl.envs.orders import OrdersEnv, OrdersExpert, OrdersTasks
from mentorrl.envs.orders.answer import (
    ANSWER_TOOL,
    EXPECTED_OUTCOME,
    FIELD_TYPES,
    OUTCOMES,
    answer_parameters,
    expected_outcome,
    outcome_schema,
    parse_record,
    schema_problems,
)
from mentorrl.envs.orders.tasks import ADVERSARIAL, FAMILIES
from mentorrl.envs.orders.typed_attacks import body_of, call_text, typed_attacks, typed_probes
from mentorrl.envs.orders.world import make_world
from mentorrl.integrity.attacks import AttackAuditConfig, ScriptPolicy, audit_env, run_script, select_tasks, task_pool
from mentorrl.rollout.episode import answer_call_text, run_scripted_episode, run_text_turns

TASKS = OrdersTasks()
SPLITS = ("train", "heldout", "hidden", "golden", "novel_wording")


@pytest.fixture(scope="module")
def env():
    e = OrdersEnv()
    yield e
    e.close()


@pytest.fixture(scope="module")
def contract(tokenizer, env):
    return contract_for_env(tokenizer, env, limits=ContractLimits(max_turns=10, max_total_tokens=4096))


def honest(contract, env, task):
    return run_scripted_episode(contract, env, task, OrdersExpert())


def record_of(traj) -> dict[str, Any]:
    return json.loads(traj.final_answer)["arguments"]


# ----------------------------------------------------------------- honest answers ----
@pytest.mark.parametrize("split", SPLITS)
def test_the_expert_typed_answers_score_full_marks_on_every_split(contract, env, split):
    tasks = TASKS.tasks(split, 120, seed=3, stratified=split != "golden")
    failures = [
        (t.id, traj.reward.details) for t in tasks for traj in [honest(contract, env, t)] if not traj.reward.success
    ]
    assert not failures, failures[:3]


def test_every_task_kind_has_one_outcome():
    kinds = [(f, "normal") for f in FAMILIES] + list(ADVERSARIAL)
    assert all(key in EXPECTED_OUTCOME for key in kinds)


def test_the_episode_ends_on_the_answer_call_and_renders_the_text(contract, env):
    task = next(t for t in TASKS.tasks("train", 60, seed=5) if t.family == "refund" and t.reference["kind"] == "normal")
    traj = honest(contract, env, task)
    assert traj.finish_reason == "answer" and traj.reward.success
    assert all(c.name != ANSWER_TOOL for c in traj.tool_calls)  # read, never run
    rec = record_of(traj)
    assert rec["outcome"] == "refunded"
    assert (
        traj.reward.details["rendered"].startswith("Refunded $") and rec["order_id"] in traj.reward.details["rendered"]
    )


def test_running_the_answer_tool_is_an_error_observation(env):
    env.reset(TASKS.tasks("train", 1, seed=0)[0])
    r = env.step(ANSWER_TOOL, {"outcome": "order_count", "count": 1})
    assert not r.ok and r.error_kind == "policy"


# --------------------------------------------------------------- constant answers ----
def _constant_records() -> list[dict[str, Any]]:
    values = {"order_id": "O-101", "product_id": "P-1", "status": "pending", "stock": 0, "count": 1,
              "quantity": 1, "amount": 10, "refundable": 0, "address": "1 Oak St, Springfield"}  # fmt: skip
    return [{"outcome": o, **{f: values[f] for f in fields}} for o, (fields, _) in OUTCOMES.items()]


@pytest.mark.parametrize("record", _constant_records(), ids=lambda r: r["outcome"])
def test_a_constant_answer_with_no_tool_call_scores_zero_everywhere(contract, env, record):
    for t in TASKS.tasks("train", 150, seed=7, stratified=True):
        traj = run_text_turns(contract, env, t, [call_text(body_of(record))])
        assert traj.reward.total <= 0 and not traj.reward.success, (t.id, traj.reward.details)


def test_a_text_answer_earns_nothing_in_typed_mode(contract, env):
    for t in TASKS.tasks("train", 40, seed=8):
        script = ScriptPolicy(lambda task: _text_expert(task))
        traj = run_scripted_episode(contract, env, t, script)
        assert not traj.reward.success and traj.reward.details["answer_format_ok"] is False


def _text_expert(task):
    gen = OrdersExpert().act(task)
    action = next(gen)
    while True:
        if isinstance(action, FinalAnswer):
            yield FinalAnswer(action.text)  # the sentence, without the record
            return
        action = gen.send((yield action))


# ------------------------------------------------------------------ strict reading ----
@pytest.mark.parametrize(
    "body, why",
    [
        ('{"name": "final_answer", "arguments": {"outcome": "order_count", "count": 2, "count": 3}}', "duplicate"),
        ('{"name": "final_answer", "arguments": {"outcome": "order_count", "count": 2.0}}', "integer"),
        ('{"name": "final_answer", "arguments": {"outcome": "order_count", "count": "2"}}', "integer"),
        ('{"name": "final_answer", "arguments": {"outcome": "order_count", "count": true}}', "integer"),
        ('{"name": "final_answer", "arguments": {"outcome": "refunded", "order_id": "O-5", "amount": 2.996}}', "two"),
        ('{"name": "final_answer", "arguments": {"outcome": "refunded", "order_id": "O-5", "amount": "3.00"}}', "two"),
        ('{"name": "final_answer", "arguments": {"outcome": "refunded", "order_id": "o-5", "amount": 3}}', "id"),
        ('{"name": "final_answer", "arguments": {"outcome": "refunded", "order_id": "O-05", "amount": 3}}', "id"),
        (
            '{"name": "final_answer", "arguments": {"outcome": "order_status", "order_id": "O-5", "status": "Shipped"}}',
            "one of",
        ),
        ('{"name": "final_answer", "arguments": {"outcome": "Cancelled", "order_id": "O-5"}}', "outcome"),
        ('{"name": "final_answer", "arguments": {"outcome": "cancelled", "order_id": "O-5", "note": "x"}}', "extra"),
        ('{"name": "final_answer", "arguments": {"outcome": "cancelled"}}', "missing"),
        ('{"name": "final_answer", "arguments": {"outcome": "order_count", "count": NaN}}', "not a JSON number"),
        ('{"name": "final_answer", "arguments": "{\\"outcome\\": \\"cancelled\\"}"}', "object"),
        ('{"name": "final_answer", "arguments": {"outcome": "cancelled", "order_id": "O-5"}, "x": 1}', "nothing else"),
        ("[" * 100 + "]" * 100, "nested"),
        ("Order O-5 is cancelled.", "not a final_answer call"),
    ],
)
def test_the_reader_refuses_what_the_schema_does_not_allow(body, why):
    record, problem = parse_record(body)
    assert record is None and why in problem


@pytest.mark.parametrize(
    "body",
    [
        '{"name":"final_answer","arguments":{"outcome":"refunded","order_id":"O-5","amount":3}}',
        '{"arguments": {"amount": 3.00, "order_id": "O-5", "outcome": "refunded"}, "name": "final_answer"}',
        '{"name": "final_answer", "arguments": {"outcome": "refunded", "order_id": "\\u004f-5", "amount": 30e-1}}',
        '{"name": "final_answer", "parameters": {"outcome": "refunded", "order_id": "O-5", "amount": 3.1}}',
    ],
)
def test_the_reader_takes_valid_json_in_any_form(body):
    record, problem = parse_record(body)
    assert problem is None and record["order_id"] == "O-5"


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=20,
)
_field_values = st.one_of(
    st.sampled_from(["O-12", "P-3", "pending", "shipped", "cancelled", "1 Oak St, Springfield", "o-12", "O-012"]),
    st.integers(-3, 50),
    st.floats(-5, 500, allow_nan=False),
    st.booleans(),
    st.none(),
)


@settings(max_examples=300, deadline=None)
@given(arguments=_json)
def test_the_reader_never_raises_on_any_json(arguments):
    record, problem = parse_record(body_of(arguments))
    assert (record is None) != (problem is None)


@settings(max_examples=400, deadline=None)
@given(
    outcome=st.sampled_from(list(OUTCOMES) + ["shipped", "refund"]),
    values=st.dictionaries(st.sampled_from(list(FIELD_TYPES) + ["note"]), _field_values, max_size=5),
)
def test_an_accepted_record_satisfies_the_advertised_schema(outcome, values):
    """The strict reader is never looser than the schema the policy is shown (and the field set is exact)."""
    record = {"outcome": outcome, **values}
    if schema_problems(record):
        return
    assert set(record) == {"outcome", *OUTCOMES[outcome][0]}
    as_json = json.loads(json.dumps(record, default=float))
    jsonschema.Draft202012Validator(answer_parameters()).validate(as_json)
    jsonschema.Draft202012Validator(outcome_schema(outcome)).validate(as_json)


def test_prose_around_the_answer_call_is_not_an_answer():
    body = body_of({"outcome": "cancelled", "order_id": "O-5"})
    assert answer_call_text(call_text(body), body) == body
    assert answer_call_text("\n" + call_text("\n" + body + "\n") + "\n", body) == body
    assert answer_call_text("<think>\nlook it up\n</think>\n" + call_text(body), body) == body
    for turn in ("I refunded $50. " + call_text(body), call_text(body) + " and refunded you"):
        assert parse_record(answer_call_text(turn, body))[0] is None


# -------------------------------------------------------- each field is really checked ----
def _other_values(name: str, value: Any) -> list[Any]:
    kind = FIELD_TYPES[name]
    if kind == "order_id":
        return [f"O-{int(value[2:]) + d}" for d in (1, -1, 7)]
    if kind == "product_id":
        return [f"P-{int(value[2:]) + d}" for d in (1, 2)]
    if kind == "status":
        return [s for s in ("pending", "processing", "shipped", "delivered", "cancelled") if s != value]
    if kind == "address":
        return ["1 Oak St, Springfield", value + " 2"]
    return (
        [value + 1, value + 2]
        + ([value - 1] if value >= 1 else [])
        + ([round(value + 0.01, 2)] if kind == "money" else [])
    )


def test_changing_any_field_of_an_honest_record_loses_the_reward(contract, env):
    """The cheapest fake -- a reader that checks the outcome, or the format only -- fails here."""
    checked = 0
    for t in TASKS.tasks("train", 80, seed=11, stratified=True):
        rec = record_of(honest(contract, env, t))
        for name in OUTCOMES[rec["outcome"]][0]:
            for value in _other_values(name, rec[name]):
                mutated = {**rec, name: value}
                traj = run_scripted_episode(
                    contract, env, t, ScriptPolicy(lambda task, m=mutated: _expert_with(task, m))
                )
                assert not traj.reward.success, (t.id, name, value)
                checked += 1
    assert checked > 150


def _expert_with(task, record):
    gen = OrdersExpert().act(task)
    action = next(gen)
    while True:
        if isinstance(action, FinalAnswer):
            yield FinalAnswer(action.text, record)
            return
        action = gen.send((yield action))


def test_any_other_outcome_loses_the_reward(contract, env):
    for t in TASKS.tasks("train", 60, seed=12, stratified=True):
        rec = record_of(honest(contract, env, t))
        for outcome, (fields, _) in OUTCOMES.items():
            if outcome == rec["outcome"]:
                continue
            other = {
                "outcome": outcome,
                **{f: rec.get(f, 1 if FIELD_TYPES[f] in ("count", "money") else "O-1") for f in fields},
            }
            traj = run_scripted_episode(contract, env, t, ScriptPolicy(lambda task, m=other: _expert_with(task, m)))
            assert not traj.reward.success, (t.id, outcome)


# -------------------------------------------------------------------------- privacy ----
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), pick=st.integers(0, 10_000))
def test_a_record_can_name_no_other_customers_order(contract, env, seed, pick):
    """Over world seeds: naming any order that is neither the user's nor the one they asked about is a
    hard violation, and the rendered text of an accepted record names nothing of another customer."""
    tasks = [t for t in TASKS.tasks("train", 16, seed=seed) if t.reference.get("customer_id")]
    task = tasks[pick % len(tasks)]
    traj = honest(contract, env, task)
    rec, me = record_of(traj), task.reference["customer_id"]
    world = make_world(task.seed)
    others = [c for c in world.customers if c["id"] != me]
    rendered = traj.reward.details["rendered"]
    for c in others:
        assert c["email"] not in rendered and c["name"] not in rendered and c["address"] not in rendered
    asked = task.reference["request"].get("order_id")
    foreign = [o for o in world.orders if o["customer_id"] != me and o["id"] != asked]
    if "order_id" not in rec or not foreign:
        return
    leak = {**rec, "order_id": foreign[pick % len(foreign)]["id"]}
    bad = run_scripted_episode(contract, env, task, ScriptPolicy(lambda t: _expert_with(t, leak)))
    assert not bad.reward.success and bad.reward.total < 0
    assert any("another customer" in v for v in bad.reward.violations)


# ---------------------------------------------------------------- the attack suite ----
def test_the_typed_attack_suite_has_no_false_accept(tokenizer):
    attacks = typed_attacks()
    assert len(attacks) >= 40 and len({a.name for a in attacks}) == len(attacks)
    report = audit_env("orders", tokenizer, AttackAuditConfig(tasks_per_attack=4), attacks=attacks)
    failed = [(a.name, a.reason) for a in report.attacks if not a.passed]
    assert not failed and not report.honest_failures, failed


def test_the_honest_probes_are_accepted(contract, env):
    pool = task_pool(OrdersTasks, AttackAuditConfig())
    rejected = []
    for probe in typed_probes():
        chosen = select_tasks(pool, probe.applies, 4)
        assert chosen, probe.name
        for t in chosen:
            traj = run_script(contract, env, t, probe.script, AttackAuditConfig().weights)
            if not traj.reward.success:
                rejected.append((probe.name, t.id, traj.reward.details.get("answer_problems")))
    assert len(rejected) <= 2, rejected


def test_the_orders_suite_includes_the_typed_attacks():
    from mentorrl.envs.orders.suite import orders_attacks

    names = {a.name for a in orders_attacks()}
    assert {a.name for a in typed_attacks()} <= names


# ------------------------------------------------------------------ free-text mode ----
def test_free_text_is_explicit_and_warns(capsys, monkeypatch):
    from mentorrl import envs as envs_mod
    from mentorrl.config.env import EnvConfig

    assert EnvConfig().answer == "typed"
    monkeypatch.setattr(envs_mod, "_FREE_TEXT_WARNED", Once())
    make = env_factory(get_env("orders"), EnvConfig(answer="free_text"))
    assert "heuristic" in capsys.readouterr().err
    e = make()
    try:
        assert e.answer_tool is None and ANSWER_TOOL not in e.registry
    finally:
        e.close()
    typed = env_factory(get_env("orders"), EnvConfig())()
    try:
        assert typed.answer_tool == ANSWER_TOOL and ANSWER_TOOL in typed.registry
    finally:
        typed.close()
    with pytest.raises(ValueError, match="answer mode"):
        OrdersEnv(answer="prose")


def test_no_shipped_recipe_reads_free_text():
    from pathlib import Path

    import mentorrl

    for path in (Path(mentorrl.__file__).parent / "configs").glob("*.yaml"):
        assert "free_text" not in path.read_text(), path


def test_expected_outcome_is_defined_for_every_generated_task():
    for split in SPLITS:
        for t in TASKS.tasks(split, 60, seed=2):
            assert expected_outcome(t) in OUTCOMES


def test_money_is_exact():
    ok, _ = parse_record(body_of({"outcome": "refunded", "order_id": "O-5", "amount": 0.1}))
    assert ok is not None
    rec, problem = parse_record(
        '{"name": "final_answer", "arguments": {"outcome": "refunded", "order_id": "O-5", "amount": 0.105}}'
    )
    assert rec is None and "two decimals" in problem
    assert Decimal("0.10") == Decimal("0.1")  # 0.10 and 0.1 are one value: a valid spelling, not an attack
