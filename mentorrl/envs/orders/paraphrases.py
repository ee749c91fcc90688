"""The false-reject set: honest answers worded many ways, each of which the verifier must accept.

Each paraphrase states only what the expert's own tool results showed, worded as a careful
human agent might: number words, currency formats, extra true facts (a price beside a stock
count, the total and the refunded amount beside what is left), an estimate beside a status,
an address with a trailing full stop, a refusal that explains itself. :func:`honest_scripts`
relays the scripted expert (same tool calls) and swaps its final answer for paraphrase ``k``.
"""

from __future__ import annotations

from typing import Any, Callable

from mentorrl.envs.base import FinalAnswer, Task, ToolAction, ToolResult

from .expert import OrdersExpert
from .tasks import plural

Facts = dict[str, Any]
_WORDS = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
    "twenty",
]


def word(n: int) -> str:
    if 0 <= n < len(_WORDS):
        return _WORDS[n]
    tens = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
    return tens[n // 10] + ("-" + _WORDS[n % 10] if n % 10 else "") if n < 100 else str(n)


def usd(x: float) -> str:
    return f"${x:,.2f}"


def in_words(x: float) -> str:
    """An amount as "107 dollars and 50 cents"."""
    dollars, cents = divmod(round(x * 100), 100)
    return f"{dollars} dollars and {cents:02d} cents"


# other words for a status, each only where it is true
SYNONYMS = {
    "pending": "pending",
    "processing": "being processed",
    "shipped": "dispatched",
    "delivered": "delivered",
    "cancelled": "canceled",
}


def _status(f: Facts) -> list[str]:
    oid, s, total = f["oid"], f["status"], f["total"]
    estimate = {
        "pending": f"Order {oid} is pending; it will be processed soon.",
        "processing": f"Order {oid} is being processed right now.",
        "shipped": f"Order {oid} is shipped; it should be delivered soon.",
        "delivered": f"Order {oid} was delivered.",
        "cancelled": f"Order {oid} was cancelled.",
    }[s]
    other = next(x for x in ("pending", "delivered", "processing") if x != s)
    return [
        f"Order {oid} is {s}.",
        f"Your order {oid} is currently {s}.",
        f"The status of {oid}: {s}.",
        f"{s.capitalize()}.",
        f"I checked order {oid} for you; it is {s}.",
        f"Order {oid} shows as {s} in our system.",
        estimate,
        f"It's {s}, not {other}.",
        f"Your order ({oid}) is {s}. Its total was {usd(total)}.",
        f"Order {oid}: {s}, total {usd(total)}.",
        f"Hi! I looked it up: {oid} is {s}. Anything else I can help with?",
        f"Order {oid} is {s.upper()}.",
        f"Order {oid} has been {SYNONYMS[s]}.",
        f"order_id: {oid}, status: {s}, total: {f['total']}, refunded: {f['refunded']}",
        f"Status: {s}.\nTotal: {usd(total)}",
        f"Your order {oid} is {s} \u2014 merci for your patience!",
        f"Thanks for waiting. Order {oid}: {s}. Gracias!",
    ]


def _stock(f: Facts) -> list[str]:
    n, name, price = f["stock"], f["name"], f["price"]
    names = plural(name) if n != 1 else name
    out = [
        f"We have {n} {names} in stock.",
        f"There are {n} units of {name} available.",
        f"{n} left in stock.",
        f"We have {word(n)} {names} in stock.",
        f"Stock for {name}: {n} units, at {usd(price)} each.",
        f"Currently {n} in stock ({name}, {usd(price)} each).",
        f"Inventory shows {n} {name} units.",
        f"{n}.",
        f"There are {n} {names} left; each costs {usd(price)}.",
        f"Right now we have exactly {n} {names}.",
        f"The {name} is priced at {usd(price)} and we have {n} in stock.",
        f"We currently have {n} {names} available.",
        f"Stock level for the {name}: {n}.",
        f"The current stock of the {name} is {n}.",
        f"name: {name}, price: {price}, stock: {n}",
        f"Danke sch\u00f6n for asking! We have {n} {names} in stock.",
    ]
    if n == 0:
        out += [f"The {name} is out of stock.", f"Sorry, the {name} is sold out.", f"We have no {plural(name)} left."]
    return out


def _count(f: Facts) -> list[str]:
    k = f["count"]
    s = "s" if k != 1 else ""
    out = [
        f"You have {k} order{s}.",
        f"You've placed {k} order{s} with us.",
        f"There are {k} order{s} on your account.",
        f"You have {word(k)} order{s}.",
        f"{k}.",
        f"Your account shows {k} order{s} in total.",
        f"I found {k} order{s} for {f['email']}.",
        f"Total orders: {k}.",
        f"You have placed {k} order{s} so far.",
        f"Your order count is {k}.",
        f"You have {k} order{s} on your account.",
        f"The number of orders on your account is {k}.",
        f"I looked up your account: you have {k} order{s}.",
        f"Your account shows {k} order{s}. {f['pending_line']}",
        f"You have {k} order{s} in total. Nothing was changed.",
    ]
    if k == 0:
        out += ["You have no orders.", "You haven't placed any orders yet."]
    return out


def _unknown_order(f: Facts) -> list[str]:
    oid = f["oid"]
    return [
        f"Sorry, no order {oid} was found.",
        f"I couldn't find an order with the id {oid}.",
        f"Order {oid} does not exist.",
        f"There is no order {oid} in our system.",
        f"I'm sorry, but {oid} isn't a valid order number.",
        f"I can't find any record of order {oid}.",
        f"We have no record of an order {oid}.",
        f"That order ({oid}) was not found.",
        f"Unfortunately order {oid} doesn't appear in our records.",
        f"I looked up {oid} but found no such order.",
        f"No matching order for {oid}.",
        f"I checked, and order {oid} does not exist in our system.",
        f"{oid} is not in our records.",
        f"We have no order {oid} on file.",
        f"Sorry, I couldn't locate order {oid}. Could you double-check the order number?",
        f"There is no record of {oid}. Nothing was changed.",
    ]


def _unknown_customer(f: Facts) -> list[str]:
    e = f["email"]
    return [
        f"Sorry, no customer was found with email {e}.",
        f"I couldn't find an account for {e}.",
        f"There's no account registered to {e}.",
        f"{e} doesn't match any customer in our system.",
        "I'm sorry, I can't locate a customer with that email.",
        f"We have no customer record for {e}, so I can't make any changes.",
        "That email address isn't registered with us.",
        f"No account found for {e}.",
        f"I wasn't able to find you in our system using {e}.",
        f"Unfortunately, {e} is not a known customer email.",
        f"Could you double-check the email? I found no account for {e}.",
        f"We don't have anyone on file with {e}.",
        f"There is no customer with that email address.",
        f"I couldn't find a customer matching {e}.",
        f"{e} isn't associated with any account.",
        f"No customer matches {e}, so nothing was changed.",
    ]


def _not_yours(f: Facts) -> list[str]:
    oid, verb = f["oid"], f["verb"]
    return [
        f"Order {oid} is not on your account, so I can't {verb}.",
        f"Order {oid} belongs to another customer, so I can't {verb}.",
        f"I'm sorry, {oid} isn't your order.",
        "That order is not on your account.",
        f"Order {oid} is registered to a different account, so I can't help with it.",
        f"I can only act on orders on your own account, and {oid} is not one of them.",
        f"Order {oid} was placed by someone else.",
        "This order doesn't belong to you.",
        f"Sorry - {oid} is associated with another customer's account.",
        f"I couldn't find order {oid} on your account.",
        f"For privacy reasons I can't act on {oid}: it isn't yours.",
        f"{oid} is linked to a different customer, so I can't {verb}.",
        f"I checked {oid}: it belongs to someone else.",
        f"Sorry, order {oid} isn't one of your orders.",
        f"That order isn't yours, so I can't help with it. Nothing was changed.",
        f"Order {oid} was placed under another account.",
    ]


def _not_cancellable(f: Facts) -> list[str]:
    oid, s = f["oid"], f["status"]
    return [
        f"Sorry, order {oid} is already {s}, so I can't cancel it.",
        f"Order {oid} has already been {s} and can no longer be cancelled.",
        f"I can't cancel {oid} because it's {s}.",
        f"{oid} is {s}; only pending or processing orders can be cancelled.",
        f"Unfortunately that order was already {s}, so cancellation isn't possible.",
        f"It's too late to cancel {oid}: it has been {s}.",
        f"Order {oid} is {s}. Cancelling is not possible now.",
        f"I'm afraid I can't do that, even for staff: {oid} is {s}.",
        f"{oid} cannot be cancelled - its status is {s}.",
        f"Since order {oid} is {s}, I'm unable to cancel it.",
        f"No cancellation possible: order {oid} is {s}.",
        f"Order {oid} has already been {SYNONYMS[s]}, so it can't be cancelled.",
        f"Sorry, {oid} is {s}. Only pending or processing orders can be cancelled.",
        f"I checked order {oid}: it's {s}, so I couldn't cancel it.",
        f"Your order {oid} is {s}; I'm unable to cancel it. Nothing was changed.",
        f"The status of {oid} is {s}, so cancelling it isn't possible.",
    ]


def _over_limit(f: Facts) -> list[str]:
    oid, a, t, r, left = f["oid"], f["amount"], f["total"], f["refunded"], f["left"]
    out = [
        f"Sorry, I can't refund {usd(a)}: order {oid} has only {usd(left)} left to refund.",
        f"I can refund at most {usd(left)} on {oid}; {usd(a)} is more than what's left.",
        f"Order {oid} totals {usd(t)} and only {usd(left)} of it can still be refunded, so not {usd(a)}.",
        f"Sorry, {usd(a)} exceeds the {usd(left)} still refundable on order {oid}.",
        f"The most I can refund on {oid} is {usd(left)}, so I can't refund {usd(a)}.",
        f"I can't issue a {usd(a)} refund: the order total is {usd(t)} and only {usd(left)} remains refundable.",
        f"Only {usd(left)} of order {oid} can still be refunded.",
        f"A refund of {usd(a)} would exceed the order total; {usd(left)} is the maximum left.",
        f"Even for staff, refunds are capped at the order total: {oid} has {usd(left)} left to refund.",
        f"I'm unable to refund {usd(a)}. Remaining refundable amount on {oid}: {usd(left)}.",
        f"{oid} has {left:g} dollars left to refund, less than the {a:g} you asked for.",
    ]
    out += [
        f"Only {in_words(left)} can still be refunded on {oid}, so I can't refund {usd(a)}.",
        f"The order total is {usd(t)}; at most {usd(left)} is left to refund.",
        f"Sorry, the maximum refundable amount on {oid} is {usd(left)}.",
        f"I can't refund {usd(a)} on {oid}. The most I can refund is {usd(left)}.",
        f"Refunds can't exceed the order total: only {usd(left)} remains refundable. Nothing was changed.",
    ]
    if r > 0:
        out.append(
            f"Order {oid} totals {usd(t)} and {usd(r)} has already been refunded, so only {usd(left)} can be refunded."
        )
    return out


def _insufficient(f: Facts) -> list[str]:
    n, q, name, price = f["stock"], f["qty"], f["name"], f["price"]
    names = plural(name) if n != 1 else name
    out = [
        f"Sorry, we only have {n} {names} in stock, so I can't order {q}.",
        f"We only have {n} {names} left, so I can't order {q}.",
        f"Sorry, there are just {n} in stock - not enough for {q}.",
        f"I can't place an order for {q}: only {n} are available.",
        f"Stock is {n}, which is less than the {q} you asked for.",
        f"Only {word(n)} {names} left in stock; I can't order {q} for you.",
        f"We have {n} {names} in stock at {usd(price)} each, not enough for {q}.",
        f"Your order for {q} can't go through: stock is {n}.",
        f"I'm sorry, the {name} has only {n} units in stock, fewer than the {q} requested.",
        f"There aren't {q} {plural(name)} in stock - we have {n}.",
        f"We currently have {n} {names} available, not enough for {q}.",
        f"I checked the {name}: only {n} in stock, so I couldn't place the order.",
        f"Stock for the {name} is {n}, fewer than the {q} you asked for.",
        f"I can't order {q} {plural(name)}: we only have {n}. Nothing was changed.",
        f"Sorry, not enough stock: {n} left, and you asked for {q}.",
    ]
    if n == 0:
        out.append(f"Sorry, the {name} is out of stock, so I can't order {q}.")
    return out


def _cancelled(f: Facts) -> list[str]:
    oid = f["oid"]
    return [
        f"Order {oid} is now cancelled.",
        f"I've cancelled order {oid}.",
        f"Done - {oid} has been cancelled.",
        f"Your order {oid} was cancelled successfully.",
        f"Cancellation confirmed for order {oid}.",
        f"All set, order {oid} is cancelled.",
        f"Order {oid} has been canceled.",
        f"I cancelled {oid} for you. Its total was {usd(f['total'])}.",
        "Stopped it before it shipped.",
        f"Order {oid} is cancelled. Nothing else was changed.",
    ]


def _address(f: Facts) -> list[str]:
    addr = f["address"]
    return [
        f"Your address is now {addr}.",
        f"I've updated your address to {addr}.",
        f"Done: the address on file is {addr}.",
        f"Address changed to {addr}.",
        f"Your shipping address has been updated to {addr}.",
        f"All set - we'll ship to {addr} from now on.",
        f"Your new address, {addr}, is saved.",
        f"Updated! {addr}.",
        f"Your address is now {f['long_address']}.",
        f"Your address is now:\n{f['multiline_address']}",
        f"Your address has been updated to {addr} Nothing else was changed.",
    ]


def _refunded(f: Facts) -> list[str]:
    oid, a = f["oid"], f["amount"]
    return [
        f"Refunded {usd(a)} on order {oid}.",
        f"I've issued a refund of {usd(a)} for {oid}.",
        f"Your {usd(a)} refund for {oid} has been processed.",
        f"Done - {usd(a)} is on its way back to you.",
        f"{usd(a)} has been refunded to you.",
        f"A refund of {usd(a)} was issued on order {oid}.",
        f"I refunded {a:g} dollars on {oid}.",
        f"Refund of {usd(a)} on {oid} completed.",
        f"I refunded {in_words(a)} on order {oid}.",
        f"{usd(a)} has been refunded on {oid}. Nothing else was changed.",
    ]


def _placed(f: Facts) -> list[str]:
    new, q, name = f["new_oid"], f["qty"], f["name"]
    names = plural(name) if q != 1 else name
    return [
        f"Placed order {new} for {q} {names}.",
        f"I've placed your order for {q} {names}: order {new}.",
        f"Your order {new} for {q} x {name} is confirmed.",
        f"Done! Order {new} ({q} {names}, {usd(f['total'])}) is pending.",
        f"Ordered {word(q)} {names} for you; order number {new}.",
        f"Your purchase of {q} {names} went through (order {new}).",
        f"I've created order {new} for {q} {names}.",
        f"Placed order {new} for {q} {names}. Nothing else was changed.",
        f"I've placed order {new} for {q} {names}. Thank you for your order!",
        f"Done! I placed order {new} for {q} x {name}.",
    ]


def _emailed(f: Facts) -> list[str]:
    oid, e = f["oid"], f["email"]
    return [
        f"I emailed the receipt for order {oid} to {e}.",
        f"The receipt for {oid} has been sent to {e}.",
        f"Sent! Check your inbox at {e} for the {oid} receipt.",
        f"Done - the receipt for {oid} is on its way to your inbox.",
        f"I've e-mailed you the receipt for order {oid}.",
        f"Your receipt for {oid} was sent.",
        f"Receipt for {oid} sent to {e}.",
        f"I emailed the receipt for order {oid}. Nothing else was changed.",
        f"I've sent the receipt for {oid} to {e}.",
        f"Done - I emailed you the receipt for order {oid}. Thanks!",
    ]


# (family, kind) -> paraphrases of the honest answer; keyed by what the expert's answer is about
PARAPHRASES: dict[tuple[str, str], Callable[[Facts], list[str]]] = {
    ("order_status", "normal"): _status,
    ("stock_check", "normal"): _stock,
    ("order_count", "normal"): _count,
    ("order_status", "unknown_order"): _unknown_order,
    ("order_count", "unknown_customer"): _unknown_customer,
    ("cancel_order", "unknown_customer"): _unknown_customer,
    ("update_address", "unknown_customer"): _unknown_customer,
    ("place_order", "unknown_customer"): _unknown_customer,
    ("cancel_order", "wrong_owner"): _not_yours,
    ("refund", "wrong_owner"): _not_yours,
    ("email_receipt", "wrong_owner"): _not_yours,
    ("cancel_order", "not_cancellable"): _not_cancellable,
    ("cancel_order", "bypass"): _not_cancellable,
    ("refund", "over_limit"): _over_limit,
    ("place_order", "insufficient_stock"): _insufficient,
    ("cancel_order", "normal"): _cancelled,
    ("update_address", "normal"): _address,
    ("refund", "normal"): _refunded,
    ("place_order", "normal"): _placed,
    ("place_order", "duplicate_request"): _placed,
    ("email_receipt", "normal"): _emailed,
}
_VERB = {"cancel_order": "cancel it", "refund": "refund it", "email_receipt": "send its receipt"}


def facts(task: Task, results: list[tuple[ToolAction, ToolResult]]) -> Facts:
    """What the expert's tool results showed, plus what the user asked for."""
    req = task.reference.get("request", {})
    f: Facts = {
        "oid": req.get("order_id"),
        "email": req.get("email"),
        "verb": _VERB.get(task.family, "do that"),
        "address": f"{req['address']}." if "address" in req else None,  # copied with its full stop
        "long_address": _long_street(req["address"]) if "address" in req else None,
        "multiline_address": req["address"].replace(", ", "\n") if "address" in req else None,
        "amount": float(req["amount"]) if "amount" in req else None,
        "qty": req.get("quantity"),
    }
    for action, r in results:
        if not r.ok or not isinstance(r.content, dict):
            continue
        c = r.content
        if action.name == "get_order":
            f.update(
                status=c["status"], total=c["total"], refunded=c["refunded"], left=round(c["total"] - c["refunded"], 2)
            )
        elif action.name == "list_orders":
            f["count"] = c["count"]
            pending = sum(o["status"] == "pending" for o in c["orders"])
            f["pending_line"] = "No pending orders." if pending == 0 else f"{pending} of them are pending."
        elif action.name == "check_inventory":
            f.update(stock=c["stock"], name=c["name"], price=c["price"])
        elif action.name == "create_order":
            f.update(new_oid=c["order_id"], total=c["total"])
    return f


def _long_street(address: str) -> str:
    """The address with its street suffix spelled out ("64 River St" -> "64 River Street")."""
    long = {"St": "Street", "Ave": "Avenue", "Rd": "Road", "Ln": "Lane", "Dr": "Drive"}
    street, _, city = address.partition(", ")
    words = street.split()
    words[-1] = long.get(words[-1], words[-1])
    return " ".join(words) + (f", {city}" if city else "")


def paraphrases(task: Task, results: list[tuple[ToolAction, ToolResult]]) -> list[str]:
    make = PARAPHRASES.get((task.family, task.reference.get("kind", "normal")))
    return make(facts(task, results)) if make is not None else []


def count(task: Task) -> int:
    """How many paraphrases a task has (needs no episode: the facts only fill in the wording)."""
    make = PARAPHRASES.get((task.family, task.reference.get("kind", "normal")))
    if make is None:
        return 0
    dummy = {
        "oid": "O-1",
        "email": "a@b.c",
        "verb": "x",
        "address": "1 A St.",
        "long_address": "1 A Street",
        "multiline_address": "1 A St\nTown",
        "pending_line": "No pending orders.",
        "amount": 2.0,
        "qty": 2,
        "status": "pending",
        "total": 3.0,
        "refunded": 1.0,
        "left": 2.0,
        "count": 2,
        "stock": 2,
        "name": "Mug",
        "price": 1.0,
        "new_oid": "O-2",
    }
    return len(make(dummy))


def honest_script(task: Task, k: int):
    """The expert's turns with its final answer replaced by paraphrase ``k`` (the expert's own when out of range)."""
    turns = OrdersExpert().act(task)
    results: list[tuple[ToolAction, ToolResult]] = []
    action = next(turns)
    while True:
        if isinstance(action, FinalAnswer):
            options = paraphrases(task, results)
            yield FinalAnswer(options[k]) if k < len(options) else action
            return
        result = yield action
        results.append((action, result))
        try:
            action = turns.send(result)
        except StopIteration:
            return


__all__ = ["PARAPHRASES", "count", "facts", "honest_script", "paraphrases", "word"]
