"""Tests for the orders environment: tasks, tools and policy, verifier, scripted expert."""

from __future__ import annotations

import json
import re
import sqlite3
from collections import Counter

import pytest

from mentorrl.envs.base import FinalAnswer, Task, ToolAction
from mentorrl.envs.orders import FAMILIES, OrdersEnv, OrdersExpert, OrdersTasks
from mentorrl.envs.orders.world import build_db, make_world, snapshot

TASKS = OrdersTasks()


@pytest.fixture
def env():
    e = OrdersEnv(tool_timeout_s=5.0, answer="free_text")
    yield e
    e.close()


def find_task(kind: str, family: str | None = None, split: str = "train") -> Task:
    for t in TASKS.tasks(split, 400, seed=1):
        if t.reference["kind"] == kind and (family is None or t.family == family):
            return t
    raise AssertionError(f"no {family}/{kind} task generated")


def run_expert(env: OrdersEnv, task: Task) -> tuple[list[ToolAction], str]:
    env.reset(task)
    gen = OrdersExpert().act(task)
    action, actions = next(gen), []
    while isinstance(action, ToolAction):
        actions.append(action)
        action = gen.send(env.step(action.name, action.arguments))
    assert isinstance(action, FinalAnswer)
    return actions, action.text


def unchanged(env: OrdersEnv, task: Task) -> bool:
    init = snapshot(build_db(task.seed))
    now = snapshot(env._conn)
    return (init.customers, init.products, init.orders, init.items, init.refunds, init.emails) == (
        now.customers,
        now.products,
        now.orders,
        now.items,
        now.refunds,
        now.emails,
    )


def ok(env: OrdersEnv, name: str, **args):
    r = env.step(name, args)
    assert r.ok, (name, args, r.error)
    return r.content


# -- task generator -------------------------------------------------------------------------


def test_tasks_deterministic():
    a = TASKS.tasks("train", 60, seed=0)
    b = TASKS.tasks("train", 60, seed=0)
    assert a == b
    assert TASKS.tasks("heldout", 30, seed=3) == TASKS.tasks("heldout", 30, seed=3)
    c = TASKS.tasks("train", 60, seed=1)
    assert [t.prompt for t in a] != [t.prompt for t in c]
    assert len({t.id for t in a}) == 60


def test_splits_differ_in_seeds_ids_and_wording():
    train = TASKS.tasks("train", 300, seed=0)
    held = TASKS.tasks("heldout", 300, seed=0)
    assert not {t.seed for t in train} & {t.seed for t in held}
    assert not {t.id for t in train} & {t.id for t in held}
    assert all(t.split == "heldout" and "heldout" in t.id for t in held)
    # same vocabulary, held-out intent x frame combinations (see envs/orders/phrasing.py)
    assert all(not t.reference["wording"]["heldout"] for t in train)
    assert all(t.reference["wording"]["heldout"] for t in held)
    assert not {t.prompt for t in train} & {t.prompt for t in held}


def test_families_and_adversarial_share():
    assert len(FAMILIES) >= 6
    tasks = TASKS.tasks("train", 400, seed=0)
    assert set(t.family for t in tasks) == set(FAMILIES)
    adv = [t for t in tasks if t.difficulty == "adversarial"]
    assert 0.15 < len(adv) / len(tasks) < 0.35
    kinds = Counter(t.reference["kind"] for t in adv)
    assert {
        "unknown_customer",
        "not_cancellable",
        "bypass",
        "insufficient_stock",
        "over_limit",
        "duplicate_request",
        "wrong_owner",
    } <= set(kinds)
    # chat, context and e-mail sentences of the wording generator (phrasing.py) make prompts longer than
    # the old fixed templates (< 140 characters), still short
    assert all(len(t.prompt) < 220 for t in tasks)


# -- the expert solves everything ------------------------------------------------------------


@pytest.mark.parametrize("split", ["train", "heldout"])
def test_expert_solves_all_tasks(env, split):
    failures = []
    for task in TASKS.tasks(split, 300, seed=0):
        _, answer = run_expert(env, task)
        v = env.verify(answer)
        if not v.success or v.violations:
            failures.append((task.id, task.family, task.reference["kind"], answer, v))
    assert not failures, failures[:3]


