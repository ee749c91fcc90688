"""The shop's data: a small world generated from a seed, loaded into in-memory SQLite.

Everything here is a pure function of the seed, so the verifier can rebuild an episode's
initial database at any time.
"""

from __future__ import annotations

import random
import sqlite3
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from mentorrl.config.process import LRUCache

FIRST_NAMES = [
    "Ana",
    "Ben",
    "Chloe",
    "Dev",
    "Ella",
    "Finn",
    "Gina",
    "Hugo",
    "Iris",
    "Jack",
    "Kira",
    "Leo",
    "Maya",
    "Nico",
    "Olga",
    "Pavel",
    "Rosa",
    "Sam",
    "Tara",
    "Omar",
]
LAST_NAMES = [
    "Lopez",
    "Smith",
    "Chen",
    "Patel",
    "Novak",
    "Kim",
    "Rossi",
    "Berg",
    "Silva",
    "Moore",
    "Khan",
    "Weber",
    "Ito",
    "Brown",
    "Diaz",
    "Meyer",
]
DOMAINS = ["mail.com", "example.org", "shopper.net"]
STREETS = [
    "Oak St",
    "Pine Ave",
    "Elm Rd",
    "Maple Ln",
    "Cedar St",
    "Lake Dr",
    "Hill Rd",
    "Park Ave",
    "River St",
    "Bay Ln",
]
CITIES = ["Springfield", "Riverton", "Lakeside", "Fairview", "Georgetown", "Milford", "Ashland", "Clayton"]
PRODUCT_NAMES = [
    "Desk Lamp",
    "Coffee Mug",
    "USB Cable",
    "Notebook",
    "Water Bottle",
    "Phone Case",
    "Backpack",
    "Headphones",
    "Yoga Mat",
    "Wall Clock",
    "Tea Kettle",
    "Mouse Pad",
    "Umbrella",
    "Candle",
]
PRICES = [5.0, 8.0, 9.5, 12.0, 15.0, 19.0, 24.0, 29.0, 35.0, 49.0, 59.0]
STATUSES = ["pending", "processing", "shipped", "delivered", "cancelled"]
OPEN_STATUSES = ("pending", "processing")
STATUS_WEIGHTS = [3, 3, 3, 4, 1]

SCHEMA = """
CREATE TABLE customers (id TEXT PRIMARY KEY, name TEXT NOT NULL, email TEXT NOT NULL UNIQUE,
                        address TEXT NOT NULL);
CREATE TABLE products (id TEXT PRIMARY KEY, name TEXT NOT NULL UNIQUE, price REAL NOT NULL, stock INTEGER NOT NULL);
CREATE TABLE orders (id TEXT PRIMARY KEY, customer_id TEXT NOT NULL REFERENCES customers(id),
                     status TEXT NOT NULL, total REAL NOT NULL);
CREATE TABLE order_items (order_id TEXT NOT NULL REFERENCES orders(id),
                          product_id TEXT NOT NULL REFERENCES products(id), quantity INTEGER NOT NULL);
CREATE TABLE refunds (id INTEGER PRIMARY KEY AUTOINCREMENT, order_id TEXT NOT NULL REFERENCES orders(id),
                      amount REAL NOT NULL);
CREATE TABLE emails (id INTEGER PRIMARY KEY AUTOINCREMENT, customer_id TEXT NOT NULL, order_id TEXT NOT NULL,
                     subject TEXT NOT NULL);
CREATE TABLE audit_log (id INTEGER PRIMARY KEY AUTOINCREMENT, tool TEXT NOT NULL, arguments TEXT NOT NULL);
"""


def money(x: float) -> float:
    return round(float(x) + 1e-9, 2)


def oid_num(order_id: str) -> int:
    return int(order_id.split("-", 1)[1])


@dataclass
class World:
    customers: list[dict[str, Any]] = field(default_factory=list)  # id, name, email, address
    products: list[dict[str, Any]] = field(default_factory=list)  # id, name, price, stock
    orders: list[dict[str, Any]] = field(default_factory=list)  # id, customer_id, status, total, items[(pid, qty)]
    refunds: list[tuple[str, float]] = field(default_factory=list)  # (order_id, amount)

    def customer(self, cid: str) -> dict[str, Any]:
        return next(c for c in self.customers if c["id"] == cid)

    def product(self, pid: str) -> dict[str, Any]:
        return next(p for p in self.products if p["id"] == pid)

    def refunded(self, order_id: str) -> float:
        return money(sum(a for o, a in self.refunds if o == order_id))

    def next_order_id(self) -> str:
        return f"O-{max(oid_num(o['id']) for o in self.orders) + 1}"


def random_address(rng: random.Random) -> str:
    return f"{rng.randint(2, 98)} {rng.choice(STREETS)}, {rng.choice(CITIES)}"


