"""The tiny model's tokenizer is the one every tool loads: `AutoTokenizer` on the saved checkpoint
(which for a qwen2 checkpoint is `Qwen2Tokenizer`) encodes exactly as tokenizer.json does."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer
from transformers import AutoTokenizer

DOMAIN = [
    "Could you refund $38.50 for order O-354? My email is chloe.lopez@mail.com.",
    '{"customer_id": "C-39", "status": "shipped", "total": 1000.0, "items": {"P-7": 12}}',
    "Order O-12 and O-1234 and C-5, 99 items, 07 and 007; 3.14 and -2",
    "Ünïcödé  text\twith\r\n  spaces and ﬁ ligatures and 漢字 and emoji 🙂",
    "<|im_start|>user\nhi<|im_end|> <tool_call>{}</tool_call>",
]


_CACHE: dict = {}


def _pair(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir), Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))


def test_autotokenizer_encodes_like_the_saved_tokenizer(tiny_model_dir):
    auto, raw = _pair(tiny_model_dir)
    for s in DOMAIN:
        assert auto.encode(s, add_special_tokens=False) == raw.encode(s, add_special_tokens=False).ids, s
    # digits are single tokens everywhere (never a mix of number tokens and digit runs)
    ids = auto.encode("O-354 C-39 1000", add_special_tokens=False)
    pieces = [auto.decode([i]) for i in ids]
    assert all(len(p.strip()) <= 1 for p in pieces if p.strip().isdigit()), pieces


@settings(max_examples=150, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=60))
def test_roundtrip_on_any_text(tiny_model_dir, text):
    auto, raw = _CACHE.setdefault(str(tiny_model_dir), _pair(tiny_model_dir))
    assert auto.encode(text, add_special_tokens=False) == raw.encode(text, add_special_tokens=False).ids
