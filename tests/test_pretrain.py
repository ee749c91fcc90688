"""Pretraining the tiny base model on the environment's language (mentorrl.models.pretrain)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_SPEC
from safetensors.torch import load_file
from typer.testing import CliRunner

from mentorrl.cli import app
from mentorrl.contract import PAD
from mentorrl.envs.orders.tasks import SEED_BASE, OrdersTasks
from mentorrl.models.build import ModelSpec, build_model, load_policy
from mentorrl.models.pretrain import (
    PretrainSpec,
    batch_order,
    build_corpus,
    heldout_transcripts,
    mean_token_loss,
    pack,
    pretrain,
    separator_id,
)
from mentorrl.train.models_init import build_tiny_model

SMALL = dict(transcripts=150, worlds=30, eval_transcripts=0)


@pytest.fixture(scope="module")
def corpus(orders_entry, tokenizer):
    return build_corpus(orders_entry, "orders", tokenizer, PretrainSpec(**SMALL))


def test_corpus_is_train_only_and_has_every_kind(corpus, tokenizer):
    assert set(corpus.kinds) == {"transcript", "schema", "free_text", "tool_session", "chained_session"}
    assert corpus.world_seeds and all(SEED_BASE["train"] <= s < SEED_BASE["heldout"] for s in corpus.world_seeds)
    assert corpus.task_ids and all(t.startswith("orders-train-") for t in corpus.task_ids)
    text = "\n".join(tokenizer.decode(d, skip_special_tokens=False) for d in corpus.docs)
    source = OrdersTasks()
    train = source.tasks("train", 150, seed=PretrainSpec().seed + 7_919)
    assert sum(t.prompt in text for t in train) == len(train)  # the check below can fire
    for split in ("heldout", "hidden"):
        leaked = [t.prompt for t in source.tasks(split, 300, seed=0) if t.prompt in text]
        assert not leaked, f"{split} prompts in the pretraining corpus: {leaked[:3]}"
    for phrase in ("void order", "call it off", "invoice", "credit me", "return $"):  # held-out-only wording
        assert phrase not in text


def test_corpus_is_deterministic(orders_entry, tokenizer, corpus):
    again = build_corpus(orders_entry, "orders", tokenizer, PretrainSpec(**SMALL))
    assert again.docs == corpus.docs and again.kinds == corpus.kinds
    other = build_corpus(orders_entry, "orders", tokenizer, PretrainSpec(**{**SMALL, "seed": 1}))
    assert other.docs != corpus.docs


def test_packing_gives_full_blocks_separated_by_eos(tokenizer):
    sep = separator_id(tokenizer)
    assert tokenizer.convert_ids_to_tokens(sep) == PAD
    docs = [list(range(1, 1 + n)) for n in (5, 9, 3, 14, 7, 2, 11)]
    blocks = pack(docs, 8, sep, seed=0)
    total = sum(len(d) + 1 for d in docs)
    assert blocks.shape == (total // 8, 8)  # full blocks only; the tail is dropped
    stream = blocks.flatten().tolist()
    # the stream is the documents in a shuffled order, each followed by one separator
    pieces, cur = [], []
    for t in stream:
        if t == sep:
            pieces.append(cur)
            cur = []
        else:
            cur.append(t)
    assert all(p in docs for p in pieces) and len(set(map(tuple, pieces))) == len(pieces)
    assert sum(len(p) + 1 for p in pieces) + len(cur) == len(stream)
    assert torch.equal(pack(docs, 8, sep, seed=0), blocks)
    assert not torch.equal(pack(docs, 8, sep, seed=1), blocks)
    with pytest.raises(ValueError, match="shorter than one block"):
        pack([[1, 2]], 8, sep, seed=0)


def test_batch_order_covers_every_block_each_epoch():
    order = batch_order(10, 5, 4, seed=3)
    flat = [i for b in order for i in b]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))
    assert order == batch_order(10, 5, 4, seed=3)


def _build(orders_entry, path, steps):
    return build_tiny_model(
        orders_entry,
        path,
        ModelSpec(**TINY_SPEC),
        corpus_tasks=60,
        pretrain=PretrainSpec(steps=steps, batch_size=4, block_size=128, **SMALL),
    )


def test_same_seed_same_weights(orders_entry, tmp_path):
    a, b = _build(orders_entry, tmp_path / "a", 5), _build(orders_entry, tmp_path / "b", 5)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    fresh = _build(orders_entry, tmp_path / "fresh", 0)
    wa, wf = load_file(a / "model.safetensors"), load_file(fresh / "model.safetensors")
    assert any(not torch.equal(wa[k], wf[k]) for k in wa)  # the 5 steps changed the weights
    rec = json.loads((a / "mentorrl_build.json").read_text())
    assert rec["config"]["pretrain"]["steps"] == 5 and len(rec["config_hash"]) == 16
    assert rec["pretrain"]["corpus"]["blocks"] > 0 and rec["pretrain"]["loss_curve"][-1]["step"] == 5
    assert json.loads((fresh / "mentorrl_build.json").read_text())["config_hash"] != rec["config_hash"]
    assert "pretrain" not in json.loads((fresh / "mentorrl_build.json").read_text())


def test_no_pretraining_builds_todays_model(orders_entry, tiny_model_dir, tmp_path):
    """steps 0 (the default) is the build every existing caller gets: same tokenizer, same weights."""
    path = _build(orders_entry, tmp_path / "m", 0)
    assert (path / "model.safetensors").read_bytes() == (tiny_model_dir / "model.safetensors").read_bytes()
    assert (path / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()


def test_pretraining_lowers_heldout_transcript_loss(orders_entry, tokenizer):
    torch.manual_seed(0)
    spec = PretrainSpec(steps=30, batch_size=4, block_size=256, lr=3e-3, warmup_steps=5, **SMALL)
    corpus = build_corpus(orders_entry, "orders", tokenizer, spec)
    blocks = pack(corpus.docs, spec.block_size, separator_id(tokenizer), spec.seed)
    evals = heldout_transcripts(orders_entry, tokenizer, 16)
    fresh = build_model(tokenizer, ModelSpec(**TINY_SPEC))
    trained = build_model(tokenizer, ModelSpec(**TINY_SPEC))
    curve = pretrain(trained, blocks, spec)
    pad = separator_id(tokenizer)
    before, after = mean_token_loss(fresh, evals, pad), mean_token_loss(trained, evals, pad)
    assert curve[-1]["loss"] < curve[0]["loss"]
    assert after < before - 1.0, (before, after)


def test_cli_init_model_pretrain_steps(tmp_path):
    out = tmp_path / "m"
    args = [
        "init-model",
        str(out),
        "--pretrain-steps",
        "2",
        "--set",
        "model.tokenizer_corpus_tasks=40",
        "--set",
        "model.pretrain.transcripts=40",
        "--set",
        "model.pretrain.worlds=5",
        "--set",
        "model.pretrain.eval_transcripts=0",
        "--set",
        "model.pretrain.block_size=64",
        "--set",
        "model.spec.vocab_size=500",
        "--set",
        "model.spec.hidden_size=32",
        "--set",
        "model.spec.intermediate_size=64",
        "--set",
        "model.spec.num_layers=1",
    ]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    rec = json.loads((out / "mentorrl_build.json").read_text())
    assert rec["config"]["pretrain"]["steps"] == 2 and rec["config"]["prompt"]["system_turn"] is False
    assert len(rec["pretrain"]["loss_curve"]) == 1
    tok, model = load_policy(out)  # the ordinary from_pretrained path
    assert model.config.vocab_size == len(tok)


def test_chained_sessions_copy_what_the_note_and_the_observations_said():
    """A chained session's calls reuse the e-mail of its opening note and the customer id that
    find_customer returned: the corpus teaches copying identifiers across prose, JSON and tool output."""
    import random
    import re

    from mentorrl.models.domain_text import _orders_chained_session

    chained = 0
    for i in range(40):
        text = "".join(str(p) for p in _orders_chained_session(SEED_BASE["train"] + i, random.Random(i)))
        note = text.split("\n", 1)[0]
        email = re.search(r"[\w.]+@[\w.]+\w", note).group(0)
        calls = [json.loads(m) for m in re.findall(r"<tool_call>(.*?)</tool_call>", text)]
        assert calls[0] == {"name": "find_customer", "arguments": {"email": email}}
        found = re.search(r'"customer_id": "(C-\d+)", "name"', text)
        if found is None:
            assert len(calls) == 1  # not found: the session stops there
            continue
        chained += len(calls) > 1
        for c in calls[1:]:
            if "customer_id" in c["arguments"]:
                assert c["arguments"]["customer_id"] == found.group(1)
    assert chained > 20


def test_corpus_versions_2_4_and_5_stay_reproducible():
    """Version 2's documents (the default, and the base shipped until version 4) are pinned by a digest
    taken before version 3 existed, version 4's by one taken when it shipped, and version 5's (the
    shipped base's) likewise; the default build config hashes as before."""
    import hashlib
    import random

    from mentorrl.models.domain_text import orders_domain_text

    docs, _ = orders_domain_text(random.Random("pin"), 12)
    assert (
        hashlib.sha256(repr([(k, [str(p) for p in ps]) for k, ps in docs]).encode()).hexdigest()[:16]
        == "6c05ccae7007fed8"
    )
    assert orders_domain_text(random.Random("pin"), 12, 2) == orders_domain_text(random.Random("pin"), 12)
    v4_docs, _ = orders_domain_text(random.Random("pin"), 12, 4)
    assert (
        hashlib.sha256(repr([(k, [str(p) for p in ps]) for k, ps in v4_docs]).encode()).hexdigest()[:16]
        == "960724bc9a090752"
    )
    v5_docs, _ = orders_domain_text(random.Random("pin"), 12, 5)
    assert (
        hashlib.sha256(repr([(k, [str(p) for p in ps]) for k, ps in v5_docs]).encode()).hexdigest()[:16]
        == "7f89d00e76e8cbfc"
    )
    from mentorrl.train.models_init import build_config

    base = build_config("orders", ModelSpec(), 400, 0, None, PretrainSpec(steps=10))
    assert base["corpus_version"] == 2 and "corpus_version" not in base["pretrain"]
    v3 = build_config("orders", ModelSpec(), 400, 0, None, PretrainSpec(steps=10, corpus_version=3))
    assert v3["corpus_version"] == 3 and {**v3, "corpus_version": 2} == base
    with pytest.raises(ValueError):
        PretrainSpec(corpus_version=6)


def test_version_3_sessions_copy_the_notes_amount_and_address_into_the_write():
    """Every version-3 session whose note names a sum or an address, and whose customer is found, makes
    a write that copies one of them exactly, and its closing line quotes what the write returned."""
    import random
    import re

    from mentorrl.models.domain_text import _orders_chained_session

    copied = {"issue_refund": 0, "update_address": 0}
    for i in range(120):
        text = "".join(str(p) for p in _orders_chained_session(SEED_BASE["train"] + i, random.Random(i), 3))
        note = text.split("\n", 1)[0]
        amount = re.search(r"\$(\d+(?:\.\d\d)?)", note)
        addr = re.search(r"(\d+ [A-Z]\w+ (?:St|Ave|Rd|Ln|Dr), [A-Z]\w+)", note)
        calls = [json.loads(m) for m in re.findall(r"<tool_call>(.*?)</tool_call>", text)]
        if (amount is None and addr is None) or len(calls) == 1:  # nothing named, or the e-mail was unknown
            continue
        writes = [c for c in calls if c["name"] in copied]
        assert len(writes) == 1, text
        w = writes[0]
        if w["name"] == "issue_refund":
            assert w["arguments"]["amount"] == float(amount.group(1))
        else:
            assert w["arguments"]["address"] == addr.group(1)
        copied[w["name"]] += 1
        after = text.split(json.dumps(w))[1]
        observation = after.split("tool\n", 1)[1].split("<|im_end|>", 1)[0]
        closing = text.rsplit("\n", 1)[1]
        if observation.startswith("{"):  # the write went through: the closing line quotes its result
            result = json.loads(observation)
            quoted = (
                f"${w['arguments']['amount']:.2f}".replace(".00", "")
                if w["name"] == "issue_refund"
                else result["address"]
            )
            assert quoted in closing, (closing, observation)
        else:
            assert observation.startswith("error:") and "paid back" not in closing and "now at" not in closing
    assert min(copied.values()) >= 10, copied


def test_version_4_is_version_3_plus_echoes_that_repeat_a_run_of_values_exactly():
    """Version 4 adds echo documents and changes nothing else in a world's documents: every echo's
    later lines repeat the first line whole or from one of its items on, character for character."""
    import random

    from mentorrl.models.domain_text import ECHO_LEADS, orders_domain_text

    v3, seeds3 = orders_domain_text(random.Random("v4"), 1, 3)
    v4, seeds4 = orders_domain_text(random.Random("v4"), 1, 4)
    assert seeds3 == seeds4 and v4[: len(v3)] == v3  # the first world's documents are version 3's
    echoes = [ps for k, ps in orders_domain_text(random.Random("e"), 60, 4)[0] if k == "echo"]
    assert len(echoes) == 120
    partial = 0
    for (text,) in echoes:
        first, *again = text.split("\n")
        assert again and len(again) <= 2
        for line in again:
            lead = next(ld for ld in ECHO_LEADS if line.startswith(ld + " "))
            copy = line[len(lead) + 1 :]
            assert first.endswith(copy) and copy.strip(), (first, line)
            partial += copy != first
    assert partial > 10


def test_version_5_is_version_4_plus_copy_drills_whose_call_uses_the_named_value_not_the_on_file_one():
    """Version 5 adds copy drills and more echo documents after a world's version-4 documents and
    changes nothing else. Each drill names a value beside an on-file one of the same kind; its tool
    call carries the named value (a product name in either case as the note wrote it), never the
    on-file one when they differ."""
    import json
    import random

    from mentorrl.contract import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
    from mentorrl.models.domain_text import COPY_DRILLS_PER_WORLD, DRILL_ON_FILE, ECHO_EXTRA_V5, orders_domain_text

    v4, seeds4 = orders_domain_text(random.Random("v5"), 1, 4)
    v5, seeds5 = orders_domain_text(random.Random("v5"), 1, 5)
    assert seeds4 == seeds5 and v5[: len(v4)] == v4
    assert [k for k, _ in v5[len(v4) :]] == ["copy_drill"] * COPY_DRILLS_PER_WORLD + ["echo"] * ECHO_EXTRA_V5
    drills = [ps for k, ps in orders_domain_text(random.Random("d"), 80, 5)[0] if k == "copy_drill"]
    assert len(drills) == 240
    seen = set()
    for ps in drills:
        text = "".join(str(p) for p in ps)
        note = text.split("\n", 1)[0]
        call = json.loads(text.split(TOOL_CALL_OPEN, 1)[1].split(TOOL_CALL_CLOSE, 1)[0])
        name, args = call["name"], call["arguments"]
        seen.add(name)
        on_file = next(filter(None, (_drill_slot(note, f) for f in DRILL_ON_FILE)))
        if name == "update_address":
            assert args["address"] in note and args["address"] != on_file
        elif name == "check_inventory":
            assert args["product"].lower() in note.lower()
            assert args["product"] != on_file
        else:
            assert name == "issue_refund" and (f"${args['amount']:.0f} " in note or f"${args['amount']:.0f}." in note)
    assert seen == {"update_address", "check_inventory", "issue_refund"}


def _drill_slot(note: str, frame: str) -> str | None:
    """The ``{old}`` value of ``frame`` when ``note`` contains it (a frame ends its sentence)."""
    import re

    head, tail = (re.escape(x) for x in frame.split("{old}"))
    m = re.search(f"{head}(.+?){tail}(?: |$)", note)
    return m.group(1) if m else None
