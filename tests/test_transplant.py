"""Vocabulary transplant (mentorrl.models.transplant, `mentorrl transplant-vocab`): a checkpoint moved
onto another byte-level BPE tokenizer keeps its body and computes the same function wherever the two
tokenizers agree."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from mentorrl.cli import app
from mentorrl.models.build import build_model_for_vocab, load_policy, train_tokenizer
from mentorrl.models.spec import ModelSpec
from mentorrl.models.transplant import TransplantError, exact_share, spell_in, transplant_vocabulary

CORPUS = [
    "find_customer email anna.lee@example.com returned customer 1042; order 77 is shipped, total $38.50",
    "cancel_order 77 refused: the order belongs to another customer. No account for bob@example.org.",
    "Prix: 12,50 € — Größe M; café crème; 東京 の 注文 は 発送済み",
] * 20


@pytest.fixture(scope="module")
def toks():
    return train_tokenizer(CORPUS, 300), train_tokenizer(CORPUS, 420)


@pytest.fixture(scope="module")
def small_model(toks):
    old, _ = toks
    spec = ModelSpec(
        hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1, vocab_size=len(old)
    )
    return build_model_for_vocab(len(old), spec, old.eos_token_id, old.pad_token_id).eval()


def test_every_new_token_is_spelled_by_the_same_bytes(toks):
    old, new = toks
    spellings = spell_in(old, new)
    assert len(spellings) == len(new)
    specials = set(new.all_special_tokens)
    for i, ids in enumerate(spellings):
        piece = new.convert_ids_to_tokens(i)
        if piece in specials:
            assert old.convert_ids_to_tokens(ids) == [piece]  # a special token maps to itself, never spelled
            continue
        assert "".join(old.convert_ids_to_tokens(ids)) == piece


def test_shared_tokens_copy_and_merged_tokens_average(toks, small_model):
    old, new = toks
    moved = transplant_vocabulary(small_model, old, new)
    w_old = small_model.get_input_embeddings().weight
    w_new = moved.get_input_embeddings().weight
    assert w_new.shape[0] == len(new)
    merged = 0
    for i, ids in enumerate(spell_in(old, new)):
        assert torch.allclose(w_new[i], w_old[ids].mean(0)), i
        merged += len(ids) > 1
    assert merged > 0, "the larger vocabulary has merges the smaller lacks: the test needs averaged rows"
    assert 0 < exact_share(spell_in(old, new)) < 1
    # the body is untouched and the head stays tied to the new embeddings
    for (n1, p1), (n2, p2) in zip(small_model.model.layers.named_parameters(), moved.model.layers.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)
    assert moved.get_output_embeddings().weight.data_ptr() == w_new.data_ptr()
    assert moved.config.vocab_size == len(new) and moved.config.eos_token_id == new.eos_token_id


def _same_function(toks, model, text: str) -> bool:
    """Where both tokenizers cut ``text`` into the same pieces, the moved model gives the old model's
    logits for every token both vocabularies hold (a resize with fresh rows would not). Returns
    whether the cuts agreed (and so were compared)."""
    old, new = toks
    moved = _moved(toks, model)
    old_pieces = old.convert_ids_to_tokens(old(text)["input_ids"])
    new_ids = new(text)["input_ids"]
    if old_pieces != new.convert_ids_to_tokens(new_ids):
        # differing cuts: still, the new cut spelled in old tokens is the old cut's bytes
        assert "".join(old_pieces) == "".join(new.convert_ids_to_tokens(new_ids))
        return False
    old_ids = old.convert_tokens_to_ids(old_pieces)
    with torch.no_grad():
        lo = model(torch.tensor([old_ids])).logits[0]
        ln = moved(torch.tensor([new_ids])).logits[0]
    shared = [(j, old.get_vocab()[p]) for p, j in new.get_vocab().items() if p in old.get_vocab()]
    nj, oj = torch.tensor([a for a, _ in shared]), torch.tensor([b for _, b in shared])
    torch.testing.assert_close(ln[:, nj], lo[:, oj], rtol=1e-4, atol=1e-5)
    return True


@settings(max_examples=25, deadline=None)
@given(st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789 .,$@é東", min_size=1, max_size=40))
def test_same_function_where_tokenizations_agree_fuzzed(toks, small_model, text):
    _same_function(toks, small_model, text)


def test_same_function_where_tokenizations_agree(toks, small_model):
    words = " ".join(CORPUS[:3]).split() + ["zq", "x7y", "Größe", "$9"]
    compared = sum(_same_function(toks, small_model, w) for w in words)
    assert compared >= 5, f"only {compared} of {len(words)} words cut the same way: nothing was compared"


_CACHE: dict = {}


def _moved(toks, model):
    key = id(model)
    if key not in _CACHE:
        _CACHE[key] = transplant_vocabulary(model, *toks).eval()
    return _CACHE[key]


def test_a_non_bpe_tokenizer_is_refused(toks, small_model):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    wl = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wl.pre_tokenizer = pre_tokenizers.Whitespace()
    other = PreTrainedTokenizerFast(tokenizer_object=wl, unk_token="[UNK]")
    with pytest.raises(TransplantError, match="byte-level BPE"):
        transplant_vocabulary(small_model, toks[0], other)


def test_a_tokenizer_that_is_not_the_models_is_refused(toks):
    old, new = toks
    spec = ModelSpec(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, vocab_size=300)
    too_small = build_model_for_vocab(50, spec)
    with pytest.raises(TransplantError, match="not this model's"):
        transplant_vocabulary(too_small, old, new)


def test_cli_writes_a_loadable_checkpoint_that_generates(tmp_path, toks, small_model):
    old, new = toks
    src, tokdir, out = tmp_path / "src", tmp_path / "tok", tmp_path / "out"
    old.save_pretrained(src)
    small_model.save_pretrained(src, safe_serialization=True)
    new.save_pretrained(tokdir)
    res = CliRunner().invoke(app, ["transplant-vocab", str(src), str(out), "--tokenizer", str(tokdir)])
    assert res.exit_code == 0, res.output
    tok, model = load_policy(out)
    assert len(tok) == len(new) and model.config.vocab_size == len(new)
    meta = json.loads((out / "mentorrl_transplant.json").read_text())
    assert meta["old_vocab"] == len(old) and meta["new_vocab"] == len(new) and 0 < meta["exact_share"] < 1
    ids = tok("order 77 is shipped", return_tensors="pt")["input_ids"]
    gen = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert gen.shape[1] > ids.shape[1]


def test_cli_refuses_a_missing_tokenizer_dir_and_a_bad_tokenizer(tmp_path, toks, small_model):
    old, _ = toks
    src = tmp_path / "src"
    old.save_pretrained(src)
    small_model.save_pretrained(src, safe_serialization=True)
    res = CliRunner().invoke(
        app, ["transplant-vocab", str(src), str(tmp_path / "o"), "--tokenizer", str(tmp_path / "nope")]
    )
    assert res.exit_code == 2
    too_small = build_model_for_vocab(
        50, ModelSpec(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, vocab_size=300)
    )
    bad = tmp_path / "bad"
    old.save_pretrained(bad)
    too_small.save_pretrained(bad, safe_serialization=True)
    res = CliRunner().invoke(app, ["transplant-vocab", str(bad), str(tmp_path / "o2"), "--tokenizer", str(src)])
    assert res.exit_code == 2 and "not this model's" in res.output
    assert not (tmp_path / "o2").exists()


def test_cli_refuses_dirs_that_are_not_a_checkpoint_or_a_tokenizer_and_an_out_dir_that_is_a_file(
    tmp_path, toks, small_model
):
    old, new = toks
    src, tokdir, empty = tmp_path / "src", tmp_path / "tok", tmp_path / "empty"
    old.save_pretrained(src)
    small_model.save_pretrained(src, safe_serialization=True)
    new.save_pretrained(tokdir)
    empty.mkdir()
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for args in (
        [str(empty), str(tmp_path / "o1"), "--tokenizer", str(tokdir)],
        [str(src), str(tmp_path / "o2"), "--tokenizer", str(empty)],
        [str(src), str(a_file), "--tokenizer", str(tokdir)],
    ):
        res = CliRunner().invoke(app, ["transplant-vocab", *args])
        assert res.exit_code == 2, (args, res.output, res.exception)
        assert "transplant-vocab:" in res.output
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists() and a_file.read_text() == "x"
