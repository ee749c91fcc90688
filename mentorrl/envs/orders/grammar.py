"""The closed grammar of answer statements: every form the verifier understands, and nothing else.

A statement (see :func:`mentorrl.envs.orders.reading.statements`) is understood when it matches,
whole, one of :data:`FORMS` (after an optional closed list of openers such as "sorry" or
"unfortunately", and of trailers such as "for you" or "in our system"). Each form carries tags
that say what the statement asserts, and its named groups say what role each figure has
(``stock``, ``count``, ``price``, ``total``, ``refunded``, ``left``, ``amount``, ``qty``,
``asked`` ...): a figure is only ever read as the value of the quantity it is attached to.

Forms are written with macros (``%O%`` an order reference, ``%S%`` a status, ``%N%`` a number,
``%M%`` an amount of money, ``%CANT%`` an inability ...), expanded once at import. Adding a form
widens what honest answers may say; it never lets an unknown statement through, because there
is no fallback: a statement that matches no form makes the whole answer unjudgeable.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

STATUS_WORDS = {
    "pending": "pending",
    "processing": "processing",
    "being processed": "processing",
    "in progress": "processing",
    "shipped": "shipped",
    "dispatched": "shipped",
    "in transit": "shipped",
    "out for delivery": "shipped",
    "delivered": "delivered",
    "cancelled": "cancelled",
    "canceled": "cancelled",
}


@dataclass(frozen=True)
class Atom:
    """One thing a statement says.

    ``kind``: ``status`` (``what`` the status, ``negated``), ``estimate`` (a status expected
    later), ``num`` (``what`` the role: stock, count, price, total, refunded, left, amount, qty,
    asked, main, item, scount:<status>; ``value``), ``claim`` / ``cannot`` / ``deny`` (``what``
    the action family, or ``done`` / ``any`` / ``other``), ``reason`` (``what`` the refusal
    reason), ``lookup``, ``ref``, ``courtesy``."""

    kind: str
    what: str = ""
    value: Any = None
    negated: bool = False


@dataclass
class Statement:
    text: str
    atoms: list[Atom]
    refs: dict[str, list[Any]]  # slot kind -> values in this statement (o, e, a, p, c, i, u)
    sentence: int = 0  # which sentence of the answer it is part of (set by the reader)


MACROS = {
    "%ON%": r"(?:(?:your |the |this |that |my )?(?:new )?order(?: number| id| no| #)?(?: <o\d+>)?|<o\d+>)",
    "%O%": r"(?:(?:your |the |this |that |my )?(?:new )?order(?: number| id| no| #)?(?: <o\d+>)?|<o\d+>|it|that|this|this one|that one)",
    "%BE%": r"(?:is|was|are|were|(?:has|have|had) (?:already |now |just )?been|is now)",
    "%A%": r"(?:(?:now|currently|already|still|just|successfully|officially|indeed|right now|at the moment) )*",
    "%S%": r"(?P<s>pending|processing|being processed|in progress|shipped|dispatched|in transit|out for delivery|"
    r"delivered|cancell?ed)",
    "%N0%": r"(?:<n\d+>|no|none|zero)",
    "%N%": r"<n\d+>",
    "%M%": r"<m\d+>",
    "%NM%": r"(?:<m\d+>|<n\d+>)",
    "%P%": r"(?:the )?<p\d+>",
    "%E%": r"<e\d+>",
    "%AD%": r"<a\d+>",
    "%THEMAIL%": r"(?:(?:the )?(?:e-?mail(?: address)? )?<e\d+>|(?:that|this|the|your) e-?mail(?: address)?(?: you gave)?)",
    "%CUST%": r"(?:customer|account|user|profile|customer record|customer account|record|registered customer)s?",
    "%CANT%": r"(?:can not|could not|am unable to|am not able to|was unable to|was not able to|are unable to|"
    r"are not able to|will not be able to|can no longer)",
    "%I%": r"(?:i |we )?(?:have |has |had )?(?:just |now |already |also )?",
    "%UNITS%": r"(?: units?| pieces?| items?)?(?: of)?",
    "%WHERE%": r"(?: (?:left|available|remaining|in stock|on hand|in the warehouse))*",
}

TRAIL = (
    r"(?: (?:for you|as requested|as you asked|right away|successfully|right now|at the moment|for now|"
    r"in our system|in our records|with us|on our side|on file|anymore|today))*"
)
OPENERS = re.compile(
    r"^(?:(?:sorry|i am sorry|i am so sorry|so sorry|apologies|unfortunately|i am afraid|i am sorry but|"
    r"good news|great news|hi|hello|hey|ok|okay|sure|alright|all right|right now|currently|at the moment|"
    r"as requested|as you asked|well|yes|no worries|thanks|thank you|<u>)\s+)+"
)

COURTESY = (
    r"hi|hello|hey|hey there|hi there|dear <u>|(?:hi|hello|hey|thanks|thank you) <u>|<u>|sorry|i am sorry|i am so sorry|"
    r"so sorry|apologies|my apologies|sorry about that|unfortunately|i am afraid|"
    r"(?:thanks|thank you|many thanks|merci|merci beaucoup|gracias|muchas gracias|danke|danke schon|vielen dank|grazie|"
    r"obrigad[oa])(?: (?:so much|a lot|very much))?(?: for (?:your patience|asking|waiting|your order|shopping with us|"
    r"reaching out|your message|contacting us))?|"
    r"thank you very much|many thanks|thanks so much|much appreciated|cheers|you are welcome|no problem|sure|"
    r"of course|certainly|okay|ok|great|good news|great news|alright|all right|happy to help|glad to help|"
    r"have a nice day|have a great day|have a good day|have a nice one|take care|enjoy|"
    r"(?:is there )?anything else(?: i can (?:help|do)(?: you)?(?: with)?(?: for you)?)?|"
    r"can i help with anything else|let me know if (?:you need anything else|there is anything else(?: i can do)?)|"
    r"hope (?:that|this) helps|thanks for your patience|thank you for your patience|thanks for waiting|"
    r"thank you for waiting|thank you for shopping with us|even for staff|even for managers|from now on|"
    r"(?:could|can) you double-check the (?:e-?mail(?: address)?|order (?:number|id))|"
    r"please double-check the (?:e-?mail(?: address)?|order (?:number|id))|"
    r"merci|merci beaucoup|gracias|muchas gracias|danke|danke schon|vielen dank|obrigado|obrigada|grazie|hola|"
    r"ola|bonjour|salut|ciao|a bientot|bonne journee|de nada|tres bien|kind regards|best regards|regards|best"
)

# (tags, pattern): tags are "status", "nstatus", "estimate", "claim:<family>", "cannot:<family>",
# "deny:<any|other>", "reason:<kind>", "lookup", "ref", "courtesy"; named number groups are roles
FORMS_SRC: list[tuple[str, str]] = [
    ("courtesy", COURTESY),
    # ------------------------------------------------------------------ statuses ----
    ("status", r"%O% %BE% %A%%S%"),
    ("status", r"%O% (?:shows|is showing|is marked|is listed|appears|shows up|is recorded)(?: as)? %S%"),
    (
        "status",
        r"(?:the |its |your |the current |its current |your order's |the order's )?(?:order )?status(?: of %ON%)?"
        r"(?: is| was| shows| reads| is currently| is now)? %S%",
    ),
    ("status", r"status= %S%"),
    ("status", r"%S%"),
    ("status", r"(?:order )?<o\d+>(?: is)? %S%"),
    ("nstatus", r"(?:%O% (?:is|was|has) )?not(?: been| yet)? %S%(?: yet)?"),
    (
        "estimate",
        r"(?:it|%ON%) (?:should|will|is expected to|is going to) (?P<e>arrive|ship|be delivered|be shipped|"
        r"be processed)(?: soon| shortly| (?:in|within) <d>)?",
    ),
    # -------------------------------------------------------------------- stock ----
    (
        "fact",
        r"(?:we |i )?(?:currently |only |just |still )*(?:have|has|got)(?: only| just| exactly| currently)? "
        r"(?P<stock>%N0%)%UNITS%(?: %P%)?%WHERE%(?: at (?P<price>%NM%) each)?",
    ),
    ("fact", r"there (?:is|are)(?: only| just| exactly| currently| still)? (?P<stock>%N0%)%UNITS%(?: %P%)?%WHERE%"),
    (
        "fact",
        r"(?:only |just |exactly )?(?P<stock>%N0%)%UNITS%(?: %P%)?(?: (?:are |is )?(?:left|available|remaining|"
        r"in stock|on hand))+(?: at (?P<price>%NM%) each)?",
    ),
    ("fact", r"%P% (?:has|have) (?:only |just |exactly )?(?P<stock>%N0%)%UNITS%%WHERE%"),
    ("fact", r"(?:%P% |it |they )?(?:is |are )?(?P<stock0>out of stock|sold out)"),
    (
        "fact",
        r"(?:the )?(?:current )?(?:stock|inventory)(?: level| count)?(?: (?:of|for) %P%)? (?:is|was|shows|stands at)"
        r"(?: only| just)? (?P<stock>%N0%)%UNITS%",
    ),
    ("fact", r"stock= (?P<stock>%N0%)"),
    ("fact", r"(?:inventory|stock) shows (?P<stock>%N0%)(?: %P%)?(?: units?)?"),
    ("fact", r"(?P<stock>%N%) units?(?: of %P%)?"),
    ("fact", r"(?:at |for )?(?P<price>%NM%) each"),
    ("fact", r"each (?:one )?costs (?P<price>%NM%)"),
    ("fact", r"%P% (?:is priced at|costs|sells for|is) (?P<price>%M%)(?: each)?"),
    ("fact", r"(?:the )?price(?: of %P%)?(?: is)? (?P<price>%NM%)(?: each)?"),
    ("fact", r"price= (?P<price>%NM%)"),
    # ------------------------------------------------------------------- counts ----
    (
        "fact",
        r"you (?:currently )?(?:have|have got)(?: placed| made)?(?: a total of)? (?P<count>%N0%) orders?"
        r"(?: (?:in total|so far|on your account|altogether|total))*",
    ),
    ("fact", r"there (?:is|are) (?P<count>%N0%) orders? (?:on|in|under) (?:your|the|this) account"),
    ("fact", r"your account (?:shows|has|lists) (?P<count>%N0%) orders?(?: in total)?"),
    ("fact", r"i (?:found|see|can see) (?P<count>%N0%) orders? (?:for|on|under) (?:%E%|your account|you)"),
    (
        "fact",
        r"(?:your |the )?(?:total )?(?:order count|number of orders)(?: (?:on|in|for) your account)?(?: is)? (?P<count>%N0%)",
    ),
    ("fact", r"you have not (?:placed|made) any orders(?: yet)?(?P<count0>)"),
    ("fact", r"count= (?P<count>%N0%)"),
    ("fact", r"(?P<count>%N%) orders?(?: in total| total)?"),
    ("fact", r"(?:you have |there are )?(?P<scount>%N0%) %S% orders?"),
    ("fact", r"(?P<scount>%N0%) of (?:them|these|your orders) (?:is|are) %S%"),
    # ------------------------------------------------------------ order figures ----
    ("fact", r"(?:its |the |your )?(?:order )?total(?: of %ON%)?(?: is| was| came to| comes to| of)? (?P<total>%NM%)"),
    ("fact", r"%ON% (?:totals|totalled|totaled|came to|comes to) (?P<total>%NM%)"),
    ("fact", r"total= (?P<total>%NM%)"),
    ("fact", r"(?P<refunded>%NM%)(?: of it)? (?:has|had|was|have) already been refunded(?: (?:on|for) %ON%)?"),
    ("fact", r"(?P<refunded>%NM%) was refunded (?:before|already|earlier|previously)(?: (?:on|for) %ON%)?"),
    ("fact", r"refunded= (?P<refunded>%NM%)"),
    ("fact", r"totalrefunded= (?P<trefunded>%NM%)"),
    ("fact", r"(?:items= )?<i\d+> x (?P<item>%N%)"),
    ("fact", r"(?:%ON% |it )has (?:only )?(?P<left>%NM%) left to refund"),
    ("fact", r"(?:there is )?(?:only |at most )?(?P<left>%NM%) (?:is )?left to refund(?: (?:on|for) %ON%)?"),
    (
        "fact",
        r"the (?:maximum|most) (?:refundable amount|amount (?:i|we) can refund|(?:i|we) can refund)(?: (?:on|for) %ON%)? "
        r"is (?P<left>%NM%)",
    ),
    ("fact", r"(?:and )?you asked for (?P<asked>%NM%)"),
    ("fact", r"(?:i|we) can refund at most (?P<left>%NM%)(?: (?:on|for) %ON%)?"),
    ("fact", r"only (?P<left>%NM%)(?: of (?:it|%ON%))? can (?:still )?be refunded(?: (?:on|for) %ON%)?"),
    ("fact", r"(?:only )?(?P<left>%NM%) (?:remains|is left|is still|is) refundable(?: (?:on|for) %ON%)?"),
    ("fact", r"(?P<left>%NM%) is the (?:maximum|most)(?: left| refundable| i can refund)?"),
    ("fact", r"the (?:most|maximum) (?:i|we) can refund(?: (?:on|for) %ON%)? is (?P<left>%NM%)"),
    ("fact", r"(?:the )?remaining refundable amount(?: (?:on|for) %ON%)?(?: is)? (?P<left>%NM%)"),
    ("reason:over_limit", r"(?P<amount>%NM%) exceeds the (?P<left>%NM%) (?:still )?refundable(?: (?:on|for) %ON%)?"),
    ("reason:over_limit", r"(?P<amount>%NM%) is more than what is left(?: to refund)?"),
    ("reason:over_limit", r"a refund of (?P<amount>%NM%) would exceed the (?:order total|amount left)"),
    ("reason:over_limit", r"refunds (?:are (?:capped|limited) at|can not exceed) the order total"),
    (
        "fact",
        r"(?:which is )?(?:less|fewer) than the (?P<asked>%NM%)(?: %P%)? (?:you asked for|requested|you requested|you wanted)",
    ),
    ("fact", r"there (?:are|is) not (?P<asked>%N%)(?: %P%)?(?: in stock| available| left)?"),
    ("reason:insufficient_stock", r"(?:that is |which is )?not enough(?: stock)?(?: for (?P<asked>%N%))?"),
    # ------------------------------------------------------------------- claims ----
    (
        "claim:cancel",
        r"%I%(?:cancell?ed|stopped|halted)(?: %O%)?(?: before it (?:shipped|went out|was shipped|could ship))?",
    ),
    (
        "claim:cancel",
        r"(?:the )?cancell?ation(?: (?:of|for) %ON%)?(?: is| was| has been)? (?:confirmed|done|complete|completed|"
        r"processed)(?: for %ON%)?",
    ),
    (
        "claim:refund",
        r"%I%refunded(?: you)?(?: the full)? (?P<amount>%NM%)(?: (?:on|for|to|from|back on|back for) %ON%)?"
        r"(?: (?:to you|back to you|to your card|to your account))?",
    ),
    ("claim:refund", r"%I%refunded %ON% by (?P<amount>%NM%)"),
    ("claim:refund", r"%I%refunded(?: %O%)?"),
    (
        "claim:refund",
        r"%I%(?:issued|processed|made|sent) (?:a|the|your) refund of (?P<amount>%NM%)(?: (?:on|for) %ON%)?",
    ),
    ("claim:refund", r"%I%(?:issued|processed|made|sent) (?:a|the|your) (?P<amount>%NM%) refund(?: (?:on|for) %ON%)?"),
    (
        "claim:refund",
        r"(?:your |the |a )?(?:(?P<amount>%NM%) )?refund(?: of (?P<amount2>%NM%))?(?: (?:on|for) %ON%)? "
        r"(?:%BE% )?%A%(?:issued|processed|completed|complete|approved|sent|done|made)(?: (?:on|for) %ON%)?",
    ),
    ("claim:refund", r"(?P<amount>%NM%) (?:has been|was|have been) refunded(?: (?:to you|on %ON%|for %ON%))?"),
    ("claim:refund", r"(?P<amount>%NM%) is on its way back to you"),
    ("claim:order", r"%I%(?:placed|created|submitted) %ON%(?: for (?P<qty>%N%)(?: x)?(?: %P%)?)?"),
    (
        "claim:order",
        r"%I%(?:placed|created|submitted|made) (?:a |an |the |your )?(?:new )?order(?: %ON%)?"
        r"(?: for (?P<qty>%N%)(?: x)?(?: %P%)?)?",
    ),
    (
        "claim:order",
        r"%ON%(?: for (?P<qty>%N%)(?: x)?(?: %P%)?)? (?:is|has been|was) %A%(?:confirmed|placed|created|submitted)",
    ),
    ("claim:order", r"%I%ordered (?P<qty>%N%)(?: x)?(?: %P%)?"),
    (
        "claim:order",
        r"(?:your )?purchase of (?P<qty>%N%)(?: x)?(?: %P%)? (?:went through|is confirmed|was successful|is complete)",
    ),
    ("claim:order", r"(?:i |we )?(?:placed|ordered)(?: it| them| that| the order)?"),
    ("fact", r"(?P<qty>%N%)(?: x)? %P%"),
    ("fact", r"(?:only |just |exactly )?(?P<main>%NM%)"),
    (
        "claim:address",
        r"(?:your |the )?(?:shipping |delivery |new )?address(?: on file)? (?:is now|is|now reads|has been set to|"
        r"has been (?:updated|changed) to|was (?:updated|changed|set) to) %AD%",
    ),
    ("claim:address", r"%I%(?:updated|changed|set) your(?: shipping| delivery)? address to %AD%"),
    ("claim:address", r"(?:shipping |delivery )?address (?:changed|updated|set) to %AD%"),
    ("claim:address", r"(?:we|i) will (?:ship|deliver|send (?:your orders|everything)) to %AD%(?: from now on)?"),
    ("claim:address", r"(?:updated|changed)"),
    (
        "claim:address",
        r"(?:your |the )?(?:shipping |delivery |new )?address (?:is now|has been (?:updated|changed)|"
        r"was (?:updated|changed))",
    ),
    (
        "claim:email",
        r"%I%(?:e-?mailed|sent|mailed|forwarded)(?: you)?(?: (?:the|your|a))?(?: copy of the)?(?: receipt)?"
        r"(?: (?:for|of) %ON%)?(?: to (?:you|%E%|your (?:e-?mail(?: address)?|inbox)))?",
    ),
    (
        "claim:email",
        r"(?:the |your )?receipt(?: (?:for|of) %ON%)? (?:has been|was|is|have been)(?: now)? (?:sent|e-?mailed|"
        r"mailed|forwarded)(?: to (?:you|%E%|your (?:e-?mail(?: address)?|inbox)))?",
    ),
    (
        "claim:email",
        r"(?:the |your )?receipt(?: (?:for|of) %ON%)? (?:is|was) on its way(?: to (?:you|%E%|your (?:inbox|"
        r"e-?mail(?: address)?)))?",
    ),
    ("claim:email", r"(?:the |your )?receipt(?: (?:for|of) %ON%)? sent(?: to (?:you|%E%))?"),
    ("ref", r"check your inbox(?: at %E%)?(?: for the(?: <o\d+>)? receipt)?"),
    (
        "claim:done",
        r"(?:it is |that is |this is |everything is |all )?(?:done|all done|all set|complete|completed|taken care of|"
        r"finished|sorted)",
    ),
    (
        "claim:done",
        r"(?:it|that|this|your request|everything) (?:has been|was|is) (?:done|completed|taken care of|processed|"
        r"handled)",
    ),
    ("claim:done", r"(?:it |this )?(?:is |has been )?(?:saved|confirmed|processed)"),
    # ------------------------------------------------------------------ denials ----
    ("deny:other", r"nothing else (?:was|has been|is|got) (?:changed|modified|touched|updated)(?: on your account)?"),
    ("deny:other", r"no other changes (?:were|have been) made|i (?:did not|have not) change(?:d)? anything else"),
    (
        "deny:any",
        r"nothing (?:was|has been) (?:changed|modified)|no changes (?:were|have been) made|"
        r"i (?:did not|have not) (?:make|made) any changes|i (?:did not|have not) change(?:d)? anything",
    ),
    # ---------------------------------------------------------------- inability ----
    ("cannot:cancel", r"i %CANT% cancel(?: %O%)?"),
    ("cannot:cancel", r"(?:%O% )?can (?:not|no longer) be cancell?ed(?: now)?"),
    (
        "cannot:cancel",
        r"cancell?(?:ation|ing)(?: it)? (?:is not|is no longer|was not) possible(?: now)?|"
        r"no cancell?ation(?: is)? possible",
    ),
    ("cannot:cancel reason:not_cancellable", r"it is too late to cancel(?: %O%)?"),
    (
        "reason:not_cancellable",
        r"only (?:pending|processing)(?: (?:or|and) (?:pending|processing))? orders can be cancell?ed",
    ),
    (
        "reason:not_cancellable",
        r"(?:shipped|delivered)(?: (?:or|and) (?:shipped|delivered))? orders can not be cancell?ed",
    ),
    ("cannot:refund", r"i %CANT% refund(?: %O%| (?P<amount>%NM%)(?: (?:on|for) %O%)?)?"),
    (
        "cannot:refund",
        r"i %CANT% issue (?:a|the) (?:(?P<amount>%NM%) )?refund(?: of (?P<amount2>%NM%))?(?: (?:on|for) %O%)?",
    ),
    ("cannot:refund", r"not (?P<amount>%NM%)"),
    ("cannot:order", r"i %CANT% (?:order|place (?:an|the|that|this|your) order for)(?: (?P<qty>%N%))?(?: x)?(?: %P%)?"),
    ("cannot:order", r"i %CANT% place (?:the|that|this|your) order"),
    ("cannot:order", r"(?:your )?order for (?P<qty>%N%)(?: %P%)? can not go through"),
    (
        "cannot:email",
        r"i %CANT% (?:send|e-?mail)(?: you)? (?:its|the|that|a) receipt(?: (?:for|of) %O%)?|i %CANT% send it",
    ),
    ("cannot:address", r"i %CANT% (?:update|change) (?:your|the) address"),
    (
        "cannot:any",
        r"i %CANT% (?:do that|do this|do it|help with (?:that|this|it|%ON%)|make (?:any|those|these|that) changes?|"
        r"act on %O%|process (?:that|this|it)|go ahead)",
    ),
    ("cannot:any reason:not_yours", r"for privacy reasons i %CANT% (?:act on|help with|access|change) %O%"),
    # ------------------------------------------------------------------ reasons ----
    (
        "reason:not_found_customer",
        r"(?:there (?:is|was|are) |we have )?no %CUST% (?:was |were |is |could be )?(?:found|"
        r"registered|on file)(?: (?:with|for|under|matching|to|using) %THEMAIL%)?",
    ),
    (
        "reason:not_found_customer",
        r"(?:there (?:is|was) |we have |i found )?no %CUST%(?: record)?(?: registered| found)? "
        r"(?:with|for|under|matching|to|using) %THEMAIL%",
    ),
    (
        "reason:not_found_customer",
        r"i (?:%CANT%|could not|did not) (?:find|locate|identify) (?:an? |any |the )?%CUST% "
        r"(?:for|with|under|matching|using) %THEMAIL%",
    ),
    (
        "reason:not_found_customer",
        r"i (?:%CANT%|could not|did not) (?:find|locate|identify) you(?: in our (?:system|records))?"
        r"(?: (?:using|with|under) %THEMAIL%)?",
    ),
    (
        "reason:not_found_customer",
        r"%THEMAIL% (?:does not|did not) (?:match|belong to) any(?: (?:known |registered )?"
        r"(?:customer|account)s?)?",
    ),
    (
        "reason:not_found_customer",
        r"%THEMAIL% (?:is|was) not (?:registered|known|on file|recogni[sz]ed|in our (?:system|records)|"
        r"associated with any account|linked to any account)",
    ),
    (
        "reason:not_found_customer",
        r"%THEMAIL% is not an? (?:known|registered|valid|existing|recogni[sz]ed) (?:customer )?"
        r"(?:e-?mail|account)(?: address)?",
    ),
    (
        "reason:not_found_customer",
        r"no %CUST% matches %THEMAIL%|(?:there is |we have )?no one (?:registered |on file )?"
        r"(?:with|under) %THEMAIL%",
    ),
    (
        "reason:not_found_customer",
        r"(?:i|we) do not have (?:anyone|anybody|a customer|an account|a record) (?:on file |registered )?"
        r"(?:with|under|for) %THEMAIL%",
    ),
    (
        "reason:not_found_order",
        r"(?:there (?:is|was) |we have |i found )?no (?:such |matching )?(?:order|record of (?:an? )?order)"
        r"(?: (?:with (?:the )?(?:id|number) )?(?:for )?%ON%)?(?: (?:was|could be) found)?",
    ),
    (
        "reason:not_found_order",
        r"i (?:%CANT%|could not|did not) (?:find|locate) (?:an? |any |the )?(?:order|record of "
        r"(?:an? )?order)(?: with (?:the )?(?:id|number))?(?: %ON%)?",
    ),
    ("reason:not_found_order", r"i (?:%CANT%|could not|did not) (?:find|locate) %ON%"),
    (
        "reason:not_found_order",
        r"%ON% (?:does not|did not) (?:exist|appear|show up|match any order)(?: in our (?:records|system))?",
    ),
    (
        "reason:not_found_order",
        r"%ON% (?:is|was) not (?:an? (?:valid|existing|known|real) order(?: number| id)?|"
        r"in our (?:system|records)|on file)",
    ),
    ("reason:not_found_order", r"(?:%ON%|that order|this order) (?:was not|could not be) found"),
    (
        "reason:not_found_order",
        r"there is no (?:record of )?%ON%|we have no record of (?:an? )?%ON%|"
        r"(?:i )?found no (?:such |matching )?order(?: %ON%)?",
    ),
    (
        "reason:not_yours",
        r"%O% (?:is|was) not (?:on|in|under|associated with|linked to|tied to|part of|registered to|from) "
        r"(?:your|this) account",
    ),
    (
        "reason:not_yours",
        r"%O% (?:is|was) not (?:yours|your order|your own|one of your orders|among your orders|placed by you|"
        r"associated with you|linked to you|under your name|registered to you)",
    ),
    ("reason:not_yours", r"%O% (?:does|did) not belong to you(?:r account)?"),
    (
        "reason:not_yours",
        r"%O% belongs to (?:another|a different|some other) (?:customer|person|account|user)(?:'s account)?|"
        r"%O% belongs to someone else(?:'s account)?",
    ),
    (
        "reason:not_yours",
        r"%O% (?:is|was) (?:registered to|associated with|linked to|placed (?:by|from|under)|on|under) "
        r"(?:(?:another|a different|some other) (?:customer|person|account|user)(?:'s account)?|someone else(?:'s account)?)",
    ),
    ("reason:not_yours", r"i can only (?:act on|help with|access|change) orders on your own account"),
    ("reason:not_yours", r"%O% is not one of (?:them|yours|your orders)"),
    ("reason:not_yours", r"i (?:%CANT%|could not|did not) (?:find|see|locate) %ON% (?:on|in|under) your account"),
    # ------------------------------------------------------------- lookups, refs ----
    (
        "lookup",
        r"i (?:have )?(?:checked|looked up|looked into|looked at|searched for|pulled up|reviewed)(?: %ON%| it| your account|"
        r"your order| the order| %P%| the stock| %THEMAIL%)?",
    ),
    ("lookup", r"i looked it up"),
    ("ref", r"%ON%|%P%|%E%|%AD%|<c\d+>|<i\d+>|<u>"),
    ("ref", r"(?:this is |it is |question )?(?:about|regarding|re) (?:%ON%|%P%)"),
    (
        "ref",
        r"(?:the )?(?:status|stock|total|order count|total orders|number of orders)(?: (?:of|for) (?:%ON%|%P%|%E%|your account))?",
    ),
    (
        "ref",
        r"(?:your )?new address|(?:your )?order number %ON%|orderid= %ON%|customerid= <c\d+>|productid= <i\d+>|items=|"
        r"name= (?:%P%|<u>)",
    ),
    ("ref", r"(?:the )?order(?: number)? is %ON%"),
    ("ref", r"(?:the )?remaining refundable amount(?: (?:on|for) %ON%)?"),
    ("ref", r"(?:the )?(?:current )?(?:stock|inventory)(?: level| count)?(?: (?:of|for) %P%)?"),
]


def _expand(src: str) -> str:
    for _ in range(3):
        for k, v in MACROS.items():
            src = src.replace(k, v)
    return src


def _compile(src: str) -> re.Pattern:
    """A form's pattern; named groups repeated by a macro are numbered apart (s, s_2 ...)."""
    seen: dict[str, int] = {}

    def rename(m: re.Match) -> str:
        name = m.group(1)
        seen[name] = seen.get(name, 0) + 1
        return f"(?P<{name}>" if seen[name] == 1 else f"(?P<{name}_{seen[name]}>"

    return re.compile(re.sub(r"\(\?P<(\w+)>", rename, _expand(src)) + TRAIL)


