"""The programming problems of the ``code`` environment: four families, each a few seeded variants.

A :class:`Problem` is a specification (the signature and a docstring that states every rule the
tests check, edge cases included), a trusted reference implementation (source code: the scripted
expert writes it, and the verifier runs it *on the host* to compute expected values), and an input
generator. A case is ``{"args": [...]}`` for a function, or ``{"ops": [[method, [args]], ...]}`` for a
class (a fresh instance per case; the result is the list of return values, an exception being
``{"raises": "IndexError"}``).
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass
from typing import Any, Callable

FAMILIES = ("strings", "lists", "parsing", "stateful")


@dataclass(frozen=True)
class Problem:
    family: str
    variant: str
    kind: str  # function | class
    entry: str  # the function or class name solution.py must define
    signature: str
    doc: str
    source: str  # reference implementation (a complete solution.py)
    gen: Callable[[random.Random], dict]  # one random case
    edge: tuple[dict, ...] = ()  # edge cases the hidden tests always include


def _words(rng: random.Random, lo: int = 1, hi: int = 5) -> str:
    return " ".join(
        "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(1, 6)))
        for _ in range(rng.randint(lo, hi))
    )


def _mixed(rng: random.Random) -> str:
    pool = string.ascii_letters + " .,!-"
    return "".join(rng.choice(pool) for _ in range(rng.randint(1, 14)))


def _ints(rng: random.Random, lo: int = 0, hi: int = 8, span: int = 20) -> list[int]:
    return [rng.randint(-span, span) for _ in range(rng.randint(lo, hi))]


def _runs(rng: random.Random) -> str:
    return "".join(rng.choice("abcxyz") * rng.randint(1, 4) for _ in range(rng.randint(1, 5)))


def _kv(rng: random.Random) -> str:
    keys = rng.sample(["a", "b", "cat", "dog", "x", "y2"], k=rng.randint(1, 4))
    parts = [
        f"{rng.choice(keys)}{rng.choice(['', ' '])}={rng.choice(['', ' '])}{rng.randint(-9, 99)}"
        for _ in range(rng.randint(1, 5))
    ]
    return ";".join(parts)


def _duration(rng: random.Random) -> str:
    out = ""
    for unit, hi in (("h", 30), ("m", 59), ("s", 59)):
        if rng.random() < 0.6:
            out += f"{rng.randint(0, hi)}{unit}"
    return out or f"{rng.randint(1, 59)}s"


def _csv(rng: random.Random) -> str:
    lines = []
    for _ in range(rng.randint(1, 5)):
        lines.append(
            "" if rng.random() < 0.15 else ",".join(str(rng.randint(-50, 50)) for _ in range(rng.randint(1, 4)))
        )
    return "\n".join(lines)


def _stack_ops(rng: random.Random) -> dict:
    ops, depth = [], 0
    for _ in range(rng.randint(2, 9)):
        r = rng.random()
        if r < 0.5 or depth == 0 and r < 0.7:
            ops.append(["push", [rng.randint(-20, 20)]])
            depth += 1
        elif r < 0.7:
            ops.append(["pop", []])
            depth = max(0, depth - 1)
        elif r < 0.9:
            ops.append(["min", []])
        else:
            ops.append(["size", []])
    return {"ops": ops}


def _counter_ops(rng: random.Random) -> dict:
    keys = ["red", "blue", "green"]
    ops = []
    for _ in range(rng.randint(2, 10)):
        r = rng.random()
        ops.append(
            ["add", [rng.choice(keys)]] if r < 0.6 else ["count", [rng.choice(keys)]] if r < 0.8 else ["top", []]
        )
    return {"ops": ops}


def _lru_ops(rng: random.Random) -> dict:
    ops = []
    for _ in range(rng.randint(2, 10)):
        k = rng.randint(1, 5)
        ops.append(["put", [k, rng.randint(0, 99)]] if rng.random() < 0.55 else ["get", [k]])
    return {"ops": ops}


def _arg(fn: Callable[[random.Random], Any]) -> Callable[[random.Random], dict]:
    return lambda rng: {"args": [fn(rng)]}


def _strings_problem(family: str, variant: str, p: int) -> Problem | None:
    """The ``strings`` family: ``transform(s) -> str`` variants. None for an unknown variant."""
    sig = "transform(s: str) -> str"
    if variant == "reverse_words":
        return Problem(
            family,
            variant,
            "function",
            "transform",
            sig,
            "Return s with the order of its space-separated words reversed (words are separated by "
            "single spaces; the empty string stays empty).",
            "def transform(s):\n    return ' '.join(s.split(' ')[::-1])\n",
            _arg(_words),
            ({"args": [""]}, {"args": ["one"]}),
        )
    if variant == "caesar":
        k = p % 25 + 1
        return Problem(
            family,
            variant,
            "function",
            "transform",
            sig,
            f"Shift every lowercase letter {k} places forward in the alphabet, wrapping from z to a; "
            "leave every other character unchanged.",
            f"def transform(s):\n    return ''.join(chr((ord(c) - 97 + {k}) % 26 + 97) if 'a' <= c <= 'z' "
            "else c for c in s)\n",
            _arg(_mixed),
            ({"args": [""]}, {"args": ["xyz ABC"]}),
        )
    if variant == "rle":
        return Problem(
            family,
            variant,
            "function",
            "transform",
            sig,
            "Run-length encode s: each run of one repeated character becomes the run's length followed "
            "by the character, e.g. 'aaab' -> '3a1b'; the empty string gives ''.",
            "def transform(s):\n    out, i = [], 0\n    while i < len(s):\n        j = i\n"
            "        while j < len(s) and s[j] == s[i]:\n            j += 1\n"
            "        out.append(f'{j - i}{s[i]}')\n        i = j\n    return ''.join(out)\n",
            _arg(_runs),
            ({"args": [""]}, {"args": ["a"]}),
        )
    if variant == "strip_vowels":
        return Problem(
            family,
            variant,
            "function",
            "transform",
            sig,
            "Remove every vowel (a, e, i, o, u, in either case) from s.",
            "def transform(s):\n    return ''.join(c for c in s if c.lower() not in 'aeiou')\n",
            _arg(_mixed),
            ({"args": [""]}, {"args": ["AEIOU"]}),
        )
    return None


def _lists_problem(family: str, variant: str, p: int) -> Problem | None:
    """The ``lists`` family: ``solve(xs)`` variants over a list of integers. None for an unknown variant."""
    sig = "solve(xs: list[int])"
    if variant == "sum_multiples":
        k = p % 5 + 2
        return Problem(
            family,
            variant,
            "function",
            "solve",
            sig + " -> int",
            f"Return the sum of the elements of xs that are divisible by {k} (0 for an empty list).",
            f"def solve(xs):\n    return sum(x for x in xs if x % {k} == 0)\n",
            _arg(_ints),
            ({"args": [[]]}, {"args": [[-4, 4]]}),
        )
    if variant == "max_subarray":
        return Problem(
            family,
            variant,
            "function",
            "solve",
            sig + " -> int",
            "Return the largest sum of a non-empty contiguous slice of xs (xs is never empty).",
            "def solve(xs):\n    best = cur = xs[0]\n    for x in xs[1:]:\n"
            "        cur = max(x, cur + x)\n        best = max(best, cur)\n    return best\n",
            _arg(lambda r: _ints(r, lo=1)),
            ({"args": [[-3]]}, {"args": [[-5, -1, -7]]}),
        )
    if variant == "second_largest":
        return Problem(
            family,
            variant,
            "function",
            "solve",
            sig + " -> int | None",
            "Return the second-largest distinct value in xs, or None when xs has fewer than two distinct values.",
            "def solve(xs):\n    vals = sorted(set(xs))\n    return vals[-2] if len(vals) >= 2 else None\n",
            _arg(lambda r: _ints(r, span=6)),
            ({"args": [[]]}, {"args": [[3, 3, 3]]}),
        )
    if variant == "running_max":
        return Problem(
            family,
            variant,
            "function",
            "solve",
            sig + " -> list[int]",
            "Return the list whose i-th element is the maximum of xs[0], ..., xs[i] ([] for []).",
            "def solve(xs):\n    out = []\n    for x in xs:\n"
            "        out.append(x if not out else max(out[-1], x))\n    return out\n",
            _arg(_ints),
            ({"args": [[]]}, {"args": [[5, -1, 7]]}),
        )
    return None


def _parsing_problem(family: str, variant: str, p: int) -> Problem | None:
    """The ``parsing`` family: ``parse(text)`` variants. None for an unknown variant."""
    if variant == "kv_sum":
        return Problem(
            family,
            variant,
            "function",
            "parse",
            "parse(text: str) -> dict[str, int]",
            "text holds 'key=value' pairs separated by ';' (integer values; spaces around keys and "
            "values are allowed and ignored). Return a dict mapping each key to the sum of its values.",
            "def parse(text):\n    out = {}\n    for part in text.split(';'):\n"
            "        if not part.strip():\n            continue\n        k, v = part.split('=')\n"
            "        out[k.strip()] = out.get(k.strip(), 0) + int(v)\n    return out\n",
            _arg(_kv),
            ({"args": [""]}, {"args": ["a=1;a=2"]}),
        )
    if variant == "duration":
        return Problem(
            family,
            variant,
            "function",
            "parse",
            "parse(text: str) -> int",
            "text is a duration such as '1h30m15s' (hours h, minutes m, seconds s, each optional but "
            "at least one present, in that order). Return the total number of seconds.",
            "def parse(text):\n    total, num = 0, ''\n    for c in text:\n        if c.isdigit():\n"
            "            num += c\n        else:\n"
            "            total += int(num) * {'h': 3600, 'm': 60, 's': 1}[c]\n            num = ''\n"
            "    return total\n",
            _arg(_duration),
            ({"args": ["0s"]}, {"args": ["2h"]}),
        )
    if variant == "csv_column":
        k = p % 3
        return Problem(
            family,
            variant,
            "function",
            "parse",
            "parse(text: str) -> int",
            f"text holds lines of comma-separated integers. Return the sum of column {k} (0-based) "
            "over the lines that have that column; blank lines are ignored.",
            f"def parse(text):\n    total = 0\n    for line in text.splitlines():\n"
            f"        cells = line.split(',') if line.strip() else []\n        if len(cells) > {k}:\n"
            f"            total += int(cells[{k}])\n    return total\n",
            _arg(_csv),
            ({"args": [""]}, {"args": ["1\n\n2,3"]}),
        )
    return None


def _stateful_problem(family: str, variant: str, p: int) -> Problem | None:
    """The ``stateful`` family: a class with methods, exercised by a sequence of operations. None for an unknown variant."""
    if variant == "min_stack":
        return Problem(
            family,
            variant,
            "class",
            "MinStack",
            "class MinStack: push(x), pop(), min(), size()",
            "A stack of integers: push(x) adds x; pop() removes and returns the top; min() returns the "
            "smallest element held; size() returns how many are held. pop() and min() on an empty "
            "stack raise IndexError.",
            "class MinStack:\n    def __init__(self):\n        self.items = []\n\n"
            "    def push(self, x):\n        self.items.append(x)\n\n    def pop(self):\n"
            "        if not self.items:\n            raise IndexError('empty')\n"
            "        return self.items.pop()\n\n    def min(self):\n        if not self.items:\n"
            "            raise IndexError('empty')\n        return min(self.items)\n\n"
            "    def size(self):\n        return len(self.items)\n",
            _stack_ops,
            ({"ops": [["pop", []]]}, {"ops": [["push", [2]], ["min", []], ["size", []]]}),
        )
    if variant == "capped_counter":
        cap = p % 3 + 2
        return Problem(
            family,
            variant,
            "class",
            "Counter",
            "class Counter: add(key), count(key), top()",
            f"Counts keys, each count capped at {cap}: add(key) increases key's count by one unless it "
            f"is already {cap}, and returns the count; count(key) returns it (0 for an unseen key); "
            "top() returns the key with the highest count (the alphabetically smallest among ties), "
            "or None before any add.",
            f"class Counter:\n    def __init__(self):\n        self.c = {{}}\n\n    def add(self, key):\n"
            f"        self.c[key] = min({cap}, self.c.get(key, 0) + 1)\n        return self.c[key]\n\n"
            "    def count(self, key):\n        return self.c.get(key, 0)\n\n    def top(self):\n"
            "        if not self.c:\n            return None\n"
            "        return min(self.c, key=lambda k: (-self.c[k], k))\n",
            _counter_ops,
            ({"ops": [["top", []]]}, {"ops": [["add", ["a"]]] * 6 + [["count", ["a"]]]}),
        )
    if variant == "lru":
        cap = p % 3 + 2
        return Problem(
            family,
            variant,
            "class",
            "LRU",
            "class LRU: get(key), put(key, value)",
            f"A cache holding at most {cap} integer keys: put(key, value) stores value (returns None) "
            "and, when that makes it hold too many keys, evicts the least recently used one; "
            "get(key) returns the value or -1 when absent. Both get and put count as a use.",
            "class LRU:\n    def __init__(self):\n        self.d = {}\n\n    def get(self, key):\n"
            "        if key not in self.d:\n            return -1\n"
            "        self.d[key] = self.d.pop(key)\n        return self.d[key]\n\n"
            "    def put(self, key, value):\n        self.d.pop(key, None)\n        self.d[key] = value\n"
            f"        if len(self.d) > {cap}:\n            del self.d[next(iter(self.d))]\n",
            _lru_ops,
            ({"ops": [["get", [1]]]},),
        )
    return None


_FAMILY_PROBLEMS: dict[str, Callable[[str, str, int], Problem | None]] = {
    "strings": _strings_problem,
    "lists": _lists_problem,
    "parsing": _parsing_problem,
    "stateful": _stateful_problem,
}


def problem(family: str, variant: str, p: int) -> Problem:
    """The problem ``variant`` of ``family`` with its integer parameter ``p`` (a shift, a divisor, ...)."""
    build = _FAMILY_PROBLEMS.get(family)
    prob = build(family, variant, p) if build is not None else None
    if prob is None:
        raise ValueError(f"unknown problem {family}/{variant}")
    return prob


VARIANTS: dict[str, tuple[str, ...]] = {
    "strings": ("reverse_words", "caesar", "rle", "strip_vowels"),
    "lists": ("sum_multiples", "max_subarray", "second_largest", "running_max"),
    "parsing": ("kv_sum", "duration", "csv_column"),
    "stateful": ("min_stack", "capped_counter", "lru"),
}


def jsonable(x: Any) -> Any:
    """``x`` as plain JSON data (tuples become lists); raises TypeError on anything else."""
    if x is None or type(x) in (bool, int, str):
        return x
    if type(x) is float:
        return x if x == x and abs(x) != float("inf") else repr(x)
    if type(x) in (list, tuple):
        return [jsonable(v) for v in x]
    if type(x) is dict and all(type(k) is str for k in x):
        return {k: jsonable(v) for k, v in x.items()}
    raise TypeError(f"not plain data: {type(x).__name__}")


def run_case(target: Any, kind: str, case: dict) -> Any:
    """The result of one case against ``target`` (a function, or a class instantiated per case)."""
    if kind == "function":
        return jsonable(target(*case["args"]))
    obj, out = target(), []
    for name, args in case["ops"]:
        try:
            out.append(jsonable(getattr(obj, name)(*args)))
        except Exception as e:  # noqa: BLE001 - the expected behaviour may be an exception
            out.append({"raises": type(e).__name__})
    return out


def expected(prob: Problem, cases: list[dict]) -> list[Any]:
    """Expected results from the trusted reference, run here on the host."""
    ns: dict[str, Any] = {}
    exec(compile(prob.source, f"<reference {prob.variant}>", "exec"), ns)  # noqa: S102 - our own source
    return [run_case(ns[prob.entry], prob.kind, c) for c in cases]


__all__ = ["FAMILIES", "VARIANTS", "Problem", "problem", "expected", "jsonable", "run_case"]
