"""Cross-tokenizer alignment: chunks of text on which a student and a teacher with different
tokenizers both have a token boundary.

Both tokenizers encode the same text; each token's end offset in the text is a boundary of
that side, but only where the token ends on a character boundary: a token that stops inside
a multi-byte character (a byte-level BPE piece, a byte-fallback ``<0xE6>`` token) belongs to
the chunk of the character it helps spell. Offsets come from the bytes each token spells (its
token string, through the tokenizer's decoder replayed token by token), in time linear in
the number of tokens. The boundaries the two sides share cut the text into *chunks*; every
token of either side lies inside exactly one chunk, and a chunk spells the same bytes on
both sides. A chunk's log-probability on one side is the sum
of that side's token log-probs inside it, so the teacher's chunk log-probs come from **one
teacher forward pass plus prefix sums** (:func:`teacher_token_logprobs`, :func:`chunk_sums`),
never from copying one teacher token's log-prob onto several student tokens.

Text that a tokenizer does not reproduce exactly (normalisation, dropped characters, tokens
whose bytes do not spell the text) raises :class:`AlignmentError` naming the side.
"""

from __future__ import annotations

import codecs
import json
import re
import weakref
from bisect import bisect_left
from dataclasses import dataclass
from typing import Callable, Sequence

import torch


class AlignmentError(ValueError):
    """The two tokenizations of a text cannot be aligned."""


def _gpt2_byte_of_char() -> dict[str, int]:
    """The inverse of GPT-2's ``bytes_to_unicode``: the byte each character of a byte-level token stands for."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), ord("\xff") + 1),
    ]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


_BYTE_OF_CHAR = _gpt2_byte_of_char()
_BYTE_TOKEN = re.compile(rb"<0x([0-9A-Fa-f]{2})>")
_REPLACEMENT = "\ufffd".encode()
_SUPPORTED_STEPS = {"ByteLevel", "ByteFallback", "Fuse", "Replace", "Strip", "Metaspace"}


def _decoder_steps(tokenizer) -> list[dict] | None:
    """The tokenizer's decoder as a flat list of steps, or None when it is not one this module can replay per token."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return None
    try:
        spec = json.loads(decoder.__getstate__())
    except Exception:  # noqa: BLE001 - an unknown decoder object: fall back to decoding token by token
        return None
    steps: list[dict] = []

    def flatten(d: dict) -> bool:
        if d.get("type") == "Sequence":
            return all(flatten(x) for x in d.get("decoders", []))
        if d.get("type") not in _SUPPORTED_STEPS:
            return False
        if d["type"] == "Replace" and "String" not in d.get("pattern", {}):
            return False  # a regex pattern
        steps.append(d)
        return True

    return steps if flatten(spec) else None


def _apply_steps(steps: list[dict], tokens: list[str]) -> list[bytes]:
    """Each token's bytes, replaying the decoder's steps token by token (linear in the number of tokens).

    Per-token steps act on every token; after ``Fuse`` the decoder sees one string, so a later
    ``Strip`` or ``Metaspace`` acts on the concatenation (its start and end)."""
    pieces = [t.encode() for t in tokens]
    fused = False
    for step in steps:
        kind = step["type"]
        if kind == "Fuse":
            fused = True
        elif kind in _STEP_REPLAYS:
            pieces = _STEP_REPLAYS[kind](pieces, step, fused)
    return pieces


def _byte_level(pieces: list[bytes], step: dict, fused: bool) -> list[bytes]:
    """A token whose characters are all byte characters spells those bytes; others, themselves."""
    out = []
    for p in pieces:
        try:
            out.append(bytes(_BYTE_OF_CHAR[c] for c in p.decode()))
        except (KeyError, UnicodeDecodeError):
            out.append(p)
    return out


def _replace(pieces: list[bytes], step: dict, fused: bool) -> list[bytes]:
    pattern, content = step["pattern"]["String"].encode(), step["content"].encode()
    return [p.replace(pattern, content) for p in pieces]


