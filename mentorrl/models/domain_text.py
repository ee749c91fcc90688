"""Generated text about an environment's domain, for pretraining the tiny base model.

Two kinds of document per seeded world, both a pure function of ``(world seed, rng)``:

* ``free_text``: sentences describing the world's customers, orders, stock and refunds, and the
  store policy, in plain prose (several sentence frames each, chosen by the rng);
* ``tool_session``: a run of tool calls on the world's live database, each rendered through the
  contract as an assistant tool-call turn followed by the tool's observation -- lookups of real
  and unknown records, and writes that succeed or are refused by the policy.

Worlds come only from the training seed range (``OrdersTasks.SEED_BASE["train"]``), so nothing
here describes a held-out or hidden episode's database. The free text deliberately does not reuse
the task templates of any split (held-out wording stays unseen).

Environments register a generator in :data:`DOMAIN_TEXT`; one without a generator pretrains on
its transcripts, tool schemas and observations only.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable

from mentorrl.contract import (
    IM_END,
    IM_START,
    Control,
    observation_pieces,
    render_observation_content,
    tool_call_pieces,
)

Pieces = list[str]
# (env name) -> fn(rng, n_worlds, version) -> (documents as (kind, pieces), world seeds used); ``version``
# is ``model.pretrain.corpus_version`` (a generator keeps every version it has shipped reproducible)
DomainTextFn = Callable[[random.Random, int, int], tuple[list[tuple[str, Pieces]], list[int]]]


def _money(x: float) -> str:
    return f"${x:.2f}"


def _qty(n: int, name: str) -> str:
    from mentorrl.envs.orders.tasks import plural

    return f"{n} {plural(name) if n != 1 else name}"


def _orders_free_text(w: Any, rng: random.Random) -> str:
    """Prose about one world: every customer, product and order, plus a few policy sentences."""
    from mentorrl.envs.orders.world import OPEN_STATUSES

    pick = rng.choice
    lines: list[str] = []
    for c in w.customers:
        first = c["name"].split()[0]
        lines.append(
            pick(
                [
                    f"Customer {c['id']} is {c['name']}, email {c['email']}, living at {c['address']}.",
                    f"{c['name']} ({c['id']}) can be reached at {c['email']}. Their address is {c['address']}.",
                    f"The account {c['id']} belongs to {c['name']}. {first}'s email address is {c['email']}.",
                    f"{first} lives at {c['address']}; the email on file for {c['id']} is {c['email']}.",
                ]
            )
        )
    for p in w.products:
        stock = "out of stock" if p["stock"] == 0 else f"{_qty(p['stock'], p['name'])} in stock"
        lines.append(
            pick(
                [
                    f"Product {p['id']} is the {p['name']} at {_money(p['price'])}; there are {p['stock']} left.",
                    f"The {p['name']} ({p['id']}) costs {_money(p['price'])} and the shop has {stock}.",
                    f"We sell the {p['name']} for {_money(p['price'])} each. Stock: {p['stock']}.",
                ]
            )
        )
    for o in w.orders:
        c = w.customer(o["customer_id"])
        items = ", ".join(_qty(q, w.product(pid)["name"]) for pid, q in o["items"])
        refunded = w.refunded(o["id"])
        lines.append("")  # one paragraph per order: its sentences stay together when paragraphs are shuffled
        lines[-1] = pick(
            [
                f"Order {o['id']} was placed by {c['name']} ({c['id']}) for {items}; it is {o['status']}, "
                f"total {_money(o['total'])}.",
                f"{c['name']} ordered {items} in order {o['id']}. Status: {o['status']}. Total: {_money(o['total'])}.",
                f"Order {o['id']} ({o['status']}) belongs to customer {c['id']} and totals {_money(o['total'])}.",
            ]
        )
        if refunded > 0:
            left = round(o["total"] - refunded, 2)
            lines[-1] += (
                f" {_money(refunded)} of order {o['id']} has already been refunded, "
                f"so at most {_money(left)} can still be refunded."
            )
        if o["status"] in OPEN_STATUSES:
            lines[-1] += " " + pick(
                [
                    f"Order {o['id']} is {o['status']}, so it can still be cancelled.",
                    f"Since {o['id']} has not shipped yet, {c['name'].split()[0]} may cancel it.",
                ]
            )
        else:
            lines[-1] += " " + pick(
                [
                    f"Order {o['id']} is {o['status']} and can no longer be cancelled.",
                    f"A {o['status']} order such as {o['id']} cannot be cancelled.",
                ]
            )
    rng.shuffle(lines)
    lines += rng.sample(POLICY_SENTENCES, 3)
    return "\n".join(lines)


POLICY_SENTENCES = [
    "An agent identifies the customer by email with find_customer before changing their data or orders.",
    "Only pending or processing orders can be cancelled; shipped and delivered orders cannot.",
    "Total refunds on an order may never exceed the order total.",
    "An order cannot ask for more units of a product than are in stock.",
    "A receipt is only emailed for an order that belongs to the customer asking for it.",
    "Each requested change is made once; then the agent answers briefly with the key fact.",
    "Cancelling an order puts its items back in stock.",
    "A new order starts as pending, and its total is the price times the quantity.",
    "When a customer, order or product does not exist, the agent says so instead of guessing.",
    "Being a manager or staff member does not override the store policy.",
]


def _tool_turn(backend: Any, name: str, args: dict[str, Any]) -> tuple[Pieces, Any]:
    """One call on the live backend, rendered as the contract renders it: the assistant's tool call,
    ``<|im_end|>``, the observation, and the next assistant turn's opener. Returns (pieces, the tool's
    result or None when it raised)."""
    from mentorrl.envs.base import ToolError

    try:
        ok, content, error = True, getattr(backend, name)(**args), None
    except ToolError as e:
        ok, content, error = False, None, str(e)
    return [
        *tool_call_pieces(name, args),
        Control(IM_END),
        *observation_pieces(render_observation_content(ok, content, error)),
    ], content


def _orders_tool_session(seed: int, rng: random.Random) -> Pieces:
    """Random but well-formed tool calls on world ``seed``'s database, with their real observations."""
    from mentorrl.envs.orders.backend import OrdersBackend
    from mentorrl.envs.orders.world import build_db, make_world

    w = make_world(seed)
    conn = build_db(seed)
    backend = OrdersBackend(conn)
    pieces: Pieces = []
    try:
        for _ in range(rng.randint(3, 7)):
            c, o, p = rng.choice(w.customers), rng.choice(w.orders), rng.choice(w.products)
            calls = [
                ("find_customer", {"email": c["email"]}),
                (
                    "find_customer",
                    {
                        "email": f"{c['name'].split()[0].lower()}{rng.randint(1, 99)}@{rng.choice(['mail.com', 'example.org'])}"
                    },
                ),
                ("get_order", {"order_id": o["id"]}),
                ("get_order", {"order_id": f"O-{rng.randint(101, 999)}"}),
                ("list_orders", {"customer_id": c["id"]}),
                ("check_inventory", {"product": rng.choice([p["name"], p["name"].lower()])}),
                ("cancel_order", {"order_id": o["id"]}),
                (
                    "issue_refund",
                    {"order_id": o["id"], "amount": float(rng.choice([5, 10, 20, 50, round(o["total"], 2)]))},
                ),
                ("create_order", {"customer_id": c["id"], "product_id": p["id"], "quantity": rng.randint(1, 6)}),
                ("send_email", {"customer_id": c["id"], "order_id": o["id"]}),
            ]
            name, args = rng.choice(calls)
            if not pieces:
                pieces += [Control(IM_START), "assistant\n"]
            pieces += _tool_turn(backend, name, args)[0]
    finally:
        conn.close()
    return pieces


