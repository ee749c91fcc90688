"""Teacher signals on student trajectories, at the granularity both sides can agree on: chunks.

A :class:`ChunkSignal` says, for one student trajectory, which chunk every student policy
token belongs to and the teacher's log-probability of each chunk. The student's log-prob of
a chunk is the sum over its own tokens in it, so the OPD advantage of chunk ``k`` is
``log p_teacher(chunk k) - log p_student(chunk k)`` and it flows to every student token of
the chunk (a policy-gradient step then moves ``log p_student(chunk)`` as a whole). No teacher
token's log-prob is ever copied onto several student tokens.

* A teacher with the student's tokenizer gives one chunk per policy token
  (:func:`same_tokenizer_signal`): the chunk advantage is then exactly the sampled-token
  reverse-KL estimator :func:`~mentorrl.algos.distill.sampled_reverse_kl_advantage`.
* A teacher with another tokenizer (:class:`CrossTokenizerTeacher`) re-tokenises the
  trajectory's text, segment by segment, and runs **one forward pass** over the whole
  teacher sequence; chunk log-probs come from prefix sums over its token log-probs.
  Special tokens (role markers, end of turn, tool-call tags) never go through BPE: each is
  its own chunk, mapped to the teacher's own spelling by ``special_tokens`` when the two
  chat templates differ. The text between them is encoded for the teacher as plain text
  (:class:`~mentorrl.contract.ChatEncoder`), exactly as the student's contract encoded it: a
  user's message or a tool's output that spells ``<|im_end|>`` or ``<tool_call>`` is text on
  both sides and never becomes a teacher control token. Text the teacher cannot reproduce raises
  :class:`~mentorrl.opd.align.AlignmentError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from mentorrl.contract import ChatEncoder
from mentorrl.opd.align import AlignmentError, check_text, chunk_bounds, chunk_sums, sampled_token_ends
from mentorrl.opd.teacher import Capability, HFTeacher, TeacherSignal, tokenizer_fingerprint
from mentorrl.trajectory import Trajectory


@dataclass
class ChunkSignal:
    """``chunk_of[t]``: chunk of student token ``t`` (-1 off policy tokens); ``teacher_lp[k]``: the
    teacher's log-prob of chunk ``k`` (float64); ``teacher_tokens``: tokens the teacher read."""

    chunk_of: torch.Tensor
    teacher_lp: torch.Tensor
    teacher_tokens: int

    @property
    def num_chunks(self) -> int:
        return int(self.teacher_lp.shape[0])


def student_chunk_logprobs(token_logprobs: torch.Tensor, chunk_of: torch.Tensor, num_chunks: int) -> torch.Tensor:
    """Sum of the student's token log-probs inside each chunk: ``[K]`` float64."""
    out = torch.zeros(num_chunks, dtype=torch.float64)
    keep = chunk_of >= 0
    return out.index_add(0, chunk_of[keep], token_logprobs.double()[keep])


def chunk_advantages(
    signal: ChunkSignal, student_token_logprobs: torch.Tensor, teacher_lp: torch.Tensor | None = None
) -> torch.Tensor:
    """Per student token ``[T]``: ``teacher_lp[k] - student_lp[k]`` of the chunk ``k`` it belongs to (0 off policy).

    ``teacher_lp`` overrides the signal's own (e.g. a multi-teacher mixture over the same chunks)."""
    t_lp = signal.teacher_lp if teacher_lp is None else teacher_lp
    s_lp = student_chunk_logprobs(student_token_logprobs, signal.chunk_of, signal.num_chunks)
    adv = (t_lp - s_lp).float()
    keep = signal.chunk_of >= 0
    out = torch.zeros(signal.chunk_of.shape[0], dtype=torch.float32)
    out[keep] = adv[signal.chunk_of[keep]]
    return out


