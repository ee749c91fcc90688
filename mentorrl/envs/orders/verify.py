"""The orders verifier: the final database, every write of the episode, and an answer it fully understands.

Three independent judgements, all of which must pass:

1. **State.** Every table and every row of the final database equals the reference replay
   (the initial database with the task's reference actions applied by the same tool code);
   autoincrement ids are ignored, everything else is compared.
2. **History.** Every write the episode made is in the audit log (one row per committed
   mutating call), compared **by value** through the tool's own schema (:func:`canonical_arguments`:
   an integer ``2.0`` is ``2``, an amount is rounded to cents, "O-0123" is "O-123", spacing is
   collapsed). A write the reference actions do not contain is a *hard violation*, even one that
   changed nothing (setting an address to its current value) or one that was undone later: the
   reward may never pay for touching data nobody asked to touch.
3. **Answer**, closed-world (verifier v3, the explicit ``free_text`` mode). The answer is read by
   :mod:`.reading` / :mod:`.grammar` into typed statements; a statement the grammar does not know
   makes the answer unjudgeable (no success): markup, over-precise numbers ("2.996") and decimal
   commas are never normalised into something it knows. Every understood statement is then
   checked (:data:`ANSWER_RULES`):

   * a statement is about the order, product or address named **in its own sentence**, never one
     named before or after it (:mod:`.linking`); a statement whose sentence names none is about
     the task's own entity only when the answer names no other, else about nothing;
   * a fact (a status, a stock level, a count, a price, a total, what was refunded, what is
     left) counts only for the quantity it is attached to, only when it is the value in the
     **final** database (:mod:`.figures`: a figure seen before a write changed it is stale) *and*
     a tool observation of *this* trajectory returned it; a denied status must be false;
   * each claim of an action consumes **one** write of the audit log that matches it: its family,
     and every detail it gives (the amount, the quantity, the product, the order id, the address);
     a second identical claim needs a second write (:func:`.linking.unmatched_claims`); a generic
     "done" needs a change; a task that asks for a change needs a confirmation about its entity;
   * a denial ("nothing was changed", "nothing else was changed") and an inability ("I can't
     cancel it") must be true of the audit log; the user's own figures repeated in a refusal
     must be the ones they wrote;
   * at most one refusal reason, and it must be this task's (with its evidence: "not found"
     after the lookup of the e-mail or order the user gave failed; "not your order" after the
     customer was identified and the order was seen to be someone else's);
   * every order id, e-mail, product and address the answer mentions is the user's own or one
     the episode touched;
   * another customer's identity, in any surface form, is a hard violation (:mod:`.privacy`).
"""

from __future__ import annotations

import json
import re
import sqlite3
from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Iterable

from mentorrl.envs.base import Task

from .backend import TOOL_SPECS, normalise_address
from .figures import is_integer_role, item_quantity, order_count, order_value, product_value
from .linking import ORDER_FAMILIES, Write, claims_of, linked, one, unmatched_claims, why_unmatched
from .privacy import privacy_violations
from .reading import Atom, Reading, Statement, Vocabulary, canon_address, canon_id, read_answer, street_of
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
    text = str(x).strip()
    return canon_id(text).lower() if "-" in text and "@" not in text else text.lower()