def _byte_fallback(pieces: list[bytes], step: dict, fused: bool) -> list[bytes]:
    """<0xHH> runs decode together; an invalid run gives one U+FFFD per byte token."""
    out, run = [], []
    for p in pieces + [None]:
        m = _BYTE_TOKEN.fullmatch(p) if p is not None else None
        if m:
            run.append(bytes([int(m.group(1), 16)]))
            continue
        if run:
            try:
                b"".join(run).decode("utf-8")
                out += run
            except UnicodeDecodeError:
                out += [_REPLACEMENT] * len(run)
            run = []
        if p is not None:
            out.append(p)
    return out


def _strip(pieces: list[bytes], step: dict, fused: bool) -> list[bytes]:
    content = step["content"].encode()
    if fused:
        _strip_across(pieces, content, step["start"], step["stop"])
    else:
        for i, p in enumerate(pieces):
            pieces[i] = _strip_across([p], content, step["start"], step["stop"])[0]
    return pieces


def _metaspace(pieces: list[bytes], step: dict, fused: bool) -> list[bytes]:
    """The first token loses its replacement characters when a prefix was prepended."""
    rep = step.get("replacement", "\u2581").encode()
    scheme = step.get("prepend_scheme", "always" if step.get("add_prefix_space", True) else "never")
    first = len(pieces) if fused else 1
    return [p.replace(rep, b"" if i < first and scheme != "never" else b" ") for i, p in enumerate(pieces)]


# each decoder step's replay on the tokens' bytes (``Fuse`` only changes what later steps see as the text's ends)
_STEP_REPLAYS: dict[str, Callable[[list[bytes], dict, bool], list[bytes]]] = {
    "ByteLevel": _byte_level,
    "Replace": _replace,
    "ByteFallback": _byte_fallback,
    "Strip": _strip,
    "Metaspace": _metaspace,
}


def _strip_across(pieces: list[bytes], content: bytes, start: int, stop: int) -> list[bytes]:
    """Remove up to ``start`` leading and ``stop`` trailing ``content`` from the concatenation of ``pieces``, in place."""
    done, i = 0, 0
    while done < start and i < len(pieces):
        if not pieces[i]:
            i += 1
        elif pieces[i].startswith(content):
            pieces[i] = pieces[i][len(content) :]
            done += 1
        else:
            break
    done, i = 0, len(pieces) - 1
    while done < stop and i >= 0:
        if not pieces[i]:
            i -= 1
        elif pieces[i].endswith(content):
            pieces[i] = pieces[i][: -len(content)]
            done += 1
        else:
            break
    return pieces


