"""Scripted expert for the orders environment.

It reads the user's request (ids, amounts, quantities) from ``task.reference["request"]``
but takes every fact it reports or acts on (customer id, status, stock, totals, new order
id) from the tool results it receives, and decides refusals from them as a real agent
would. Each family always uses the same tool-sequence shape.
"""

from __future__ import annotations

from typing import Any, Generator

from mentorrl.envs.base import Action, FinalAnswer, Task, ToolAction, ToolResult

from .tasks import fmt_amount, plural
from .world import OPEN_STATUSES

Gen = Generator[Action, ToolResult, None]


def _qty(n: int, name: str) -> str:
    return f"{n} {plural(name) if n != 1 else name}"


class OrdersExpert:
    def act(self, task: Task) -> Gen:
        req = task.reference["request"]
        family = task.family
        if family == "order_status":
            r = yield ToolAction("get_order", {"order_id": req["order_id"]})
            if not r.ok:
                yield FinalAnswer(f"Sorry, no order {req['order_id']} was found.")
                return
            yield FinalAnswer(f"Order {r.content['order_id']} is {r.content['status']}.")
            return
        if family == "stock_check":
            r = yield ToolAction("check_inventory", {"product": req["product"]})
            if not r.ok:
                yield FinalAnswer(f"Sorry, I couldn't find the product {req['product']}.")
                return
            yield FinalAnswer(f"We have {_qty(r.content['stock'], r.content['name'])} in stock.")
            return

        # every other family starts by identifying the customer
        r = yield ToolAction("find_customer", {"email": req["email"]})
        if not r.ok:
            yield FinalAnswer(f"Sorry, no customer was found with email {req['email']}.")
            return
        cid = r.content["customer_id"]
        yield from getattr(self, f"_{family}")(req, cid)

    # -- families after identification ------------------------------------------------------
    def _order_count(self, req: dict[str, Any], cid: str) -> Gen:
        r = yield ToolAction("list_orders", {"customer_id": cid})
        n = r.content["count"]
        yield FinalAnswer(f"You have {n} order{'s' if n != 1 else ''}.")

    def _own_order(self, req: dict[str, Any], cid: str, refused: str) -> Gen:
        """get_order, then refuse if it is not the customer's; returns the order or None."""
        r = yield ToolAction("get_order", {"order_id": req["order_id"]})
        if not r.ok:
            yield FinalAnswer(f"Sorry, no order {req['order_id']} was found.")
            return None
        order = r.content
        if order["customer_id"] != cid:
            yield FinalAnswer(f"Order {order['order_id']} is not on your account, so I can't {refused}.")
            return None
        return order

    def _cancel_order(self, req: dict[str, Any], cid: str) -> Gen:
        order = yield from self._own_order(req, cid, "cancel it")
        if order is None:
            return
        if order["status"] not in OPEN_STATUSES:
            yield FinalAnswer(f"Sorry, order {order['order_id']} is already {order['status']}, so I can't cancel it.")
            return
        r = yield ToolAction("cancel_order", {"order_id": order["order_id"]})
        if not r.ok:
            yield FinalAnswer(f"Sorry, I couldn't cancel order {order['order_id']}: {r.error}")
            return
        yield FinalAnswer(f"Order {r.content['order_id']} is now cancelled.")

    def _update_address(self, req: dict[str, Any], cid: str) -> Gen:
        r = yield ToolAction("update_address", {"customer_id": cid, "address": req["address"]})
        if not r.ok:
            yield FinalAnswer(f"Sorry, I couldn't update your address: {r.error}")
            return
        yield FinalAnswer(f"Your address is now {r.content['address']}.")

    def _refund(self, req: dict[str, Any], cid: str) -> Gen:
        order = yield from self._own_order(req, cid, "refund it")
        if order is None:
            return
        amount = float(req["amount"])
        left = round(order["total"] - order["refunded"], 2)
        if amount > left + 1e-9:
            yield FinalAnswer(
                f"Sorry, I can't refund ${fmt_amount(amount)}: order {order['order_id']} "
                f"has only ${left:.2f} left to refund."
            )
            return
        r = yield ToolAction("issue_refund", {"order_id": order["order_id"], "amount": amount})
        if not r.ok:
            yield FinalAnswer(f"Sorry, I couldn't issue the refund: {r.error}")
            return
        yield FinalAnswer(f"Refunded ${r.content['refunded']:.2f} on order {r.content['order_id']}.")

    def _place_order(self, req: dict[str, Any], cid: str) -> Gen:
        qty = int(req["quantity"])
        r = yield ToolAction("check_inventory", {"product": req["product"]})
        if not r.ok:
            yield FinalAnswer(f"Sorry, we don't sell {req['product']}.")
            return
        p = r.content
        if p["stock"] < qty:
            yield FinalAnswer(f"Sorry, we only have {_qty(p['stock'], p['name'])} in stock, so I can't order {qty}.")
            return
        r = yield ToolAction("create_order", {"customer_id": cid, "product_id": p["product_id"], "quantity": qty})
        if not r.ok:
            yield FinalAnswer(f"Sorry, I couldn't place the order: {r.error}")
            return
        yield FinalAnswer(f"Placed order {r.content['order_id']} for {_qty(qty, p['name'])}.")

    def _email_receipt(self, req: dict[str, Any], cid: str) -> Gen:
        order = yield from self._own_order(req, cid, "send its receipt")
        if order is None:
            return
        r = yield ToolAction("send_email", {"customer_id": cid, "order_id": order["order_id"]})
        if not r.ok:
            yield FinalAnswer(f"Sorry, I couldn't send the receipt: {r.error}")
            return
        yield FinalAnswer(f"I emailed the receipt for order {r.content['order_id']} to {r.content['to']}.")
