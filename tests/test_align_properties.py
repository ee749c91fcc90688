"""Cross-tokenizer alignment on multi-byte text: chunks spell the same bytes on both sides.

Three kinds of tokenizer, built locally with ``tokenizers`` (no downloads) and wrapped as
``PreTrainedTokenizerFast``: byte-level BPE (GPT-2/Qwen style), byte-fallback BPE
(Llama/SentencePiece style: ``▁`` for spaces, ``<0xHH>`` tokens for characters outside the
vocabulary) and a char-level model (one token per known character, bytes for the rest).
Random Unicode text (ASCII, CJK, emoji with ZWJ and skin tones, combining accents) and random
pairs of them; the oracle is each side's own ``decode`` of its token prefixes, never the code
under test."""

from __future__ import annotations

import json
import time
from functools import cache
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from mentorrl.opd import AlignmentError, align_texts, token_ends
from mentorrl.opd.align import chunk_bounds
from mentorrl.opd.signals import CrossTokenizerTeacher, sampled_token_ends
from mentorrl.trajectory import Segment, Trajectory

CORPUS = [
    "hello world, the order was shipped to the customer",
    "please cancel my order 12345, thanks",
    "café naïve résumé déjà vu",
    "漢字 漫画 演劇 漁業 字",
    "日本語のテキストです",
    "中文文本 汉字",
    "emoji 😀 ok 👍🏽 fine 🎉",
    "a\u0301 e\u0300 combining u\u0308",
    "Hello 漢字 café ✓ — €",
] * 4


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> character table of byte-level BPE."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


CHAR_OF_BYTE = _bytes_to_unicode()
KINDS = ["byte_level", "byte_fallback", "char_level"]


def _wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def _byte_fallback_from(vocab: dict[str, int], merges: list[tuple[str, str]], prepend: bool) -> Tokenizer:
    vocab = dict(vocab)
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True))
    steps = [normalizers.Prepend("▁")] if prepend else []
    tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if prepend else [])
    )
    return tok


@cache
def make(kind: str) -> PreTrainedTokenizerFast:
    """One of the three kinds of tokenizer, trained deterministically on :data:`CORPUS`."""
    if kind == "byte_level":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(
            CORPUS,
            trainer=trainers.BpeTrainer(
                vocab_size=420, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
            ),
        )
        return _wrap(tok)
    if kind == "byte_fallback":
        tok = Tokenizer(models.BPE())
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.train_from_iterator(
            CORPUS, trainer=trainers.BpeTrainer(vocab_size=260, limit_alphabet=45, show_progress=False)
        )
        model = json.loads(tok.to_str())["model"]
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
        return _wrap(_byte_fallback_from(model["vocab"], merges, prepend=True))
    if kind == "char_level":
        chars = sorted({c for line in CORPUS for c in line})[::2]  # half the corpus's characters; bytes for the rest
        tok = _byte_fallback_from({c: i for i, c in enumerate(chars)}, [], prepend=False)
        tok.normalizer = None
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
        return _wrap(tok)
    raise ValueError(kind)


@cache
def issue_tokenizers() -> tuple[PreTrainedTokenizerFast, PreTrainedTokenizerFast]:
    """The issue's pair: a byte-level BPE that splits 漢 (E6 BC A2) as ``E6 BC | A2 E5 AD | 97`` with 字 (E5 AD 97),
    and a byte-fallback BPE that knows 字 but spells 漢 as ``<0xE6> <0xBC> <0xA2>``."""
    alphabet = [CHAR_OF_BYTE[b] for b in range(256)]
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges = [
        (CHAR_OF_BYTE[0xE6], CHAR_OF_BYTE[0xBC]),
        (CHAR_OF_BYTE[0xA2], CHAR_OF_BYTE[0xE5]),
        (CHAR_OF_BYTE[0xA2] + CHAR_OF_BYTE[0xE5], CHAR_OF_BYTE[0xAD]),
    ]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    bl = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    bl.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    bl.decoder = decoders.ByteLevel()
    bf = _byte_fallback_from({"▁": 0, "字": 1, "a": 2}, [], prepend=True)
    return _wrap(bl), _wrap(bf)


def byte_ids(tok, kind: str, data: bytes) -> list[int]:
    """The single-byte tokens spelling ``data`` (not how the tokenizer would encode it)."""
    names = [CHAR_OF_BYTE[b] for b in data] if kind == "byte_level" else [f"<0x{b:02X}>" for b in data]
    return tok.convert_tokens_to_ids(names)


