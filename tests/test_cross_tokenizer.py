"""Cross-tokenizer alignment: shared-boundary chunks, and teacher chunk log-probs from one forward
pass plus prefix sums against one forward per chunk, on 200+ random texts with two local tokenizers."""

from __future__ import annotations

import random

import pytest
import torch

from mentorrl.models.build import ModelSpec, build_model, train_tokenizer
from mentorrl.opd import AlignmentError, align_texts, brute_force_chunk_logprobs, chunk_sums, teacher_token_logprobs

WORDS = [
    "order",
    "refund",
    "customer",
    "email",
    "cancel",
    "status",
    "shipped",
    "widget",
    "gadget",
    "Hello",
    "please",
    "thanks",
    "the",
    "my",
    "is",
    "was",
    "total",
    "address",
    "Main",
    "Street",
    "café",
    "naïve",
    "✓",
    "—",
    "€",
    "ok",
    "#",
    "$",
    "@",
    "shop.example",
    "id",
    "tool_call",
    "{",
    "}",
    ":",
    ",",
    ".",
    "?",
    "'",
]


def random_text(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(3, 14)):
        r = rng.random()
        if r < 0.2:
            parts.append(str(rng.randint(0, 99999)))
        elif r < 0.25:
            parts.append(f"{rng.randint(1, 999)}.{rng.randint(0, 99):02d}")
        else:
            parts.append(rng.choice(WORDS))
    seps = [" ", " ", " ", "", "\n", "  "]
    return "".join(p + rng.choice(seps) for p in parts).strip() or "ok"


@pytest.fixture(scope="module")
def teacher(tokenizer):
    """A teacher with its own, smaller vocabulary, trained on other text than the student's tokenizer."""
    rng = random.Random(99)
    corpus = [random_text(rng) for _ in range(400)]
    tok = train_tokenizer(corpus, vocab_size=420)
    model = build_model(
        tok,
        ModelSpec(
            vocab_size=420, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1, seed=3
        ),
    ).eval()
    return tok, model


def test_tokenizers_really_differ(tokenizer, teacher):
    text = "Hello, my order 12345 was shipped to 12 Main Street — café ✓"
    al = align_texts(text, tokenizer, teacher[0])
    assert al.student_ids != al.teacher_ids and len(al.student_ids) != len(al.teacher_ids)
    assert al.chunk_ends[-1] == len(text) and al.num_chunks < max(len(al.student_ids), len(al.teacher_ids))


def test_chunks_partition_both_tokenizations(tokenizer, teacher):
    rng = random.Random(1)
    multibyte = [
        "漢字 日本語のテキスト 😀👍🏽 café ✓",
        "order 漢字 #12345 — naïve 👩\u200d❤\ufe0f\u200d👩 ü",
        "€12.50 → ¥1,800 (返金) — ok",
    ]
    for text in [random_text(rng) for _ in range(50)] + multibyte:
        al = align_texts(text, tokenizer, teacher[0])
        for ids, bounds in ((al.student_ids, al.student_bounds), (al.teacher_ids, al.teacher_bounds)):
            assert bounds[0][0] == 0 and bounds[-1][1] == len(ids)
            assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:])) and all(lo < hi for lo, hi in bounds)
        # every chunk is the same text on both sides: no chunk boundary falls inside a character
        pieces = []
        for k, (lo, hi) in enumerate(al.student_bounds):
            tlo, thi = al.teacher_bounds[k]
            s_text = tokenizer.decode(al.student_ids[lo:hi])
            t_text = teacher[0].decode(al.teacher_ids[tlo:thi])
            assert s_text == t_text and "\ufffd" not in s_text, (k, s_text, t_text, text)
            pieces.append(s_text)
        assert "".join(pieces) == text
        assert len(al.student_chunk_of_token()) == len(al.student_ids)


def test_prefix_sum_chunk_logprobs_match_one_forward_per_chunk(tokenizer, teacher):
    """≥ 200 random texts: max |one pass + prefix sums - one forward per chunk| < 1e-4."""
    tok, model = teacher
    context = tok("Customer: ", add_special_tokens=False)["input_ids"]
    rng = random.Random(2026)
    worst, chunks = 0.0, 0
    for _ in range(210):
        al = align_texts(random_text(rng), tokenizer, tok)
        fast = chunk_sums(teacher_token_logprobs(model, context, al.teacher_ids), al.teacher_bounds)
        slow = brute_force_chunk_logprobs(model, context, al.teacher_ids, al.teacher_bounds)
        worst = max(worst, (fast - slow).abs().max().item())
        chunks += al.num_chunks
        assert fast.sum().item() == pytest.approx(teacher_token_logprobs(model, context, al.teacher_ids).sum().item())
    assert chunks > 1000 and worst < 1e-4, worst


def test_chunk_sums_and_errors(tokenizer, teacher):
    v = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert chunk_sums(v, [(0, 1), (1, 3), (3, 4)]).tolist() == [1.0, 5.0, 4.0]
    with pytest.raises(AlignmentError, match="empty"):
        align_texts("", tokenizer, teacher[0])

    class Lowercasing:  # a tokenizer whose normalisation changes the text
        def __init__(self, inner):
            self.inner = inner

        def __call__(self, text, **kw):
            return self.inner(text.lower(), **kw)

        def decode(self, ids, **kw):
            return self.inner.decode(ids, **kw)

    with pytest.raises(AlignmentError, match="teacher tokenizer: tokenizing changes the text"):
        align_texts("Hello World", tokenizer, Lowercasing(teacher[0]))
    with pytest.raises(ValueError, match="context_ids"):
        teacher_token_logprobs(teacher[1], [], [1, 2])