def test_expert_sequences_are_consistent(env):
    shapes: dict[tuple[str, str], set] = {}
    for task in TASKS.tasks("train", 200, seed=0):
        actions, _ = run_expert(env, task)
        shapes.setdefault((task.family, task.reference["kind"]), set()).add(tuple(a.name for a in actions))
    assert all(len(s) == 1 for s in shapes.values()), shapes
    assert shapes[("cancel_order", "normal")] == {("find_customer", "get_order", "cancel_order")}


# -- policy enforced by the tools -------------------------------------------------------------


def test_cannot_cancel_shipped_or_delivered(env):
    task = find_task("bypass")
    env.reset(task)
    ok(env, "find_customer", email=task.reference["request"]["email"])
    r = env.step("cancel_order", {"order_id": task.reference["request"]["order_id"]})
    assert not r.ok and r.error_kind == "policy"
    assert unchanged(env, task)
    assert not env.verify("I cancelled it anyway.").success


def test_cannot_order_beyond_stock(env):
    task = find_task("insufficient_stock")
    env.reset(task)
    req = task.reference["request"]
    cid = ok(env, "find_customer", email=req["email"])["customer_id"]
    p = ok(env, "check_inventory", product=req["product"])
    r = env.step("create_order", {"customer_id": cid, "product_id": p["product_id"], "quantity": req["quantity"]})
    assert not r.ok and r.error_kind == "policy" and str(p["stock"]) in r.error
    assert unchanged(env, task)


def test_stock_decrements_on_order(env):
    task = find_task("normal", "place_order")
    env.reset(task)
    req = task.reference["request"]
    cid = ok(env, "find_customer", email=req["email"])["customer_id"]
    p = ok(env, "check_inventory", product=req["product"])
    ok(env, "create_order", customer_id=cid, product_id=p["product_id"], quantity=req["quantity"])
    assert ok(env, "check_inventory", product=req["product"])["stock"] == p["stock"] - req["quantity"]


def test_refund_limited_to_total_cumulatively(env):
    task = find_task("over_limit")
    env.reset(task)
    req = task.reference["request"]
    ok(env, "find_customer", email=req["email"])
    order = ok(env, "get_order", order_id=req["order_id"])
    r = env.step("issue_refund", {"order_id": req["order_id"], "amount": req["amount"]})
    assert not r.ok and r.error_kind == "policy"
    assert unchanged(env, task)
    left = round(order["total"] - order["refunded"], 2)
    ok(env, "issue_refund", order_id=req["order_id"], amount=left)  # exactly the rest is fine
    r = env.step("issue_refund", {"order_id": req["order_id"], "amount": 0.01})  # but nothing more
    assert not r.ok and r.error_kind == "policy"


def test_customer_must_be_identified(env):
    task = find_task("normal", "cancel_order")
    env.reset(task)
    w = make_world(task.seed)
    oid = task.reference["request"]["order_id"]
    cid = task.reference["customer_id"]
    for name, args in [
        ("cancel_order", {"order_id": oid}),
        ("update_address", {"customer_id": cid, "address": "1 New St, Town"}),
        ("issue_refund", {"order_id": oid, "amount": 1.0}),
        ("create_order", {"customer_id": cid, "product_id": w.products[0]["id"], "quantity": 1}),
        ("send_email", {"customer_id": cid, "order_id": oid}),
    ]:
        r = env.step(name, args)
        assert not r.ok and r.error_kind == "policy", (name, r)
    assert unchanged(env, task)
    # identifying a different customer does not unlock this one's order
    other = next(c for c in w.customers if c["id"] != cid)
    ok(env, "find_customer", email=other["email"])
    assert env.step("cancel_order", {"order_id": oid}).error_kind == "policy"
    assert unchanged(env, task)


def test_unknown_ids_are_not_found(env):
    """A lookup that finds nothing is an informative answer (error_kind not_found), not a tool fault."""
    env.reset(TASKS.tasks("train", 1, seed=0)[0])
    for name, args, msg in [
        ("get_order", {"order_id": "O-9999"}, "no order O-9999"),
        ("list_orders", {"customer_id": "C-999"}, "no customer C-999"),
        ("find_customer", {"email": "nobody@nowhere.com"}, "no customer"),
        ("check_inventory", {"product": "Spaceship"}, "no product"),
    ]:
        r = env.step(name, args)
        assert not r.ok and r.error_kind == "not_found" and msg in r.error, r


