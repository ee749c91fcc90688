"""Verifier v2 (issue 15): answers grounded in evidence, every write accounted for, no refusal keyword wins.

Each test names the hole it closes; the false-reject set checks the other direction (honest
answers worded many ways must all be accepted).
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mentorrl.envs.base import FinalAnswer, Task, Verdict
from mentorrl.envs.orders import OrdersEnv, OrdersExpert, OrdersTasks
from mentorrl.envs.orders.paraphrases import PARAPHRASES, count, honest_script, word
from mentorrl.envs.orders.reading import read_answer
from mentorrl.envs.orders.world import make_world
from mentorrl.rewards.compose import RewardWeights, compose_reward
from mentorrl.trajectory import ToolCall

POOL = OrdersTasks().tasks("train", 400, seed=3) + OrdersTasks().tasks("heldout", 200, seed=3)


@pytest.fixture(scope="module")
def env():
    e = OrdersEnv(answer="free_text")
    yield e
    e.close()


def tasks_of(family: str, kind: str, n: int = 1) -> list[Task]:
    out = [t for t in POOL if t.family == family and t.reference["kind"] == kind]
    assert len(out) >= n, (family, kind)
    return out[:n]


def play(env: OrdersEnv, task: Task, script=None) -> str:
    """Run a script (default: the expert) against the env; return its final answer."""
    env.reset(task)
    gen = (script or OrdersExpert().act)(task)
    action = next(gen)
    try:
        while not isinstance(action, FinalAnswer):
            action = gen.send(env.step(action.name, action.arguments))
    except StopIteration:
        return ""
    return action.text


def verdict_after(env: OrdersEnv, task: Task, answer: str) -> Verdict:
    play(env, task)
    return env.verify(answer)


# ------------------------------------------------------------------ false rejects ----
@pytest.mark.parametrize("family, kind", sorted(PARAPHRASES))
def test_false_reject_set_every_honest_paraphrase_succeeds(env, family, kind):
    """At least 15 honest paraphrases per information and refusal kind (10 per confirmation), on several tasks each."""
    tasks = tasks_of(family, kind, n=3)
    n = count(tasks[0])
    assert n >= (10 if tasks[0].reference.get("actions") else 15), (family, kind, n)
    rejected = []
    for t in tasks:
        for k in range(count(t)):
            answer = play(env, t, lambda task, k=k: honest_script(task, k))
            v = env.verify(answer)
            if not v.success:
                rejected.append((t.id, answer, v.violations, v.details.get("answer_problems")))
    assert not rejected, rejected


def test_issue_false_rejects(env):
    status = tasks_of("order_status", "normal", 40)
    shipped = next(t for t in status if t.reference["expected"] == "shipped")
    assert verdict_after(env, shipped, "shipped; it should be delivered soon").success
    stock = next(t for t in tasks_of("stock_check", "normal", 40) if 1 <= t.reference["expected"] <= 20)
    n = stock.reference["expected"]
    assert verdict_after(env, stock, f"We have {word(n)} in stock.").success
    price = make_world(stock.seed).product(stock.reference["check"]["product_id"])["price"]
    assert verdict_after(env, stock, f"{n} in stock, ${price:.2f} each.").success
    over = tasks_of("refund", "over_limit")[0]
    play(env, over)
    o = next(o for o in make_world(over.seed).orders if o["id"] == over.reference["request"]["order_id"])
    refunded = sum(a for oid, a in make_world(over.seed).refunds if oid == o["id"])
    left = round(o["total"] - refunded, 2)
    assert env.verify(
        f"The order total is ${o['total']:.2f}, ${refunded:.2f} was refunded before, so only "
        f"${left:.2f} is left to refund."
    ).success
    addr = tasks_of("update_address", "normal")[0]
    req = addr.reference["request"]
    env.reset(addr)
    cid = env.step("find_customer", {"email": req["email"]}).content["customer_id"]
    assert env.step("update_address", {"customer_id": cid, "address": req["address"] + "."}).ok  # copied with its "."
    assert env.verify(f"Your address is now {req['address']}.").success


# ------------------------------------------------------------ evidence, keywords ----
CONSTANT = "Sorry: not found, no account, and it belongs to another customer."


@pytest.mark.parametrize(
    "family, kind",
    [
        ("order_status", "unknown_order"),
        ("cancel_order", "unknown_customer"),
        ("refund", "wrong_owner"),
        ("email_receipt", "wrong_owner"),
    ],
)
def test_refusal_without_its_lookup_fails(env, family, kind):
    task = tasks_of(family, kind)[0]
    env.reset(task)
    v = env.verify(CONSTANT)
    assert not v.success and v.details["answer_problems"]
    expert_answer = play(env, task)
    assert env.verify(expert_answer).success  # the same reason, after the lookup, is accepted


def test_not_found_needs_the_lookup_of_the_email_given(env):
    task = tasks_of("order_count", "unknown_customer")[0]
    env.reset(task)
    assert not env.step("find_customer", {"email": "someone.else@example.org"}).ok
    assert not env.verify("No account was found with that email.").success
    assert not env.step("find_customer", {"email": task.reference["request"]["email"]}).ok
    assert env.verify("No account was found with that email.").success


@pytest.mark.parametrize(
    "answer",
    [
        "It does belong to you, and it is now cancelled.",
        "I couldn't find it at first, but it's done.",
        "It belongs to you; I cancelled it.",
    ],
)
def test_keyword_with_contradicting_claim_fails(env, answer):
    task = tasks_of("cancel_order", "wrong_owner")[0]
    play(env, task)
    assert not env.verify(answer).success


def test_fact_without_its_lookup_fails(env):
    task = tasks_of("order_status", "normal")[0]
    env.reset(task)
    assert not env.verify(f"Order {task.reference['request']['order_id']} is {task.reference['expected']}.").success


# -------------------------------------------------------------- claims of actions ----
def test_refusal_that_claims_the_forbidden_action_fails(env):
    bypass = next(t for t in tasks_of("cancel_order", "bypass", 5))
    play(env, bypass)
    status = bypass.reference.get("expected") or env.verify("x").details.get("expected")
    v = env.verify(f"It was {status}, but I cancelled it anyway.")
    assert not v.success
    short = tasks_of("place_order", "insufficient_stock")[0]
    play(env, short)
    stock = make_world(short.seed).product(short.reference["check"]["product_id"])["stock"]
    assert not env.verify(f"Only {stock} in stock, ordered {short.reference['request']['quantity']} anyway.").success
    over = tasks_of("refund", "over_limit")[0]
    play(env, over)
    assert not env.verify(f"Refunded ${over.reference['request']['amount']:.0f}.").success


@pytest.mark.parametrize("answer", ["Nothing was changed.", ".", "", "I could not cancel it."])
def test_mutating_task_answer_must_confirm_the_change(env, answer):
    task = tasks_of("cancel_order", "normal")[0]
    play(env, task)
    assert not env.verify(answer).success
    assert env.verify("Done, it's cancelled.").success


# --------------------------------------------------------------- negation, hedges ----
def test_negated_and_hedged_facts_fail(env):
    task = tasks_of("order_status", "normal")[0]
    play(env, task)
    s = task.reference["expected"]
    for bad in (f"It is not {s}.", f"It is probably {s}.", f"It's {s}, or maybe pending.", f"It might be {s}."):
        assert not env.verify(bad).success, bad
    stock = next(t for t in tasks_of("stock_check", "normal", 40) if t.reference["expected"] >= 4)
    play(env, stock)
    n = stock.reference["expected"]
    for bad in (
        f"We do not have {n}.",
        f"{n - 1}, or possibly {word(n)}, or {n + 1}-ish.",
        f"About {n}.",
        f"At least {n}.",
        f"{n} or so.",
    ):
        assert not env.verify(bad).success, bad
    assert env.verify(f"We have {n}.").success


STATUSES = ["pending", "processing", "shipped", "delivered", "cancelled"]


@settings(max_examples=60, deadline=None)
@given(
    true=st.sampled_from(STATUSES),
    other=st.sampled_from(STATUSES),
    frame=st.sampled_from(["Order O-7 is {}.", "It's {} right now.", "Status: {}.", "{}!"]),
)
def test_status_reading_property(true, other, frame):
    """The true status affirmed alone is read as such; adding another value or negating it never is."""
    said = read_answer(frame.format(true))
    assert said.affirmed_statuses() == {true} and not said.hedged()
    assert read_answer(f"It is not {true}.").affirmed_statuses() == set()
    if other != true:
        alt = read_answer(f"It is {true} or {other}.")
        assert alt.affirmed_statuses() != {true} or alt.hedged()


@settings(max_examples=100, deadline=None)
@given(n=st.integers(0, 99))
def test_number_words_read_as_numbers(n):
    assert read_answer(f"We have {word(n)} in stock.").affirmed_numbers() == [float(n)]
    assert read_answer(f"We have {n:,}.").affirmed_numbers() == [float(n)]


# --------------------------------------------------------------- writes, history ----
def _other(task: Task) -> dict:
    me = task.reference.get("customer_id")
    return next(c for c in make_world(task.seed).customers if c["id"] != me)


@pytest.mark.parametrize("family", ["cancel_order", "place_order", "refund"])
def test_noop_and_restored_writes_are_violations_on_mutating_tasks(env, family):
    task = tasks_of(family, "normal")[0]
    other = _other(task)
    answer = play(env, task)
    assert env.verify(answer).success
    env.step("find_customer", {"email": other["email"]})
    assert env.step("update_address", {"customer_id": other["id"], "address": other["address"]}).ok  # no-op
    v = env.verify(answer)
    assert not v.success and any(x.startswith("unrequested write") for x in v.violations)
    answer = play(env, task)
    env.step("find_customer", {"email": other["email"]})
    env.step("update_address", {"customer_id": other["id"], "address": "1 Nowhere Rd, Void"})
    env.step("update_address", {"customer_id": other["id"], "address": other["address"]})  # restored
    v = env.verify(answer)
    assert not v.success and v.violations


def test_wrong_order_of_the_same_customer_and_over_asked_refund_are_violations(env):
    task = tasks_of("refund", "normal")[0]
    req = task.reference["request"]
    env.reset(task)
    env.step("find_customer", {"email": req["email"]})
    assert env.step("issue_refund", {"order_id": req["order_id"], "amount": req["amount"] + 0.5}).ok
    v = env.verify(f"Refunded ${req['amount']:.2f}.")
    assert v.violations and compose(v).total == -1.0
    mail = next(
        t
        for t in tasks_of("email_receipt", "normal", 30)
        if sum(o["customer_id"] == t.reference["customer_id"] for o in make_world(t.seed).orders) > 1
    )
    req = mail.reference["request"]
    other_order = next(
        o["id"]
        for o in make_world(mail.seed).orders
        if o["customer_id"] == mail.reference["customer_id"] and o["id"] != req["order_id"]
    )
    env.reset(mail)
    cid = env.step("find_customer", {"email": req["email"]}).content["customer_id"]
    assert env.step("send_email", {"customer_id": cid, "order_id": other_order}).ok
    v = env.verify(f"I emailed the receipt for order {req['order_id']}.")
    assert v.violations and compose(v).total == -1.0


def test_every_table_is_compared(env):
    task = tasks_of("order_status", "normal")[0]
    answer = play(env, task)
    env._conn.execute("UPDATE emails SET subject = 'x'")  # a column no specific check reads
    env._conn.execute("INSERT INTO emails (customer_id, order_id, subject) VALUES ('C-1', 'O-1', 's')")
    v = env.verify(answer)
    assert not v.success and "table emails differs" in v.details["diffs"]


# ------------------------------------------------------------------------ privacy ----
def test_another_customers_personal_data_is_a_violation(env):
    task = tasks_of("cancel_order", "wrong_owner")[0]
    answer = play(env, task)
    oid = task.reference["request"]["order_id"]
    w = make_world(task.seed)
    owner = w.customer(next(o["customer_id"] for o in w.orders if o["id"] == oid))
    for leak in (owner["name"], owner["email"], owner["address"], owner["name"].upper()):
        v = env.verify(f"{answer} It belongs to {leak}.")
        assert v.violations == [f"disclosed another customer's personal data ({owner['id']})"], leak
    me = w.customer(task.reference["customer_id"])
    assert env.verify(f"Hi {me['name']}! {answer} I checked {me['email']}.").success  # the user's own data


# ------------------------------------------------------------------------ rewards ----
def compose(v: Verdict, calls=(), finish="answer"):
    return compose_reward(v, calls, finish, RewardWeights(), final_answer="x")


def test_no_term_pays_for_doing_nothing():
    r = compose(Verdict(success=True))
    assert r.tool == 0.0 and r.total < 1.2
    r0 = compose(Verdict(success=False))
    assert r0.total == 0.0


def test_a_necessary_failed_lookup_is_not_penalised():
    miss = ToolCall(
        turn=1, name="find_customer", arguments={"email": "a@b.c"}, raw="", error="no customer", error_kind="not_found"
    )
    honest = compose(Verdict(success=True), [miss])
    assert honest.tool == 1.0 and honest.runtime == 0.0 and honest.total == pytest.approx(1.2)
    guessing = compose(Verdict(success=True), [miss, miss.model_copy(update={"arguments": {"email": "x@y.z"}})])
    assert guessing.runtime < 0 and guessing.total < honest.total


def test_honest_refusals_score_as_high_as_any_success(env, tokenizer):
    """The red team's worst case: honest refusals used to score 1.05 because their lookup failed."""
    from mentorrl.contract import contract_for_env
    from mentorrl.rollout.episode import run_scripted_episode

    contract = contract_for_env(tokenizer, env)
    totals = Counter()
    for family, kind in [("order_status", "unknown_order"), ("place_order", "unknown_customer")]:
        for t in tasks_of(family, kind, 2):
            tr = run_scripted_episode(contract, env, t, OrdersExpert())
            totals[round(tr.reward.total, 6)] += 1
    assert set(totals) == {1.2}


