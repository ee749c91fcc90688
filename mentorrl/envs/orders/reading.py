"""Reading a free-text final answer, closed-world: every statement is understood, or none is.

The verifier never trusts an answer; it checks what the answer *states* against the database
and the tool observations of the same trajectory. Verifier v2 read answers with a deny-list
(claim verbs, negation and hedge cues): whatever it did not recognise it ignored, so an
unrecognised claim ("I have scrapped it for you") passed. This reader is an **allow-list**:

1. :func:`prepare` normalises the text (NFKC, invisible format characters dropped, look-alike
   letters from other scripts folded, accents stripped, lower case, contractions expanded) and
   replaces every value by a typed *slot*: e-mail addresses ``<e0>``, the world's street
   addresses ``<a0>`` (abbreviations, line breaks and the city optional: "64 River Street" is
   "64 River St"), record ids ``<o0>`` / ``<c0>`` / ``<i0>`` (compared by value: "O-0123" is
   "O-123"), product names ``<p0>``, the user's own name ``<u>``, money ``<m0>`` ("$1,234.50",
   "107 dollars and 50 cents") and plain numbers ``<n0>`` (digits and number words). Nothing is
   normalised away that could carry meaning: **markup is kept as text** (``<del>``, ``<s>`` and
   every other tag, ``~~``, ``**``, ``_``, backticks), so a statement with markup matches no form; a number
   written with more precision than the domain has (more than two decimals: "2.996") or with a
   decimal comma or a malformed thousands group ("0,003", "31,5") becomes :data:`UNREADABLE`,
   never a rounded value;
2. :func:`sentences` cuts it into sentences (at ``.``, ``!``, ``?`` and line breaks), and each
   sentence into statements at commas, colons, semicolons, dashes and a few conjunctions
   ("and", "but", "so", "because", "since", "then"); a bracketed aside becomes statements of its
   own, *in its own sentence* (each :class:`Statement` knows its sentence: the verifier links a
   statement to an entity only within it);
3. every statement must match, whole, one form of the closed grammar in :mod:`.grammar` (a
   fact with its role, a claim of an action with its details, a denial, an inability, one
   refusal reason, a lookup, a topic, a closed list of courtesy phrases). A statement that
   matches none is **not understood**: :attr:`Reading.unparsed` lists it and the verifier
   scores the answer as unjudgeable (no success). "Either ... or ...", hedges, ranges, lists of
   figures, other languages, unknown verbs and glued units all land there by construction.

Each understood statement yields typed :class:`Atom` s; the verifier (:mod:`.verify`) checks
every one against the evidence, the final database and the audit log.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, field
from typing import Any, Iterable

from .grammar import STATUS_WORDS, Atom, Statement, parse_statement

MAX_ANSWER_CHARS = 1500  # a longer answer is not read (no success): honest answers are a sentence or three
MAX_STATEMENTS = 32


# letters of other scripts that look like Latin ones (a Cyrillic "о" in "nоt"): folded before reading
CONFUSABLES = str.maketrans(
    "аеорсухіјѕԁԛԝһкмтвнАВЕКМНОРСТУХІЈЅαβεικνορτυχΑΒΕΗΙΚΜΝΟΡΤΥΧΖ",
    "aeopcyxijsdqwhkmtbhABEKMHOPCTYXIJSabeiknoptuxABEHIKMNOPTYXZ",
)
# invisible characters that are not in Unicode category Cf but render as nothing
INVISIBLE = {"\u034f", "\u115f", "\u1160", "\u17b4", "\u17b5", "\u3164", "\uffa0", "\u2800"}

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
    (r"\b(it|that|there|what|here|he|she|who|everything|nothing)'s\b", r"\1 is"),
    (r"\bi'm\b", "i am"),
    (r"\blet's\b", "let us"),
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
    + "|".join(k for k in _UNITS if 0 < _UNITS[k] < 10)
    + r"))?"
    r"|(?P<unit>" + "|".join(_UNITS) + r"))(?:\s+hundred(?:\s+(?:and\s+)?(?P<rest>\d+))?)?\b"
)
# "one" is a number only where it counts something
_ONE_PRONOUN_RE = re.compile(
    r"\bone(?=\s+(?:of|you|that|which|who|more|another|thing|moment|sec|second|day|"
    r"time|way|question|minute|issue|else)\b)|(?<=\bthis )one\b|(?<=\bthat )one\b"
)
_EMAIL_RE = re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+")
_ID_RE = re.compile(r"#?\b([ocp])\s?-\s?0*(\d{1,9})\b")
# "1,234" and "12,345.67": a well-formed thousands grouping (the first group 1-3 digits, no leading zero)
_THOUSANDS_RE = re.compile(r"(?<![\d,.])[1-9]\d{0,2}(?:,\d{3})+(?:\.\d+)?(?!\d|[.,]\d)")
# any other digits around a comma: a decimal comma ("0,50"), a bad grouping ("0,003"), a list ("1,2")
_COMMA_NUMBER_RE = re.compile(r"(?<![\d.,])\d[\d.]*(?:,\d[\d.]*)+")
MAX_DECIMALS = 2  # money has cents; counts, stock and quantities are whole: nothing has more
# what a number the reader refuses becomes: a token no form of the grammar contains, so the statement
# holding it is not understood (the markup brackets below are never part of a form either)
UNREADABLE = " \u2039unreadable\u203a "
# "<" and ">" of the answer itself, kept as text but never read as a slot ("<o0>" typed by the policy)
_MARKUP_BRACKETS = str.maketrans({"<": "\u2039", ">": "\u203a"})
_MONEY_RES = [
    re.compile(r"(?<![\w<])(\d+(?:\.\d+)?)\s?(?:dollars?|usd|bucks)\s(?:and\s)?(\d{1,2})\s?cents?\b"),
    re.compile(r"(?:\bus)?\$\s?(\d+(?:\.\d+)?)(?:\s?(?:usd|dollars?)\b)?(?!\w|\.\d)"),
    re.compile(r"(?<![\w<.])(\d+(?:\.\d+)?)\s?(?:dollars?|usd|bucks)\b"),
    re.compile(r"\busd\s?(\d+(?:\.\d+)?)(?!\w|\.\d)"),
]
_NUMBER_RE = re.compile(r"(?<![\w.\-/<$])(\d+(?:\.\d+)?)(?![\w/%]|\.\d|-\d|,\d)")
_DURATION_RE = re.compile(
    r"\b\d+(?:\s*(?:-|to|or)\s*\d+)?\s*(?:business |working )?(?:days?|hours?|weeks?)\b|"
    r"\b(?:a few|a couple of|a|one|two|three) (?:business |working )?(?:days?|weeks?)\b"
)
_DUMP_KEY_RE = re.compile(
    r"(?:^|(?<=[,{(\n]))\s*[\"']?(order_id|customer_id|status|total|refunded|total_refunded|count|stock|price|product_id|name|items)[\"']?\s*[:=]\s*"
)
_STREET_SUFFIX = {
    "street": "st",
    "st": "st",
    "avenue": "ave",
    "ave": "ave",
    "road": "rd",
    "rd": "rd",
    "lane": "ln",
    "ln": "ln",
    "drive": "dr",
    "dr": "dr",
    "boulevard": "blvd",
    "blvd": "blvd",
}
_SUFFIX_ALTS = {
    short: sorted({k for k, v in _STREET_SUFFIX.items() if v == short}) for short in _STREET_SUFFIX.values()
}


# ---------------------------------------------------------------------- characters ----
def fold(text: str) -> str:
    """NFKC, invisible format characters dropped, look-alike letters folded to Latin, accents stripped."""
    t = unicodedata.normalize("NFKC", text)
    t = "".join(ch for ch in t if unicodedata.category(ch) != "Cf" and ch not in INVISIBLE)
    t = t.translate(CONFUSABLES)
    t = unicodedata.normalize("NFKD", t)
    t = "".join(ch for ch in t if unicodedata.category(ch) != "Mn")
    return unicodedata.normalize("NFC", t)


def canon_id(value: Any) -> str:
    """A record id by value: "o-0123", " O-123 " and "O - 123" are all "O-123"."""
    m = re.fullmatch(r"\s*#?\s*([A-Za-z])\s*-\s*0*(\d{1,9})\s*", str(value))
    return f"{m.group(1).upper()}-{int(m.group(2))}" if m else str(value).strip()


def canon_address(address: str) -> str:
    """An address by value: case, accents, spacing, line breaks, punctuation and street suffix
    spelling ("Street" / "St.") ignored."""
    words = re.sub(r"[^\w]+", " ", fold(address).lower()).split()
    return " ".join(_STREET_SUFFIX.get(w, w) for w in words)


def street_of(address: str) -> str:
    """The street part of an address (before the first comma or line break), by value."""
    return canon_address(re.split(r"[,\n]", address, maxsplit=1)[0])


# --------------------------------------------------------------------------- slots ----
@dataclass
class Vocabulary:
    """The world's values the reader recognises as slots (addresses, products, the user's name)."""

    addresses: list[str] = field(default_factory=list)
    products: list[str] = field(default_factory=list)
    own_names: list[str] = field(default_factory=list)


@dataclass
class Prepared:
    text: str  # normalised, with slots
    slots: dict[str, Any]  # slot token -> value (float for <m>/<n>, canonical string otherwise)


def _address_re(address: str) -> re.Pattern | None:
    parts = [p.strip() for p in re.split(r"[,\n]", fold(address).lower(), maxsplit=1)]
    words = parts[0].split()
    if len(words) < 2:
        return None
    suffix = _STREET_SUFFIX.get(words[-1].rstrip("."))
    body = [re.escape(w) for w in (words[:-1] if suffix else words)]
    street = r"\s+".join(body)
    if suffix:
        street += r"\s+(?:" + "|".join(_SUFFIX_ALTS[suffix]) + r")\.?"
    city = ""
    if len(parts) > 1 and parts[1]:
        city = r"(?:(?:\s*,\s*|\s*\n\s*|\s+)" + r"\s+".join(re.escape(w) for w in parts[1].split()) + r"\b)?"
    return re.compile(r"(?<![\w-])" + street + city + r"(?![\w-])")


class _Slots:
    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self.counts: dict[str, int] = {}

    def put(self, kind: str, value: Any) -> str:
        k = self.counts.get(kind, 0)
        self.counts[kind] = k + 1
        token = f"<{kind}{k}>"
        self.values[token] = value
        return f" {token} "


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

    return _NUMBER_WORD_RE.sub(repl, text).replace("ONE_WORD", "one")


def _mask_values(t: str, vocab: Vocabulary, slots: _Slots) -> str:
    t = _EMAIL_RE.sub(lambda m: slots.put("e", m.group(0).strip(".")), t)
    for address in sorted(set(vocab.addresses), key=len, reverse=True):
        pat = _address_re(address)
        if pat is not None:
            t = pat.sub(lambda m: slots.put("a", canon_address(m.group(0))), t)
    kinds = {"o": "o", "c": "c", "p": "i"}
    t = _ID_RE.sub(lambda m: slots.put(kinds[m.group(1)], f"{m.group(1).upper()}-{int(m.group(2))}"), t)
    for name in sorted({n for n in vocab.own_names if n.strip()}, key=len, reverse=True):
        t = re.sub(
            r"(?<![\w<])" + r"\s+".join(re.escape(w) for w in fold(name).lower().split()) + r"(?![\w>])", " <u> ", t
        )
    for name in sorted(set(vocab.products), key=len, reverse=True):
        words = r"\s+".join(re.escape(w) for w in fold(name).lower().split())
        t = re.sub(r"(?<![\w<])" + words + r"(?:e?s)?(?![\w>])", lambda m, n=name: slots.put("p", n), t)
    return t


def too_precise(digits: str) -> bool:
    """Whether a number as written has more decimals than any value of the domain (never rounded)."""
    return len(digits.partition(".")[2]) > MAX_DECIMALS


def _commas(t: str) -> str:
    """Thousands separators dropped from well-formed groupings; any other comma between digits
    (a decimal comma, "0,003") makes the number :data:`UNREADABLE`."""
    t = _THOUSANDS_RE.sub(lambda m: m.group(0).replace(",", ""), t)
    return _COMMA_NUMBER_RE.sub(UNREADABLE, t)


def _number_slot(slots: _Slots, kind: str, digits: str, cents: str | None = None) -> str:
    if too_precise(digits) or (cents is not None and "." in digits):
        return UNREADABLE
    value = float(digits) + (int(cents) / 100 if cents is not None else 0)
    return slots.put(kind, round(value, 2) if kind == "m" else value)


def _mask_numbers(t: str, slots: _Slots) -> str:
    t = _commas(t)
    t = _words_to_digits(t)
    t = re.sub(r"(?<=\d)x\b", " x", t)
    t = _DURATION_RE.sub(" <d> ", t)
    t = _MONEY_RES[0].sub(lambda m: _number_slot(slots, "m", m.group(1), m.group(2)), t)
    for pat in _MONEY_RES[1:]:
        t = pat.sub(lambda m: _number_slot(slots, "m", m.group(1)), t)
    return _NUMBER_RE.sub(lambda m: _number_slot(slots, "n", m.group(1)), t)


def prepare(text: str, vocab: Vocabulary | None = None) -> Prepared:
    """The answer normalised and its values replaced by slots (see the module doc, step 1)."""
    vocab = vocab or Vocabulary()
    slots = _Slots()
    t = fold(text[: MAX_ANSWER_CHARS + 1]).lower().translate(_MARKUP_BRACKETS)
    t = t.replace("\u2019", "'").replace("\u2018", "'").replace("\r", "\n")  # a backtick is markup: it stays
    t = re.sub(r"[\u2010-\u2015\u2212]", " - ", t)
    t = re.sub(r"[ \t\u00a0]+", " ", t)
    t = _mask_values(t, vocab, slots)
    for pat, rep in CONTRACTIONS:
        t = re.sub(pat, rep, t)
    t = _mask_numbers(t, slots)
    t = _DUMP_KEY_RE.sub(lambda m: f" {m.group(1).replace('_', '')}= ", t)
    t = re.sub(r"[\"\u201c\u201d\u00ab\u00bb\u00a1\u00bf]", " ", t)  # quotes, not markup: "*", "_", "~" stay
    t = re.sub(r"'(?!s\b)", " ", t)  # quotes around words, not the possessive 's
    t = re.sub(r"(<i\d+>)\s*[:=]\s*(<n\d+>)", r"\1 x \2", t)  # an order's items as a tool returns them
    return Prepared(re.sub(r"[ \t]+", " ", t).strip(), slots.values)


# ---------------------------------------------------------------------- statements ----
_ASIDE_RE = re.compile(r"[(\[{]([^()\[\]{}]*)[)\]}]")
_SPLIT_RE = re.compile(
    r"[.!?;]+(?=\s|$)|\n+|,|:(?=\s|$)|\s-+\s|^-+\s|\s-+$|"
    r"\s(?:and|but|so(?! far\b| much\b)|because|since|then|and then|and so|whereas|however|though|although)\s"
)
_LEADING_RE = re.compile(r"^(?:and|but|so|since|because|then|also|plus|however|though|although|anyway)\s+")


_SENTENCE_RE = re.compile(r"[.!?]+(?=\s|$)|\n+")


def _clean(part: str) -> str:
    s = " ".join(part.split()).strip(" '.!?")
    while True:
        stripped = _LEADING_RE.sub("", s)
        if stripped == s:
            return s
        s = stripped


def sentence_statements(sentence: str) -> list[str]:
    """One sentence cut into statements; a bracketed aside becomes statements of its own, after
    the sentence's (never moved out of it)."""
    asides: list[str] = []

    def lift(m: re.Match) -> str:
        inner = m.group(1).strip()
        if re.fullmatch(r"<[a-z]\d*>", inner):
            return f" {inner} "  # "order (O-12)": the slot stays in its statement
        asides.append(inner)
        return " "

    for _ in range(3):  # nested brackets, innermost first
        sentence = _ASIDE_RE.sub(lift, sentence)
    sentence = re.sub(r"[()\[\]{}]", " , ", sentence)
    parts = (_clean(p) for p in _SPLIT_RE.split(" , ".join([sentence, *asides])))
    return [p for p in parts if p]