@dataclass
class Evidence:
    """What the episode's tool observations revealed."""

    observations: list[Observation] = field(default_factory=list)

    def _ok(self, name: str) -> Iterable[Observation]:
        return (o for o in self.observations if o.ok and o.name == name and isinstance(o.content, dict))

    def statuses_seen(self, order_id: str) -> set[str]:
        oid = _norm(order_id)
        seen = {o.content.get("status") for o in self._ok("get_order") if _norm(o.content.get("order_id")) == oid}
        for name in ("cancel_order", "create_order"):
            seen |= {o.content.get("status") for o in self._ok(name) if _norm(o.content.get("order_id")) == oid}
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

    def product_values(self, product: str, key: str) -> set[float]:
        """``key`` (stock, price) of ``product`` as check_inventory returned it."""
        p = _norm(product)
        return {
            money(o.content[key])
            for o in self._ok("check_inventory")
            if key in o.content and p in (_norm(o.content.get("name")), _norm(o.content.get("product_id")))
        }

    def counts(self, customer_id: str, status: str | None = None) -> set[float]:
        """The customer's order count (of one status, if given) as list_orders returned it."""
        out: set[float] = set()
        for o in self._ok("list_orders"):
            if _norm(o.content.get("customer_id")) != _norm(customer_id):
                continue
            rows = o.content.get("orders", [])
            out.add(
                float(
                    o.content.get("count", len(rows))
                    if status is None
                    else sum(r.get("status") == status for r in rows)
                )
            )
        return out

    def order_values(self, order_id: str, key: str) -> set[float]:
        """An order's total, refunded or left (total - refunded) as the tools returned it: get_order and
        create_order show the total (get_order also what was refunded); issue_refund shows the new
        refunded sum, and with a total seen before, what is left after the refund."""
        oid, out = _norm(order_id), set()
        for name in ("get_order", "create_order", "issue_refund"):
            for o in self._ok(name):
                c = o.content
                if _norm(c.get("order_id")) != oid:
                    continue
                if key == "left" and name == "get_order":
                    out.add(money(c["total"] - c["refunded"]))
                elif key == "refunded" and name == "issue_refund":
                    out.add(money(c.get("total_refunded", -1)))
                elif key in c and name != "issue_refund":
                    out.add(money(c[key]))
        if key == "left":
            totals, refunded = self.order_values(order_id, "total"), self._refunded_after_writes(oid)
            out |= {money(t - r) for t in totals for r in refunded}
        return out

    def _refunded_after_writes(self, oid: str) -> set[float]:
        return {
            money(o.content["total_refunded"])
            for o in self._ok("issue_refund")
            if _norm(o.content.get("order_id")) == oid and isinstance(o.content.get("total_refunded"), (int, float))
        }

    def items(self, order_id: str) -> set[tuple[str, float]]:
        oid = _norm(order_id)
        return {
            (canon_id(pid), float(q))
            for o in self._ok("get_order")
            if _norm(o.content.get("order_id")) == oid and isinstance(o.content.get("items"), dict)
            for pid, q in o.content["items"].items()
        }

    def seen_ids(self) -> set[str]:
        """Every record id a tool returned (an order, customer or product id)."""
        out: set[str] = set()

        def walk(x: Any) -> None:
            if isinstance(x, str) and re.fullmatch(r"[OCP]-\d+", x):
                out.add(canon_id(x))
            elif isinstance(x, dict):
                for k, v in x.items():
                    walk(k)
                    walk(v)
            elif isinstance(x, list):
                for v in x:
                    walk(v)

        for o in self.observations:
            if o.ok:
                walk(o.content)
        return out

    def looked_up(self) -> bool:
        return any(
            o.name in ("find_customer", "get_order", "list_orders", "check_inventory") for o in self.observations
        )

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


_SCHEMAS = {name: params.get("properties", {}) for name, _, params in TOOL_SPECS}


def canonical_value(tool: str, key: str, value: Any) -> Any:
    """One argument by value, through the tool's schema (module doc, point 2)."""
    kind = _SCHEMAS.get(tool, {}).get(key, {}).get("type")
    if isinstance(value, bool):
        return value
    if kind == "integer" and isinstance(value, (int, float)) and float(value).is_integer():
        return int(value)
    if kind in ("number", "integer") and isinstance(value, (int, float)):
        return money(value)
    if isinstance(value, str):
        if key.endswith("_id"):
            return canon_id(value)
        return normalise_address(value) if key == "address" else " ".join(value.split())
    return value


def canonical_arguments(tool: str, arguments: str) -> str:
    """An audit-log row's arguments (JSON) by value, as canonical JSON; unparseable text unchanged."""
    try:
        args = json.loads(arguments)
    except ValueError:
        return arguments
    if not isinstance(args, dict):
        return arguments
    return json.dumps({k: canonical_value(tool, k, v) for k, v in args.items()}, sort_keys=True)