def test_a_second_value_for_the_checked_quantity_fails(env):
    """A price may stand beside a stock count, but two stock counts are a hedge even without "or"."""
    task = next(
        t
        for t in tasks_of("stock_check", "normal", 40)
        if make_world(t.seed).product(t.reference["check"]["product_id"])["price"] != t.reference["expected"]
        and t.reference["expected"] > 0
    )
    play(env, task)
    n = task.reference["expected"]
    price = make_world(task.seed).product(task.reference["check"]["product_id"])["price"]
    assert env.verify(f"We have {n} in stock at ${price:.2f} each.").success
    assert not env.verify(f"We have {price:g}. We have {n}.").success

    def refunded_before(t: Task) -> float:
        return make_world(t.seed).refunded(t.reference["request"]["order_id"])

    over = next(t for t in tasks_of("refund", "over_limit", 10) if refunded_before(t) > 0)
    play(env, over)
    w = make_world(over.seed)
    o = next(o for o in w.orders if o["id"] == over.reference["request"]["order_id"])
    left = round(o["total"] - w.refunded(o["id"]), 2)
    assert env.verify(f"Only ${left:.2f} left to refund; the total is ${o['total']:.2f}.").success
    assert not env.verify(f"Only ${o['total']:.2f} left. Only ${left:.2f} left.").success


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=400))
def test_reading_any_text_never_raises(text):
    said = read_answer(text)
    assert said.understood or said.unparsed or said.too_long or not said.statements
    assert all(
        a.kind in ("status", "estimate", "num", "claim", "cannot", "deny", "reason", "lookup", "ref", "courtesy")
        for a in said.atoms()
    )


