"""Free-text mode: the final database's value of each figure an answer may report.

A reported figure (a stock level, a price, an order count, an order's total, what was refunded,
what is left to refund, an item's quantity) counts only when it equals the value in the **final**
database *and* a tool of the episode returned that value (the verifier checks the second part
against its observations). A figure seen before a write changed it is stale: it was observed,
but it is no longer true, so it fails.
"""

from __future__ import annotations

import sqlite3

from .world import money

# roles whose value is a whole number of units: a figure with decimals is never one of them
INTEGER_ROLES = frozenset({"stock", "count", "qty", "item"})


def is_integer_role(role: str) -> bool:
    return role in INTEGER_ROLES or role.startswith("scount:")


def product_row(act: sqlite3.Connection, product: str) -> tuple | None:
    """(id, name, price, stock) of the product named ``product`` (its name, plural or id)."""
    key = str(product).strip().lower()
    for row in act.execute("SELECT id, name, price, stock FROM products"):
        if key in {row[0].lower(), row[1].lower(), row[1].lower() + "s", row[1].lower() + "es"}:
            return row
    return None


def product_value(act: sqlite3.Connection, product: str, key: str) -> float | None:
    """The final ``key`` (``stock`` or ``price``) of ``product``; None for an unknown product."""
    row = product_row(act, product)
    if row is None:
        return None
    return money(row[3] if key == "stock" else row[2])


def order_count(act: sqlite3.Connection, customer_id: str, status: str | None = None) -> float:
    """How many orders the customer has in the final database (of one status, if given)."""
    if status is None:
        sql, params = "SELECT COUNT(*) FROM orders WHERE customer_id = ?", (customer_id,)
    else:
        sql, params = "SELECT COUNT(*) FROM orders WHERE customer_id = ? AND status = ?", (customer_id, status)
    return float(act.execute(sql, params).fetchone()[0])


def order_value(act: sqlite3.Connection, order_id: str, key: str) -> float | None:
    """An order's final ``total``, ``refunded`` (the sum of its refunds) or ``left`` (total - refunded)."""
    row = act.execute(
        "SELECT total, COALESCE((SELECT SUM(amount) FROM refunds WHERE order_id = ?), 0) FROM orders WHERE id = ?",
        (order_id, order_id),
    ).fetchone()
    if row is None:
        return None
    total, refunded = row
    return money({"total": total, "refunded": refunded, "left": total - refunded}[key])


def item_quantity(act: sqlite3.Connection, order_id: str, product_id: str) -> float | None:
    """How many units of ``product_id`` the order holds in the final database (None: not one of its items)."""
    row = act.execute(
        "SELECT SUM(quantity) FROM order_items WHERE order_id = ? AND product_id = ?", (order_id, product_id)
    ).fetchone()
    return None if row is None or row[0] is None else float(row[0])


__all__ = [
    "INTEGER_ROLES",
    "is_integer_role",
    "item_quantity",
    "order_count",
    "order_value",
    "product_row",
    "product_value",
]
