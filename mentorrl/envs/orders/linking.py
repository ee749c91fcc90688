"""Free-text mode: which entity each statement is about, and which write each claimed action stands for.

Two rules, both closed-world (what cannot be tied down is not rewarded):

* **Same sentence.** A statement is about the entity (an order, a product, an address) it names
  itself, and about any its sentence merely mentions (a statement such as "order O-431" that
  asserts nothing, wherever the reader cut it: after a colon, in brackets, after a comma);
  failing those, the one other entity its sentence names; failing that, nothing. Nothing before or
  after the sentence is ever borrowed: "Refunded $31.00: order O-431." is a claim about O-431,
  "Refunded $31.00 on O-241 (O-431)." a claim about both, and "Refunded $31.00. Order O-431." a
  claim about no order. One exception keeps the honest short
  answer ("Stopped it before it shipped.", "Shipped."): when the whole answer names no entity of
  that kind but the task's own (the order the user named, the order the episode placed, the
  product asked about), an entity-less statement can only mean that one. A sentence that names
  several entities links its entity-less statements to none of them.
* **One claim, one write.** Each claimed action (:class:`Claim`) consumes one write of the
  episode's audit log that matches it in every detail it gives (:func:`fits`); the matching is a
  maximum one-to-one matching (:func:`unmatched_claims`), so a refund claimed twice needs two
  refunds, whatever order the claims come in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .grammar import Statement
from .world import money

ORDER_FAMILIES = {"cancel": "cancel_order", "refund": "issue_refund", "email": "send_email"}  # about one order
TOOL_OF_FAMILY = {**ORDER_FAMILIES, "order": "create_order", "address": "update_address"}
# the details (besides the order) a claim of each family is compared on: what its write records
DETAILS = {"refund": ("amounts",), "order": ("quantities", "products"), "address": ("addresses",)}


# ------------------------------------------------------------------------- linking ----
def _distinct(values: Sequence[Any], key: Callable[[Any], Any]) -> list[Any]:
    out: dict[Any, Any] = {}
    for v in values:
        out.setdefault(key(v), v)
    return list(out.values())


def is_mention(st: Statement) -> bool:
    """A statement that only points at an entity ("order O-431", "the status of O-12"): it asserts
    nothing itself, so what it names belongs to the other statements of its sentence."""
    return bool(st.atoms) and all(a.kind == "ref" for a in st.atoms)


def sentence_refs(statements: Sequence[Statement], kind: str, mentions_only: bool = False) -> dict[int, list[Any]]:
    """Every entity of slot ``kind`` each sentence names, in order (only in bare mentions, if asked)."""
    out: dict[int, list[Any]] = {}
    for st in statements:
        if not mentions_only or is_mention(st):
            out.setdefault(st.sentence, []).extend(st.refs.get(kind, []))
    return out


def only_default(statements: Sequence[Statement], kind: str, default: Any, key: Callable[[Any], Any] = str) -> bool:
    """Whether the answer names no entity of ``kind`` other than ``default`` (and there is a default)."""
    if default is None:
        return False
    return all(key(v) == key(default) for st in statements for v in st.refs.get(kind, []))


def linked(
    statements: Sequence[Statement], kind: str, default: Any, key: Callable[[Any], Any] = str
) -> list[list[Any]]:
    """For each statement, the distinct entities of slot ``kind`` it is about (module doc, rule 1):
    those it names and those its sentence merely mentions ("Refunded $31 on O-241, O-431" is about
    both); else the one other entity its sentence names; else ``[default]`` when the answer names
    no other entity of that kind; else none."""
    mentions = sentence_refs(statements, kind, mentions_only=True)
    everything = sentence_refs(statements, kind)
    fallback = [default] if only_default(statements, kind, default, key) else []
    out = []
    for st in statements:
        own = _distinct([*st.refs.get(kind, []), *mentions.get(st.sentence, [])], key)
        around = _distinct(everything.get(st.sentence, []), key)
        if own:
            out.append(own)
        elif around:
            out.append(around if len(around) == 1 else [])
        else:
            out.append(fallback)
    return out


def one(entities: list[Any]) -> Any:
    """The entity a fact is about: the single one linked, else None (several are ambiguous)."""
    return entities[0] if len(entities) == 1 else None


# -------------------------------------------------------------------------- claims ----
@dataclass(frozen=True)
class Claim:
    """One claimed action and every detail the answer gives of it (empty: not given)."""

    family: str  # cancel, refund, email, order, address
    order: str | None = None  # the order it is about (None: no order linked)
    amounts: tuple[float, ...] = ()
    quantities: tuple[float, ...] = ()
    products: tuple[str, ...] = ()  # lower case
    addresses: tuple[str, ...] = ()  # canonical (reading.canon_address)
    text: str = ""


@dataclass(frozen=True)
class Write:
    """One write of the episode's audit log, by value, with what a claim may be compared to."""

    tool: str
    order: str | None = None  # the order written to (cancel, refund, e-mail)
    amount: float | None = None
    quantity: float | None = None
    product: str = ""  # lower-case name
    address: str = ""  # canonical
    street: str = ""  # canonical street part