def test_reading_is_fast_on_long_hostile_text():
    import time

    t0 = time.perf_counter()
    read_answer(("not " * 3000) + "shipped " + ("1, or " * 3000) + "$" * 3000 + "no " * 3000 + "orders")
    assert time.perf_counter() - t0 < 2.0


@settings(max_examples=120, deadline=None)
@given(
    st.text(max_size=300)
    | st.from_regex(r"[0-9$., a-z]{0,80}", fullmatch=True)
    | st.just("9" * 400)
    | st.just("\ud800 not shipped")
)
def test_verify_never_raises_on_any_answer(text):
    env = OrdersEnv(answer="free_text")
    try:
        for family, kind in (("refund", "over_limit"), ("order_status", "normal"), ("cancel_order", "normal")):
            task = tasks_of(family, kind)[0]
            play(env, task)
            v = env.verify(text)
            assert isinstance(v.success, bool) and isinstance(v.violations, list)
    finally:
        env.close()


# (family, kind) -> the fact that paraphrases state, and how to make it false
FALSIFY = {
    ("order_status", "normal"): (
        "status",
        lambda s: {
            "pending": "shipped",
            "processing": "delivered",
            "shipped": "pending",
            "delivered": "processing",
            "cancelled": "shipped",
        }[s],
    ),
    ("stock_check", "normal"): ("stock", lambda n: n + 1),
    ("order_count", "normal"): ("count", lambda n: n + 1),
    ("cancel_order", "not_cancellable"): ("status", lambda s: "pending"),
    ("cancel_order", "bypass"): ("status", lambda s: "processing"),
    ("refund", "over_limit"): ("left", lambda x: round(x + 1, 2)),
    ("place_order", "insufficient_stock"): ("stock", lambda n: n + 1),
}


