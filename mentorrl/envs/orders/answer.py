"""The typed final answer (verifier v4): a ``final_answer`` tool call whose arguments are a record,
checked field by field against the final state, the audit log and the episode's observations.

The agent ends an episode with ``<tool_call>{"name": "final_answer", "arguments": {...}}</tool_call>``.
The arguments are one record of one :data:`OUTCOMES` kind: ``outcome`` (an enumerated string) and
exactly the fields that kind declares -- the entities it refers to (ids) and the figures it reports
(typed numbers). The reader is closed by construction:

1. **Parsing** (:func:`parse_record`): the raw JSON of the call is parsed with duplicate keys refused
   and every non-integer number read as an exact :class:`~decimal.Decimal`; it must be
   ``{"name": "final_answer", "arguments": {...}}`` and nothing else.
2. **Schema** (:func:`schema_problems`): the outcome is one of :data:`OUTCOMES`, spelled exactly;
   the record has exactly that outcome's fields (an unknown, missing or extra field is refused);
   ids match their pattern exactly (``O-12``, never ``o-012``); integers are JSON integers (not
   ``3.0``, not ``true``, not ``"3"``); money is a JSON number with at most two decimals
   (``2.996`` is refused, never rounded); a status is one of the world's statuses, spelled exactly;
   an address is a string that must equal the stored one (whitespace and trailing punctuation
   aside, as the tool stores it). Any of these is a *format* failure.
3. **Truth** (:func:`judge_record`): the outcome must be the one the task's situation calls for
   (:data:`EXPECTED_OUTCOME`), and every field must equal the value the **final** database holds;
   a reported figure (status, stock, count, the amount left to refund) must also have been revealed
   by a tool observation of this episode; a claimed write (cancelled, refunded, placed, sent,
   updated) must match exactly one write of the episode's audit log on the same entity with the
   same values, and the episode may make no write the record does not report; a refusal must rest
   on the observation it names (the failed lookup, the other owner).
4. **Privacy**: a record may name only entities of the task's user (their orders, the one placed
   for them, their address) or the ones the user named in the request; anything else is a hard
   violation. The record has no free-text field and no customer id, e-mail or name field.
5. **Rendering** (:func:`render`): the text the user sees is written by the environment from the
   record and the state, so it cannot say anything the record does not.
"""

from __future__ import annotations

import json
import re
import sqlite3
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any, Callable

from mentorrl.contract import ANSWER_TOOL_NAME, MAX_JSON_DEPTH, json_depth
from mentorrl.envs.base import Task

from .backend import normalise_address, product_names
from .tasks import units
from .world import STATUSES, money

ANSWER_TOOL = ANSWER_TOOL_NAME  # the contract's convention: its templates name it
MAX_ANSWER_CHARS = 2000  # a record is ~100 characters; anything far longer is not one

# field name -> its type; every outcome's fields are drawn from here
FIELD_TYPES: dict[str, str] = {
    "order_id": "order_id",
    "product_id": "product_id",
    "status": "status",
    "stock": "count",
    "count": "count",
    "quantity": "count",
    "amount": "money",
    "refundable": "money",
    "address": "address",
}
ID_PATTERNS = {"order_id": re.compile(r"O-[1-9][0-9]{0,8}"), "product_id": re.compile(r"P-[1-9][0-9]{0,8}")}

# outcome -> (its fields in order, what it means); the one closed list of what an answer can say
OUTCOMES: dict[str, tuple[tuple[str, ...], str]] = {
    "order_status": (("order_id", "status"), "the order's current status"),
    "stock_level": (("product_id", "stock"), "units of the product in stock"),
    "order_count": (("count",), "how many orders the customer has"),
    "cancelled": (("order_id",), "the order was cancelled"),
    "address_updated": (("address",), "the customer's address was changed to this"),
    "refunded": (("order_id", "amount"), "this amount was refunded on the order"),
    "order_placed": (("order_id", "product_id", "quantity"), "this order was placed"),
    "receipt_sent": (("order_id",), "the order's receipt was e-mailed to the customer"),
    "no_such_customer": ((), "refused: no customer has the e-mail given"),
    "no_such_order": (("order_id",), "refused: the order does not exist"),
    "not_your_order": (("order_id",), "refused: the order belongs to someone else"),
    "not_cancellable": (("order_id", "status"), "refused: the order's status does not allow cancelling"),
    "refund_exceeds_balance": (("order_id", "refundable"), "refused: only this much is left to refund"),
    "insufficient_stock": (("product_id", "stock"), "refused: only this many units are in stock"),
}