def audit_rows(conn: sqlite3.Connection) -> Counter:
    """The audit log as a multiset of (tool, canonical arguments)."""
    return Counter(
        (tool, canonical_arguments(tool, args)) for tool, args in conn.execute("SELECT tool, arguments FROM audit_log")
    )


def new_writes(init: sqlite3.Connection, act: sqlite3.Connection) -> list[tuple[str, dict[str, Any]]]:
    """The writes of the episode, by value: (tool, arguments) for each new audit-log row."""
    return writes_between(audit_rows(init), audit_rows(act))


def writes_between(base: Counter, act: Counter) -> list[tuple[str, dict[str, Any]]]:
    """:func:`new_writes` on two :func:`audit_rows` results."""
    out = []
    for (tool, args), k in (act - base).items():
        try:
            parsed = json.loads(args)
        except ValueError:
            parsed = {}
        out += [(tool, parsed if isinstance(parsed, dict) else {})] * k
    return out


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


# the refusal reason each task's check stands for (None: a task with no refusal)
TRUE_REASON = {
    "not_found_customer": "not_found_customer",
    "no_order": "not_found_order",
    "not_yours": "not_yours",
    "status_word": "not_cancellable",
    "amount_left": "over_limit",
    "number": "insufficient_stock",
}
STATUS_ORDER = ("pending", "processing", "shipped", "delivered")


def vocabulary(task: Task, init: sqlite3.Connection, act: sqlite3.Connection) -> Vocabulary:
    """What the reader recognises as slots in this episode: every customer's address (old and new),
    the asked address, every product name, and the user's own name."""
    req = task.reference.get("request", {})
    addresses = [str(req["address"])] if req.get("address") else []
    own: list[str] = []
    for conn in (init, act):
        addresses += [r[0] for r in conn.execute("SELECT address FROM customers")]
        me = task.reference.get("customer_id")
        row = conn.execute("SELECT name FROM customers WHERE id = ?", (me,)).fetchone() if me else None
        if row:
            own += [row[0], row[0].split()[0]]
    products = [r[0] for r in init.execute("SELECT name FROM products")]
    return Vocabulary(addresses=addresses, products=products, own_names=own)


@dataclass
class AnswerContext:
    """Everything an answer rule may look at (built once per verdict)."""

    task: Task
    reading: Reading
    evidence: Evidence
    init: sqlite3.Connection
    exp: sqlite3.Connection
    act: sqlite3.Connection
    writes: list[tuple[str, dict[str, Any]]]  # the episode's writes, by value
    true_value: float | None  # the checked number (stock, order count, amount left), if any

    @property
    def req(self) -> dict[str, Any]:
        return self.task.reference.get("request", {})

    @property
    def check(self) -> dict[str, Any]:
        return self.task.reference.get("check") or {}

    @property
    def changed(self) -> set[str]:
        return {FAMILY_OF_TOOL.get(tool, tool) for tool, _ in self.writes}

    @property
    def requested(self) -> str | None:
        return FAMILY_OF_TASK.get(self.task.family) if self.task.reference.get("actions") else None

    def new_orders(self) -> list[str]:
        before = {r[0] for r in self.init.execute("SELECT id FROM orders")}
        return [r[0] for r in self.act.execute("SELECT id FROM orders") if r[0] not in before]

    def default_order(self) -> str | None:
        if self.req.get("order_id"):
            return canon_id(self.req["order_id"])
        new = self.new_orders()
        return new[0] if new else None

    def status_of(self, order_id: str) -> str | None:
        row = self.act.execute("SELECT status FROM orders WHERE id = ?", (order_id,)).fetchone()
        return row[0] if row else None

    def writes_of(self, tool: str) -> list[dict[str, Any]]:
        return [a for t, a in self.writes if t == tool]

    def default_product(self) -> str | None:
        """The product the task is about: the one asked about, else the first one looked up."""
        if self.req.get("product"):
            return str(self.req["product"])
        seen = [o.content.get("name") for o in self.evidence._ok("check_inventory")]
        return seen[0] if seen else None

    @cached_property
    def order_links(self) -> list[list[str]]:
        """For each statement, the orders it is about (:func:`.linking.linked`: within its sentence)."""
        return linked(self.reading.statements, "o", self.default_order())

    @cached_property
    def product_links(self) -> list[list[str]]:
        """For each statement, the products it is about (within its sentence, as for orders)."""
        return linked(self.reading.statements, "p", self.default_product(), key=lambda p: str(p).lower())

    def about(self) -> Iterable[tuple[Statement, str | None, str | None]]:
        """Each statement with the one order and the one product it is about (None: none, or several)."""
        return zip(self.reading.statements, map(one, self.order_links), map(one, self.product_links))