def same_tokenizer_signal(teacher: HFTeacher, traj: Trajectory, scored: TeacherSignal | None = None) -> ChunkSignal:
    """One chunk per policy token, from the teacher's one forward pass over the student's own ids
    (``scored``: that pass's result when the caller already has it, e.g. with top-k)."""
    sig = scored if scored is not None else teacher.score(traj)
    mask = torch.tensor(traj.loss_mask, dtype=torch.bool)
    chunk_of = torch.full((len(traj.token_ids),), -1, dtype=torch.long)
    chunk_of[mask] = torch.arange(int(mask.sum()))
    return ChunkSignal(chunk_of, sig.token_logprobs.double()[mask], len(traj.token_ids))


def _special_ids(tokenizer) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids |= {int(i) for i in getattr(tokenizer, "added_tokens_decoder", {})}
    return ids


def _pieces(ids: Sequence[int], special: set[int]) -> list[tuple[bool, int, int]]:
    """``(is_special, lo, hi)`` runs of ``ids``: every special token alone, plain tokens in maximal runs."""
    out: list[tuple[bool, int, int]] = []
    lo = 0
    for i, t in enumerate(ids):
        if t in special:
            if lo < i:
                out.append((False, lo, i))
            out.append((True, i, i + 1))
            lo = i + 1
    if lo < len(ids):
        out.append((False, lo, len(ids)))
    return out


def plain_token_ends(encoder: ChatEncoder, text: str, side: str) -> tuple[list[int], list[int]]:
    """:func:`~mentorrl.opd.align.token_ends` through the contract's plain-text path: ``(ids, ends)`` of
    ``text`` encoded by ``encoder`` as plain text, so a control string in it (``<|im_end|>`` in a user's
    message or a tool's output) stays text and never becomes the tokenizer's control token."""
    check_text(text, side)
    try:
        ids = encoder.text(text)
    except ValueError as e:
        raise AlignmentError(f"{side}: {e}") from None
    if not ids:
        raise AlignmentError(f"{side}: produced no tokens for {text[:40]!r}")
    decoded = encoder.tokenizer.decode(ids, clean_up_tokenization_spaces=False)
    if decoded != text:
        raise AlignmentError(f"{side}: tokenizing changes the text (normalisation?): {text[:40]!r} -> {decoded[:40]!r}")
    return ids, sampled_token_ends(encoder.tokenizer, ids, text, side)


def vocab_map(teacher_tokenizer, student_tokenizer, special_tokens: Mapping[str, str] | None = None) -> torch.Tensor:
    """``[teacher vocab]``: the student id of the token that spells the same text as each teacher
    token, -1 where the student has none (or several). Text is the token decoded alone; a token
    that decodes to a partial character (U+FFFD) is never mapped. Special tokens map by name,
    through ``special_tokens`` (student name -> teacher name) where the templates differ."""

    def spellings(tok) -> dict[str, int]:
        seen: dict[str, int] = {}
        special = set(tok.all_special_ids)
        for i in range(len(tok)):
            if i in special:
                continue
            text = tok.decode([i], clean_up_tokenization_spaces=False)
            if text and "\ufffd" not in text:
                seen[text] = -1 if text in seen else i
        return seen

    student = spellings(student_tokenizer)
    out = torch.full((len(teacher_tokenizer),), -1, dtype=torch.long)
    for text, i in spellings(teacher_tokenizer).items():
        if i >= 0 and student.get(text, -1) >= 0:
            out[i] = student[text]
    names = {v: k for k, v in (special_tokens or {}).items()}
    t_vocab, s_vocab = teacher_tokenizer.get_vocab(), student_tokenizer.get_vocab()
    for name in teacher_tokenizer.all_special_tokens:
        s_name = names.get(name, name)
        if s_name in s_vocab:
            out[t_vocab[name]] = s_vocab[s_name]
    return out


