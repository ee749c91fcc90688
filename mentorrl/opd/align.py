"""Cross-tokenizer alignment: chunks of text on which a student and a teacher with different
tokenizers both have a token boundary.

Both tokenizers encode the same text; each token's end offset in the text is a boundary of
that side. The boundaries the two sides share cut the text into *chunks*; every token of
either side lies inside exactly one chunk. A chunk's log-probability on one side is the sum
of that side's token log-probs inside it, so the teacher's chunk log-probs come from **one
teacher forward pass plus prefix sums** (:func:`teacher_token_logprobs`, :func:`chunk_sums`),
never from copying one teacher token's log-prob onto several student tokens.

Text that a tokenizer does not reproduce exactly (normalisation, dropped characters, tokens
that do not cover the text contiguously) raises :class:`AlignmentError` naming the side.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Sequence

import torch


class AlignmentError(ValueError):
    """The two tokenizations of a text cannot be aligned."""


def token_ends(tokenizer, text: str, side: str = "tokenizer") -> tuple[list[int], list[int]]:
    """``(ids, ends)``: the text's token ids (no special tokens added) and each token's end offset.

    Tokens of a byte-level tokenizer that split one character share that character's end, so
    no boundary falls inside a character."""
    if not text:
        raise AlignmentError(f"{side}: empty text")
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
    if not ids:
        raise AlignmentError(f"{side}: produced no tokens for {text[:40]!r}")
    decoded = tokenizer.decode(ids, clean_up_tokenization_spaces=False)
    if decoded != text:
        raise AlignmentError(f"{side}: tokenizing changes the text (normalisation?): {text[:40]!r} -> {decoded[:40]!r}")
    ends, covered = [], 0
    for i, (start, end) in enumerate(offsets):
        if start > covered:
            raise AlignmentError(f"{side}: token {i} ({start}, {end}) leaves a gap after offset {covered}")
        covered = max(covered, end)
        ends.append(covered)
    if covered != len(text):
        raise AlignmentError(f"{side}: tokens cover {covered} of {len(text)} characters")
    return ids, ends


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


def _bounds(ends: Sequence[int], chunk_ends: Sequence[int]) -> list[tuple[int, int]]:
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
    s_bounds, t_bounds = _bounds(s_ends, chunk_ends), _bounds(t_ends, chunk_ends)
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
def teacher_token_logprobs(model, context_ids: Sequence[int], ids: Sequence[int], temperature: float = 1.0) -> torch.Tensor:
    """Log-prob of every token of ``ids`` after ``context_ids`` (the teacher's own prompt), one forward pass: ``[len(ids)]``."""
    if not context_ids:
        raise ValueError("context_ids must hold at least one token (the first token has no prediction otherwise)")
    device = next(model.parameters()).device
    seq = torch.tensor([list(context_ids) + list(ids)], device=device)
    logits = model(input_ids=seq).logits[0, len(context_ids) - 1 : -1].double() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, seq[0, len(context_ids):, None].long()).squeeze(-1).cpu()


@torch.no_grad()
def brute_force_chunk_logprobs(model, context_ids: Sequence[int], ids: Sequence[int],
                               bounds: Sequence[tuple[int, int]], temperature: float = 1.0) -> torch.Tensor:
    """The reference path: one teacher forward per chunk over everything up to the chunk's end."""
    out = []
    for lo, hi in bounds:
        lp = teacher_token_logprobs(model, context_ids, list(ids[:hi]), temperature)
        out.append(lp[lo:hi].sum())
    return torch.stack(out)