Rule = Callable[[AnswerContext], list[str]]


def understood_rule(c: AnswerContext) -> list[str]:
    """Closed world: every statement parsed, or the answer is unjudgeable."""
    if c.reading.too_long:
        return ["too long to judge"]
    if c.reading.unparsed:
        return [f"statement not understood: {c.reading.unparsed[0][:60]!r}"]
    return [] if c.reading.statements else ["no statement"]


def references_rule(c: AnswerContext) -> list[str]:
    """Every id, e-mail, product and address named is the user's own or one the episode touched."""
    me = c.task.reference.get("customer_id")
    own_orders = {r[0] for r in c.act.execute("SELECT id FROM orders WHERE customer_id = ?", (me,))} if me else set()
    orders = own_orders | set(c.new_orders()) | ({c.default_order()} - {None})
    seen = c.evidence.seen_ids()
    emails = {str(c.req.get("email", "")).lower()}
    if me:
        emails |= {r[0].lower() for r in c.act.execute("SELECT email FROM customers WHERE id = ?", (me,))}
    addresses = {canon_address(a) for a in _allowed_addresses(c)}
    streets = {street_of(a) for a in _allowed_addresses(c)}
    products = {str(c.req.get("product", "")).lower()} | {
        str(o.content.get("name", "")).lower() for o in c.evidence._ok("check_inventory")
    }
    out = []
    for st in c.reading.statements:
        bad = [o for o in st.refs.get("o", []) if o not in orders]
        bad += [e for e in st.refs.get("e", []) if e.lower() not in emails]
        bad += [a for a in st.refs.get("a", []) if a not in addresses and a not in streets]
        bad += [p for p in st.refs.get("p", []) if p.lower() not in products]
        bad += [x for x in st.refs.get("c", []) + st.refs.get("i", []) if x not in seen and x != me]
        out += [f"names {b} (not the user's, nor touched by this episode)" for b in bad]
    return list(dict.fromkeys(out))


def _allowed_addresses(c: AnswerContext) -> list[str]:
    me = c.task.reference.get("customer_id")
    out = [a.get("address", "") for a in c.writes_of("update_address")]
    if c.req.get("address"):
        out.append(str(c.req["address"]))
    if me:
        for conn in (c.init, c.act):
            out += [r[0] for r in conn.execute("SELECT address FROM customers WHERE id = ?", (me,))]
    return [a for a in out if a]


def statuses_rule(c: AnswerContext) -> list[str]:
    """A status is said of an order (named in its sentence), was seen by a tool, and is true of the
    final database; a denied status is false."""
    out = []
    for st, order, _ in c.about():
        for a in st.atoms:
            if a.kind not in ("status", "estimate"):
                continue
            true = c.status_of(order) if order else None
            if true is None:
                out.append(f"states a status of no known order ({a.what})")
            elif a.kind == "estimate":
                if true not in STATUS_ORDER or STATUS_ORDER.index(true) >= STATUS_ORDER.index(a.what):
                    out.append(f"expects {order} to become {a.what}, but it is {true}")
            elif a.negated:
                if a.what == true:
                    out.append(f"denies that {order} is {true}")
            elif a.what != true:
                out.append(f"affirms status {a.what} for {order} (it is {true})")
            elif a.what not in c.evidence.statuses_seen(order):
                out.append(f"states the status of {order} without looking it up")
    return out


