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

The answer-reading rules are in :mod:`.reading`; this module decides what the answer must say,
as small rules over one :class:`AnswerContext`: :data:`GENERAL_RULES` run on every task (claims,
statuses, numbers) and :data:`FACT_RULES` maps the task's check type to the rule for its fact.
"""

from __future__ import annotations

import json
import sqlite3
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from mentorrl.envs.base import Task

from .reading import Reading, mentions, read_answer
from .world import money

# mutating tool -> the action family an answer's claim is read as
FAMILY_OF_TOOL = {
    "cancel_order": "cancel",
    "issue_refund": "refund",
    "create_order": "order",
    "update_address": "address",
    "send_email": "email",
}
FAMILY_OF_TASK = {
    "cancel_order": "cancel",
    "refund": "refund",
    "place_order": "order",
    "update_address": "address",
    "email_receipt": "email",
}


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
        return next(
            (o.content.get("customer_id") for o in self._ok("get_order") if _norm(o.content.get("order_id")) == oid),
            None,
        )

    def identified(self, email: str) -> str | None:
        e = _norm(email)
        return next(
            (o.content.get("customer_id") for o in self._ok("find_customer") if _norm(o.arguments.get("email")) == e),
            None,
        )

    def not_found(self, name: str, key: str, value: str) -> bool:
        v = _norm(value)
        return any(
            o.name == name and not o.ok and o.error_kind == "not_found" and _norm(o.arguments.get(key)) == v
            for o in self.observations
        )

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
    tables = [
        r[0]
        for r in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY name"
        )
    ]
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
    return unrequested_audit(audit_rows(init), audit_rows(exp), audit_rows(act))


def unrequested_audit(base: Counter, exp: Counter, act: Counter) -> list[str]:
    """:func:`unrequested_writes` on the three audit logs (:func:`audit_rows`)."""
    extra = (act - base) - (exp - base)
    out = []
    for (tool, args), k in sorted(extra.items()):
        try:
            shown = ", ".join(f"{a}={v}" for a, v in json.loads(args).items())
        except (ValueError, AttributeError):
            shown = args
        out.append(f"unrequested write: {tool}({shown})" + (f" x{k}" if k > 1 else ""))
    return out


def table_diffs(exp: sqlite3.Connection, act: sqlite3.Connection) -> list[str]:
    return rows_diffs(table_rows(exp), table_rows(act))


def rows_diffs(e: dict[str, Counter], a: dict[str, Counter]) -> list[str]:
    """:func:`table_diffs` on two :func:`table_rows` results."""
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


@dataclass
class AnswerContext:
    """Everything an answer rule may look at (built once per verdict)."""

    task: Task
    reading: Reading
    evidence: Evidence
    init: sqlite3.Connection
    exp: sqlite3.Connection
    changed: set[str]  # action families the episode committed
    final_status: str | None  # of the order the user named, if any
    true_value: float | None  # the checked number (stock, order count, amount left), if any

    @property
    def req(self) -> dict[str, Any]:
        return self.task.reference.get("request", {})

    @property
    def check(self) -> dict[str, Any]:
        return self.task.reference.get("check") or {}

    @property
    def own_numbers(self) -> set[float]:
        """Numbers the user wrote (may be repeated back, compared, refused)."""
        return {money(float(v)) for k, v in self.req.items() if k in ("amount", "quantity")}


Rule = Callable[[AnswerContext], list[str]]


def claims_rule(c: AnswerContext) -> list[str]:
    """No claim of a change the database does not show, no denial of one it shows, and a
    confirmation where the task asks for a change."""
    out: list[str] = []
    claims, order_id = c.reading.claims, c.req.get("order_id")
    past_refunds = _past_refund_figures(c.init, order_id) if order_id else set()
    for fam in sorted(claims - {"done"}):
        if fam in c.changed:
            continue
        if fam == "cancel" and c.final_status == "cancelled":  # "it is already cancelled" is a fact, not a claim
            continue
        if fam == "refund" and all(n is not None and money(n) in past_refunds for n in c.reading.claim_numbers[fam]):
            continue  # "$17.00 has already been refunded": a refund made before the episode
        out.append(f"claims a {fam} change the database does not show")
    if "done" in claims and not c.changed and c.task.family in FAMILY_OF_TASK:
        out.append("claims the request was carried out; nothing changed")
    denied = c.reading.denials & (c.changed | {"any", "done"})
    if c.changed and denied:
        out.append(f"denies a change the database shows ({', '.join(sorted(denied))})")
    requested = FAMILY_OF_TASK.get(c.task.family) if c.task.reference.get("actions") else None
    if requested and not ({requested, "done"} & claims):
        out.append(f"does not confirm the {requested} change")
    return out


def statuses_rule(c: AnswerContext) -> list[str]:
    """A status affirmed of the user's order was seen or is true; no status is hedged."""
    out: list[str] = []
    order_id = c.req.get("order_id")
    if order_id:
        allowed = c.evidence.statuses_seen(order_id) | ({c.final_status} if c.final_status else set())
        wrong = c.reading.affirmed_statuses() - allowed
        if wrong:
            out.append(f"affirms status {', '.join(sorted(wrong))} for {order_id}")
    if any(m.polarity == "hedged" for m in c.reading.statuses):
        out.append("hedges the status")
    return out


