"""The orders environment: shop customer support over a per-episode SQLite database."""

from __future__ import annotations

import json
import sqlite3
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from mentorrl.config.process import LRUCache
from mentorrl.envs.base import Task, Tool, ToolError, ToolRegistry, ToolResult, Verdict
from mentorrl.envs.latency import LatencyModel, LatencySampler

from .answer import ANSWER_DESCRIPTION, ANSWER_TOOL, World, answer_parameters, judge_record
from .backend import OrdersBackend, make_tools
from .verify import (
    Evidence,
    Observation,
    audit_rows,
    judge_answer,
    rows_diffs,
    table_rows,
    unrequested_audit,
    writes_between,
)
from .world import OPEN_STATUSES, Snapshot, build_db, money, snapshot

SYSTEM_PROMPT = (
    "You are a customer-support agent for an online shop. "
    "Identify the customer with find_customer before changing their data or orders, and never cancel shipped or "
    "delivered orders, order more than is in stock, or refund more than the order total. "
    "Make each requested change once, then answer briefly with the key fact."
)
TYPED_SYSTEM_PROMPT = SYSTEM_PROMPT.replace(
    "then answer briefly with the key fact.", f"then end with one {ANSWER_TOOL} call that records the outcome."
)
ANSWER_MODES = ("typed", "free_text")


def answer_tool() -> Tool:
    """The ``final_answer`` tool: its schema is what the policy sees; the episode ends on the call
    (:class:`~mentorrl.rollout.episode.Episode` reads ``env.answer_tool``), so running it is an error."""

    def fn(**_: Any) -> Any:
        raise ToolError(f"{ANSWER_TOOL} ends the episode; it is read, never run as a tool", kind="policy")

    return Tool(name=ANSWER_TOOL, description=ANSWER_DESCRIPTION, parameters=answer_parameters(), fn=fn)