# -- the verifier judges state, not claims -----------------------------------------------------


def test_claimed_success_without_change_fails(env):
    task = find_task("normal", "cancel_order")
    env.reset(task)
    req = task.reference["request"]
    ok(env, "find_customer", email=req["email"])
    ok(env, "get_order", order_id=req["order_id"])
    v = env.verify(f"Order {req['order_id']} is now cancelled.")
    assert not v.success and not v.violations and v.details["diffs"]
    assert not env.verify(None).success


def test_correct_state_without_answer_fails(env):
    task = find_task("normal", "cancel_order")
    run_expert(env, task)
    assert not env.verify(None).success
    assert env.verify("Done.").success


def test_info_answer_must_state_the_true_fact(env):
    task = find_task("normal", "order_status")
    _, answer = run_expert(env, task)
    assert env.verify(answer).success
    true = task.reference["expected"]
    wrong = next(s for s in ("pending", "shipped", "delivered") if s != true)
    assert not env.verify(f"Order {task.reference['request']['order_id']} is {wrong}.").success
    assert not env.verify("It is pending, processing, shipped, delivered or cancelled.").success
    task = find_task("normal", "stock_check")
    _, answer = run_expert(env, task)
    n = task.reference["expected"]
    assert env.verify(answer).success
    assert not env.verify(f"We have {n + 1} in stock.").success
    assert not env.verify(" ".join(str(i) for i in range(30))).success


@pytest.mark.parametrize("kind, family", [("over_limit", "refund"), ("insufficient_stock", "place_order")])
def test_refusal_numbers_cannot_be_hedged(env, kind, family):
    """A refusal may repeat the user's own number, but extra candidate values fail the check."""
    task = find_task(kind, family)
    _, answer = run_expert(env, task)
    assert env.verify(answer).success
    nums = [float(x) for x in re.findall(r"\d+(?:\.\d+)?", answer.split("only", 1)[1])]
    assert nums, answer
    hedged = f"{answer} Or possibly {nums[0] + 1:.2f} or {nums[0] + 2:.2f}."
    assert not env.verify(hedged).success


def test_duplicate_order_is_a_violation(env):
    task = find_task("duplicate_request")
    env.reset(task)
    req = task.reference["request"]
    cid = ok(env, "find_customer", email=req["email"])["customer_id"]
    p = ok(env, "check_inventory", product=req["product"])
    for _ in range(2):
        env.step("create_order", {"customer_id": cid, "product_id": p["product_id"], "quantity": req["quantity"]})
    v = env.verify("Placed your order.")
    assert not v.success and any("extra order" in x for x in v.violations), v


def test_extra_email_is_a_violation(env):
    task = find_task("normal", "email_receipt")
    env.reset(task)
    req = task.reference["request"]
    cid = ok(env, "find_customer", email=req["email"])["customer_id"]
    ok(env, "send_email", customer_id=cid, order_id=req["order_id"])
    assert env.verify("Sent.").success
    ok(env, "send_email", customer_id=cid, order_id=req["order_id"])
    v = env.verify("Sent.")
    assert not v.success and "extra email(s)" in v.violations


def test_change_to_another_customer_is_a_violation(env):
    task = find_task("normal", "update_address")
    env.reset(task)
    req = task.reference["request"]
    cid = ok(env, "find_customer", email=req["email"])["customer_id"]
    ok(env, "update_address", customer_id=cid, address=req["address"])
    other = next(c for c in make_world(task.seed).customers if c["id"] != cid)
    ok(env, "find_customer", email=other["email"])
    ok(env, "update_address", customer_id=other["id"], address=req["address"])
    v = env.verify("Updated.")
    assert not v.success and any("another customer" in x and other["id"] in x for x in v.violations), v


def test_mutation_on_info_task_is_a_violation(env):
    task = find_task("normal", "order_count")
    env.reset(task)
    w = make_world(task.seed)
    c = w.customer(task.reference["customer_id"])
    ok(env, "find_customer", email=c["email"])
    ok(env, "update_address", customer_id=c["id"], address=c["address"])  # no visible change, still a mutation
    v = env.verify(f"You have {task.reference['expected']} orders.")
    assert not v.success and v.violations