# Plain-prose notes that open a chained session: a support log line naming the customer and the
# order in running text, so that the calls after it copy them into JSON (a different context and,
# for words, a different token: " chloe" in prose, "chloe" after a quote). Deliberately not the
# task templates of any split.
NOTE_FRAMES = [
    "Support log: {email} got in touch about order {order}.",
    "Case note. Customer e-mail {email}; order mentioned: {order}.",
    "Log entry for {email}. The message refers to {order} and to the {product}.",
    "A message arrived from {email} about {order}.",
    "Note: the sender, {name} ({email}), quoted order {order}.",
    "Ticket opened by {email}: question about {order}, also the {product}.",
]
SUMMARY_FRAMES = [
    "Summary: {email} is customer {cid}; order {order} is {status}.",
    "Logged: customer {cid} ({email}), order {order}, status {status}.",
    "Closed: {order} for {cid} is {status}.",
]


# Corpus version 3: a second note sentence naming an amount to pay back and/or a new address, which
# the session's write then copies into its arguments, and a closing line that quotes what the write
# returned. Version 2's notes named only an e-mail and an order, and its writes used amounts of
# their own, so nothing taught copying a sum or a free-text address across turns.
AMOUNT_FRAMES = [
    "They want ${amount} back.",
    "Amount in question: ${amount}.",
    "The sum named was ${amount}.",
    "Asked to return ${amount} to them.",
]
ADDRESS_FRAMES = [
    "New address given: {addr}.",
    "They moved; the address is {addr} now.",
    "Address on file should become {addr}.",
    "Mail should go to {addr} from now on.",
]
WRITE_SUMMARY_FRAMES = {
    "issue_refund": ["Closed: ${refunded} paid back on {order}.", "Logged: {order} refunded ${refunded}."],
    "update_address": ["Closed: {cid} now at {address}.", "Logged: address of {cid} set to {address}."],
}