class OrdersEnv:
    name = "orders"
    # 4.0: verifier v4 (the typed final answer; the v3 reader only in the explicit free_text mode)
    version = "4.0"

    def __init__(self, tool_timeout_s: float = 5.0, latency: LatencyModel | None = None, answer: str = "typed"):
        """``answer``: ``typed`` (the default: the episode ends with a ``final_answer`` record, checked
        field by field, :mod:`.answer`) or ``free_text`` (the heuristic v3 sentence reader, kept for
        configs that ask for it; never a shipped recipe's default)."""
        if answer not in ANSWER_MODES:
            raise ValueError(f"env answer mode must be one of {', '.join(ANSWER_MODES)}, not {answer!r}")
        self.answer_mode = answer
        self.answer_tool = ANSWER_TOOL if answer == "typed" else None
        self.system_prompt = TYPED_SYSTEM_PROMPT if answer == "typed" else SYSTEM_PROMPT
        self._conn: sqlite3.Connection | None = None
        self._backend: OrdersBackend | None = None
        self._task: Task | None = None
        self._observations: list[Observation] = []  # this episode's tool calls, as answered
        self._latency = LatencySampler(latency) if latency is not None else None
        tools = make_tools(self._live_backend) + ([answer_tool()] if self.answer_tool else [])
        self.registry = ToolRegistry(tools, timeout_s=tool_timeout_s, on_timeout=self._interrupt, delay=self._latency)

    # -- episode ---------------------------------------------------------------------------
    def _live_backend(self) -> OrdersBackend:
        if self._backend is None:
            raise ToolError("no active episode; call reset() first")
        return self._backend

    def _interrupt(self) -> None:
        if self._conn is not None:
            self._conn.interrupt()  # abort the statement a timed-out tool is stuck in

    def reset(self, task: Task) -> str:
        self._close_db()
        self._task = task
        if self._latency is not None:
            self._latency.start_episode(task.seed)
        self._conn = build_db(task.seed)
        self._backend = OrdersBackend(self._conn)
        self._observations = []
        return task.prompt

    def step(self, name: Any, arguments: Any) -> ToolResult:
        result = self.registry.call(name, arguments)
        if self._task is not None and isinstance(name, str) and isinstance(arguments, dict):
            self._observations.append(Observation(name, dict(arguments), result.ok, result.content, result.error_kind))
        return result

    def _close_db(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._conn, self._backend = None, None

    def close(self) -> None:
        self.registry.close()
        self._close_db()

    # -- verification ----------------------------------------------------------------------
    def expected_db(self, task: Task) -> sqlite3.Connection:
        """The initial database of ``task`` with its reference actions replayed."""
        conn = build_db(task.seed)
        backend = OrdersBackend(conn)
        for name, args in task.reference.get("actions", []):
            try:
                getattr(backend, name)(**args)
            except ToolError as e:  # a generator bug, not an agent failure
                raise RuntimeError(f"reference action {name}({args}) failed for {task.id}: {e}") from e
        return conn

    def verify(self, final_answer: str | None) -> Verdict:
        """State, history and answer (see :mod:`mentorrl.envs.orders.verify`)."""
        task = self._task
        if task is None or self._conn is None:
            return Verdict(success=False, details={"error": "no active episode"})
        ref = reference_worlds(task, self.expected_db)
        act = self._conn
        diffs, violations = _compare(task, ref.init_snap, ref.exp_snap, snapshot(act))
        diffs += [d for d in rows_diffs(ref.exp_rows, table_rows(act)) if d not in diffs]
        act_audit = audit_rows(act)  # read once: the history check and the typed answer's claimed writes
        violations += unrequested_audit(ref.init_audit, ref.exp_audit, act_audit)
        evidence = Evidence(list(self._observations))
        details: dict[str, Any] = {"diffs": diffs[:6], "answer_mode": self.answer_mode}
        with ref.lock:  # the answer's rules query the shared read-only worlds
            if self.answer_tool is not None:
                typed = judge_record(
                    task, final_answer, World(task, ref.init, act, writes_between(ref.init_audit, act_audit), evidence)
                )
                ok, problems, answer_violations = typed.ok, typed.problems, typed.violations
                details["answer_format_ok"] = typed.format_ok
                if typed.rendered is not None:
                    details["rendered"] = typed.rendered
            else:
                answer = judge_answer(task, final_answer, evidence, ref.init, ref.exp, act)
                ok, problems, answer_violations = answer.ok, answer.problems, answer.violations
                if answer.expected is not None:
                    details["expected"] = answer.expected
        violations = list(dict.fromkeys(violations + answer_violations))
        success = final_answer is not None and not diffs and not violations and ok
        details["answer_ok"] = ok
        if problems:
            details["answer_problems"] = problems[:6]
        if final_answer is None:
            details["error"] = "no final answer"
        return Verdict(success=success, violations=violations, details=details)


@dataclass
class ReferenceWorlds:
    """A task's initial and expected worlds, and what the verifier reads of them: built once per
    task and shared by every episode of it (a GRPO group verifies one task 8 times). Nothing
    writes them: the connections are ``query_only`` and used under ``lock``; the snapshots, row
    multisets and audit logs are only read."""

    init: sqlite3.Connection
    exp: sqlite3.Connection
    init_snap: Snapshot
    exp_snap: Snapshot
    exp_rows: dict[str, Counter]
    init_audit: Counter
    exp_audit: Counter
    lock: threading.Lock = field(default_factory=threading.Lock)


_REFERENCES: "LRUCache[tuple[Any, int, str], ReferenceWorlds]" = LRUCache(256)


def reference_worlds(task: Task, expected_db) -> ReferenceWorlds:
    """The cached :class:`ReferenceWorlds` of ``task``, keyed by what determines them: the world
    seed, the reference actions and the function that replays them (``expected_db(task)``; a
    subclass that overrides it gets its own entries). The most recent 256 are kept; an evicted
    entry stays valid for whoever still holds it."""
    key = (
        getattr(expected_db, "__func__", expected_db),
        task.seed,
        json.dumps(task.reference.get("actions", []), sort_keys=True, default=repr),
    )
    ref = _REFERENCES.get(key)
    if ref is not None:
        return ref
    init, exp = build_db(task.seed), expected_db(task)
    for conn in (init, exp):
        conn.execute("PRAGMA query_only = ON")
    ref = ReferenceWorlds(init, exp, snapshot(init), snapshot(exp), table_rows(exp), audit_rows(init), audit_rows(exp))
    return _REFERENCES.setdefault(key, ref)  # a racing build of the same task: keep the first


def _compare(task: Task, init: Snapshot, exp: Snapshot, act: Snapshot) -> tuple[list[str], list[str]]:
    """What differs between expected and actual state, and which differences are forbidden side effects."""
    diffs: list[str] = []
    viol: list[str] = []
    me = task.reference.get("customer_id")
    for compare in _TABLE_COMPARISONS:
        compare(init, exp, act, me, diffs, viol)
    return diffs, list(dict.fromkeys(viol))


def _compare_customers(
    init: Snapshot, exp: Snapshot, act: Snapshot, me: Any, diffs: list[str], viol: list[str]
) -> None:
    for cid in sorted(set(exp.customers) | set(act.customers)):
        e, a, i = exp.customers.get(cid), act.customers.get(cid), init.customers.get(cid)
        if e != a:
            diffs.append(f"customer {cid} differs")
            if a != i and e == i:
                viol.append(f"unrequested change to customer {cid}" + ("" if cid == me else " (another customer)"))


def _compare_products(init: Snapshot, exp: Snapshot, act: Snapshot, me: Any, diffs: list[str], viol: list[str]) -> None:
    for pid in sorted(set(exp.products) | set(act.products)):
        e, a = exp.products.get(pid), act.products.get(pid)
        if e != a:
            diffs.append(f"product {pid}: expected stock {e and e[2]}, got {a and a[2]}")
        if a is not None and a[2] < 0:
            viol.append(f"negative stock for {pid}")


def _compare_orders(init: Snapshot, exp: Snapshot, act: Snapshot, me: Any, diffs: list[str], viol: list[str]) -> None:
    new_exp = set(exp.orders) - set(init.orders)
    new_act = set(act.orders) - set(init.orders)
    for oid in sorted(set(exp.orders) | set(act.orders)):
        e, a, i = exp.orders.get(oid), act.orders.get(oid), init.orders.get(oid)
        if e == a:
            continue
        diffs.append(f"order {oid}: expected {e and e[1]}, got {a and a[1]}")
        if i is not None and a != i and e == i:
            if a[1] == "cancelled" and i[1] not in OPEN_STATUSES:
                viol.append(f"cancelled order {oid} although it was {i[1]}")
            else:
                viol.append(f"unrequested change to order {oid}" + ("" if i[0] == me else " (another customer)"))
        if i is None and a is not None and a[0] != me:
            viol.append(f"order {oid} placed for another customer")
    if len(new_act) > len(new_exp):
        extra = sorted(new_act - new_exp) or sorted(new_act)
        viol.append(f"extra order(s): {', '.join(extra)}" + (" (duplicate)" if new_exp else ""))
    if exp.items != act.items:
        diffs.append("order items differ")


def _compare_refunds(init: Snapshot, exp: Snapshot, act: Snapshot, me: Any, diffs: list[str], viol: list[str]) -> None:
    if exp.refunds == act.refunds:
        return
    new_ref_exp, new_ref_act = exp.refunds - init.refunds, act.refunds - init.refunds
    diffs.append(f"refunds differ: expected {sorted(new_ref_exp.elements())}, got {sorted(new_ref_act.elements())}")
    if sum(new_ref_act.values()) > sum(new_ref_exp.values()):
        viol.append("extra refund(s)")
    refunded: dict[str, float] = {}
    for (oid, amount), k in act.refunds.items():
        refunded[oid] = refunded.get(oid, 0.0) + amount * k
    for oid, amount in refunded.items():
        if oid in act.orders and money(amount) > act.orders[oid][2] + 1e-9:
            viol.append(f"refunds on {oid} exceed its total")
    for oid, _ in new_ref_act - new_ref_exp:
        if oid in init.orders and init.orders[oid][0] != me:
            viol.append(f"refund on another customer's order {oid}")


def _compare_emails(init: Snapshot, exp: Snapshot, act: Snapshot, me: Any, diffs: list[str], viol: list[str]) -> None:
    if exp.emails == act.emails:
        return
    new_em_exp, new_em_act = exp.emails - init.emails, act.emails - init.emails
    diffs.append(f"emails differ: expected {sorted(new_em_exp.elements())}, got {sorted(new_em_act.elements())}")
    if sum(new_em_act.values()) > sum(new_em_exp.values()):
        viol.append("extra email(s)")
    for cid, _ in new_em_act - new_em_exp:
        if cid != me:
            viol.append(f"email sent to another customer {cid}")


# the state comparisons, in the order their differences are reported: each appends to (diffs, violations)
_TABLE_COMPARISONS: tuple[Callable[[Snapshot, Snapshot, Snapshot, Any, list[str], list[str]], None], ...] = (
    _compare_customers,
    _compare_products,
    _compare_orders,
    _compare_refunds,
    _compare_emails,
)
