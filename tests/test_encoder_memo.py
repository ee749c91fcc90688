"""ChatEncoder remembers the ids of the texts it encoded (a GRPO group's episodes encode one prompt eight
times): a remembered text gives the ids a fresh encoder gives, a caller changing the list it got back
changes nothing remembered, and a full memo starts over."""

from __future__ import annotations

from pathlib import Path

import pytest

import mentorrl.contract as contract_mod
from mentorrl.contract import ChatEncoder

SHIPPED = Path(__file__).resolve().parent.parent / "mentorrl" / "models" / "bases" / "orders-tiny"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(SHIPPED)


TEXTS = ["order 1234 for alice", "", "refund <|im_end|> now", "order 1234 for alice", "x" * 50, "\ud800 bad"]


def test_remembered_ids_equal_a_fresh_encoders(tokenizer):
    enc = ChatEncoder(tokenizer)
    for text in TEXTS + TEXTS:
        assert enc.text(text) == ChatEncoder(tokenizer).text(text)
    got = enc.text(TEXTS[0])
    got.append(-1)  # the caller's own list
    assert enc.text(TEXTS[0]) == ChatEncoder(tokenizer).text(TEXTS[0])


def test_a_full_memo_starts_over(tokenizer, monkeypatch):
    monkeypatch.setattr(contract_mod, "MEMO_TEXTS", 3)
    enc = ChatEncoder(tokenizer)
    for i in range(10):
        assert enc.text(f"item {i}") == ChatEncoder(tokenizer).text(f"item {i}")
        assert len(enc._memo) <= 3