def check_chunks(student, s_ids, s_bounds, teacher, t_ids, t_bounds, chunk_ends, text) -> None:
    """The property, against each side's own ``decode`` of its token prefixes: the chunks partition both
    tokenizations, concatenate back to ``text``, and each chunk is the same text and bytes on both sides."""
    assert chunk_ends[-1] == len(text) and len(s_bounds) == len(t_bounds) == len(chunk_ends)
    for ids, bounds in ((s_ids, s_bounds), (t_ids, t_bounds)):
        assert bounds[0][0] == 0 and bounds[-1][1] == len(ids)
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:])) and all(lo < hi for lo, hi in bounds)
    prev = ("", "")
    for k, ((slo, shi), (tlo, thi)) in enumerate(zip(s_bounds, t_bounds)):
        s_prefix = student.decode(s_ids[:shi], clean_up_tokenization_spaces=False)
        t_prefix = teacher.decode(t_ids[:thi], clean_up_tokenization_spaces=False)
        assert s_prefix == t_prefix == text[: chunk_ends[k]], (k, s_prefix, t_prefix, text)
        s_chunk, t_chunk = s_prefix[len(prev[0]) :], t_prefix[len(prev[1]) :]
        assert s_chunk.encode() == t_chunk.encode() and s_chunk
        prev = (s_prefix, t_prefix)
    assert prev[0] == text


# ------------------------------------------------------------------- reproducers ---
def test_issue_pair_splits_inside_characters():
    bl, bf = issue_tokenizers()
    assert bl.convert_ids_to_tokens(bl("漢字", add_special_tokens=False)["input_ids"]) == ["æ¼", "¢åŃ", "Ĺ"]
    assert bf.convert_ids_to_tokens(bf("漢字", add_special_tokens=False)["input_ids"]) == [
        "▁",
        "<0xE6>",
        "<0xBC>",
        "<0xA2>",
        "字",
    ]


@pytest.mark.parametrize("student_first", [True, False])
def test_issue_kanji_chunks_are_the_same_bytes_on_both_sides(student_first):
    """align_texts("漢字", byte-level BPE, byte-fallback BPE): chunk 0 was E6 BC on one side, E6 BC A2 on the other."""
    bl, bf = issue_tokenizers()
    student, teacher = (bl, bf) if student_first else (bf, bl)
    al = align_texts("漢字", student, teacher)
    assert al.chunk_ends == [2]  # 漢 and 字 share the byte-level token A2 E5 AD: one chunk
    check_chunks(
        student, al.student_ids, al.student_bounds, teacher, al.teacher_ids, al.teacher_bounds, al.chunk_ends, "漢字"
    )


def test_issue_sampled_bytes_join_the_character_they_complete():
    """A sampled a|E6|BC|A2: the three bytes of 漢 end with it (offset 2), none with "a" or after it."""
    bl, bf = issue_tokenizers()
    ids = bl.convert_tokens_to_ids(["a"]) + byte_ids(bl, "byte_level", "漢".encode())
    assert bl.decode(ids) == "a漢"
    assert sampled_token_ends(bl, ids, "a漢") == [1, 2, 2, 2]
    t_ids, t_ends = token_ends(bf, "a漢")
    chunk_ends = sorted(set(sampled_token_ends(bl, ids, "a漢")) & set(t_ends))
    assert chunk_ends == [1, 2]
    check_chunks(
        bl, ids, chunk_bounds([1, 2, 2, 2], chunk_ends), bf, t_ids, chunk_bounds(t_ends, chunk_ends), chunk_ends, "a漢"
    )
    # the same sampled on the byte-fallback side
    f_ids = bf.convert_tokens_to_ids(["a"]) + byte_ids(bf, "byte_fallback", "漢".encode())
    assert sampled_token_ends(bf, f_ids, "a漢") == [1, 2, 2, 2]


def test_invalid_sampled_bytes_count_as_the_replacement_characters_decode_gives():
    """A student may sample bytes that are not UTF-8; its text then holds U+FFFD and the chunks still agree on it."""
    bl, bf = issue_tokenizers()
    ids = bl.convert_tokens_to_ids(["a"]) + byte_ids(bl, "byte_level", b"\xe6\xbc") + bl.convert_tokens_to_ids(["a"])
    text = bl.decode(ids)
    assert text == "a\ufffda" and sampled_token_ends(bl, ids, text) == [1, 3, 3, 3]
    f_ids = (
        bf.convert_tokens_to_ids(["a"]) + byte_ids(bf, "byte_fallback", b"\xe6\xbc") + bf.convert_tokens_to_ids(["a"])
    )
    text = bf.decode(f_ids)
    assert text == "a\ufffd\ufffda" and sampled_token_ends(bf, f_ids, text) == [1, 2, 3, 4]
    with pytest.raises(AlignmentError, match="student tokenizer: its tokens spell"):
        sampled_token_ends(bl, ids, "a漢a")


