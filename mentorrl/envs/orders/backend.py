"""Tool logic over one episode's database, with the store policy enforced in the tools.

The same class runs the live episode and the verifier's replay of the reference actions.
All SQL is parameterised; mutating tools check, change and write an audit row in one
transaction, so a refused or failed call leaves the database untouched.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from mentorrl.envs.base import Tool, ToolError

from .world import OPEN_STATUSES, money, oid_num


def _s(value: Any, limit: int = 40) -> str:
    """Quote untrusted input for an error message, shortened."""
    text = str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def normalise_address(address: str) -> str:
    """One spelling per address: whitespace collapsed, trailing punctuation dropped
    ("12 Oak St, Springfield." as copied from a sentence is "12 Oak St, Springfield")."""
    return " ".join(address.split()).rstrip(" .,;:!?")


def product_names(product_id: str, name: str) -> set[str]:
    """The lower-cased strings a product is found by: its id, its name, the name's plural forms."""
    return {product_id.lower(), name.lower(), name.lower() + "s", name.lower() + "es"}


class OrdersBackend:
    MUTATING = ("create_order", "cancel_order", "update_address", "issue_refund", "send_email")

    def __init__(self, conn: sqlite3.Connection):
        self.conn = conn
        self.identified: set[str] = set()  # customers identified by find_customer this episode

    # -- helpers -------------------------------------------------------------------------
    def _one(self, sql: str, params: tuple) -> tuple | None:
        return self.conn.execute(sql, params).fetchone()

    def _customer(self, customer_id: str) -> tuple:
        row = self._one("SELECT id, name, email, address FROM customers WHERE id = ?", (customer_id,))
        if row is None:
            raise ToolError(f"no customer {_s(customer_id)}", kind="not_found")
        return row

    def _order(self, order_id: str) -> tuple:
        row = self._one("SELECT id, customer_id, status, total FROM orders WHERE id = ?", (order_id,))
        if row is None:
            raise ToolError(f"no order {_s(order_id)}", kind="not_found")
        return row

    def _require_identified(self, customer_id: str) -> None:
        if customer_id not in self.identified:
            raise ToolError(f"customer {customer_id} is not identified; call find_customer first", kind="policy")

    def _refunded(self, order_id: str) -> float:
        return money(self._one("SELECT COALESCE(SUM(amount), 0) FROM refunds WHERE order_id = ?", (order_id,))[0])

    def _audit(self, tool: str, **arguments: Any) -> None:
        self.conn.execute(
            "INSERT INTO audit_log (tool, arguments) VALUES (?, ?)", (tool, json.dumps(arguments, sort_keys=True))
        )

    # -- read tools ----------------------------------------------------------------------
    def find_customer(self, email: str) -> dict[str, Any]:
        row = self._one("SELECT id, name FROM customers WHERE email = ?", (email.strip().lower(),))
        if row is None:
            raise ToolError(f"no customer with email {_s(email)}", kind="not_found")
        self.identified.add(row[0])
        return {"customer_id": row[0], "name": row[1]}

    def get_order(self, order_id: str) -> dict[str, Any]:
        oid, cid, status, total = self._order(order_id.strip())
        items = {
            pid: q
            for pid, q in self.conn.execute(
                "SELECT product_id, quantity FROM order_items WHERE order_id = ? ORDER BY product_id", (oid,)
            )
        }
        return {
            "order_id": oid,
            "customer_id": cid,
            "status": status,
            "total": money(total),
            "refunded": self._refunded(oid),
            "items": items,
        }

    def list_orders(self, customer_id: str) -> dict[str, Any]:
        cid = self._customer(customer_id.strip())[0]
        rows = self.conn.execute("SELECT id, status FROM orders WHERE customer_id = ?", (cid,)).fetchall()
        rows.sort(key=lambda r: oid_num(r[0]))
        return {"customer_id": cid, "count": len(rows), "orders": [{"order_id": o, "status": s} for o, s in rows]}

    def _product(self, product: str) -> tuple:
        key = product.strip().lower()
        rows = self.conn.execute("SELECT id, name, price, stock FROM products").fetchall()
        for r in rows:
            if key in product_names(r[0], r[1]):
                return r
        raise ToolError(f"no product named {_s(product)}", kind="not_found")

    def check_inventory(self, product: str) -> dict[str, Any]:
        pid, name, price, stock = self._product(product)
        return {"product_id": pid, "name": name, "price": money(price), "stock": stock}

    # -- mutating tools ------------------------------------------------------------------
    def create_order(self, customer_id: str, product_id: str, quantity: int) -> dict[str, Any]:
        cid = self._customer(customer_id.strip())[0]
        row = self._one("SELECT id, name, price, stock FROM products WHERE id = ?", (product_id.strip(),))
        if row is None:
            raise ToolError(f"no product {_s(product_id)}", kind="not_found")
        pid, name, price, stock = row
        self._require_identified(cid)
        if quantity > stock:
            raise ToolError(f"only {stock} {name} in stock; cannot order {quantity}", kind="policy")
        with self.conn:
            last = max(oid_num(r[0]) for r in self.conn.execute("SELECT id FROM orders"))
            oid = f"O-{last + 1}"
            total = money(price * quantity)
            self.conn.execute("INSERT INTO orders VALUES (?, ?, 'pending', ?)", (oid, cid, total))
            self.conn.execute("INSERT INTO order_items VALUES (?, ?, ?)", (oid, pid, quantity))
            self.conn.execute("UPDATE products SET stock = stock - ? WHERE id = ?", (quantity, pid))
            self._audit("create_order", customer_id=cid, product_id=pid, quantity=quantity)
        return {"order_id": oid, "status": "pending", "total": total}

    def cancel_order(self, order_id: str) -> dict[str, Any]:
        oid, cid, status, _ = self._order(order_id.strip())
        self._require_identified(cid)
        if status not in OPEN_STATUSES:
            raise ToolError(f"order {oid} is {status} and cannot be cancelled", kind="policy")
        with self.conn:
            self.conn.execute("UPDATE orders SET status = 'cancelled' WHERE id = ?", (oid,))
            for pid, q in self.conn.execute(
                "SELECT product_id, quantity FROM order_items WHERE order_id = ?", (oid,)
            ).fetchall():
                self.conn.execute("UPDATE products SET stock = stock + ? WHERE id = ?", (q, pid))
            self._audit("cancel_order", order_id=oid)
        return {"order_id": oid, "status": "cancelled"}

    def update_address(self, customer_id: str, address: str) -> dict[str, Any]:
        cid = self._customer(customer_id.strip())[0]
        self._require_identified(cid)
        address = normalise_address(address)
        if len(address) < 5:
            raise ToolError(
                "address is too short once spaces and trailing punctuation are removed", kind="bad_arguments"
            )
        with self.conn:
            self.conn.execute("UPDATE customers SET address = ? WHERE id = ?", (address, cid))
            self._audit("update_address", customer_id=cid, address=address)
        return {"customer_id": cid, "address": address}

    def issue_refund(self, order_id: str, amount: float) -> dict[str, Any]:
        oid, cid, status, total = self._order(order_id.strip())
        self._require_identified(cid)
        amount = money(amount)
        if amount <= 0:
            raise ToolError("refund amount must be positive", kind="policy")
        left = money(total - self._refunded(oid))
        if amount > left + 1e-9:
            raise ToolError(f"refund exceeds order total: at most {left:.2f} left to refund on {oid}", kind="policy")
        with self.conn:
            self.conn.execute("INSERT INTO refunds (order_id, amount) VALUES (?, ?)", (oid, amount))
            self._audit("issue_refund", order_id=oid, amount=amount)
        return {"order_id": oid, "refunded": amount, "total_refunded": money(total - left + amount)}

    def send_email(self, customer_id: str, order_id: str) -> dict[str, Any]:
        cid, _, email, _ = self._customer(customer_id.strip())
        oid, owner, _, _ = self._order(order_id.strip())
        self._require_identified(cid)
        if owner != cid:
            raise ToolError(f"order {oid} does not belong to customer {cid}", kind="policy")
        with self.conn:
            self.conn.execute(
                "INSERT INTO emails (customer_id, order_id, subject) VALUES (?, ?, ?)",
                (cid, oid, f"Receipt for order {oid}"),
            )
            self._audit("send_email", customer_id=cid, order_id=oid)
        return {"sent": True, "to": email, "order_id": oid}


