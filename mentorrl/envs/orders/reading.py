"""Reading a free-text final answer: what it asserts, denies, hedges and claims was done.

The verifier never trusts an answer; it checks what the answer *asserts* against the
database and against the tool observations of the same trajectory. This module only reads:
it turns text into a :class:`Reading` (pure functions, no database).

Steps, in order:

1. :func:`normalise` lower-cases, unifies quotes, expands contractions ("isn't" -> "is not",
   "can't" -> "can not"), masks e-mail addresses, record ids (O-1042, C-7, P-3) and any
   given literal strings (addresses) so their digits are never read as numbers, joins
   thousands separators, turns number words ("five", "twenty-one") into digits and zero
   phrases ("out of stock", "no orders", "not ... any") into ``0``;
2. :func:`clauses` splits the text at sentence punctuation and contrastive conjunctions, so a
   negation or a hedge governs only its own clause;
3. every status word and number becomes a :class:`Mention` with a *polarity*, decided by the
   few words right before it (and right after, for "-ish" / "or so"):

   * ``negated``: "is not shipped", "has not been delivered", "do not have 5";
   * ``hedged``: "probably shipped", "could be 5", "about 5", "at least 5", "5-ish", "5 or so",
     and values offered as alternatives ("3 or 4", "shipped or delivered");
   * ``prospective``: "should be delivered soon", "will be shipped" (an estimate, not a fact
     about now);
   * ``affirmed``: everything else;

4. claims of actions ("I cancelled it", "refunded $38", "placed order", "it's done") and
   denials ("nothing was changed", "could not cancel") per action family;
5. refusal reasons (not found, no such order, not your order), each as a phrase with its
   own negation built in: "it does belong to you" is not a reason, "belongs to another
   customer" is.

The rules are deliberately about *how* a value is asserted rather than lists of magic
keywords: the verifier then requires the true value affirmed, no other value affirmed and
nothing hedged (see :mod:`mentorrl.envs.orders.verify`).
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, field
from typing import Iterable

STATUS_WORDS = {
    "pending": "pending",
    "processing": "processing",
    "shipped": "shipped",
    "delivered": "delivered",
    "cancelled": "cancelled",
    "canceled": "cancelled",
}
# a value may be separated from the cue before it by up to three of these words
_FILLER = (
    "be",
    "been",
    "being",
    "yet",
    "currently",
    "already",
    "actually",
    "even",
    "really",
    "have",
    "has",
    "had",
    "got",
    "exactly",
    "quite",
    "just",
    "any",
    "the",
    "a",
    "an",
    "it",
    "its",
    "this",
    "that",
    "order",
    "status",
    "still",
    "was",
    "is",
    "are",
    "were",
    "get",
    "gotten",
    "there",
    "we",
    "you",
    "in",
    "stock",
    "of",
    "only",
    "left",
    "at",
    "your",
    "my",
    "me",
    "i",
    "$",
    "usd",
)
_FILL = r"(?:(?:" + "|".join(re.escape(w) for w in _FILLER) + r")\s+){0,3}"
_NEG_CUE = r"(?:not|never|no longer|neither|nor|nothing|without|nobody|none of)"
_HEDGE_CUE = (
    r"(?:maybe|perhaps|possibly|probably|presumably|likely|might|may|could|guess|think|believe|doubt|"
    r"unclear|uncertain|between|plus or minus|"
    r"suppose|around|about|approximately|approx|roughly|nearly|almost|estimated|"
    r"at least|more than|less than|fewer than|over|under|above|below|upwards of|some|several|"
    r"not sure|unsure|either|~)"
)
_PROSPECTIVE_CUE = (
    r"(?:will|should|shall|can|if|unless|whether|going to|expected to|expect it to|soon|once|when|until|"
    r"next|tomorrow|later|eventually|on its way to|about to|due to)"
)

CONTRACTIONS = [
    (r"\bcan't\b", "can not"),
    (r"\bcannot\b", "can not"),
    (r"\bwon't\b", "will not"),
    (r"\bshan't\b", "shall not"),
    (r"n't\b", " not"),
    (r"'re\b", " are"),
    (r"'ve\b", " have"),
    (r"'ll\b", " will"),
    (r"'d\b", " would"),
    (r"\b(it|that|there|what|here|he|she|who)'s\b", r"\1 is"),
    (r"\bi'm\b", "i am"),
]

_UNITS = {
    "zero": 0,
    "one": 1,
    "two": 2,
    "three": 3,
    "four": 4,
    "five": 5,
    "six": 6,
    "seven": 7,
    "eight": 8,
    "nine": 9,
    "ten": 10,
    "eleven": 11,
    "twelve": 12,
    "thirteen": 13,
    "fourteen": 14,
    "fifteen": 15,
    "sixteen": 16,
    "seventeen": 17,
    "eighteen": 18,
    "nineteen": 19,
}
_TENS = {"twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70, "eighty": 80, "ninety": 90}
_NUMBER_WORD_RE = re.compile(
    r"\b(?:(?P<tens>"
    + "|".join(_TENS)
    + r")(?:[\s-]+(?P<unit1>"
    + "|".join(k for k in _UNITS if _UNITS[k] < 10 and _UNITS[k] > 0)
    + r"))?"
    r"|(?P<unit>" + "|".join(_UNITS) + r"))(?:\s+hundred(?:\s+(?:and\s+)?(?P<rest>\d+))?)?\b"
)
# "one" is a number only where it counts something
_ONE_PRONOUN_RE = re.compile(
    r"\bone(?=\s+(?:of|you|that|which|who|more|another|thing|moment|sec|second|day|"
    r"time|way|question|minute|issue|else)\b)"
)
_ZERO_PATTERNS = [
    re.compile(r"\b(?:out of stock|sold out|none left|none in stock|none available|none remaining)\b"),
    re.compile(r"\bno(?=\s+(?:\w+\s+){0,3}?(?:left|in stock|available|remaining|units?|items?|pieces?|orders)\b)"),
    re.compile(
        r"\bnot\s+(?:(?:have|has|had|placed|made|got|see|find|show)\s+)?any(?=\s+(?:\w+\s+){0,2}?"
        r"(?:left|in stock|available|remaining|units?|items?|pieces?|orders)\b)"
    ),
]
_EMAIL_RE = re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+")
_ID_RE = re.compile(r"\b[ocp]-\d+\b")
_THOUSANDS_RE = re.compile(r"(?<=\d),(?=\d{3}\b)")
_NUMBER_RE = re.compile(r"(?<![\w.\-/])(\d+(?:\.\d+)?)(?![\w/]|-\d|\.\d)")
_STATUS_RE = re.compile(r"\b(pending|processing|shipped|delivered|cancell?ed)\b")
_BEING_PROCESSED_RE = re.compile(r"\b(?:being|still being) processed\b")
_STATUS_SYNONYMS = [
    (re.compile(r"\b(?:in transit|out for delivery)\b"), "shipped"),
    (re.compile(r"\b(?:has|have) arrived\b|\bwas received\b"), "delivered"),
    (re.compile(r"\bin progress\b|\bbeing (?:prepared|packed)\b"), "processing"),
]
_MARKUP_RE = re.compile(r"<[^<>]{0,40}>|[*_~\"\u201c\u201d\u00ab\u00bb()\[\]{}\u2014\u2013]|(?<=\s)-(?=\s)")
# clause boundaries: sentence punctuation, commas and contrastive / causal conjunctions (not dashes or
# brackets, which :data:`_MARKUP_RE` removes: "it is (not) shipped" must stay one clause)
_CLAUSE_SPLIT_RE = re.compile(
    r"(?:[.!?;:]+(?=\s|$)|[\n,]|\s+(?:but|however|although|though|whereas|while|"
    r"so|because|since|as|and then|then)\s+)"
)
_MIXED_SCRIPT_RE = re.compile(r"(?=\w*[a-z])(?=\w*[^\W\d_a-z])\w+")


@dataclass(frozen=True)
class Mention:
    value: str | float
    polarity: str  # affirmed | negated | hedged | prospective
    clause: int
    role: str = ""  # numbers: "money" ($12, 12 dollars) or "count"; "left" for money said to be what remains


@dataclass
class Reading:
    text: str  # the normalised text
    statuses: list[Mention] = field(default_factory=list)
    numbers: list[Mention] = field(default_factory=list)
    claims: set[str] = field(default_factory=set)  # action families the answer says were done
    claim_numbers: dict[str, list[float | None]] = field(default_factory=dict)  # family -> each claim's nearest number
    denials: set[str] = field(default_factory=set)  # action families (or "any") it says were not done
    reasons: set[str] = field(default_factory=set)  # refusal reasons it gives

    def affirmed_statuses(self) -> set[str]:
        return {m.value for m in self.statuses if m.polarity == "affirmed"}

    def affirmed_numbers(self) -> list[float]:
        return [m.value for m in self.numbers if m.polarity == "affirmed"]

    def mixed_script(self) -> bool:
        """A word mixing ASCII letters with other letters ("nоt" with a Cyrillic о): a homoglyph
        can hide a negation from the reader, so such an answer is not read at all."""
        return bool(_MIXED_SCRIPT_RE.search(self.text))

    def hedged(self) -> bool:
        return any(m.polarity == "hedged" for m in (*self.statuses, *self.numbers))


# ---------------------------------------------------------------------- normalising ----
def _words_to_digits(text: str) -> str:
    text = _ONE_PRONOUN_RE.sub("ONE_WORD", text)

    def repl(m: re.Match) -> str:
        if m.group("tens"):
            value = _TENS[m.group("tens")] + (_UNITS[m.group("unit1")] if m.group("unit1") else 0)
        else:
            value = _UNITS[m.group("unit")]
        if "hundred" in m.group(0):
            value = value * 100 + (int(m.group("rest")) if m.group("rest") else 0)
        return str(value)

    text = _NUMBER_WORD_RE.sub(repl, text)
    text = re.sub(r"\ba (?:single|lone)\b", "1", text)
    text = re.sub(r"\ba dozen\b", "12", text)
    return text.replace("ONE_WORD", "one")


_DURATION_RE = re.compile(
    r"\b\d+(?:\s*(?:-|to|or)\s*\d+)?\s*(?:business |working )?(?:days?|hours?|hrs?|weeks?|"
    r"minutes?|mins?|months?)\b"
)


def normalise(text: str, literals: Iterable[str] = (), zeros: bool = False) -> str:
    """The answer prepared for reading (see the module doc, step 1); ``zeros`` also turns zero
    phrases into ``0`` (for reading numbers only: "no order" is a reason, not a count)."""
    t = unicodedata.normalize("NFKC", text)
    t = "".join(ch for ch in t if unicodedata.category(ch) != "Cf")  # zero-width joiners, marks, BOMs ...
    t = t.replace("\u2019", "'").replace("\u2018", "'").replace("`", "'").lower()
    t = _MARKUP_RE.sub(" ", t)  # <b>not</b>, **not**, (not): emphasis and brackets never hide a word
    t = re.sub(r"\s+", " ", t)
    for lit in sorted({" ".join(s.lower().split()) for s in literals if s and s.strip()}, key=len, reverse=True):
        t = t.replace(lit, " LITERAL ")
    t = _EMAIL_RE.sub(" EMAIL ", t)
    t = _ID_RE.sub(" RECORDID ", t)
    for pat, rep in CONTRACTIONS:
        t = re.sub(pat, rep, t)
    t = _THOUSANDS_RE.sub("", t)
    t = re.sub(r"(?<=\d)\s*(?:-\s*)?ish\b", " ish", t)
    t = re.sub(r"\$\s*(?=\d)", "$ ", t)
    t = _words_to_digits(t)
    t = _DURATION_RE.sub(" DURATION ", t)  # "in 2-3 days" is an estimate, not a figure of the order
    if zeros:
        for pat in _ZERO_PATTERNS:
            t = pat.sub(" 0 ", t)
    t = _BEING_PROCESSED_RE.sub("processing", t)
    for pat, status in _STATUS_SYNONYMS:
        t = pat.sub(status, t)
    return re.sub(r"\s+", " ", t).strip()


def clauses(text: str) -> list[str]:
    return [c.strip() for c in _CLAUSE_SPLIT_RE.split(text) if c and c.strip()]


# ---------------------------------------------------------------------- polarity ----
_BEFORE_NEG = re.compile(r"\b" + _NEG_CUE + r"\s+" + _FILL + r"$")
_BEFORE_HEDGE = re.compile(r"(?:\b|^|(?<=\s))" + _HEDGE_CUE + r"\s+" + _FILL + r"$")
_BEFORE_PROSPECTIVE = re.compile(r"\b" + _PROSPECTIVE_CUE + r"\s+" + _FILL + r"$")
_AFTER_HEDGE = re.compile(
    r"^\s*(?:ish\b|or so\b|or more\b|or less\b|give or take\b|\?|or (?:possibly |maybe |"
    r"perhaps |so )?(?:\$ )?(?:\d|pending|processing|shipped|delivered|cancell?ed)|/)"
)
# a status word used as a category of orders, not said of this one
_CATEGORY_AFTER = re.compile(
    r"^(?:\s*(?:,|or|and|/)\s*(?:pending|processing|shipped|delivered|cancell?ed))*\s+"
    r"(?:or\s+\w+\s+)?orders\b"
)
_BEFORE_MODAL = re.compile(r"\b(?:can|must|will|would|shall|to)\s+(?:not\s+|no longer\s+|never\s+)?(?:\w+\s+)?be\s+$")
_BEFORE_ALTERNATIVE = re.compile(r"(?:\bor\b|/)\s*(?:possibly |maybe |perhaps )?(?:\$ )?$")


_MONEY_BEFORE = re.compile(r"(?:\$|usd|us\$|dollars?)\s*$")
_MONEY_AFTER = re.compile(r"^\s*(?:dollars?|usd|bucks)\b|^\.\d\d\b")
_LEFT_BEFORE = re.compile(
    r"(?:\bat most|\bup to|\bmaximum(?: of| is)?|\bonly|\bjust|\bleft|\bremaining|"
    r"\bremains|\brefundable|\bmost (?:i|we) can refund (?:is|would be))\s*:?\s*(?:\$|usd)?\s*$"
)
_LEFT_AFTER = re.compile(r"^\s*(?:dollars?|usd)?\s*(?:\S+\s+){0,3}?(?:left|remaining|remains|refundable|still)\b")


def number_role(clause: str, start: int, end: int) -> str:
    """What a number counts: ``money`` ("$12", "12 dollars"), ``left`` (money said to remain:
    "only $42 left", "at most $42"), else ``count`` (a stock level, a number of orders)."""
    before, after = clause[:start], clause[end:]
    money = bool(_MONEY_BEFORE.search(before) or _MONEY_AFTER.search(after) or "." in clause[start:end])
    if money and (_LEFT_BEFORE.search(before) or _LEFT_AFTER.search(after)):
        return "left"
    return "money" if money else "count"


def polarity(clause: str, start: int, end: int) -> str:
    before, after = clause[:start], clause[end:]
    if _BEFORE_HEDGE.search(before) or _AFTER_HEDGE.search(after) or _BEFORE_ALTERNATIVE.search(before):
        return "hedged"
    if _BEFORE_MODAL.search(before):  # "can no longer be cancelled": what may happen, not what is
        return "prospective"
    if _BEFORE_NEG.search(before):
        return "negated"
    if _BEFORE_PROSPECTIVE.search(before):
        return "prospective"
    return "affirmed"


# ---------------------------------------------------------------- actions, reasons ----
# past/passive forms that say a change happened, per action family
CLAIM_PATTERNS: dict[str, re.Pattern] = {
    "cancel": re.compile(
        r"\bcancell?ed\b|\b(?:voided|called off|terminated|revoked|withdrawn)\b|\bcancell?ation (?:is |was |has been )?(?:done|complete|processed|"
        r"confirmed)|\bconfirmed (?:the |your )?cancell?ation"
    ),
    "refund": re.compile(
        r"\brefunded\b|\brefund (?:\S+ ){0,4}?(?:is|was|has been|have been) (?:now )?"
        r"(?:issued|processed|sent|made|done|completed?|approved|applied)|\b(?:issued|processed|"
        r"made|sent|applied) (?:a|the|your|an) (?:\$ [\d.]+ )?refund|\b(?:credited|reimbursed|paid back)\b|"
        r"\breturned \$|\bmoney (?:is|was|has been) (?:sent|returned)"
    ),
    "order": re.compile(
        r"(?<!you )(?<!you have )(?<!you had )(?<!you just )\b(?:ordered|placed)\b(?! by)|"
        r"\bplaced (?:a |an |the |your )?(?:new )?order\b|\border (?:recordid )?(?:is|was|has been)"
        r" (?:now )?(?:placed|created|submitted|confirmed)|\b(?:i|we) (?:have |just )?(?:placed|"
        r"created|submitted|made)\b|\b(?:purchased|bought|booked|reserved)\b"
    ),
    "address": re.compile(
        r"\b(?:updated|changed)\b|\baddress (?:is|has been|was) (?:now|set)|\bset (?:your |the )?"
        r"(?:shipping )?address|\bnow (?:lives|reads|points)"
    ),
    "email": re.compile(r"\b(?:e-?mailed|sent|mailed|forwarded)\b"),
    "done": re.compile(
        r"\b(?:done|completed|complete|taken care of|went through|gone through|successfully|"
        r"all set|succeeded|finished|processed|saved|confirmed|issued|on (?:its|the|their) way)\b"
    ),
}
_DENY_ANY = re.compile(
    r"\b(?:nothing (?:was|has been|is|got|could be|can be|will be)? ?(?:changed|done|"
    r"updated|modified|processed)|no (?:changes?|action|refund|order|email) (?:was|were|has|"
    r"have|is)|(?:did|could|can|will|was|were) not (?:make|do) (?:any|the|that)|unable to|"
    r"failed to|not able to)\b"
)
_DENY_VERB = {
    "cancel": r"cancel(?:l?ed)?",
    "refund": r"refund(?:ed)?|issue (?:the|a) refund|credit",
    "order": r"order(?:ed)?|"
    r"place(?:d)?(?: the| an| your)? order|create(?:d)?(?: the| an| your)? order|purchase",
    "address": r"update(?:d)?|change(?:d)?",
    "email": r"e-?mail(?:ed)?|send|sent|mail(?:ed)?",
    "done": r"done|complete(?:d)?|process(?:ed)?",
}
_REASON_PATTERNS: dict[str, re.Pattern] = {
    # nothing matches what the user gave
    "not_found": re.compile(
        r"\bnot (?:be )?(?:found|located|recogni[sz]ed|registered|on file|in our (?:system|records))\b|"
        r"\bnot (?:find|locate|see|match|identify)\b|\bno (?:such |matching |existing )?(?:customer|account|record|"
        r"profile|user|match|order|result)s?\b|\bnot exist\b|\bunknown (?:email|customer|account|order)\b|"
        r"\bno (?:one|customer|account) (?:is |was )?(?:registered|found|on file)\b|\bnot match any\b|"
        r"\binvalid (?:order|email|account)\b|\b(?:unable|not able) to (?:find|locate)\b|"
        r"\bnot (?:a )?(?:valid|known|existing|recogni[sz]ed|registered) (?:order|customer|email|account)\b|"
        r"\bnot (?:appear|show up|exist)\b|\bno record\b|\bnot (?:associated|linked) with any\b"
    ),
    # the order exists but is someone else's
    "not_yours": re.compile(
        r"\bnot (?:on|in|under|associated with|linked to|tied to|part of|registered to|from) (?:your|this) account\b|"
        r"\bnot (?:yours|your order|your own|one of your orders|among your orders|placed by you|associated with you|"
        r"linked to you|under your name|registered to you)\b|\bnot belong to you\b|"
        r"\bbelongs? to (?:another|someone|somebody|a different|other|a other)\b|"
        r"\b(?:another|a different|other|someone else's|somebody else's) (?:customer|person|account|user)\b|"
        r"\bnot (?:find|see|locate) (?:\w+ ){0,3}?(?:on|in|under) your account\b|\bnot one of (?:them|yours|your orders)\b|"
        r"\bby (?:someone|somebody) else\b|\bby (?:another|a different) (?:customer|person|account)\b|\bsomeone else's\b|\bsomebody else's\b|\bnot (?:authori[sz]ed|permitted|allowed) to (?:access|change|"
        r"cancel|refund|view)\b.*\baccount\b"
    ),
}


def _nearest_number(clause: str, start: int, end: int) -> float | None:
    """The number in ``clause`` closest to the span [start, end) (what a claim like "refunded $38" is about)."""
    best: tuple[int, float] | None = None
    for m in _NUMBER_RE.finditer(clause):
        d = start - m.end() if m.end() <= start else m.start() - end
        if best is None or d < best[0]:
            best = (max(d, 0), float(m.group(1)))
    return None if best is None else best[1]


def _claims_and_denials(clause_list: list[str]) -> tuple[set[str], set[str], dict[str, list[float | None]]]:
    claims: set[str] = set()
    denials: set[str] = set()
    numbers: dict[str, list[float | None]] = {}
    for c in clause_list:
        if _DENY_ANY.search(c):
            denials.add("any")
        for family, pat in CLAIM_PATTERNS.items():
            for m in pat.finditer(c):
                if polarity(c, m.start(), m.end()) in ("negated",):
                    denials.add(family)
                elif polarity(c, m.start(), m.end()) == "affirmed":
                    claims.add(family)
                    numbers.setdefault(family, []).append(_nearest_number(c, m.start(), m.end()))
        for family, verb in _DENY_VERB.items():
            if re.search(
                r"\b(?:not|never|unable to|failed to|not able to|nothing)\s+" + _FILL + r"(?:" + verb + r")\b", c
            ):
                denials.add(family)
    return claims, denials, numbers


def _reasons(clause_list: list[str]) -> set[str]:
    out: set[str] = set()
    for c in clause_list:
        for reason, pat in _REASON_PATTERNS.items():
            for m in pat.finditer(c):
                # "it is not that it is not found": a second negation right before cancels the reason
                if re.search(r"\bnot\s+(?:that\s+)?(?:it|this|that)?\s*(?:is|was)?\s*$", c[: m.start()]) and m.group(
                    0
                ).startswith("not"):
                    continue
                out.add(reason)
    return out


def read_answer(text: str, literals: Iterable[str] = ()) -> Reading:
    """Everything the verifier needs from a final answer (see the module doc)."""
    norm = normalise(text, literals)
    parts = clauses(norm)
    reading = Reading(text=norm)
    for i, c in enumerate(parts):
        for m in _STATUS_RE.finditer(c):
            if _CATEGORY_AFTER.match(c[m.end() :]):  # "only pending or processing orders can be cancelled"
                continue
            reading.statuses.append(Mention(STATUS_WORDS[m.group(1)], polarity(c, m.start(), m.end()), i))
    for i, c in enumerate(clauses(normalise(text, literals, zeros=True))):
        for m in _NUMBER_RE.finditer(c):
            reading.numbers.append(
                Mention(float(m.group(1)), polarity(c, m.start(), m.end()), i, number_role(c, m.start(), m.end()))
            )
    reading.claims, reading.denials, reading.claim_numbers = _claims_and_denials(parts)
    reading.reasons = _reasons(parts)
    return reading


def _name_tokens(text: str) -> list[str]:
    return [t.strip(".") for t in re.sub(r"[^\w@.+-]+", " ", text.lower()).split() if t.strip(".")]


def mentions(text: str, needles: Iterable[str]) -> list[str]:
    """Which of ``needles`` (names, e-mail addresses, street addresses) occur in ``text`` as whole
    words, compared case-insensitively with punctuation and spacing ignored ("Ana  LOPEZ." finds
    "Ana Lopez")."""
    hay = " " + " ".join(_name_tokens(unicodedata.normalize("NFKC", text))) + " "
    found = []
    for n in needles:
        key = " ".join(_name_tokens(n))
        if key and f" {key} " in hay:
            found.append(n)
    return found


__all__ = [
    "CLAIM_PATTERNS",
    "Mention",
    "Reading",
    "STATUS_WORDS",
    "clauses",
    "mentions",
    "normalise",
    "polarity",
    "read_answer",
]
