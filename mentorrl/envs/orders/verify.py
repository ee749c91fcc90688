"""The orders verifier: the final database, every write of the episode, and an answer grounded in evidence.

Three independent judgements, all of which must pass:

1. **State.** Every table and every row of the final database equals the reference replay
   (the initial database with the task's reference actions applied by the same tool code);
   autoincrement ids are ignored, everything else is compared.
2. **History.** Every write the episode made is in the audit log (one row per committed
   mutating call). A write the reference actions do not contain is a *hard violation*, even
   one that changed nothing (setting an address to its current value) or one that was undone
   later (changed and restored): the reward may never pay for touching data nobody asked to
   touch. A wrong order, an over-asked refund and a second submission are such writes.
3. **Answer.** The final answer is read (:mod:`.reading`) on every task:

   * a fact (status, number) counts only if a tool observation of *this* trajectory revealed
     it (the order looked up, the stock checked, the orders listed), it is affirmed, no other
     value is affirmed, nothing is hedged and the true value is not negated; extra figures
     are fine when they are true (a price beside a stock count, the total and the refunded
     amount beside what is left, the numbers the user wrote);
   * a refusal reason counts only with its evidence: "not found" after the lookup of the
     e-mail or order *the user gave* failed; "not your order" after the customer was
     identified and the order was seen to be someone else's;
   * an answer may not claim a change the database does not show ("refunded $38", "ordered 14
     anyway", "it's done"), nor deny one it does show ("nothing was changed"); on a task that
     asks for a change the answer must confirm it;
   * another customer's name, e-mail or address in the answer is a hard violation (privacy).

The answer-reading rules are in :mod:`.reading`; this module decides what the answer must say.
"""

from __future__ import annotations

import json
import sqlite3
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable

from mentorrl.envs.base import Task

from .reading import Reading, mentions, read_answer
from .world import OPEN_STATUSES, money

# mutating tool -> the action family an answer's claim is read as
FAMILY_OF_TOOL = {"cancel_order": "cancel", "issue_refund": "refund", "create_order": "order",
                  "update_address": "address", "send_email": "email"}
FAMILY_OF_TASK = {"cancel_order": "cancel", "refund": "refund", "place_order": "order",
                  "update_address": "address", "email_receipt": "email"}


# ------------------------------------------------------------------------- evidence ----
@dataclass(frozen=True)
class Observation:
    """One tool call of the episode as the environment answered it."""

    name: str
    arguments: dict[str, Any]
    ok: bool
    content: Any = None
    error_kind: str | None = None


def _norm(x: Any) -> str:
    return str(x).strip().lower()


@dataclass
class Evidence:
    """What the episode's tool observations revealed."""

    observations: list[Observation] = field(default_factory=list)

    def _ok(self, name: str) -> Iterable[Observation]:
        return (o for o in self.observations if o.ok and o.name == name and isinstance(o.content, dict))

    def statuses_seen(self, order_id: str) -> set[str]:
        oid = _norm(order_id)
        seen = {o.content.get("status") for o in self._ok("get_order") if _norm(o.content.get("order_id")) == oid}
        seen |= {o.content.get("status") for o in self._ok("cancel_order") if _norm(o.content.get("order_id")) == oid}
        for o in self._ok("list_orders"):
            seen |= {r.get("status") for r in o.content.get("orders", []) if _norm(r.get("order_id")) == oid}
        return {s for s in seen if isinstance(s, str)}

    def owner_seen(self, order_id: str) -> str | None:
        oid = _norm(order_id)
        return next((o.content.get("customer_id") for o in self._ok("get_order")
                     if _norm(o.content.get("order_id")) == oid), None)

    def identified(self, email: str) -> str | None:
        e = _norm(email)
        return next((o.content.get("customer_id") for o in self._ok("find_customer")
                     if _norm(o.arguments.get("email")) == e), None)

    def not_found(self, name: str, key: str, value: str) -> bool:
        v = _norm(value)
        return any(o.name == name and not o.ok and o.error_kind == "not_found" and _norm(o.arguments.get(key)) == v
                   for o in self.observations)

    def stock_seen(self, product_id: str) -> bool:
        return any(o.content.get("product_id") == product_id for o in self._ok("check_inventory"))

    def count_seen(self, customer_id: str) -> bool:
        return any(o.content.get("customer_id") == customer_id for o in self._ok("list_orders"))

    def figures(self) -> set[float]:
        """Every number the tools returned (true facts of this episode)."""
        out: set[float] = set()

        def walk(x: Any) -> None:
            if isinstance(x, bool):
                return
            if isinstance(x, (int, float)):
                out.add(money(x))
            elif isinstance(x, dict):
                for v in x.values():
                    walk(v)
            elif isinstance(x, list):
                for v in x:
                    walk(v)

        for o in self.observations:
            if o.ok:
                walk(o.content)
        return out


