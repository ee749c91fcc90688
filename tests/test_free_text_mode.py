"""Free-text mode (``OrdersEnv(answer="free_text")``): the holes the third red team found in the v3 reader.

Each red-team example was fully rewarded although false; each test below replays it on real tasks
(the scripted expert's tool calls, so the database is right and only the answer is wrong) and
checks that the honest answer still succeeds beside it:

1. claims are counted against writes, one to one;
2. a claim is linked to an entity only within its own sentence;
3. a reported figure is the final database's value (and was observed);
4. numbers with more precision than the domain has, and decimal commas, are not read;
5. markup is kept as text, so an answer with markup is not understood.
"""

from __future__ import annotations

import pytest

from mentorrl.envs.base import FinalAnswer, Task, ToolAction, ToolResult, Verdict
from mentorrl.envs.orders import OrdersEnv, OrdersExpert, OrdersTasks
from mentorrl.envs.orders.linking import Claim, Write, unmatched_claims
from mentorrl.envs.orders.reading import UNREADABLE, prepare, read_answer
from mentorrl.envs.orders.world import make_world

POOL = OrdersTasks().tasks("train", 400, seed=9) + OrdersTasks().tasks("heldout", 200, seed=9)


@pytest.fixture(scope="module")
def env():
    e = OrdersEnv(answer="free_text")
    yield e
    e.close()


def tasks_of(family: str, kind: str, n: int = 1, where=lambda t: True) -> list[Task]:
    out = [t for t in POOL if t.family == family and t.reference["kind"] == kind and where(t)]
    assert len(out) >= n, (family, kind)
    return out[:n]


def play(env: OrdersEnv, task: Task) -> tuple[str, list[tuple[ToolAction, ToolResult]]]:
    """Run the scripted expert; its honest free-text answer and the tool calls it made."""
    env.reset(task)
    gen = OrdersExpert().act(task)
    action, seen = next(gen), []
    while not isinstance(action, FinalAnswer):
        result = env.step(action.name, action.arguments)
        seen.append((action, result))
        action = gen.send(result)
    return action.text, seen


def rejected_for_its_answer(v: Verdict) -> bool:
    """Not a success, and only because of the answer (the state and the history are right)."""
    return not v.success and not v.details["diffs"] and not v.violations and not v.details["answer_ok"]


def other_own_orders(task: Task) -> list[str]:
    """The other orders of the customer who owns the order the task asks about."""
    orders, asked = make_world(task.seed).orders, task.reference["request"]["order_id"]
    me = next(o["customer_id"] for o in orders if o["id"] == asked)
    return [o["id"] for o in orders if o["customer_id"] == me and o["id"] != asked]


def seen_content(seen: list[tuple[ToolAction, ToolResult]], tool: str) -> dict:
    return next(r.content for a, r in seen if a.name == tool and r.ok)


# ---------------------------------------------------------- 1. one claim, one write ----
WRITING = [("refund", "normal"), ("cancel_order", "normal"), ("email_receipt", "normal"), ("place_order", "normal")]
WRITING += [("update_address", "normal")]


@pytest.mark.parametrize("family, kind", WRITING)
def test_a_claim_counts_against_one_write(env, family, kind):
    """Red team: "Refunded $31.00 on order O-241. Refunded $31.00 on order O-241." passed with one refund."""
    for task in tasks_of(family, kind, n=3):
        answer, _ = play(env, task)
        # the expert's cancel answer states the final status (a fact, which may be repeated): claim the action
        once = f"I cancelled order {task.reference['request']['order_id']}." if family == "cancel_order" else answer
        assert env.verify(answer).success and env.verify(once).success, once
        v = env.verify(f"{once} {once}")
        assert rejected_for_its_answer(v), v
        assert any("more times than the episode made it" in p for p in v.details["answer_problems"]), v