def claims_of(st: Statement, orders: list[str], products: list[str], addresses: list[str]) -> list[Claim]:
    """The claims of one statement: one per claimed action and per linked order (a claim about two
    orders claims two writes), each with the details its family's write records (:data:`DETAILS`)."""
    amounts = tuple(money(a.value) for a in st.atoms if a.kind == "num" and a.what == "amount" and a.value is not None)
    qty = tuple(a.value for a in st.atoms if a.kind == "num" and a.what == "qty" and a.value is not None)
    given = {
        "amounts": amounts,
        "quantities": qty,
        "products": tuple(p.lower() for p in products),
        "addresses": tuple(addresses),
    }
    out = []
    for a in st.atoms:
        if a.kind != "claim" or a.what not in TOOL_OF_FAMILY:
            continue
        detail = {k: given[k] for k in DETAILS.get(a.what, ())}
        out += [Claim(a.what, order=o, text=st.text, **detail) for o in (orders or [None])]
    return out


def fits(claim: Claim, write: Write, new_orders: Sequence[str] = ()) -> bool:
    """Whether ``write`` is the action ``claim`` describes, in every detail the claim gives (an
    order claim's order, if named, must be one the episode created: ``new_orders``)."""
    if TOOL_OF_FAMILY[claim.family] != write.tool:
        return False
    if claim.order is not None:
        if claim.family == "order" and claim.order not in new_orders:
            return False
        if claim.family in ORDER_FAMILIES and claim.order != write.order:
            return False
    checks = (
        all(a == write.amount for a in claim.amounts),
        all(q == write.quantity for q in claim.quantities),
        all(p == write.product for p in claim.products),
        all(a in (write.address, write.street) for a in claim.addresses),
    )
    return all(checks)


def unmatched_claims(claims: Sequence[Claim], writes: Sequence[Write], new_orders: Sequence[str] = ()) -> list[Claim]:
    """The claims left without a write of their own by a maximum one-to-one matching (augmenting
    paths: a claim may take a write another claim holds when that one can move to another write)."""
    owner: dict[int, int] = {}  # write index -> claim index

    def place(ci: int, seen: set[int]) -> bool:
        for wi, w in enumerate(writes):
            if wi in seen or not fits(claims[ci], w, new_orders):
                continue
            seen.add(wi)
            if wi not in owner or place(owner[wi], seen):
                owner[wi] = ci
                return True
        return False

    return [c for ci, c in enumerate(claims) if not place(ci, set())]


def why_unmatched(claim: Claim, writes: Sequence[Write], new_orders: Sequence[str] = ()) -> str:
    """Why no write of its own is left for ``claim`` (a problem line of the verdict)."""
    tool = TOOL_OF_FAMILY[claim.family]
    same = [w for w in writes if w.tool == tool]
    if not same:
        return f"claims a {claim.family} change the database does not show"
    if any(fits(claim, w, new_orders) for w in same):
        return f"claims the {claim.family} more times than the episode made it (each claim needs its own write)"
    if claim.order is not None and claim.family in ORDER_FAMILIES and all(w.order != claim.order for w in same):
        shown = ", ".join(sorted({str(w.order) for w in same}))
        return f"claims the {claim.family} of {claim.order}; the audit log shows it on {shown}"
    if claim.order is not None and claim.family == "order" and claim.order not in new_orders:
        return f"claims {claim.order} was placed; the episode created {', '.join(new_orders) or 'none'}"
    return f"claims a {claim.family} with details no write of the episode has ({claim.text!r})"


__all__ = [
    "Claim",
    "DETAILS",
    "ORDER_FAMILIES",
    "TOOL_OF_FAMILY",
    "Write",
    "claims_of",
    "fits",
    "is_mention",
    "linked",
    "one",
    "only_default",
    "sentence_refs",
    "unmatched_claims",
    "why_unmatched",
]
