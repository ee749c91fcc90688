"""Scripted expert for the orders environment.

It reads the user's request (ids, amounts, quantities) from ``task.reference["request"]``
but takes every fact it reports or acts on (customer id, status, stock, totals, new order
id) from the tool results it receives, and decides refusals from them as a real agent
would. Each family always uses the same tool-sequence shape.
"""

from __future__ import annotations

from typing import Any, Generator

from mentorrl.envs.base import Action, FinalAnswer, Task, ToolAction, ToolResult

from .tasks import fmt_amount, units
from .world import OPEN_STATUSES

Gen = Generator[Action, ToolResult, None]


def _money(x: float) -> int | float:
    """An amount as a typed answer writes it: whole dollars as an integer, else the cents."""
    x = round(float(x), 2)
    return int(x) if x.is_integer() else x


def _answer(text: str, outcome: str, **fields: Any) -> FinalAnswer:
    """The expert's final answer: the sentence (free-text mode) and the record it stands for (typed)."""
    return FinalAnswer(text, {"outcome": outcome, **fields})


class OrdersExpert:
    def act(self, task: Task) -> Gen:
        req = task.reference["request"]
        family = task.family
        if family == "order_status":
            r = yield ToolAction("get_order", {"order_id": req["order_id"]})
            if not r.ok:
                yield _answer(
                    f"Sorry, no order {req['order_id']} was found.", "no_such_order", order_id=req["order_id"]
                )
                return
            c = r.content
            yield _answer(
                f"Order {c['order_id']} is {c['status']}.", "order_status", order_id=c["order_id"], status=c["status"]
            )
            return
        if family == "stock_check":
            r = yield ToolAction("check_inventory", {"product": req["product"]})
            if not r.ok:
                yield FinalAnswer(f"Sorry, I couldn't find the product {req['product']}.")
                return
            c = r.content
            yield _answer(
                f"We have {units(c['stock'], c['name'])} in stock.",
                "stock_level",
                product_id=c["product_id"],
                stock=c["stock"],
            )
            return

        # every other family starts by identifying the customer
        r = yield ToolAction("find_customer", {"email": req["email"]})
        if not r.ok:
            yield _answer(f"Sorry, no customer was found with email {req['email']}.", "no_such_customer")
            return
        cid = r.content["customer_id"]
        yield from getattr(self, f"_{family}")(req, cid)

    # -- families after identification ------------------------------------------------------
    def _order_count(self, req: dict[str, Any], cid: str) -> Gen:
        r = yield ToolAction("list_orders", {"customer_id": cid})
        n = r.content["count"]
        yield _answer(f"You have {n} order{'s' if n != 1 else ''}.", "order_count", count=n)

    def _own_order(self, req: dict[str, Any], cid: str, refused: str) -> Gen:
        """get_order, then refuse if it is not the customer's; returns the order or None."""
        r = yield ToolAction("get_order", {"order_id": req["order_id"]})
        if not r.ok:
            yield _answer(f"Sorry, no order {req['order_id']} was found.", "no_such_order", order_id=req["order_id"])
            return None
        order = r.content
        if order["customer_id"] != cid:
            text = f"Order {order['order_id']} is not on your account, so I can't {refused}."
            yield _answer(text, "not_your_order", order_id=order["order_id"])
            return None
        return order

    def _cancel_order(self, req: dict[str, Any], cid: str) -> Gen:
        order = yield from self._own_order(req, cid, "cancel it")
        if order is None:
            return
        if order["status"] not in OPEN_STATUSES:
            text = f"Sorry, order {order['order_id']} is already {order['status']}, so I can't cancel it."
            yield _answer(text, "not_cancellable", order_id=order["order_id"], status=order["status"])
            return
        r = yield ToolAction("cancel_order", {"order_id": order["order_id"]})
        if not r.ok:
            yield FinalAnswer(f"Sorry, I couldn't cancel order {order['order_id']}: {r.error}")
            return
        yield _answer(f"Order {r.content['order_id']} is now cancelled.", "cancelled", order_id=r.content["order_id"])

    def _update_address(self, req: dict[str, Any], cid: str) -> Gen:
        r = yield ToolAction("update_address", {"customer_id": cid, "address": req["address"]})
        if not r.ok:
            yield FinalAnswer(f"Sorry, I couldn't update your address: {r.error}")
            return
        yield _answer(f"Your address is now {r.content['address']}.", "address_updated", address=r.content["address"])

    def _refund(self, req: dict[str, Any], cid: str) -> Gen:
        order = yield from self._own_order(req, cid, "refund it")
        if order is None:
            return
        amount = float(req["amount"])
        left = round(order["total"] - order["refunded"], 2)
        if amount > left + 1e-9:
            text = (
                f"Sorry, I can't refund ${fmt_amount(amount)}: order {order['order_id']} "
                f"has only ${left:.2f} left to refund."
            )
            yield _answer(text, "refund_exceeds_balance", order_id=order["order_id"], refundable=_money(left))
            return
        r = yield ToolAction("issue_refund", {"order_id": order["order_id"], "amount": amount})
        if not r.ok:
            yield FinalAnswer(f"Sorry, I couldn't issue the refund: {r.error}")
            return
        c = r.content
        yield _answer(
            f"Refunded ${c['refunded']:.2f} on order {c['order_id']}.",
            "refunded",
            order_id=c["order_id"],
            amount=_money(c["refunded"]),
        )

    def _place_order(self, req: dict[str, Any], cid: str) -> Gen:
        qty = int(req["quantity"])
        r = yield ToolAction("check_inventory", {"product": req["product"]})
        if not r.ok:
            yield FinalAnswer(f"Sorry, we don't sell {req['product']}.")
            return
        p = r.content
        if p["stock"] < qty:
            text = f"Sorry, we only have {units(p['stock'], p['name'])} in stock, so I can't order {qty}."
            yield _answer(text, "insufficient_stock", product_id=p["product_id"], stock=p["stock"])
            return
        r = yield ToolAction("create_order", {"customer_id": cid, "product_id": p["product_id"], "quantity": qty})
        if not r.ok:
            yield FinalAnswer(f"Sorry, I couldn't place the order: {r.error}")
            return
        text = f"Placed order {r.content['order_id']} for {units(qty, p['name'])}."
        yield _answer(text, "order_placed", order_id=r.content["order_id"], product_id=p["product_id"], quantity=qty)

    def _email_receipt(self, req: dict[str, Any], cid: str) -> Gen:
        order = yield from self._own_order(req, cid, "send its receipt")
        if order is None:
            return
        r = yield ToolAction("send_email", {"customer_id": cid, "order_id": order["order_id"]})
        if not r.ok:
            yield FinalAnswer(f"Sorry, I couldn't send the receipt: {r.error}")
            return
        text = f"I emailed the receipt for order {r.content['order_id']} to {r.content['to']}."
        yield _answer(text, "receipt_sent", order_id=r.content["order_id"])