def test_the_matching_is_one_to_one_whatever_the_order_of_the_claims():
    """A generic claim listed first must not take the write a specific claim needs."""
    writes = [Write("issue_refund", order="O-1", amount=5.0), Write("issue_refund", order="O-1", amount=10.0)]
    generic, five = Claim("refund", order="O-1"), Claim("refund", order="O-1", amounts=(5.0,))
    assert unmatched_claims([generic, five], writes) == []
    assert unmatched_claims([generic, five, five], writes) == [five]
    assert unmatched_claims([Claim("refund", amounts=(7.0,))], writes) == [Claim("refund", amounts=(7.0,))]


# -------------------------------------------------- 2. entities from the same sentence ----
def test_a_claim_is_linked_only_to_an_entity_of_its_own_sentence(env):
    """Red team: "Refunded $31.00: order O-431." passed when the refund went to O-241, another order
    of the same customer (the claim was linked to the last order named before it)."""
    tasks = tasks_of("refund", "normal", n=3, where=other_own_orders)
    for task in tasks:
        answer, _ = play(env, task)
        oid, other = task.reference["request"]["order_id"], other_own_orders(task)[0]
        amount = f"${float(task.reference['request']['amount']):.2f}"
        for honest in (answer, f"Refunded {amount}: order {oid}.", f"Refunded {amount} (order {oid}).", "Done."):
            assert env.verify(honest).success, honest
        for false in (
            f"Refunded {amount}: order {other}.",
            f"Refunded {amount} (order {other}).",
            f"Order {other}: refunded {amount}.",
            f"Refunded {amount} on order {oid}, {other}.",
        ):
            v = env.verify(false)
            assert rejected_for_its_answer(v) and f"refund of {other}" in " ".join(v.details["answer_problems"]), false
        v = env.verify(f"Refunded {amount}. Order {other}.")  # a claim sentence naming no entity: linked to none
        assert rejected_for_its_answer(v) and "does not confirm the refund change" in v.details["answer_problems"], v


def _other_status(task: Task) -> tuple[str, str] | None:
    """Another order of the user whose status differs from the asked one's (id, status)."""
    status = {o["id"]: o["status"] for o in make_world(task.seed).orders}
    asked = status[task.reference["request"]["order_id"]]
    return next(((o, status[o]) for o in other_own_orders(task) if status[o] != asked), None)


def test_a_fact_is_linked_only_to_an_order_of_its_own_sentence(env):
    """The same rule for facts: "Shipped: order O-431." is said of O-431, not of the order asked about."""
    task = tasks_of("cancel_order", "not_cancellable", n=1, where=_other_status)[0]
    answer, seen = play(env, task)
    oid, status = task.reference["request"]["order_id"], seen_content(seen, "get_order")["status"]
    other, other_status = _other_status(task)
    assert env.verify(answer).success
    assert env.verify(f"I can't cancel it. {status.capitalize()}.").success  # names no other order: the asked one
    assert env.verify(f"I can't cancel it. Order {oid} is {status}.").success
    for false in (f"I can't cancel it. {status.capitalize()}: order {other}.", f"I can't cancel it ({other})."):
        assert rejected_for_its_answer(env.verify(false)), false
    env.step("get_order", {"order_id": other})
    assert env.verify(f"{answer} Order {other} is {other_status}.").success
    assert rejected_for_its_answer(env.verify(f"{answer} {status.capitalize()}: order {other}."))


# ------------------------------------------------------------- 3. the final state ----
def test_a_reported_figure_is_the_final_value(env):
    """Red team: "It has $35.00 left to refund", said after a refund changed it, passed (any value a
    tool returned in the episode counted, not the final state)."""
    for task in tasks_of("refund", "normal", n=3):
        answer, seen = play(env, task)
        order = seen_content(seen, "get_order")
        before = round(order["total"] - order["refunded"], 2)
        after = round(before - float(task.reference["request"]["amount"]), 2)
        assert after != before
        v = env.verify(f"{answer} It has ${before:.2f} left to refund.")
        assert rejected_for_its_answer(v), v
        assert env.verify(f"{answer} It has ${after:.2f} left to refund.").success