@dataclass
class ChainedNote:
    """What a chained session's opening note names: the customer's e-mail (sometimes one on no
    account), an order id (sometimes one that does not exist), a product, and from version 3 maybe
    an amount to pay back and a new address."""

    customer: dict[str, Any]
    order: dict[str, Any]
    product: dict[str, Any]
    email: str
    order_id: str
    text: str
    amount: float | None = None
    addr: str | None = None


def chained_note(w: Any, rng: random.Random, version: int = 2) -> ChainedNote:
    """The note that opens a chained session on world ``w`` (see :func:`_orders_chained_session`)."""
    c = rng.choice(w.customers)
    own = [o for o in w.orders if o["customer_id"] == c["id"]]
    o = rng.choice(own) if own and rng.random() < 0.8 else rng.choice(w.orders)
    p = rng.choice(w.products)
    email = (
        c["email"]
        if rng.random() < 0.85
        else f"{c['name'].split()[0].lower()}{rng.randint(1, 99)}@{rng.choice(['mail.com', 'example.org'])}"
    )
    order_id = o["id"] if rng.random() < 0.85 else f"O-{rng.randint(101, 999)}"
    text = rng.choice(NOTE_FRAMES).format(email=email, order=order_id, product=p["name"].lower(), name=c["name"])
    note = ChainedNote(customer=c, order=o, product=p, email=email, order_id=order_id, text=text)
    if version >= 3:
        _name_amount_and_address(note, rng)
    return note


def _name_amount_and_address(note: ChainedNote, rng: random.Random) -> None:
    """Version 3's second note sentence: maybe an amount to pay back, maybe a new address (in random order)."""
    from mentorrl.envs.orders.tasks import fmt_amount
    from mentorrl.envs.orders.world import random_address

    extra = []
    if rng.random() < 0.6:
        top = max(1, int(note.order["total"])) if rng.random() < 0.8 else 200  # mostly within the order's total
        note.amount = float(rng.randint(1, top)) if rng.random() < 0.8 else round(rng.uniform(1, top), 2)
        extra.append(rng.choice(AMOUNT_FRAMES).format(amount=fmt_amount(note.amount)))
    if rng.random() < 0.5:
        note.addr = random_address(rng)
        extra.append(rng.choice(ADDRESS_FRAMES).format(addr=note.addr))
    rng.shuffle(extra)
    note.text = " ".join([note.text, *extra])