FORMS: list[tuple[tuple[str, ...], re.Pattern]] = [(tuple(tags.split()), _compile(src)) for tags, src in FORMS_SRC]
_ESTIMATE = {
    "arrive": "delivered",
    "be delivered": "delivered",
    "ship": "shipped",
    "be shipped": "shipped",
    "be processed": "processing",
}
_SLOT_RE = re.compile(r"<([a-z])(\d*)>")
_ROLE_ALIASES = {"amount2": "amount", "stock0": "stock", "count0": "count", "trefunded": "refunded"}
_ZERO_WORDS = {"no", "none", "zero"}


def _value(token: str | None, slots: dict[str, Any]) -> float | None:
    if token is None:
        return None
    if token in _ZERO_WORDS or token in ("out of stock", "sold out", ""):
        return 0.0
    return slots.get(token)


def _atoms(tags: tuple[str, ...], m: re.Match, slots: dict[str, Any]) -> list[Atom]:
    groups: dict[str, str] = {}
    for k, v in m.groupdict().items():
        if v is not None:
            groups[re.sub(r"_\d+$", "", k)] = v
    out: list[Atom] = []
    status = STATUS_WORDS.get(groups.get("s") or "")
    for tag in tags:
        kind, _, what = tag.partition(":")
        if kind in ("status", "nstatus") and status:
            out.append(Atom("status", status, negated=kind == "nstatus"))
        elif kind == "estimate":
            out.append(Atom("estimate", _ESTIMATE[groups["e"]]))
        elif kind in ("claim", "cannot", "deny", "reason"):
            out.append(Atom(kind, what))
        elif kind in ("lookup", "ref", "courtesy"):
            out.append(Atom(kind))
    for name, token in groups.items():
        if name in ("s", "e") or token is None:
            continue
        role = _ROLE_ALIASES.get(name, name)
        if role == "scount":
            out.append(Atom("num", f"scount:{status}", _value(token, slots)))
        else:
            out.append(Atom("num", role, _value(token, slots)))
    return out


def _refs(text: str, slots: dict[str, Any]) -> dict[str, list[Any]]:
    refs: dict[str, list[Any]] = {}
    for m in _SLOT_RE.finditer(text):
        kind = m.group(1)
        if kind in ("m", "n", "d"):
            continue
        refs.setdefault(kind, []).append(slots.get(m.group(0), m.group(0)))
    return refs


def parse_statement(text: str, slots: dict[str, Any]) -> Statement | None:
    """The statement's atoms, or None when no form of the grammar matches it whole."""
    body = OPENERS.sub("", text).strip()
    if not body:
        return Statement(text, [Atom("courtesy")], {})
    for candidate in dict.fromkeys((text, body)):
        for tags, pattern in FORMS:
            m = pattern.fullmatch(candidate)
            if m is not None:
                return Statement(text, _atoms(tags, m, slots), _refs(candidate, slots))
    return None


__all__ = ["Atom", "FORMS", "FORMS_SRC", "MACROS", "STATUS_WORDS", "Statement", "parse_statement"]