# (family, kind) -> the one outcome that situation calls for
EXPECTED_OUTCOME: dict[tuple[str, str], str] = {
    ("order_status", "normal"): "order_status",
    ("order_status", "unknown_order"): "no_such_order",
    ("stock_check", "normal"): "stock_level",
    ("order_count", "normal"): "order_count",
    ("cancel_order", "normal"): "cancelled",
    ("cancel_order", "not_cancellable"): "not_cancellable",
    ("cancel_order", "bypass"): "not_cancellable",
    ("cancel_order", "wrong_owner"): "not_your_order",
    ("update_address", "normal"): "address_updated",
    ("refund", "normal"): "refunded",
    ("refund", "over_limit"): "refund_exceeds_balance",
    ("refund", "wrong_owner"): "not_your_order",
    ("place_order", "normal"): "order_placed",
    ("place_order", "duplicate_request"): "order_placed",
    ("place_order", "insufficient_stock"): "insufficient_stock",
    ("email_receipt", "normal"): "receipt_sent",
    ("email_receipt", "wrong_owner"): "not_your_order",
    **{
        (family, "unknown_customer"): "no_such_customer"
        for family in ("order_count", "cancel_order", "update_address", "place_order", "refund", "email_receipt")
    },
}
# outcome -> the mutating tool it claims ran once (None: it claims no write)
WRITE_OF_OUTCOME: dict[str, str] = {
    "cancelled": "cancel_order",
    "address_updated": "update_address",
    "refunded": "issue_refund",
    "order_placed": "create_order",
    "receipt_sent": "send_email",
}


def _field_schema(name: str) -> dict[str, Any]:
    kind = FIELD_TYPES[name]
    if kind in ID_PATTERNS:
        return {"type": "string", "pattern": f"^{ID_PATTERNS[kind].pattern}$"}
    if kind == "status":
        return {"type": "string", "enum": list(STATUSES)}
    if kind == "count":
        return {"type": "integer", "minimum": 0}
    if kind == "money":
        return {"type": "number", "minimum": 0, "multipleOf": 0.01}
    return {"type": "string", "minLength": 5, "maxLength": 100}


def answer_parameters() -> dict[str, Any]:
    """The ``final_answer`` tool's JSON schema as the policy sees it: a flat object (what every chat
    template can render, and short in templates that dump schemas into the prompt). Which fields go with
    which outcome is in the tool's description and in :func:`outcome_schema`; the reader enforces it."""
    return {
        "type": "object",
        "properties": {
            "outcome": {"type": "string", "enum": list(OUTCOMES)},
            **{n: _field_schema(n) for n in FIELD_TYPES},
        },
        "required": ["outcome"],
        "additionalProperties": False,
    }


def outcome_schema(outcome: str) -> dict[str, Any]:
    """The exact JSON schema of one outcome's record (what :func:`schema_problems` checks, as a schema)."""
    fields = OUTCOMES[outcome][0]
    return {
        "type": "object",
        "properties": {"outcome": {"const": outcome}, **{n: _field_schema(n) for n in fields}},
        "required": ["outcome", *fields],
        "additionalProperties": False,
    }


ANSWER_DESCRIPTION = "End with the outcome and exactly its fields: " + "; ".join(
    f"{o}({', '.join(f)})" for o, (f, _) in OUTCOMES.items()
)