def test_bad_text_is_a_clear_alignment_error():
    bl, bf = issue_tokenizers()
    with pytest.raises(AlignmentError, match="teacher tokenizer: text holds a lone surrogate"):
        token_ends(bf, "x\ud800", "teacher tokenizer")
    with pytest.raises(AlignmentError, match="teacher tokenizer: tokenizing changes the text"):
        align_texts("a\u2581b", bl, bf)  # SentencePiece-style tokenizers read ▁ as a space
    with pytest.raises(AlignmentError, match="student tokenizer: token id 999999 is not in its vocabulary"):
        sampled_token_ends(bl, [999999], "a")


def test_sampled_token_ends_is_linear_and_decodes_nothing(monkeypatch):
    """A 7,200-token turn: no decode of any prefix (it was one per token, 15 s), well under a second."""
    student = make("byte_level")
    unit = "Order 12345 漢字 café 😀👍🏽 e\u0301 — shipped. "
    ids: list[int] = []
    while len(ids) < 7200:
        ids += student(unit, add_special_tokens=False)["input_ids"]
        ids += byte_ids(student, "byte_level", "漢".encode())
    ids = ids[:7200]
    text = student.decode(ids)
    calls = []
    real = type(student).decode
    monkeypatch.setattr(type(student), "decode", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    t0 = time.perf_counter()
    ends = sampled_token_ends(student, ids, text)
    elapsed = time.perf_counter() - t0
    assert calls == [] and elapsed < 0.5, (len(calls), elapsed)
    assert len(ends) == 7200 and ends[-1] == len(text)


# ------------------------------------------------------------------- properties ----
ALPHABET = st.one_of(
    st.sampled_from(list("abcdefxyz ABCXYZ.,!?'\n\t0123456789")),
    st.sampled_from(list("漢字漫画演劇漁業日本語のテキスト中文汉한국어")),
    st.sampled_from(["😀", "👍", "🏽", "\u200d", "👩", "❤", "\ufe0f", "🎉", "🇯", "🇵"]),
    st.sampled_from(["\u0301", "\u0300", "\u0308", "é", "ñ", "ü", "ß", "Ж", "ω", "€", "—", "✓"]),
    st.characters(exclude_categories=("Cs",), exclude_characters="\u2581"),
)
FRAGMENTS = sorted({w for line in CORPUS for w in line.split()} | {"👩\u200d❤\ufe0f\u200d👩", "😀👍🏽x"})
# single characters, and the corpus's words (so the tokenizers' multi-byte merges come into play)
TEXTS = st.lists(st.one_of(ALPHABET, st.sampled_from(FRAGMENTS), st.just(" ")), min_size=1, max_size=12).map("".join)
PAIRS = st.tuples(st.sampled_from(KINDS), st.sampled_from(KINDS))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=TEXTS, pair=PAIRS)
def test_canonical_chunks_spell_the_same_bytes_on_both_sides(text, pair):
    student, teacher = make(pair[0]), make(pair[1])
    if student.decode(student(text, add_special_tokens=False)["input_ids"]) != text:
        with pytest.raises(AlignmentError, match="tokenizing changes the text"):
            align_texts(text, student, teacher)
        return
    al = align_texts(text, student, teacher)
    check_chunks(
        student, al.student_ids, al.student_bounds, teacher, al.teacher_ids, al.teacher_bounds, al.chunk_ends, text
    )


def sampled_spelling(draw, tok, kind: str, text: str) -> list[int]:
    """A non-canonical spelling of ``text``: each random piece canonically encoded or spelled byte by byte."""
    cuts = sorted(draw(st.sets(st.integers(1, max(len(text) - 1, 1)), max_size=6)) - {len(text)})
    ids: list[int] = []
    for a, b in zip([0] + cuts, cuts + [len(text)]):
        piece = text[a:b]
        if draw(st.booleans()) and (kind != "byte_fallback" or a == 0):  # (a canonical piece gains a ▁ prefix)
            ids += tok(piece, add_special_tokens=False)["input_ids"]
        else:
            ids += byte_ids(tok, kind, piece.encode())
    return ids


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), text=TEXTS, pair=PAIRS)
def test_sampled_chunks_spell_the_same_bytes_on_both_sides(data, text, pair):
    student, teacher = make(pair[0]), make(pair[1])
    s_ids = sampled_spelling(data.draw, student, pair[0], text)
    text = student.decode(s_ids, clean_up_tokenization_spaces=False)  # what CrossTokenizerTeacher re-tokenises
    if not text or teacher.decode(teacher(text, add_special_tokens=False)["input_ids"]) != text:
        return
    s_ends = sampled_token_ends(student, s_ids, text)
    t_ids, t_ends = token_ends(teacher, text, "teacher tokenizer")
    chunk_ends = sorted(set(s_ends) & set(t_ends))
    check_chunks(
        student,
        s_ids,
        chunk_bounds(s_ends, chunk_ends),
        teacher,
        t_ids,
        chunk_bounds(t_ends, chunk_ends),
        chunk_ends,
        text,
    )