class _Speller:
    """The bytes each token id spells, in context, for one tokenizer: a replay of its decoder per token,
    or (a decoder this module does not know) each token decoded on its own."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.steps = _decoder_steps(tokenizer)
        self._alone: dict[int, bytes] = {}

    def pieces(self, ids: Sequence[int], side: str) -> list[bytes]:
        ids = [int(i) for i in ids]
        if self.steps is None:
            for i in set(ids) - self._alone.keys():
                self._alone[i] = self.tokenizer.decode([i], clean_up_tokenization_spaces=False).encode()
            return [self._alone[i] for i in ids]
        tokens = self.tokenizer.convert_ids_to_tokens(ids)
        missing = [i for i, t in zip(ids, tokens) if t is None]
        if missing:
            raise AlignmentError(f"{side}: token id {missing[0]} is not in its vocabulary")
        return _apply_steps(self.steps, list(tokens))


_SPELLERS: "weakref.WeakKeyDictionary[object, tuple[int, _Speller]]" = weakref.WeakKeyDictionary()


def _speller(tokenizer) -> _Speller:
    size = len(tokenizer) if hasattr(tokenizer, "__len__") else -1
    try:
        cached = _SPELLERS.get(tokenizer)
    except TypeError:  # not weak-referenceable: no cache
        return _Speller(tokenizer)
    if cached is None or cached[0] != size:  # added tokens invalidate the cache
        cached = (size, _Speller(tokenizer))
        _SPELLERS[tokenizer] = cached
    return cached[1]


def _char_ends(pieces: Sequence[bytes], text: str, side: str) -> list[int]:
    """End offset in ``text`` of every token, given the bytes each spells; linear in the bytes.

    A token's end is a boundary only when it falls on a character boundary (no bytes of a
    character are still pending); a token that stops inside a character takes the end of
    the first later token that completes it, so it joins the chunk of the character it helps
    spell. Bytes that are not UTF-8 count as the U+FFFD characters ``decode`` gives for them.
    A leading token that spells nothing takes the first positive end. Raises
    :class:`AlignmentError` when the bytes do not spell ``text``."""
    if not pieces:
        raise AlignmentError(f"{side}: no tokens for {text[:40]!r}")
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    out, ends, n = [], [], 0
    for p in pieces:
        s = decoder.decode(p)
        out.append(s)
        n += len(s)
        ends.append(n if n > 0 and not decoder.getstate()[0] else -1)
    s = decoder.decode(b"", final=True)
    out.append(s)
    n += len(s)
    spelled = "".join(out)
    if spelled != text:
        at = next((i for i, (a, b) in enumerate(zip(spelled, text)) if a != b), min(len(spelled), len(text)))
        raise AlignmentError(
            f"{side}: its tokens spell {spelled[at : at + 20]!r} where the text has "
            f"{text[at : at + 20]!r} (offset {at})"
        )
    ends[-1] = n
    nxt = n
    for i in range(len(ends) - 1, -1, -1):
        if ends[i] < 0:
            ends[i] = nxt
        else:
            nxt = ends[i]
    return ends


def check_text(text: str, side: str) -> None:
    """Raise :class:`AlignmentError` unless ``text`` is a non-empty str of valid Unicode (``side`` names it)."""
    if not isinstance(text, str):
        raise AlignmentError(f"{side}: text must be a str, got {type(text).__name__}")
    if not text:
        raise AlignmentError(f"{side}: empty text")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise AlignmentError(
            f"{side}: text holds a lone surrogate at offset {e.start}; it is not valid Unicode"
        ) from None


def token_ends(tokenizer, text: str, side: str = "tokenizer") -> tuple[list[int], list[int]]:
    """``(ids, ends)``: the text's token ids (no special tokens added) and each token's end offset.

    Ends come from the bytes each token spells (:func:`sampled_token_ends`), not from the
    tokenizer's character offsets, which put a token that stops inside a character at that
    character's end."""
    check_text(text, side)
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not ids:
        raise AlignmentError(f"{side}: produced no tokens for {text[:40]!r}")
    decoded = tokenizer.decode(ids, clean_up_tokenization_spaces=False)
    if decoded != text:
        raise AlignmentError(f"{side}: tokenizing changes the text (normalisation?): {text[:40]!r} -> {decoded[:40]!r}")
    return ids, sampled_token_ends(tokenizer, ids, text, side)


def sampled_token_ends(tokenizer, ids: Sequence[int], text: str, side: str = "student tokenizer") -> list[int]:
    """End offset in ``text`` of each of the (sampled, not necessarily canonical) token ids; ``text`` is their decoding.

    Linear in the number of tokens: each token's bytes come from its token string (the
    tokenizer's decoder replayed token by token), never from decoding prefixes. Only a token
    that ends on a character boundary ends a chunk: one that stops inside a character
    (a byte-level BPE piece, a ``<0xE6>`` byte-fallback token) takes the end of the token
    that completes the character."""
    check_text(text, side)
    return _char_ends(_speller(tokenizer).pieces(ids, side), text, side)