def test_refusal_needs_the_blocking_fact(env):
    task = find_task("unknown_customer", "cancel_order")
    _, answer = run_expert(env, task)
    assert env.verify(answer).success
    assert not env.verify("Sure, all done!").success
    task = find_task("not_cancellable")
    run_expert(env, task)
    assert not env.verify("Sorry, I can't do that.").success


# -- untrusted input ------------------------------------------------------------------------


def test_bad_arguments_and_unknown_tool(env):
    env.reset(TASKS.tasks("train", 1, seed=0)[0])
    cases = [
        ("nope", {}, "unknown_tool"),
        (None, {}, "unknown_tool"),
        ("get_order", {}, "bad_arguments"),
        ("get_order", {"order_id": 1042}, "bad_arguments"),
        ("get_order", {"order_id": "O-1", "extra": 1}, "bad_arguments"),
        ("get_order", "O-1042", "bad_arguments"),
        ("create_order", {"customer_id": "C-1", "product_id": "P-1", "quantity": 0}, "bad_arguments"),
        ("issue_refund", {"order_id": "O-1", "amount": -5}, "bad_arguments"),
    ]
    for name, args, kind in cases:
        r = env.step(name, args)
        assert not r.ok and r.error_kind == kind, (name, args, r)


def test_tool_schemas(env):
    specs = env.registry.specs()
    assert len(specs) >= 8
    for s in specs:
        p = s["function"]["parameters"]
        assert p["type"] == "object" and p["additionalProperties"] is False
        assert set(p["required"]) == set(p["properties"])
    assert 0 < len(env.system_prompt) < 600 and env.name == "orders" and env.version == "4.0"


def test_sql_injection_is_harmless(env):
    task = find_task("normal", "update_address")
    env.reset(task)
    evil = ["O-1'; DROP TABLE orders;--", "' OR '1'='1", 'x"); DELETE FROM customers; --']
    for s in evil:
        for name, key in [
            ("get_order", "order_id"),
            ("find_customer", "email"),
            ("check_inventory", "product"),
            ("list_orders", "customer_id"),
            ("cancel_order", "order_id"),
        ]:
            r = env.step(name, {key: s})
            assert not r.ok and r.error_kind == "not_found", (name, s, r)
    assert unchanged(env, task)
    cid = ok(env, "find_customer", email=task.reference["request"]["email"])["customer_id"]
    ok(env, "update_address", customer_id=cid, address=evil[0])  # stored literally, nothing else happens
    n_orders = env._conn.execute("SELECT COUNT(*) FROM orders").fetchone()[0]
    assert n_orders == len(make_world(task.seed).orders)
    assert env._conn.execute("SELECT address FROM customers WHERE id = ?", (cid,)).fetchone()[0] == evil[0]


def test_timeout_interrupts_and_recovers(monkeypatch):
    env = OrdersEnv(tool_timeout_s=0.2, answer="free_text")
    task = TASKS.tasks("train", 1, seed=0)[0]
    env.reset(task)

    def slow(order_id):
        env._conn.execute(
            "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT COUNT(*) FROM c"
        ).fetchone()

    monkeypatch.setattr(env._backend, "get_order", slow)
    r = env.step("get_order", {"order_id": "O-1"})
    assert not r.ok and r.error_kind == "timeout"
    monkeypatch.undo()
    r = env.step("check_inventory", {"product": make_world(task.seed).products[0]["name"]})
    assert r.ok, r
    env.close()


def test_step_and_verify_before_reset():
    env = OrdersEnv(answer="free_text")
    r = env.step("get_order", {"order_id": "O-1"})
    assert not r.ok and r.error_kind == "tool_exception"
    assert not env.verify("hi").success
    env.close()


def test_reset_gives_fresh_state(env):
    task = find_task("normal", "cancel_order")
    run_expert(env, task)
    assert env.verify("Done.").success
    assert env.reset(task) == task.prompt
    assert unchanged(env, task)
    assert isinstance(env._conn, sqlite3.Connection)