class _NoModel(torch.nn.Linear):
    """Stands in for the teacher model: ``alignment`` reads only its config."""

    def __init__(self):
        super().__init__(1, 1)
        self.config = SimpleNamespace(max_position_embeddings=None)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), text=TEXTS, pair=PAIRS)
def test_cross_tokenizer_teacher_chunks_spell_the_same_bytes(data, text, pair):
    """Through CrossTokenizerTeacher.alignment: a prompt segment, then a sampled policy turn."""
    student, teacher = make(pair[0]), make(pair[1])
    prompt = student("Q: 漢字?", add_special_tokens=False)["input_ids"]
    policy = sampled_spelling(data.draw, student, pair[0], text)
    turn = student.decode(policy, clean_up_tokenization_spaces=False)
    if not turn or teacher.decode(teacher(turn, add_special_tokens=False)["input_ids"]) != turn:
        return
    ids = prompt + policy
    traj = Trajectory(
        id="t",
        task_id="q",
        family="f",
        token_ids=ids,
        loss_mask=[0] * len(prompt) + [1] * len(policy),
        logprobs=[0.0] * len(ids),
        env_name="e",
        env_version="1",
        segments=[
            Segment(role="prompt", start=0, end=len(prompt)),
            Segment(role="policy", start=len(prompt), end=len(ids)),
        ],
    )
    t_ids, chunk_of, bounds = CrossTokenizerTeacher(_NoModel(), teacher, student).alignment(traj)
    p_teacher = len(token_ends(teacher, student.decode(prompt))[0])
    run = t_ids[p_teacher:]
    s_bounds, k = [], chunk_of[len(prompt) :].tolist()
    for c in range(len(bounds)):
        s_bounds.append((k.index(c), len(k) - k[::-1].index(c)))
    t_bounds = [(a - p_teacher, b - p_teacher) for a, b in bounds]
    ends = [len(student.decode(policy[:hi])) for _, hi in s_bounds]
    check_chunks(student, policy, s_bounds, teacher, run, t_bounds, ends, turn)


@cache
def metaspace(scheme: str) -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer whose decoder is ``Metaspace`` (T5-like), with byte fallback."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=scheme)
    tok.train_from_iterator(CORPUS, trainer=trainers.BpeTrainer(vocab_size=220, limit_alphabet=40, show_progress=False))
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    out = _byte_fallback_from(model["vocab"], merges, prepend=False)
    out.normalizer = None
    out.pre_tokenizer = tok.pre_tokenizer
    out.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(prepend_scheme=scheme)])
    return _wrap(out)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(KINDS + ["metaspace-always", "metaspace-first", "metaspace-never"]),
    picks=st.lists(st.integers(0, 10**6), min_size=1, max_size=20),
)
def test_decoder_replay_spells_what_decode_gives(kind, picks):
    """Any id sequence, valid UTF-8 or not: the bytes replayed token by token decode to the tokenizer's own decode."""
    from mentorrl.opd.align import _speller

    tok = metaspace(kind.split("-")[1]) if kind.startswith("metaspace") else make(kind)
    ids = [p % len(tok) for p in picks]
    text = tok.decode(ids, clean_up_tokenization_spaces=False)
    assert b"".join(_speller(tok).pieces(ids, "x")).decode("utf-8", "replace") == text
    if text:
        assert sampled_token_ends(tok, ids, text)[-1] == len(text)


def test_an_unknown_decoder_falls_back_to_decoding_each_token_and_fails_loudly():
    """A decoder this module cannot replay (WordPiece's ## joins): each id decoded alone, and text it does not
    reproduce is an AlignmentError naming the side, never a silent misalignment."""
    vocab = {"[UNK]": 0, "a": 1, "##b": 2, "c": 3}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    wp = _wrap(tok)
    ids = wp("ab c", add_special_tokens=False)["input_ids"]
    assert wp.decode(ids) == "ab c"
    with pytest.raises(AlignmentError, match="teacher tokenizer: its tokens spell"):
        token_ends(wp, "ab c", "teacher tokenizer")