@dataclass(frozen=True)
class ChunkAlignment:
    """Shared-boundary chunks of one text. ``*_bounds[k] = (lo, hi)``: chunk k's tokens ``lo:hi`` on that side."""

    text: str
    student_ids: list[int]
    teacher_ids: list[int]
    chunk_ends: list[int]
    student_bounds: list[tuple[int, int]]
    teacher_bounds: list[tuple[int, int]]

    @property
    def num_chunks(self) -> int:
        return len(self.chunk_ends)

    def student_chunk_of_token(self) -> list[int]:
        """Chunk index of every student token: where a chunk-level signal flows back to."""
        return [k for k, (lo, hi) in enumerate(self.student_bounds) for _ in range(lo, hi)]


def chunk_bounds(ends: Sequence[int], chunk_ends: Sequence[int]) -> list[tuple[int, int]]:
    """``(lo, hi)`` per chunk: the tokens (by their end offsets ``ends``) that fall in chunk k, for chunks ending at
    the shared boundaries ``chunk_ends``."""
    chunk_of = [bisect_left(chunk_ends, e) for e in ends]  # the first shared boundary at or after the token's end
    out, lo = [], 0
    for k in range(len(chunk_ends)):
        hi = lo
        while hi < len(chunk_of) and chunk_of[hi] == k:
            hi += 1
        out.append((lo, hi))
        lo = hi
    return out


def align_texts(text: str, student_tokenizer, teacher_tokenizer) -> ChunkAlignment:
    s_ids, s_ends = token_ends(student_tokenizer, text, "student tokenizer")
    t_ids, t_ends = token_ends(teacher_tokenizer, text, "teacher tokenizer")
    chunk_ends = sorted(set(s_ends) & set(t_ends))  # always holds len(text)
    s_bounds, t_bounds = chunk_bounds(s_ends, chunk_ends), chunk_bounds(t_ends, chunk_ends)
    if any(lo == hi for lo, hi in s_bounds + t_bounds):
        raise AlignmentError(f"a chunk of {text[:40]!r} holds no token on one side")
    return ChunkAlignment(text, s_ids, t_ids, chunk_ends, s_bounds, t_bounds)


def chunk_sums(token_values: torch.Tensor, bounds: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Sum of ``token_values[lo:hi]`` for every chunk, from one prefix sum (float64)."""
    prefix = torch.cat([token_values.new_zeros(1, dtype=torch.float64), token_values.double().cumsum(0)])
    lo = torch.tensor([b[0] for b in bounds], dtype=torch.long)
    hi = torch.tensor([b[1] for b in bounds], dtype=torch.long)
    return prefix[hi] - prefix[lo]


@torch.no_grad()
def teacher_token_logprobs(
    model, context_ids: Sequence[int], ids: Sequence[int], temperature: float = 1.0
) -> torch.Tensor:
    """Log-prob of every token of ``ids`` after ``context_ids`` (the teacher's own prompt), one forward pass: ``[len(ids)]``."""
    if not context_ids:
        raise ValueError("context_ids must hold at least one token (the first token has no prediction otherwise)")
    device = next(model.parameters()).device
    seq = torch.tensor([list(context_ids) + list(ids)], device=device)
    logits = model(input_ids=seq).logits[0, len(context_ids) - 1 : -1].double() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, seq[0, len(context_ids) :, None].long()).squeeze(-1).cpu()


@torch.no_grad()
def brute_force_chunk_logprobs(
    model, context_ids: Sequence[int], ids: Sequence[int], bounds: Sequence[tuple[int, int]], temperature: float = 1.0
) -> torch.Tensor:
    """The reference path: one teacher forward per chunk over everything up to the chunk's end."""
    out = []
    for lo, hi in bounds:
        lp = teacher_token_logprobs(model, context_ids, list(ids[:hi]), temperature)
        out.append(lp[lo:hi].sum())
    return torch.stack(out)