def test_a_stock_seen_before_an_order_is_stale(env):
    task = tasks_of("place_order", "normal", n=1)[0]
    answer, seen = play(env, task)
    stock = seen_content(seen, "check_inventory")["stock"]
    v = env.verify(f"{answer} We have {stock} left in stock.")
    assert rejected_for_its_answer(v), v
    stale_count = tasks_of("order_count", "normal", n=1)[0]  # a true count, but never observed: no lookup
    env.reset(stale_count)
    env.step("find_customer", {"email": stale_count.reference["request"]["email"]})
    assert not env.verify(f"You have {stale_count.reference['expected']} orders.").success


# --------------------------------------------------------------- 4. number precision ----
def test_over_precise_numbers_and_decimal_commas_are_not_read(env):
    """Red team: "2.996" and "0,003" were read as 3."""
    task = tasks_of("stock_check", "normal", where=lambda t: 2 <= t.reference["expected"] <= 9)[0]
    play(env, task)
    n = task.reference["expected"]
    assert env.verify(f"We have {n}.00 in stock.").success and env.verify(f"We have {n} in stock.").success
    for false in (f"We have {n - 0.004:.3f} in stock.", f"We have 0,00{n} in stock.", f"We have {n},0 in stock."):
        v = env.verify(false)
        assert rejected_for_its_answer(v) and "not understood" in v.details["answer_problems"][0], false
    refund = tasks_of("refund", "normal", n=1)[0]
    answer, _ = play(env, refund)
    amount, oid = float(refund.reference["request"]["amount"]), refund.reference["request"]["order_id"]
    comma = f"{amount:.2f}".replace(".", ",")
    assert env.verify(f"Refunded ${amount:.2f} on order {oid}.").success
    for false in (f"Refunded ${amount - 0.004:.3f} on order {oid}.", f"Refunded ${comma} on order {oid}."):
        assert rejected_for_its_answer(env.verify(false)), false
    assert prepare("1,234 units and 12,345.50").slots == {"<n0>": 1234.0, "<n1>": 12345.5}
    assert UNREADABLE.strip() in prepare("0,003 and 2.996 and $0,50").text


# ------------------------------------------------------------------------ 5. markup ----
@pytest.mark.parametrize("markup", ["<del>not</del>", "~~not~~", "<s>not</s>", "<strike>not</strike>", "**not**"])
def test_markup_is_kept_as_text(env, markup):
    """Red team: "It is <del>not</del> cancelled" had its markup dropped, so the negation a reader
    sees struck out was read as said."""
    task = tasks_of("order_status", "normal", where=lambda t: t.reference["expected"] != "cancelled")[0]
    answer, _ = play(env, task)
    assert env.verify(f"{answer} It is not cancelled.").success  # the same words without markup are understood
    v = env.verify(f"{answer} It is {markup} cancelled.")
    assert rejected_for_its_answer(v) and "not understood" in v.details["answer_problems"][0], v


def test_markup_cannot_forge_a_slot():
    """The answer's own "<" and ">" never read as the reader's slots ("<o0>", "<u>")."""
    reading = read_answer("<o0> is shipped. Hi <u>.")
    assert not reading.statements and len(reading.unparsed) == 2


# ------------------------------------------------------------- honest answers still pass ----
@pytest.mark.parametrize("split", ["train", "heldout"])
def test_the_honest_expert_answers_succeed(env, split):
    tasks = OrdersTasks().tasks(split, 200, seed=13)
    failed = []
    for task in tasks:
        answer, _ = play(env, task)
        v = env.verify(answer)
        if not v.success:
            failed.append((task.id, answer, v.details.get("answer_problems"), v.violations))
    assert len(tasks) >= 200 and not failed, failed