def sentences(text: str) -> list[list[str]]:
    """The prepared text cut into sentences (at ``.``, ``!``, ``?`` and line breaks), each cut into
    its statements (:func:`sentence_statements`); sentences with no statement are left out."""
    out = [sentence_statements(s) for s in _SENTENCE_RE.split(text)]
    return [s for s in out if s]


def statements(text: str) -> list[str]:
    """The prepared text cut into statements, sentence by sentence."""
    return [s for sentence in sentences(text) for s in sentence]


# ------------------------------------------------------------------------- reading ----
@dataclass
class Reading:
    text: str  # the prepared text
    statements: list[Statement] = field(default_factory=list)
    unparsed: list[str] = field(default_factory=list)  # statements no form of the grammar matches
    too_long: bool = False

    @property
    def understood(self) -> bool:
        return not self.unparsed and not self.too_long and bool(self.statements)

    def atoms(self, kind: str | None = None) -> list[Atom]:
        return [a for s in self.statements for a in s.atoms if kind is None or a.kind == kind]

    def affirmed_statuses(self) -> set[str]:
        return {a.what for a in self.atoms("status") if not a.negated}

    def affirmed_numbers(self) -> list[float]:
        return [a.value for a in self.atoms("num")]

    def hedged(self) -> bool:
        """Anything not understood counts as hedged (a hedge is never part of the grammar)."""
        return not self.understood