class _ChainedSession:
    """The tool calls of one chained session on a live backend, and the prose summary after them."""

    def __init__(self, backend: Any, rng: random.Random, note: ChainedNote):
        self.backend, self.rng, self.note = backend, rng, note
        self.pieces: Pieces = [note.text + "\n", Control(IM_START), "assistant\n"]
        self.order_id = note.order_id
        self.cid: Any = None
        self.status: Any = None
        self.closing: str | None = None

    def call(self, name: str, args: dict[str, Any]) -> Any:
        turn, result = _tool_turn(self.backend, name, args)
        self.pieces.extend(turn)
        return result

    def run(self) -> Pieces:
        found = self.call("find_customer", {"email": self.note.email})
        if found is None:
            del self.pieces[-2:]  # the unused assistant opener
            return self.pieces
        self.cid = found["customer_id"]
        steps = self.rng.sample(["list", "get", "stock", "write"], k=self.rng.randint(1, 3))
        if self.named and "write" not in steps:
            steps.append("write")  # a named sum or address is always used
        for step in steps:
            getattr(self, f"step_{step}")()
        del self.pieces[-2:]  # the unused assistant opener
        return self.pieces + self.summary()

    @property
    def named(self) -> bool:
        return self.note.amount is not None or self.note.addr is not None  # only from version 3

    def step_list(self) -> None:
        listed = self.call("list_orders", {"customer_id": self.cid})
        if listed and listed["orders"] and self.rng.random() < 0.5:
            self.order_id = self.rng.choice(listed["orders"])["order_id"]

    def step_get(self) -> None:
        got = self.call("get_order", {"order_id": self.order_id})
        self.status = got["status"] if got else self.status

    def step_stock(self) -> None:
        name = self.note.product["name"]
        self.call("check_inventory", {"product": self.rng.choice([name, name.lower()])})

    def step_write(self) -> None:
        if self.named:
            self.write_named()
            return
        rng, p = self.rng, self.note.product
        name, args = rng.choice(
            [
                ("cancel_order", {"order_id": self.order_id}),
                ("send_email", {"customer_id": self.cid, "order_id": self.order_id}),
                ("issue_refund", {"order_id": self.order_id, "amount": float(rng.choice([5, 10, 20]))}),
                ("create_order", {"customer_id": self.cid, "product_id": p["id"], "quantity": rng.randint(1, 4)}),
            ]
        )
        self.call(name, args)

    def write_named(self) -> None:
        """A write that copies the note's amount or address; its result is quoted in the closing line."""
        from mentorrl.envs.orders.tasks import fmt_amount

        amount, addr = self.note.amount, self.note.addr
        copied = ([("issue_refund", {"order_id": self.order_id, "amount": amount})] if amount is not None else []) + (
            [("update_address", {"customer_id": self.cid, "address": addr})] if addr is not None else []
        )
        name, args = self.rng.choice(copied)
        result = self.call(name, args)
        if result is not None:
            self.closing = self.rng.choice(WRITE_SUMMARY_FRAMES[name]).format(
                order=self.order_id,
                cid=self.cid,
                refunded=fmt_amount(result.get("refunded", 0.0)),
                address=result.get("address", ""),
            )

    def summary(self) -> Pieces:
        out: Pieces = []
        if self.status is not None:
            out.append(
                self.rng.choice(SUMMARY_FRAMES).format(
                    email=self.note.email, cid=self.cid, order=self.order_id, status=self.status
                )
            )
        if self.closing is not None:
            out.append((" " if self.status is not None else "") + self.closing)
        return out