def _final_and_seen(c: AnswerContext, role: str, v: float, order: str | None, product: str | None) -> bool | None:
    """Whether ``v`` is the final database's value of a state figure *and* a tool of the episode
    returned it (stale or unobserved: False); None for a role that is not a state figure."""
    me = c.task.reference.get("customer_id")
    if role in ("stock", "price"):
        seen = c.evidence.product_values(product, role) if product else set()
        return product is not None and v == product_value(c.act, product, role) and v in seen
    if role == "count" or role.startswith("scount:"):
        status = role.split(":", 1)[1] if ":" in role else None
        return me is not None and v == order_count(c.act, me, status) and v in c.evidence.counts(me, status)
    if role in ("total", "refunded", "left"):
        return order is not None and v == order_value(c.act, order, role) and v in c.evidence.order_values(order, role)
    return None


def _item_seen(c: AnswerContext, st: Statement, order: str | None, v: float) -> bool:
    """An item's quantity: what the final database holds and get_order showed."""
    if order is None:
        return False
    return any(
        (pid, v) in c.evidence.items(order) and item_quantity(c.act, order, pid) == v for pid in st.refs.get("i", [])
    )


def _figure_problem(c: AnswerContext, st: Statement, about: tuple[str | None, str | None], a: Atom) -> str | None:
    """Why the figure ``a`` is not the value of the quantity it is attached to (None: it is)."""
    role, v = a.what, money(a.value) if a.value is not None else None
    if v is None:
        return f"a {role} figure with no value"
    if is_integer_role(role) and not float(v).is_integer():
        return f"states {v:g} as the {role}, which counts whole units"
    ok = _final_and_seen(c, role, v, *about)
    if ok is None:
        ok = _item_seen(c, st, about[0], v) if role == "item" else _action_figure_ok(c, st, role, v)
    return None if ok else f"states {v:g} as the {role}, which it is not (now, as a tool of this episode showed it)"


def _action_figure_ok(c: AnswerContext, st: Statement, role: str, v: float) -> bool:
    """A figure of an action: the amount or quantity written (in a claim), else the one the user asked
    for; a bare figure is the task's checked number (or the new order's total)."""
    kinds = {x.kind + ":" + x.what for x in st.atoms}
    if role == "amount" and "claim:refund" in kinds:
        return any(money(w.get("amount", -1)) == v for w in c.writes_of("issue_refund"))
    if role == "qty" and c.writes_of("create_order") and "cannot:order" not in kinds:
        return any(money(w.get("quantity", -1)) == v for w in c.writes_of("create_order"))
    if role in ("amount", "qty", "asked"):
        return v in {money(float(x)) for k, x in c.req.items() if k in ("amount", "quantity")}
    return role == "main" and v == _main_value(c)


def _main_value(c: AnswerContext) -> float | None:
    """What a bare figure ("3.") is read as: the task's checked number, else the new order's total."""
    if c.true_value is not None:
        return money(c.true_value)
    new = c.new_orders()
    totals = c.evidence.order_values(new[0], "total") if new else set()
    return next(iter(totals)) if len(totals) == 1 else None


def numbers_rule(c: AnswerContext) -> list[str]:
    """Every figure is the true (final), observed value of the quantity it is attached to."""
    out = []
    for st, order, product in c.about():
        out += [p for a in st.atoms if a.kind == "num" and (p := _figure_problem(c, st, (order, product), a))]
    return list(dict.fromkeys(out))


def episode_writes(c: AnswerContext) -> list[Write]:
    """The episode's writes as claims are compared to them (:class:`.linking.Write`)."""
    out = []
    for tool, args in c.writes:
        amount, qty = args.get("amount"), args.get("quantity")
        out.append(
            Write(
                tool,
                order=canon_id(args["order_id"]) if args.get("order_id") else None,
                amount=money(amount) if isinstance(amount, (int, float)) else None,
                quantity=float(qty) if isinstance(qty, (int, float)) else None,
                product=_product_name(c, args.get("product_id")),
                address=canon_address(str(args.get("address", ""))),
                street=street_of(str(args.get("address", ""))),
            )
        )
    return out