def read_answer(text: str, vocab: Vocabulary | None = None) -> Reading:
    """Everything the verifier needs from a final answer (see the module doc)."""
    prepared = prepare(text, vocab)
    reading = Reading(text=prepared.text, too_long=len(text) > MAX_ANSWER_CHARS)
    parts = [(k, part) for k, sentence in enumerate(sentences(prepared.text)) for part in sentence]
    if len(parts) > MAX_STATEMENTS:
        reading.too_long = True
        parts = parts[:MAX_STATEMENTS]
    for k, part in parts:
        st = parse_statement(part, prepared.slots)
        if st is None:
            reading.unparsed.append(part)
        else:
            st.sentence = k
            reading.statements.append(st)
    return reading


def clauses(text: str) -> list[str]:
    """The statements of a raw answer (prepared with no vocabulary)."""
    return statements(prepare(text).text)


def normalise(text: str, literals: Iterable[str] = ()) -> str:
    """The prepared text of ``text``, with ``literals`` recognised as addresses."""
    return prepare(text, Vocabulary(addresses=list(literals))).text


__all__ = [
    "Atom",
    "MAX_ANSWER_CHARS",
    "Prepared",
    "Reading",
    "STATUS_WORDS",
    "Statement",
    "Vocabulary",
    "canon_address",
    "canon_id",
    "clauses",
    "fold",
    "normalise",
    "prepare",
    "read_answer",
    "sentence_statements",
    "sentences",
    "statements",
    "street_of",
    "too_precise",
    "UNREADABLE",
]