def numbers_rule(c: AnswerContext) -> list[str]:
    """Every affirmed number is a figure a tool returned, a figure of the user's order, or the
    user's own; no number is hedged (a comparison with the user's own number is not a hedge)."""
    figures = c.evidence.figures() | c.own_numbers
    order_id = c.req.get("order_id")
    if order_id:
        for conn in (c.init, c.exp):
            row = conn.execute(
                "SELECT o.total, COALESCE((SELECT SUM(amount) FROM refunds r WHERE r.order_id = o.id), "
                "0) FROM orders o WHERE o.id = ?",
                (order_id,),
            ).fetchone()
            if row:
                figures |= {money(row[0]), money(row[1]), money(row[0] - row[1])}
    if c.true_value is not None:
        figures.add(money(c.true_value))
    out: list[str] = []
    false_numbers = sorted({n for n in (money(x) for x in c.reading.affirmed_numbers()) if n not in figures})
    if false_numbers:
        out.append(f"states figures no tool returned: {', '.join(f'{n:g}' for n in false_numbers)}")
    if any(m.polarity == "hedged" and money(m.value) not in c.own_numbers for m in c.reading.numbers):
        out.append("hedges a number")
    return out


def number_fact_rule(c: AnswerContext) -> list[str]:
    """The checked number, after the lookup that reveals it: affirmed, not denied, and no second
    value in its role ("We have 12. We have 5." with a price of 12 is not a count beside a price)."""
    check, ev = c.check, c.evidence
    out: list[str] = []
    if check["type"] == "amount_left":
        if ev.owner_seen(check["order_id"]) is None:
            out.append("states the amount left without looking the order up")
    elif check["what"] == "stock":
        if not ev.stock_seen(check["product_id"]):
            out.append("states the stock without checking it")
    elif not ev.count_seen(check["customer_id"]):
        out.append("states the order count without listing the orders")
    true = money(c.true_value)
    slot = "left" if check["type"] == "amount_left" else "count"
    rivals = sorted(
        {
            money(m.value)
            for m in c.reading.numbers
            if m.polarity == "affirmed" and m.role == slot and money(m.value) not in c.own_numbers | {true}
        }
    )
    if rivals:
        out.append(f"states another value for the checked quantity: {', '.join(f'{n:g}' for n in rivals)}")
    if true not in {money(n) for n in c.reading.affirmed_numbers()}:
        out.append(f"does not state {true:g}")
    if any(m.polarity == "negated" and money(m.value) == true for m in c.reading.numbers):
        out.append(f"denies {true:g}")
    return out