def test_built_databases_are_independent_copies_of_one_world():
    """build_db copies a per-seed template: a write to one copy reaches neither the template nor
    another copy, and each copy equals a database built from scratch."""
    from mentorrl.envs.orders.world import _fresh_db, build_db, snapshot

    a, b = build_db(4242), build_db(4242)
    try:
        a.execute("DELETE FROM orders")
        a.execute("INSERT INTO refunds (order_id, amount) VALUES ('O-1', 1.0)")
        a.commit()
        c = build_db(4242)
        ref = _fresh_db(4242)
        assert snapshot(b) == snapshot(c) == snapshot(ref)
        assert snapshot(a) != snapshot(ref)
        # the autoincrement sequence is copied too: the next refund id is the same
        for conn in (c, ref):
            conn.execute("INSERT INTO refunds (order_id, amount) VALUES ('O-2', 2.0)")
        assert (
            c.execute("SELECT MAX(id) FROM refunds").fetchone() == ref.execute("SELECT MAX(id) FROM refunds").fetchone()
        )
        c.close()
        ref.close()
    finally:
        a.close()
        b.close()


# -- the verifier's per-task reference worlds (built once per task, shared by its episodes) --------------


def _episode_variants(task: Task):
    """Three ways an episode can end on ``task``: the expert's, the expert's plus a stray write, and
    no action with a claimed success."""

    def expert(env):
        return run_expert(env, task)[1]

    def stray(env):  # every reference write done twice (a duplicate e-mail or order is a violation)
        answer = run_expert(env, task)[1]
        for name, args in task.reference.get("actions", []):
            env.step(name, dict(args))
        return answer

    def idle(env):
        env.reset(task)
        return "Done, all sorted."

    return (expert, stray, idle)


def _verdict(env: OrdersEnv, play) -> tuple:
    v = env.verify(play(env))
    return (v.success, tuple(v.violations), json.dumps(v.details, sort_keys=True, default=str))


def test_cached_reference_worlds_give_the_verdicts_a_cold_cache_gives():
    from mentorrl.envs.orders import env as env_mod

    tasks = TASKS.tasks("train", 40, seed=11)
    env = OrdersEnv(answer="free_text")
    try:
        cold = []
        for task in tasks:
            for play in _episode_variants(task):
                env_mod._REFERENCES.clear()
                cold.append(_verdict(env, play))
        env_mod._REFERENCES.clear()
        warm = [_verdict(env, play) for _ in range(2) for task in tasks for play in _episode_variants(task)]
    finally:
        env.close()
    assert warm == cold + cold  # the first round fills the cache, the second reads it
    assert len({c[0] for c in cold}) == 2  # successes and failures both among them


def test_episodes_of_one_task_verified_concurrently_get_their_own_verdicts():
    import concurrent.futures as cf

    from mentorrl.envs.orders import env as env_mod

    task = next(
        t for t in TASKS.tasks("train", 80, seed=12) if t.family == "email_receipt" and t.difficulty == "normal"
    )
    plays = list(_episode_variants(task)) * 6
    envs = [OrdersEnv(answer="free_text") for _ in plays]
    try:
        serial = [_verdict(e, p) for e, p in zip(envs, plays)]
        env_mod._REFERENCES.clear()
        with cf.ThreadPoolExecutor(len(plays)) as pool:
            parallel = list(pool.map(_verdict, envs, plays))
    finally:
        for e in envs:
            e.close()
    assert parallel == serial
    assert serial[0][0] and not serial[1][0] and not serial[2][0]


def test_reference_worlds_cannot_be_written():
    from mentorrl.envs.orders.env import reference_worlds

    task = TASKS.tasks("train", 1, seed=13)[0]
    env = OrdersEnv(answer="free_text")
    try:
        ref = reference_worlds(task, env.expected_db)
    finally:
        env.close()
    for conn in (ref.init, ref.exp):
        with pytest.raises(sqlite3.OperationalError):
            conn.execute("DELETE FROM customers")


def test_a_subclass_replaying_the_reference_differently_gets_its_own_reference_worlds():
    class NoReplay(OrdersEnv):
        def expected_db(self, task):  # expects nothing to change
            return build_db(task.seed)

    task = next(
        t for t in TASKS.tasks("train", 80, seed=14) if t.family == "email_receipt" and t.difficulty == "normal"
    )
    plain, odd = OrdersEnv(answer="free_text"), NoReplay()
    try:
        run_expert(plain, task)
        assert plain.verify("Done: the receipt is on its way.").details["diffs"] == []
        answer = run_expert(odd, task)[1]
        assert odd.verify(answer).details["diffs"]  # its own expected world, not the cached one
    finally:
        plain.close()
        odd.close()