def _product_name(c: AnswerContext, product_id: Any) -> str:
    if not product_id:
        return ""
    row = c.act.execute("SELECT name FROM products WHERE id = ?", (canon_id(product_id),)).fetchone()
    return row[0].lower() if row else ""


def _sentence_addresses(c: AnswerContext) -> list[list[str]]:
    """For each statement, the addresses it names, else those its sentence names (never another sentence's)."""
    return linked(c.reading.statements, "a", None)


def _confirms(c: AnswerContext, family: str, orders: list[str]) -> bool:
    """Whether a claim of ``family`` about ``orders`` confirms the task's requested change: the same
    family (or a generic "done"), and, for a change to one order, about that order."""
    if family not in (c.requested, "done"):
        return False
    return c.requested not in ORDER_FAMILIES or c.default_order() in orders


def claims_rule(c: AnswerContext) -> list[str]:
    """Each claimed action consumes one write of the audit log that matches it in every detail
    (:mod:`.linking`: one claim, one write; entities only from its own sentence); a generic "done"
    needs a change; a task that asks for a change gets a confirmation about the right entity."""
    out: list[str] = []
    claims, confirmed = [], False
    addresses = _sentence_addresses(c)
    for st, orders, products, addrs in zip(c.reading.statements, c.order_links, c.product_links, addresses):
        claims += claims_of(st, orders, products, addrs)
        for a in st.atoms:
            if a.kind == "claim":
                if a.what == "done" and not c.writes:
                    out.append("claims the request was carried out; nothing changed")
                confirmed |= _confirms(c, a.what, orders)
            elif a.kind == "status" and not a.negated and c.requested == "cancel" and a.what == "cancelled":
                confirmed |= one(orders) == c.default_order()
    writes, new = episode_writes(c), c.new_orders()
    out += [why_unmatched(x, writes, new) for x in unmatched_claims(claims, writes, new)]
    if c.requested and not confirmed:
        out.append(f"does not confirm the {c.requested} change")
    return list(dict.fromkeys(out))


def denials_rule(c: AnswerContext) -> list[str]:
    """A denial or an inability is true of the audit log."""
    out = []
    for a in c.reading.atoms():
        if a.kind == "deny" and a.what == "any" and c.writes:
            out.append("denies a change the database shows")
        elif a.kind == "deny" and a.what == "other" and c.changed - {c.requested}:
            out.append("says nothing else changed; the audit log shows other writes")
        elif a.kind == "cannot" and (a.what in c.changed or (a.what == "any" and c.writes)):
            out.append(f"says it could not do a {a.what} change the database shows")
    return list(dict.fromkeys(out))


def reasons_rule(c: AnswerContext) -> list[str]:
    """At most one refusal reason, this task's own (and, for a refusal task, given with its evidence)."""
    given = {a.what for a in c.reading.atoms("reason")}
    true = TRUE_REASON.get(c.check.get("reason") or c.check.get("type") or "")
    if c.check.get("type") == "number_only":
        true = None
    out = [f"gives a refusal reason that is not this task's ({r})" for r in sorted(given - {true})]
    if len(given) > 1:
        out.append("gives more than one refusal reason")
    if c.check.get("type") == "reason":
        out += _reason_evidence(c.check["reason"], given, c.evidence, c.req)
    return out


def lookups_rule(c: AnswerContext) -> list[str]:
    return (
        ["says it looked something up; no lookup was made"]
        if c.reading.atoms("lookup") and not (c.evidence.looked_up())
        else []
    )


def number_fact_rule(c: AnswerContext) -> list[str]:
    """The checked number, after the lookup that reveals it, is stated in its role."""
    check, ev = c.check, c.evidence
    out: list[str] = []
    if check["type"] == "amount_left":
        roles = ("left", "main")
        if ev.owner_seen(check["order_id"]) is None:
            out.append("states the amount left without looking the order up")
    elif check["what"] == "stock":
        roles = ("stock", "main")
        if not ev.stock_seen(check["product_id"]):
            out.append("states the stock without checking it")
    else:
        roles = ("count", "main")
        if not ev.count_seen(check["customer_id"]):
            out.append("states the order count without listing the orders")
    true = money(c.true_value)
    if not any(a.what in roles and money(a.value) == true for a in c.reading.atoms("num") if a.value is not None):
        out.append(f"does not state {true:g}")
    return out