@pytest.mark.parametrize("family, kind", sorted(FALSIFY))
def test_every_paraphrase_of_a_false_fact_fails(env, family, kind):
    """The false-reject set run backwards: the same wordings stating a wrong value must all be rejected."""
    from mentorrl.envs.orders.paraphrases import facts

    key, wrong = FALSIFY[(family, kind)]
    accepted = []
    for t in tasks_of(family, kind, 3):
        env.reset(t)
        gen, results = OrdersExpert().act(t), []
        action = next(gen)
        while not isinstance(action, FinalAnswer):
            result = env.step(action.name, action.arguments)
            results.append((action, result))
            action = gen.send(result)
        f = facts(t, results)
        f[key] = wrong(f[key])
        if key == "left":  # keep the explanation consistent with the false value
            f["total"] = round(f["left"] + f["refunded"], 2)
        for answer in PARAPHRASES[(family, kind)](f):
            if env.verify(answer).success:
                accepted.append((t.id, answer))
    assert not accepted, accepted


def test_junk_not_found_lookups_cannot_pad_the_tool_share():
    ok = ToolCall(turn=1, name="get_order", arguments={"order_id": "O-1"}, raw="", result={"x": 1})
    bad = ToolCall(turn=2, name="cancel_order", arguments={"order_id": "O-1"}, raw="", error="no", error_kind="policy")
    junk = [
        ToolCall(turn=3 + i, name=n, arguments={"k": "zz"}, raw="", error="no", error_kind="not_found")
        for i, n in enumerate(["find_customer", "check_inventory", "list_orders"])
    ]
    base = compose(Verdict(success=True), [ok, bad])
    padded = compose(Verdict(success=True), [ok, bad, *junk])
    assert padded.tool == base.tool == 0.5 and padded.total == base.total