class CrossTokenizerTeacher:
    """A local causal LM with its **own** tokenizer as an OPD teacher over student trajectories.

    ``special_tokens`` maps a student special token to the teacher's spelling of it (e.g.
    ``{"<|im_end|>": "<|eot_id|>"}``); unmapped special tokens are looked up in the teacher's
    vocabulary under the same string and fail with a clear error when it has none."""

    capabilities = frozenset({Capability.TOKEN_LOGPROBS, Capability.TOPK_LOGPROBS, Capability.SAMPLING})

    def __init__(
        self,
        model,
        tokenizer,
        student_tokenizer,
        name: str = "cross-teacher",
        temperature: float = 1.0,
        special_tokens: Mapping[str, str] | None = None,
    ):
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.tokenizer, self.student_tokenizer = tokenizer, student_tokenizer
        self.name, self.temperature = name, temperature
        self.special_map = dict(special_tokens or {})
        self.fingerprint = tokenizer_fingerprint(tokenizer)
        self._student_special = _special_ids(student_tokenizer)
        self._encoder = ChatEncoder(tokenizer)
        self._special_cache: dict[int, list[int]] = {}
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self._vocab_map: torch.Tensor | None = None

    @property
    def to_student(self) -> torch.Tensor:
        """Teacher id -> student id of the same spelling (-1: none), built on first use."""
        if self._vocab_map is None:
            self._vocab_map = vocab_map(self.tokenizer, self.student_tokenizer, self.special_map)
        return self._vocab_map

    def _teacher_special(self, student_id: int) -> list[int]:
        if student_id not in self._special_cache:
            s = self.student_tokenizer.convert_ids_to_tokens(student_id)
            t = self.special_map.get(s, s)
            ids = list(self.tokenizer.encode(t, add_special_tokens=False))
            if t not in self.tokenizer.get_vocab():
                raise AlignmentError(
                    f"teacher tokenizer has no special token {t!r} (the student's {s!r}); "
                    f"map it with special_tokens: {{{s!r}: <teacher's token>}}"
                )
            self._special_cache[student_id] = ids
        return self._special_cache[student_id]

    def _plain_ids(self, text: str) -> tuple[list[int], list[int]]:
        return plain_token_ends(self._encoder, text, "teacher tokenizer")

    def alignment(self, traj: Trajectory) -> tuple[list[int], torch.Tensor, list[tuple[int, int]]]:
        """``(teacher_ids, chunk_of, teacher_bounds)``: the teacher's sequence for the whole trajectory,
        each student token's chunk (-1 off policy) and each chunk's teacher token span."""
        teacher_ids: list[int] = []
        chunk_of = torch.full((len(traj.token_ids),), -1, dtype=torch.long)
        bounds: list[tuple[int, int]] = []
        segments = traj.segments or []
        if not segments:
            raise AlignmentError(f"trajectory {traj.id} records no segments; cross-tokenizer OPD needs them")
        for seg in segments:
            ids = traj.token_ids[seg.start : seg.end]
            for special, lo, hi in _pieces(ids, self._student_special):
                if special:
                    t_ids = self._teacher_special(ids[lo])
                    if seg.role == "policy":
                        chunk_of[seg.start + lo] = len(bounds)
                        bounds.append((len(teacher_ids), len(teacher_ids) + len(t_ids)))
                    teacher_ids += t_ids
                    continue
                text = self.student_tokenizer.decode(ids[lo:hi], clean_up_tokenization_spaces=False)
                t_ids, t_ends = self._plain_ids(text)
                if seg.role == "policy":
                    s_ends = sampled_token_ends(self.student_tokenizer, ids[lo:hi], text)
                    chunk_ends = sorted(set(s_ends) & set(t_ends))
                    s_b, t_b = chunk_bounds(s_ends, chunk_ends), chunk_bounds(t_ends, chunk_ends)
                    if any(a == b for a, b in s_b + t_b):
                        raise AlignmentError(
                            f"trajectory {traj.id}: a chunk of {text[:40]!r} holds no token on one side"
                        )
                    base, k0 = len(teacher_ids), len(bounds)
                    bounds += [(base + c, base + d) for c, d in t_b]
                    for j, (a, b) in enumerate(s_b):
                        chunk_of[seg.start + lo + a : seg.start + lo + b] = k0 + j
                teacher_ids += t_ids
        if self.max_positions is not None and len(teacher_ids) > self.max_positions:
            raise AlignmentError(
                f"trajectory {traj.id}: {len(teacher_ids)} teacher tokens exceed the teacher's "
                f"{self.max_positions} positions"
            )
        if bounds and bounds[0][0] == 0:
            raise AlignmentError(f"trajectory {traj.id}: a policy chunk starts the teacher sequence (no context)")
        return teacher_ids, chunk_of, bounds

    @torch.no_grad()
    def score(self, traj: Trajectory, top_k: int | None = None) -> ChunkSignal | tuple[ChunkSignal, TeacherSignal]:
        """One teacher forward over the re-tokenised trajectory, chunk log-probs by prefix sums.

        With ``top_k``, the same pass also gives a top-k target at every policy token whose chunk is
        one token on both sides (the same text): the teacher's ``top_k`` most likely next tokens among
        those the student can spell, as student ids, with the teacher's (unrenormalised) log-probs, so
        a tail bin holds the mass of everything else, the student-unspellable tokens included.
        Returns ``(ChunkSignal, TeacherSignal)`` then; ``topk_mask`` marks the covered positions."""
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        teacher_ids, chunk_of, bounds = self.alignment(traj)
        device = next(self.model.parameters()).device
        seq = torch.tensor([teacher_ids], device=device)
        logits = self.model(input_ids=seq).logits[0, :-1].float() / self.temperature
        lp = torch.log_softmax(logits, dim=-1)
        tok = lp.gather(-1, seq[0, 1:, None]).squeeze(-1).cpu()
        token_lp = torch.cat([tok.new_zeros(1), tok])  # lp of teacher token j given < j
        teacher_lp = chunk_sums(token_lp, bounds) if bounds else torch.zeros(0, dtype=torch.float64)
        signal = ChunkSignal(chunk_of, teacher_lp, len(teacher_ids))
        if top_k is None:
            return signal
        return signal, self._one_to_one_topk(traj, chunk_of, bounds, lp, top_k)

    def _one_to_one_topk(
        self, traj: Trajectory, chunk_of: torch.Tensor, bounds: list[tuple[int, int]], lp: torch.Tensor, top_k: int
    ) -> TeacherSignal:
        T = len(traj.token_ids)
        sizes = torch.bincount(chunk_of[chunk_of >= 0], minlength=len(bounds))
        rows = [
            (t, bounds[int(c)][0])
            for t, c in enumerate(chunk_of.tolist())
            if c >= 0 and sizes[c] == 1 and bounds[c][1] - bounds[c][0] == 1
        ]
        mapped = self.to_student.to(lp.device)
        k = min(top_k, int((mapped >= 0).sum()))
        ids, vals = torch.zeros(T, max(k, 1), dtype=torch.long), torch.zeros(T, max(k, 1))
        mask = torch.zeros(T, dtype=torch.bool)
        if rows and k > 0:
            pos = torch.tensor([t for t, _ in rows])
            at = torch.tensor([j - 1 for _, j in rows], device=lp.device)  # row j-1 predicts teacher token j
            spellable = lp[at].masked_fill(mapped[None, :] < 0, float("-inf"))
            v, i = spellable.topk(k, dim=-1)
            ids[pos], vals[pos] = mapped[i].cpu(), v.cpu()
            mask[pos] = True
        return TeacherSignal(torch.zeros(T), ids, vals, mask)


__all__ = [
    "ChunkSignal",
    "CrossTokenizerTeacher",
    "chunk_advantages",
    "plain_token_ends",
    "same_tokenizer_signal",
    "sampled_token_ends",
    "student_chunk_logprobs",
    "vocab_map",
]