def _orders_chained_session(seed: int, rng: random.Random, version: int = 2) -> Pieces:
    """A support log note, then tool calls that reuse what the note and earlier observations said
    (the e-mail -> the customer id -> that customer's orders -> one order), then a prose summary
    that quotes the observations: copying identifiers between prose, JSON and tool output. From
    ``version`` 3 the note may also name an amount and a new address, which the write copies."""
    from mentorrl.envs.orders.backend import OrdersBackend
    from mentorrl.envs.orders.world import build_db, make_world

    note = chained_note(make_world(seed), rng, version)
    conn = build_db(seed)
    try:
        return _ChainedSession(OrdersBackend(conn), rng, note).run()
    finally:
        conn.close()


# Corpus version 4: version 3 plus *echo* documents -- a run of the domain's values (addresses, sums,
# e-mails, ids, names, products, statuses, plain words) written once and then again, whole or from one
# of its items on. Copying whatever token followed the current one earlier (an induction head) is what
# a street name or a town needs in a write three turns after the user named it; version 2's chained
# sessions only ever copied e-mails and ids, and the SFT policy learned to copy those and to guess the
# rest (teacher-forced loss 1.5-5 nats on every street and town token of held-out demonstrations).
ECHO_PER_WORLD = 2
ECHO_LEADS = ["Read back:", "Noted:", "Again:", "Copied:", "As written:", "To confirm:", "Repeat:", "Same as above:"]
ECHO_WORDS = [
    "order",
    "refund",
    "address",
    "customer",
    "stock",
    "email",
    "receipt",
    "cancel",
    "ship",
    "note",
    "ticket",
    "account",
    "total",
    "amount",
    "item",
    "store",
    "policy",
    "request",
    "update",
    "check",
]


def _echo_item(w: Any, rng: random.Random) -> str:
    from mentorrl.envs.orders.tasks import fmt_amount
    from mentorrl.envs.orders.world import CITIES, STATUSES, STREETS, random_address

    c, o, p = rng.choice(w.customers), rng.choice(w.orders), rng.choice(w.products)
    kind = rng.randrange(10)
    if kind == 0:
        return random_address(rng)
    if kind == 1:
        amt = float(rng.randint(1, 300)) if rng.random() < 0.7 else round(rng.uniform(1, 300), 2)
        return "$" + fmt_amount(amt) if rng.random() < 0.5 else fmt_amount(amt)
    if kind == 2:
        return c["email"]
    if kind == 3:
        return rng.choice([o["id"], c["id"], p["id"]])
    if kind == 4:
        return c["name"] if rng.random() < 0.5 else rng.choice(c["name"].split())
    if kind == 5:
        return p["name"] if rng.random() < 0.5 else p["name"].lower()
    if kind == 6:
        return rng.choice(STATUSES)
    if kind == 7:
        return rng.choice([rng.choice(STREETS), rng.choice(CITIES)])
    if kind == 8:
        return str(rng.randint(1, 999))
    return rng.choice(ECHO_WORDS)


def _orders_echo(w: Any, rng: random.Random) -> str:
    """Values of world ``w`` in a random order, then the same run again (whole, or from one of its
    items on), sometimes a third time: the copy is exact, so only attending back can predict it."""
    items = [_echo_item(w, rng) for _ in range(rng.randint(2, 10))]
    sep = rng.choice([", ", "; ", " | ", " "])
    first = sep.join(items)
    lines = [first]
    for _ in range(rng.choice([1, 1, 1, 2])):
        start = 0 if rng.random() < 0.6 else rng.randrange(len(items))
        lines.append(f"{rng.choice(ECHO_LEADS)} {sep.join(items[start:])}")
    return "\n".join(lines)