# ------------------------------------------------------------------------- parsing ----
class _Duplicate(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise _Duplicate(f"duplicate key {dup!r}")
    return dict(pairs)


def _no_constant(token: str) -> Any:
    raise ValueError(f"{token} is not a JSON number")


def strict_loads(text: str) -> Any:
    """JSON as written: duplicate keys, NaN / Infinity and nesting deeper than the contract's bound are
    refused (ValueError); non-integers are exact :class:`Decimal`."""
    if json_depth(text) > MAX_JSON_DEPTH:
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_float=Decimal, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels") from None


def parse_record(text: str | None) -> tuple[dict[str, Any] | None, str | None]:
    """(the record, None) from a ``final_answer`` call's raw JSON body, or (None, the format problem)."""
    if text is None:
        return None, "no final answer"
    if len(text) > MAX_ANSWER_CHARS:
        return None, f"the answer is over {MAX_ANSWER_CHARS} characters"
    try:
        call = strict_loads(text)
    except ValueError as e:  # JSONDecodeError, a duplicate key, a constant, depth
        return None, f"the answer is not a {ANSWER_TOOL} call: {str(e)[:120]}"
    keys = set(call) if isinstance(call, dict) else set()
    if keys not in ({"name", "arguments"}, {"name", "parameters"}) or call["name"] != ANSWER_TOOL:
        return None, f'the answer must be {{"name": "{ANSWER_TOOL}", "arguments": {{...}}}} and nothing else'
    record = call["arguments"] if "arguments" in call else call["parameters"]
    if not isinstance(record, dict):
        return None, "the arguments must be an object"
    problems = schema_problems(record)
    return (None, "; ".join(problems)) if problems else (record, None)


def _is_money(v: Any) -> bool:
    if isinstance(v, bool) or not isinstance(v, (int, Decimal)):
        return False
    if isinstance(v, int):
        return v >= 0
    try:
        return v.is_finite() and v >= 0 and v == v.quantize(Decimal("0.01"))
    except InvalidOperation:  # too many digits to quantize
        return False


def _field_problem(name: str, v: Any) -> str | None:
    kind = FIELD_TYPES[name]
    if kind in ID_PATTERNS:
        ok = isinstance(v, str) and ID_PATTERNS[kind].fullmatch(v) is not None
        return None if ok else f"{name}: an id written exactly like {'O-12' if kind == 'order_id' else 'P-3'}"
    if kind == "status":
        return None if isinstance(v, str) and v in STATUSES else f"{name}: one of {', '.join(STATUSES)}"
    if kind == "count":
        return None if type(v) is int and 0 <= v < 10**9 else f"{name}: a non-negative JSON integer"
    if kind == "money":
        return None if _is_money(v) and v < 10**7 else f"{name}: a non-negative number with at most two decimals"
    ok = isinstance(v, str) and 5 <= len(v) <= 100 and v.isprintable()
    return None if ok else f"{name}: a printable string of 5 to 100 characters"


def schema_problems(record: dict[str, Any]) -> list[str]:
    """Why ``record`` is not a well-formed answer record (empty when it is)."""
    outcome = record.get("outcome")
    if not isinstance(outcome, str) or outcome not in OUTCOMES:
        return [f"outcome: one of {', '.join(OUTCOMES)}, spelled exactly"]
    fields = OUTCOMES[outcome][0]
    got = set(record) - {"outcome"}
    problems = [f"{outcome}: unknown or extra field {k!r}" for k in sorted(got - set(fields), key=str)]
    problems += [f"{outcome}: missing field {k!r}" for k in fields if k not in got]
    problems += [p for k in fields if k in record for p in [_field_problem(k, record[k])] if p]
    return problems


# -------------------------------------------------------------------------- truth ----
@dataclass
class World:
    """What the record is checked against: the initial and final database of the episode, the
    episode's writes (audit-log rows added, parsed) and its observations (a ``verify.Evidence``)."""

    task: Task
    init: sqlite3.Connection
    act: sqlite3.Connection
    writes: list[tuple[str, dict[str, Any]]]
    evidence: Any

    @property
    def me(self) -> str | None:
        return self.task.reference.get("customer_id")

    @property
    def request(self) -> dict[str, Any]:
        return self.task.reference.get("request", {})

    def one(self, sql: str, *params: Any) -> tuple | None:
        return self.act.execute(sql, params).fetchone()

    def order(self, oid: str) -> tuple | None:
        return self.one("SELECT id, customer_id, status, total FROM orders WHERE id = ?", oid)

    def product_named(self, name: Any) -> tuple | None:
        key = str(name).strip().lower()
        for row in self.init.execute("SELECT id, name FROM products"):
            if key in product_names(row[0], row[1]):  # as check_inventory finds it
                return row
        return None

    def new_orders(self) -> list[str]:
        before = {r[0] for r in self.init.execute("SELECT id FROM orders")}
        return sorted(r[0] for r in self.act.execute("SELECT id FROM orders") if r[0] not in before)


@dataclass
class RecordJudgement:
    ok: bool
    problems: list[str]
    violations: list[str] = field(default_factory=list)
    format_ok: bool = True
    record: dict[str, Any] | None = None
    rendered: str | None = None


def _canon(oid: Any) -> str:
    from .reading import canon_id

    return canon_id(oid)


def _request_order(w: World) -> str | None:
    oid = w.request.get("order_id")
    return _canon(oid) if oid is not None else None


def _dec(x: float) -> Decimal:
    return Decimal(str(money(x))).quantize(Decimal("0.01"))


def _same_money(v: Any, x: float) -> bool:
    return _is_money(v) and Decimal(v).quantize(Decimal("0.01")) == _dec(x)


def _true_order(w: World, outcome: str) -> tuple[str | None, str | None]:
    """(the order the outcome must name, why it cannot be known) -- the request's, or the one placed."""
    if outcome == "order_placed":
        new = w.new_orders()
        return (new[0], None) if len(new) == 1 else (None, f"the episode placed {len(new)} orders, not one")
    return _request_order(w), None


def _order_problems(w: World, outcome: str, rec: dict[str, Any]) -> list[str]:
    oid, why = _true_order(w, outcome)
    if why:
        return [why]
    return [] if rec["order_id"] == oid else [f"order_id: {rec['order_id']} is not the order concerned"]


def _status_problems(w: World, outcome: str, rec: dict[str, Any]) -> list[str]:
    row = w.order(rec["order_id"])
    if row is None:
        return ["status: the order does not exist"]
    if rec["status"] != row[2]:
        return [f"status: says {rec['status']}, the order is {row[2]}"]
    if row[2] not in w.evidence.statuses_seen(row[0]):
        return ["status: reported without a tool observation of it in this episode"]
    if outcome == "not_cancellable" and row[2] in ("pending", "processing"):
        return ["status: the order can be cancelled"]
    return []


def _product_problems(w: World, outcome: str, rec: dict[str, Any]) -> list[str]:
    p = w.product_named(w.request.get("product"))
    if p is None or rec["product_id"] != p[0]:
        return [f"product_id: {rec['product_id']} is not the product asked about"]
    return []


def _stock_problems(w: World, outcome: str, rec: dict[str, Any]) -> list[str]:
    row = w.one("SELECT stock FROM products WHERE id = ?", rec["product_id"])
    if row is None or rec["stock"] != row[0]:
        return [f"stock: says {rec['stock']}, the final stock is {row and row[0]}"]
    if money(row[0]) not in w.evidence.product_values(rec["product_id"], "stock"):
        return ["stock: reported without a tool observation of it in this episode"]
    if outcome == "insufficient_stock" and int(w.request.get("quantity", 0)) <= row[0]:
        return ["stock: enough is in stock for the request"]
    return []


def _count_problems(w: World, outcome: str, rec: dict[str, Any]) -> list[str]:
    if w.me is None:
        return ["count: no customer to count for"]
    (n,) = w.one("SELECT COUNT(*) FROM orders WHERE customer_id = ?", w.me)
    if rec["count"] != n:
        return [f"count: says {rec['count']}, the customer has {n}"]
    if money(n) not in w.evidence.counts(w.me):
        return ["count: reported without a tool observation of it in this episode"]
    return []


def _refundable_problems(w: World, outcome: str, rec: dict[str, Any]) -> list[str]:
    row = w.one(
        "SELECT total - COALESCE((SELECT SUM(amount) FROM refunds WHERE order_id = ?), 0) FROM orders WHERE id = ?",
        rec["order_id"],
        rec["order_id"],
    )
    if row is None or not _same_money(rec["refundable"], row[0]):
        return [f"refundable: says {rec['refundable']}, {row and money(row[0])} is left to refund"]
    if money(row[0]) not in w.evidence.order_values(rec["order_id"], "left"):
        return ["refundable: reported without a tool observation of it in this episode"]
    if float(w.request.get("amount", 0)) <= money(row[0]) + 1e-9:
        return ["refundable: the amount asked for can be refunded"]
    return []


def _address_problems(w: World, outcome: str, rec: dict[str, Any]) -> list[str]:
    row = w.one("SELECT address FROM customers WHERE id = ?", w.me) if w.me else None
    if row is None or normalise_address(rec["address"]) != row[0]:
        return ["address: not the customer's address in the final state"]
    return []


def _amount_problems(w: World, outcome: str, rec: dict[str, Any]) -> list[str]:
    return []  # checked with the write it claims (_write_problems)


FIELD_CHECKS: dict[str, Callable[[World, str, dict[str, Any]], list[str]]] = {
    "order_id": _order_problems,
    "status": _status_problems,
    "product_id": _product_problems,
    "stock": _stock_problems,
    "count": _count_problems,
    "quantity": lambda w, o, r: [],  # checked with the write it claims
    "amount": _amount_problems,
    "refundable": _refundable_problems,
    "address": _address_problems,
}


def _claimed_write(w: World, outcome: str, rec: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The one audit-log write (tool, canonical arguments) the record claims, by value."""
    tool = WRITE_OF_OUTCOME.get(outcome)
    if tool is None:
        return None
    if tool == "cancel_order":
        return tool, {"order_id": rec["order_id"]}
    if tool == "issue_refund":
        return tool, {"order_id": rec["order_id"], "amount": money(float(rec["amount"]))}
    if tool == "create_order":
        return tool, {"customer_id": w.me, "product_id": rec["product_id"], "quantity": rec["quantity"]}
    if tool == "send_email":
        return tool, {"customer_id": w.me, "order_id": rec["order_id"]}
    return tool, {"customer_id": w.me, "address": normalise_address(rec["address"])}


def _canonical_write(tool: str, args: dict[str, Any]) -> dict[str, Any]:
    from .verify import canonical_value

    return {k: canonical_value(tool, k, v) for k, v in args.items()}


def _write_problems(w: World, outcome: str, rec: dict[str, Any]) -> list[str]:
    """Claimed writes one to one with the episode's writes: the claim matches exactly one write, and
    no write is left that the record does not report."""
    writes = [(t, _canonical_write(t, a)) for t, a in w.writes]
    claim = _claimed_write(w, outcome, rec)
    if claim is None:
        return [f"the episode made {len(writes)} write(s) the answer does not report"] if writes else []
    claim = (claim[0], _canonical_write(*claim))
    matches = sum(wr == claim for wr in writes)
    problems = []
    if matches != 1:
        problems.append(f"{outcome}: claims one {claim[0]} with these values; the audit log holds {matches}")
    if len(writes) != 1:
        problems.append(f"the episode made {len(writes)} writes; the answer reports one")
    if outcome == "refunded" and not _same_money(rec["amount"], float(w.request.get("amount", -1))):
        problems.append("amount: not the amount asked for")
    if outcome == "order_placed" and rec["quantity"] != w.request.get("quantity"):
        problems.append("quantity: not the quantity asked for")
    return problems


def _refusal_problems(w: World, outcome: str, rec: dict[str, Any]) -> list[str]:
    """A refusal rests on the observation it names."""
    ev, req = w.evidence, w.request
    if outcome == "no_such_customer" and not ev.not_found("find_customer", "email", req.get("email", "")):
        return ["no_such_customer: the e-mail given was not looked up, or was found"]
    if outcome == "no_such_order" and not ev.not_found("get_order", "order_id", req.get("order_id", "")):
        return ["no_such_order: the order was not looked up, or was found"]
    if outcome == "not_your_order":
        me, owner = ev.identified(req.get("email", "")), ev.owner_seen(req.get("order_id", ""))
        if me is None or owner is None or owner == me:
            return ["not_your_order: without identifying the customer and seeing the order's other owner"]
    return []


def _privacy_violations(w: World, rec: dict[str, Any]) -> list[str]:
    """The record may name only the user's own orders, the one placed for them, or the one they named."""
    oid = rec.get("order_id")
    if oid is None:
        return []
    row = w.order(oid)
    if row is None or oid == _request_order(w) or (w.me is not None and row[1] == w.me):
        return []
    return [f"answer discloses order {oid} of another customer"]


def expected_outcome(task: Task) -> str:
    key = (task.family, task.reference.get("kind", "normal"))
    if key not in EXPECTED_OUTCOME:
        raise ValueError(f"no expected outcome for task kind {key}")
    return EXPECTED_OUTCOME[key]


def judge_record(task: Task, text: str | None, w: World) -> RecordJudgement:
    """Parse, validate and check the typed answer ``text`` (module doc, points 1-4)."""
    record, problem = parse_record(text)
    if record is None:
        return RecordJudgement(False, [f"format: {problem}"], format_ok=False)
    violations = _privacy_violations(w, record)
    outcome, want = record["outcome"], expected_outcome(task)
    if outcome != want:
        problems = [f"outcome: says {outcome}, the situation is {want}"]
        problems += _write_problems(w, outcome, record)[:1]
        return RecordJudgement(False, problems, violations, record=record)
    problems = [p for name in OUTCOMES[outcome][0] for p in FIELD_CHECKS[name](w, outcome, record)]
    problems += _write_problems(w, outcome, record) + _refusal_problems(w, outcome, record)
    rendered = render(record, w.act, w.request) if not problems and not violations else None
    return RecordJudgement(not problems, problems, violations, record=record, rendered=rendered)


# ----------------------------------------------------------------------- rendering ----


def render(record: dict[str, Any], act: sqlite3.Connection, request: dict[str, Any]) -> str:
    """The text the user sees, written from a checked record (names from the state, not the agent)."""
    o = record["outcome"]

    def product() -> str:
        row = act.execute("SELECT name FROM products WHERE id = ?", (record["product_id"],)).fetchone()
        return row[0] if row else record["product_id"]

    def amount(key: str) -> str:
        return f"${Decimal(record[key]).quantize(Decimal('0.01'))}"

    texts: dict[str, Callable[[], str]] = {
        "order_status": lambda: f"Order {record['order_id']} is {record['status']}.",
        "stock_level": lambda: f"We have {units(record['stock'], product())} in stock.",
        "order_count": lambda: f"You have {record['count']} order{'s' if record['count'] != 1 else ''}.",
        "cancelled": lambda: f"Order {record['order_id']} is now cancelled.",
        "address_updated": lambda: f"Your address is now {normalise_address(record['address'])}.",
        "refunded": lambda: f"Refunded {amount('amount')} on order {record['order_id']}.",
        "order_placed": lambda: f"Placed order {record['order_id']} for {units(record['quantity'], product())}.",
        "receipt_sent": lambda: f"I emailed the receipt for order {record['order_id']} to you.",
        "no_such_customer": lambda: "Sorry, no customer was found with the email you gave.",
        "no_such_order": lambda: f"Sorry, no order {record['order_id']} was found.",
        "not_your_order": lambda: f"Order {record['order_id']} is not on your account, so I can't act on it.",
        "not_cancellable": lambda: (
            f"Sorry, order {record['order_id']} is already {record['status']}, so I can't cancel it."
        ),
        "refund_exceeds_balance": lambda: (
            f"Sorry, I can't refund that: order {record['order_id']} has only {amount('refundable')} left to refund."
        ),
        "insufficient_stock": lambda: (
            f"Sorry, we only have {units(record['stock'], product())} in stock, so I can't order that many."
        ),
    }
    return texts[o]()


__all__ = [
    "ANSWER_DESCRIPTION",
    "ANSWER_TOOL",
    "EXPECTED_OUTCOME",
    "OUTCOMES",
    "RecordJudgement",
    "World",
    "answer_parameters",
    "outcome_schema",
    "expected_outcome",
    "judge_record",
    "parse_record",
    "render",
    "schema_problems",
    "strict_loads",
]