def make_world(seed: int) -> World:
    rng = random.Random(seed)
    w = World()
    n_cust = rng.randint(6, 9)
    names = rng.sample([(f, l) for f in FIRST_NAMES for l in LAST_NAMES], n_cust)
    for num, (first, last) in zip(sorted(rng.sample(range(1, 60), n_cust)), names):
        w.customers.append(
            {
                "id": f"C-{num}",
                "name": f"{first} {last}",
                "email": f"{first}.{last}@{rng.choice(DOMAINS)}".lower(),
                "address": random_address(rng),
            }
        )
    n_prod = rng.randint(6, 8)
    for num, name in zip(sorted(rng.sample(range(1, 30), n_prod)), rng.sample(PRODUCT_NAMES, n_prod)):
        stock = rng.choice([0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 20, 25])
        w.products.append({"id": f"P-{num}", "name": name, "price": rng.choice(PRICES), "stock": stock})
    n_ord = rng.randint(10, 18)
    for num in sorted(rng.sample(range(101, 900), n_ord)):
        items = [(p["id"], rng.randint(1, 3)) for p in rng.sample(w.products, rng.choice([1, 1, 2]))]
        total = money(sum(w.product(pid)["price"] * q for pid, q in items))
        status = rng.choices(STATUSES, weights=STATUS_WEIGHTS)[0]
        w.orders.append(
            {
                "id": f"O-{num}",
                "customer_id": rng.choice(w.customers)["id"],
                "status": status,
                "total": total,
                "items": items,
            }
        )
    for o in w.orders:  # some delivered orders already got a partial refund
        if o["status"] == "delivered" and rng.random() < 0.3:
            w.refunds.append((o["id"], money(max(1.0, round(o["total"] * rng.choice([0.2, 0.3, 0.5]))))))
    return w


def _rows(seed: int) -> tuple[tuple, ...]:
    """The insert rows of ``seed``'s world (built once per template, see :func:`build_db`)."""
    w = make_world(seed)
    return (
        tuple((c["id"], c["name"], c["email"], c["address"]) for c in w.customers),
        tuple((p["id"], p["name"], p["price"], p["stock"]) for p in w.products),
        tuple((o["id"], o["customer_id"], o["status"], o["total"]) for o in w.orders),
        tuple((o["id"], pid, q) for o in w.orders for pid, q in o["items"]),
        tuple(w.refunds),
    )


def _fresh_db(seed: int) -> sqlite3.Connection:
    customers, products, orders, items, refunds = _rows(seed)
    conn = sqlite3.connect(":memory:", check_same_thread=False)
    conn.executescript(SCHEMA)
    with conn:
        conn.executemany("INSERT INTO customers VALUES (?, ?, ?, ?)", customers)
        conn.executemany("INSERT INTO products VALUES (?, ?, ?, ?)", products)
        conn.executemany("INSERT INTO orders VALUES (?, ?, ?, ?)", orders)
        conn.executemany("INSERT INTO order_items VALUES (?, ?, ?)", items)
        conn.executemany("INSERT INTO refunds (order_id, amount) VALUES (?, ?)", refunds)
    return conn


_TEMPLATES: "LRUCache[int, sqlite3.Connection]" = LRUCache(256, on_evict=sqlite3.Connection.close)


def build_db(seed: int) -> sqlite3.Connection:
    """A fresh in-memory database holding the world for ``seed``: a page copy (``backup``) of a
    template built once per seed (an episode builds the same world three times: the agent's, the
    verifier's initial and expected states; a GRPO group shares its task). Templates are never
    written; the most recent 256 are kept."""
    conn = sqlite3.connect(":memory:", check_same_thread=False)
    with _TEMPLATES.lock:  # held from the look-up to the copy: no other thread builds or evicts it meanwhile
        tpl = _TEMPLATES.get(seed)
        if tpl is None:
            tpl = _TEMPLATES.setdefault(seed, _fresh_db(seed))
        tpl.backup(conn)
    return conn


@dataclass
class Snapshot:
    """The task-relevant tables, keyed for comparison (autoincrement ids dropped)."""

    customers: dict[str, tuple]
    products: dict[str, tuple]
    orders: dict[str, tuple]
    items: Counter
    refunds: Counter
    emails: Counter
    audit_rows: int


def snapshot(conn: sqlite3.Connection) -> Snapshot:
    q = conn.execute
    return Snapshot(
        customers={r[0]: tuple(r[1:]) for r in q("SELECT id, name, email, address FROM customers")},
        products={r[0]: (r[1], money(r[2]), r[3]) for r in q("SELECT id, name, price, stock FROM products")},
        orders={r[0]: (r[1], r[2], money(r[3])) for r in q("SELECT id, customer_id, status, total FROM orders")},
        items=Counter(tuple(r) for r in q("SELECT order_id, product_id, quantity FROM order_items")),
        refunds=Counter((r[0], money(r[1])) for r in q("SELECT order_id, amount FROM refunds")),
        emails=Counter(tuple(r) for r in q("SELECT customer_id, order_id FROM emails")),
        audit_rows=q("SELECT COUNT(*) FROM audit_log").fetchone()[0],
    )