def _schema(**props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


_STR = {"type": "string", "minLength": 1, "maxLength": 100}

TOOL_SPECS: list[tuple[str, str, dict[str, Any]]] = [
    (
        "find_customer",
        "Identify a customer by email; required before changing their data or orders.",
        _schema(email=_STR),
    ),
    ("get_order", "Look up an order: owner, status, total, refunded amount, items.", _schema(order_id=_STR)),
    ("list_orders", "List a customer's orders with their statuses.", _schema(customer_id=_STR)),
    ("check_inventory", "Look up a product by name: id, price and stock.", _schema(product=_STR)),
    (
        "create_order",
        "Place an order for an identified customer (quantity must be in stock).",
        _schema(customer_id=_STR, product_id=_STR, quantity={"type": "integer", "minimum": 1, "maximum": 1000}),
    ),
    ("cancel_order", "Cancel a pending or processing order of an identified customer.", _schema(order_id=_STR)),
    (
        "update_address",
        "Change an identified customer's address.",
        _schema(customer_id=_STR, address={"type": "string", "minLength": 5, "maxLength": 100}),
    ),
    (
        "issue_refund",
        "Refund an amount on an order (total refunds may not exceed the order total).",
        _schema(order_id=_STR, amount={"type": "number", "exclusiveMinimum": 0, "maximum": 100000}),
    ),
    (
        "send_email",
        "Email the receipt for one of the customer's orders to the customer.",
        _schema(customer_id=_STR, order_id=_STR),
    ),
]


def make_tools(get_backend) -> list[Tool]:
    """Tools whose functions forward to ``get_backend()`` (the live episode's backend)."""

    def forward(name: str):
        def fn(**kwargs: Any) -> Any:
            return getattr(get_backend(), name)(**kwargs)

        fn.__name__ = name
        return fn

    return [Tool(name=n, description=d, parameters=p, fn=forward(n)) for n, d, p in TOOL_SPECS]