def status_fact_rule(c: AnswerContext) -> list[str]:
    """The order's true status, after looking it up, is affirmed of it."""
    order = canon_id(c.check["order_id"])
    status = c.status_of(order)
    out: list[str] = []
    if not c.evidence.statuses_seen(order):
        out.append("states a status without looking the order up")
    said = {a.what for st, o, _ in c.about() for a in st.atoms if a.kind == "status" and not a.negated and o == order}
    if status not in said:
        out.append(f"does not state that the order is {status}")
    return out


def reason_rule(c: AnswerContext) -> list[str]:
    return []  # the reason and its evidence are judged by reasons_rule on every task


# rules read on every task, then the rule of the task's check type
ANSWER_RULES: tuple[Rule, ...] = (
    understood_rule,
    references_rule,
    statuses_rule,
    numbers_rule,
    claims_rule,
    denials_rule,
    reasons_rule,
    lookups_rule,
)
GENERAL_RULES = ANSWER_RULES
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
    """Is every statement of the answer understood, grounded and true? (module doc, point 3)"""
    if answer is None or not any(ch.isalnum() for ch in answer):
        return AnswerJudgement(False, ["no answer"])
    check = task.reference.get("check") or {}
    kind = check.get("type")
    if kind is not None and kind not in FACT_RULES:
        raise ValueError(f"unknown check type {kind!r}")
    reading = read_answer(answer, vocabulary(task, init, act))
    ctx = AnswerContext(task, reading, evidence, init, exp, act, new_writes(init, act), _true_value(check, exp))
    problems: list[str] = []
    for rule in ANSWER_RULES:
        problems += rule(ctx)
        if rule is understood_rule and problems:
            break  # an answer that is not understood is not judged further
    if not problems and kind:
        problems += FACT_RULES[kind](ctx)
    expected = (
        ctx.true_value
        if ctx.true_value is not None
        else (_expected_status(ctx) if kind in ("status", "status_word") else None)
    )
    return AnswerJudgement(not problems, problems, expected, privacy_violations(answer, task, init, act))


def _expected_status(c: AnswerContext) -> str | None:
    order = c.check.get("order_id")
    return c.status_of(canon_id(order)) if order else None


def _reason_evidence(reason: str, given: set[str], evidence: Evidence, req: dict[str, Any]) -> list[str]:
    if reason == "not_found_customer":
        if not evidence.not_found("find_customer", "email", req["email"]):
            return ["says the customer is unknown without looking up the e-mail given"]
        return [] if "not_found_customer" in given else ["does not say the customer was not found"]
    if reason == "no_order":
        if not evidence.not_found("get_order", "order_id", req["order_id"]):
            return ["says the order does not exist without looking it up"]
        return [] if "not_found_order" in given else ["does not say the order was not found"]
    if reason == "not_yours":
        me = evidence.identified(req["email"])
        owner = evidence.owner_seen(req["order_id"])
        if me is None or owner is None or owner == me:
            return ["says the order is someone else's without identifying the customer and looking the order up"]
        return [] if "not_yours" in given else ["does not say the order is not the customer's"]
    raise ValueError(f"unknown refusal reason {reason!r}")


__all__ = [
    "ANSWER_RULES",
    "AnswerContext",
    "AnswerJudgement",
    "Evidence",
    "FACT_RULES",
    "GENERAL_RULES",
    "FAMILY_OF_TOOL",
    "Observation",
    "audit_rows",
    "canonical_arguments",
    "canonical_value",
    "changed_families",
    "judge_answer",
    "new_writes",
    "privacy_violations",
    "rows_diffs",
    "table_diffs",
    "table_rows",
    "unrequested_audit",
    "unrequested_writes",
    "vocabulary",
    "writes_between",
]