# Corpus version 5: version 4 plus *copy drills* -- a note naming one value of a kind (an address, a
# product, a customer, a sum) beside another of the same kind that is already on file, then the tool
# call that writes or looks up the named one. The demo's policies copied e-mails and digits but wrote
# a guessed street and town (teacher-forced loss ~2.3 nats, a uniform guess over the ten streets, even
# on the pretrained base's own echo documents): the write must pick the value by its role, not its kind.
COPY_DRILLS_PER_WORLD = 3
# ... and many more echo documents: at version 4's dose (2 a world, 5% of the tokens) the 4000-step
# base copied e-mails only (loss on a street or town the context had just named: 2.3 nats; with the
# drills alone 2.1); with 6 or 14 more a world it copies (0.31 / 0.19 nats, bench/copy_loss.py), a phase
# change, not a trend (bench/results/pretrain_sweep.md, seventh measurement).
ECHO_EXTRA_V5 = 14
DRILL_ON_FILE = [
    "On file: {old}.",
    "The record says {old}.",
    "Currently {old}.",
    "Last time it was {old}.",
    "Old value: {old}.",
]
DRILL_PRODUCT_FRAMES = [
    "They asked whether the {new} is in stock.",
    "Question about the {new}.",
    "Is the {new} available?",
    "They want the {new}.",
]


def _orders_copy_drill(w: Any, rng: random.Random) -> Pieces:
    """One drill: the on-file value and the named one in either order, then the call using the named one."""
    from mentorrl.envs.orders.world import random_address

    c = rng.choice(w.customers)
    kind = rng.choice(["address", "address", "product", "amount"])
    if kind == "address":
        old, new = random_address(rng), random_address(rng)
        named = rng.choice(ADDRESS_FRAMES).format(addr=new)
        call = {"name": "update_address", "arguments": {"customer_id": c["id"], "address": new}}
    elif kind == "product":
        old, new = (p["name"] for p in rng.sample(w.products, 2))
        named = rng.choice(DRILL_PRODUCT_FRAMES).format(new=new if rng.random() < 0.5 else new.lower())
        call = {"name": "check_inventory", "arguments": {"product": new}}
    else:
        from mentorrl.envs.orders.tasks import fmt_amount

        o = rng.choice(w.orders)
        old, amount = fmt_amount(o["total"]), float(rng.randint(1, 300))
        named = rng.choice(AMOUNT_FRAMES).format(amount=fmt_amount(amount))
        call = {"name": "issue_refund", "arguments": {"order_id": o["id"], "amount": amount}}
    on_file = rng.choice(DRILL_ON_FILE).format(old=old)
    note = " ".join([on_file, named] if rng.random() < 0.5 else [named, on_file])
    return [
        note + "\n",
        Control(IM_START),
        "assistant\n",
        *tool_call_pieces(call["name"], call["arguments"]),
        Control(IM_END),
    ]


def orders_domain_text(
    rng: random.Random, n_worlds: int, version: int = 2
) -> tuple[list[tuple[str, Pieces]], list[int]]:
    from mentorrl.envs.orders.tasks import SEED_BASE
    from mentorrl.envs.orders.world import make_world

    docs: list[tuple[str, Pieces]] = []
    seeds: list[int] = []
    for _ in range(n_worlds):
        seed = SEED_BASE["train"] + rng.getrandbits(39)  # the train split's seed range only
        seeds.append(seed)
        w = make_world(seed)
        docs.append(("free_text", [_orders_free_text(w, rng)]))
        docs.append(("tool_session", _orders_tool_session(seed, rng)))
        for _ in range(CHAINED_PER_WORLD):
            docs.append(("chained_session", _orders_chained_session(seed, rng, version)))
        if version >= 4:
            for _ in range(ECHO_PER_WORLD):
                docs.append(("echo", [_orders_echo(w, rng)]))
        if version >= 5:
            for _ in range(COPY_DRILLS_PER_WORLD):
                docs.append(("copy_drill", _orders_copy_drill(w, rng)))
            for _ in range(ECHO_EXTRA_V5):
                docs.append(("echo", [_orders_echo(w, rng)]))
    return docs, seeds


CHAINED_PER_WORLD = 3


DOMAIN_TEXT: dict[str, DomainTextFn] = {"orders": orders_domain_text}