def status_fact_rule(c: AnswerContext) -> list[str]:
    """The order's true status, after looking it up: affirmed alone and not denied."""
    status = c.final_status
    out: list[str] = []
    if not c.evidence.statuses_seen(c.check["order_id"]):
        out.append("states a status without looking the order up")
    affirmed = c.reading.affirmed_statuses()
    if status not in affirmed:
        out.append(f"does not state that the order is {status}")
    if affirmed - {status}:
        out.append(f"also affirms {', '.join(sorted(affirmed - {status}))}")
    if any(m.polarity == "negated" and m.value == status for m in c.reading.statuses):
        out.append(f"denies that the order is {status}")
    return out


def reason_rule(c: AnswerContext) -> list[str]:
    return _reason_problems(c.check["reason"], c.reading, c.evidence, c.req)


# rules read on every task, then the rule of the task's check type
GENERAL_RULES: tuple[Rule, ...] = (claims_rule, statuses_rule, numbers_rule)
FACT_RULES: dict[str, Rule] = {
    "status": status_fact_rule,
    "status_word": status_fact_rule,
    "number": number_fact_rule,
    "number_only": number_fact_rule,
    "amount_left": number_fact_rule,
    "reason": reason_rule,
}


def _true_value(check: dict[str, Any], exp: sqlite3.Connection) -> float | None:
    kind = check.get("type")
    if kind == "amount_left":
        total, paid = exp.execute(
            "SELECT total, COALESCE((SELECT SUM(amount) FROM refunds WHERE order_id = ?), 0) FROM orders WHERE id = ?",
            (check["order_id"], check["order_id"]),
        ).fetchone()
        return money(total - paid)
    if kind in ("number", "number_only"):
        if check["what"] == "stock":
            return exp.execute("SELECT stock FROM products WHERE id = ?", (check["product_id"],)).fetchone()[0]
        return exp.execute("SELECT COUNT(*) FROM orders WHERE customer_id = ?", (check["customer_id"],)).fetchone()[0]
    return None


def judge_answer(
    task: Task,
    answer: str | None,
    evidence: Evidence,
    init: sqlite3.Connection,
    exp: sqlite3.Connection,
    act: sqlite3.Connection,
) -> AnswerJudgement:
    """Does the answer say what is true, with evidence, and nothing false? (module doc, point 3)"""
    if answer is None or not any(ch.isalnum() for ch in answer):
        return AnswerJudgement(False, ["no answer"])
    check = task.reference.get("check") or {}
    kind = check.get("type")
    if kind is not None and kind not in FACT_RULES:
        raise ValueError(f"unknown check type {kind!r}")
    order_id = task.reference.get("request", {}).get("order_id")
    row = exp.execute("SELECT status FROM orders WHERE id = ?", (order_id,)).fetchone() if order_id else None
    reading = read_answer(answer, _literals(task, init))
    ctx = AnswerContext(
        task,
        reading,
        evidence,
        init,
        exp,
        changed_families(init, act),
        row[0] if row else None,
        _true_value(check, exp),
    )
    problems = ["mixes scripts inside a word (homoglyphs)"] if reading.mixed_script() else []
    for rule in GENERAL_RULES + ((FACT_RULES[kind],) if kind else ()):
        problems += rule(ctx)
    expected = (
        ctx.true_value
        if ctx.true_value is not None
        else (ctx.final_status if kind in ("status", "status_word") else None)
    )
    return AnswerJudgement(not problems, problems, expected, privacy_violations(answer, task, init, act))


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


__all__ = [
    "AnswerContext",
    "AnswerJudgement",
    "Evidence",
    "FACT_RULES",
    "GENERAL_RULES",
    "FAMILY_OF_TOOL",
    "Observation",
    "audit_rows",
    "changed_families",
    "judge_answer",
    "privacy_violations",
    "rows_diffs",
    "table_diffs",
    "table_rows",
    "unrequested_audit",
    "unrequested_writes",
]