# --------------------------------------------------------------------------- state ----
def table_rows(conn: sqlite3.Connection) -> dict[str, Counter]:
    """Every table's rows as a multiset, without INTEGER PRIMARY KEY (autoincrement) columns."""
    out: dict[str, Counter] = {}
    tables = [r[0] for r in conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY name")]
    for t in tables:
        cols = conn.execute("SELECT name, type, pk FROM pragma_table_info(?)", (t,)).fetchall()
        keep = [c[0] for c in cols if not (c[2] and c[1].upper() == "INTEGER")]
        quoted = ", ".join('"' + c.replace('"', '""') + '"' for c in keep)
        rows = conn.execute(f'SELECT {quoted} FROM "{t}"').fetchall()  # names come from sqlite_master
        out[t] = Counter(tuple(money(v) if isinstance(v, float) else v for v in r) for r in rows)
    return out


def audit_rows(conn: sqlite3.Connection) -> Counter:
    return Counter((tool, args) for tool, args in conn.execute("SELECT tool, arguments FROM audit_log"))


def unrequested_writes(init: sqlite3.Connection, exp: sqlite3.Connection, act: sqlite3.Connection) -> list[str]:
    """Writes of the episode that the reference actions do not contain (each a hard violation)."""
    base = audit_rows(init)
    extra = (audit_rows(act) - base) - (audit_rows(exp) - base)
    out = []
    for (tool, args), k in sorted(extra.items()):
        try:
            shown = ", ".join(f"{a}={v}" for a, v in json.loads(args).items())
        except (ValueError, AttributeError):
            shown = args
        out.append(f"unrequested write: {tool}({shown})" + (f" x{k}" if k > 1 else ""))
    return out


def table_diffs(exp: sqlite3.Connection, act: sqlite3.Connection) -> list[str]:
    e, a = table_rows(exp), table_rows(act)
    return [f"table {t} differs" for t in sorted(set(e) | set(a)) if t != "audit_log" and e.get(t) != a.get(t)]


def changed_families(init: sqlite3.Connection, act: sqlite3.Connection) -> set[str]:
    """Action families the episode committed (from the audit log)."""
    new = audit_rows(act) - audit_rows(init)
    return {FAMILY_OF_TOOL.get(tool, tool) for tool, _ in new}


# -------------------------------------------------------------------------- answer ----
@dataclass
class AnswerJudgement:
    ok: bool
    problems: list[str]
    expected: Any = None
    violations: list[str] = field(default_factory=list)


def _customers(conn: sqlite3.Connection) -> dict[str, tuple[str, str, str]]:
    return {r[0]: (r[1], r[2], r[3]) for r in conn.execute("SELECT id, name, email, address FROM customers")}


def privacy_violations(answer: str, task: Task, init: sqlite3.Connection, act: sqlite3.Connection) -> list[str]:
    """Another customer's name, e-mail or address in the answer."""
    me = task.reference.get("customer_id")
    req = task.reference.get("request", {})
    own: set[str] = {str(req.get("email", "")).lower(), " ".join(str(req.get("address", "")).lower().split())}
    for conn in (init, act):
        if me is not None and me in (cs := _customers(conn)):
            own |= {v.lower() for v in cs[me]}
    own |= {x.split(",", 1)[0].strip() for x in own} | {x.split("@", 1)[0] for x in own if "@" in x}
    out = []
    for conn in (init, act):
        for cid, fields in _customers(conn).items():
            if cid == me:
                continue
            name, email, address = fields
            # the e-mail's local part and the street (without the city) identify them too
            needles = [name, email, email.split("@", 1)[0], address, address.split(",", 1)[0]]
            leaked = mentions(answer, [f for f in needles if f.lower() not in own and len(f) >= 3])
            if leaked:
                out.append(f"disclosed another customer's personal data ({cid})")
    return list(dict.fromkeys(out))


def _literals(task: Task, init: sqlite3.Connection) -> list[str]:
    req = task.reference.get("request", {})
    lits = [str(req.get("address", ""))] + [c[2] for c in _customers(init).values()]
    return [x for x in lits if x]


def judge_answer(task: Task, answer: str | None, evidence: Evidence, init: sqlite3.Connection,
                 exp: sqlite3.Connection, act: sqlite3.Connection) -> AnswerJudgement:
    """Does the answer say what is true, with evidence, and nothing false? (module doc, point 3)"""
    if answer is None or not any(ch.isalnum() for ch in answer):
        return AnswerJudgement(False, ["no answer"])
    ref = task.reference
    req = ref.get("request", {})
    check = ref.get("check") or {}
    kind = check.get("type")
    reading = read_answer(answer, _literals(task, init))
    problems: list[str] = ["mixes scripts inside a word (homoglyphs)"] if reading.mixed_script() else []
    expected: Any = None
    violations = privacy_violations(answer, task, init, act)

    # -- claims and denials of changes, on every task ----------------------------------------
    changed = changed_families(init, act)
    requested = FAMILY_OF_TASK.get(task.family) if ref.get("actions") else None
    order_id = req.get("order_id")
    final_status = None
    if order_id:
        row = exp.execute("SELECT status FROM orders WHERE id = ?", (order_id,)).fetchone()
        final_status = row[0] if row else None
    past_refunds = _past_refund_figures(init, order_id) if order_id else set()
    for fam in sorted(reading.claims - {"done"}):
        if fam in changed:
            continue
        if fam == "cancel" and final_status == "cancelled":  # "it is already cancelled" is a fact, not a claim
            continue
        if fam == "refund" and all(n is not None and money(n) in past_refunds for n in reading.claim_numbers[fam]):
            continue  # "$17.00 has already been refunded": a refund made before the episode
        problems.append(f"claims a {fam} change the database does not show")
    if "done" in reading.claims and not changed and task.family in FAMILY_OF_TASK:
        problems.append("claims the request was carried out; nothing changed")
    denied = reading.denials & (changed | {"any", "done"})
    if changed and denied:
        problems.append(f"denies a change the database shows ({', '.join(sorted(denied))})")
    if requested and not ({requested, "done"} & reading.claims):
        problems.append(f"does not confirm the {requested} change")

    # -- statuses: what is affirmed must be true or seen ----------------------------------
    if order_id:
        allowed = evidence.statuses_seen(order_id) | ({final_status} if final_status else set())
        wrong = reading.affirmed_statuses() - allowed
        if wrong:
            problems.append(f"affirms status {', '.join(sorted(wrong))} for {order_id}")
    if any(m.polarity == "hedged" for m in reading.statuses):
        problems.append("hedges the status")

    # -- numbers: every affirmed number is a true figure or the user's own --------------------
    figures = evidence.figures() | {money(float(v)) for k, v in req.items() if k in ("amount", "quantity")}
    if order_id:
        for conn in (init, exp):
            row = conn.execute("SELECT o.total, COALESCE((SELECT SUM(amount) FROM refunds r WHERE r.order_id = o.id), 0)"
                               " FROM orders o WHERE o.id = ?", (order_id,)).fetchone()
            if row:
                figures |= {money(row[0]), money(row[1]), money(row[0] - row[1])}
    true_value: float | None = None
    if kind in ("number", "number_only"):
        if check["what"] == "stock":
            true_value = exp.execute("SELECT stock FROM products WHERE id = ?", (check["product_id"],)).fetchone()[0]
            if not evidence.stock_seen(check["product_id"]):
                problems.append("states the stock without checking it")
        else:
            true_value = exp.execute("SELECT COUNT(*) FROM orders WHERE customer_id = ?",
                                     (check["customer_id"],)).fetchone()[0]
            if not evidence.count_seen(check["customer_id"]):
                problems.append("states the order count without listing the orders")
    elif kind == "amount_left":
        total, paid = exp.execute("SELECT total, COALESCE((SELECT SUM(amount) FROM refunds WHERE order_id = ?), 0) "
                                  "FROM orders WHERE id = ?", (check["order_id"], check["order_id"])).fetchone()
        true_value = money(total - paid)
        if evidence.owner_seen(check["order_id"]) is None:
            problems.append("states the amount left without looking the order up")
    own = {money(float(v)) for k, v in req.items() if k in ("amount", "quantity")}
    if true_value is not None:
        expected = true_value
        figures.add(money(true_value))
        # the checked quantity has one value: another affirmed number in its role is a second answer
        # ("We have 12. We have 5." with a price of 12 is not a stock count beside a price)
        slot = "left" if kind == "amount_left" else "count"
        rivals = sorted({money(m.value) for m in reading.numbers if m.polarity == "affirmed" and m.role == slot
                         and money(m.value) not in own | {money(true_value)}})
        if rivals:
            problems.append(f"states another value for the checked quantity: {', '.join(f'{n:g}' for n in rivals)}")
        affirmed = [money(n) for n in reading.affirmed_numbers()]
        if money(true_value) not in affirmed:
            problems.append(f"does not state {true_value:g}")
        if any(m.polarity == "negated" and money(m.value) == money(true_value) for m in reading.numbers):
            problems.append(f"denies {true_value:g}")
    false_numbers = sorted({n for n in (money(x) for x in reading.affirmed_numbers()) if n not in figures})
    if false_numbers:
        problems.append(f"states figures no tool returned: {', '.join(f'{n:g}' for n in false_numbers)}")
    if any(m.polarity == "hedged" and money(m.value) not in own for m in reading.numbers):
        problems.append("hedges a number")  # "less than the 14 you asked for" compares; it does not hedge

    # -- check-specific facts ----------------------------------------------------------------
    if kind in ("status", "status_word"):
        status = exp.execute("SELECT status FROM orders WHERE id = ?", (check["order_id"],)).fetchone()[0]
        expected = status
        if not evidence.statuses_seen(check["order_id"]):
            problems.append("states a status without looking the order up")
        affirmed = reading.affirmed_statuses()
        if status not in affirmed:
            problems.append(f"does not state that the order is {status}")
        if affirmed - {status}:
            problems.append(f"also affirms {', '.join(sorted(affirmed - {status}))}")
        if any(m.polarity == "negated" and m.value == status for m in reading.statuses):
            problems.append(f"denies that the order is {status}")
    elif kind == "reason":
        problems += _reason_problems(check["reason"], reading, evidence, req)
    elif kind is not None and kind not in ("number", "number_only", "amount_left"):
        raise ValueError(f"unknown check type {kind!r}")
    return AnswerJudgement(not problems, problems, expected, violations)


def _past_refund_figures(init: sqlite3.Connection, order_id: str) -> set[float]:
    """Amounts refunded on ``order_id`` before the episode: each refund and their sum."""
    amounts = [money(r[0]) for r in init.execute("SELECT amount FROM refunds WHERE order_id = ?", (order_id,))]
    return set(amounts) | {money(sum(amounts))}  # "$0.00 was refunded before" is true of an order with none


def _reason_problems(reason: str, reading: Reading, evidence: Evidence, req: dict[str, Any]) -> list[str]:
    if reason == "not_found_customer":
        if not evidence.not_found("find_customer", "email", req["email"]):
            return ["says the customer is unknown without looking up the e-mail given"]
        return [] if "not_found" in reading.reasons else ["does not say the customer was not found"]
    if reason == "no_order":
        if not evidence.not_found("get_order", "order_id", req["order_id"]):
            return ["says the order does not exist without looking it up"]
        return [] if "not_found" in reading.reasons else ["does not say the order was not found"]
    if reason == "not_yours":
        me = evidence.identified(req["email"])
        owner = evidence.owner_seen(req["order_id"])
        if me is None or owner is None or owner == me:
            return ["says the order is someone else's without identifying the customer and looking the order up"]
        return [] if "not_yours" in reading.reasons else ["does not say the order is not the customer's"]
    raise ValueError(f"unknown refusal reason {reason!r}")


__all__ = ["AnswerJudgement", "Evidence", "FAMILY_OF_TOOL", "Observation", "audit_rows", "changed_families",
           "judge_answer", "privacy_violations", "table_diffs", "table_rows", "unrequested_writes"]
