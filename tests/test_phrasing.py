"""The compositional wording generator (envs/orders/phrasing.py): surface-form counts, the
held-out combination rule, a shared vocabulary, slots copied exactly, and speed."""

from __future__ import annotations

import random
import re
import time

from mentorrl.envs.orders import ADVERSARIAL, FAMILIES, OrdersTasks
from mentorrl.envs.orders.phrasing import (
    FRAMES,
    HELDOUT_MOD,
    NOVEL_ONLY_WORDS,
    abstract_forms,
    add_typo,
    compose,
    intents,
    is_heldout_pair,
    pairs,
)

TASKS = OrdersTasks()
KINDS = [(f, "normal") for f in FAMILIES] + list(ADVERSARIAL)
_WORDS = re.compile(r"[a-z']+")


def _words(template: str) -> set[str]:
    return set(_WORDS.findall(re.sub(r"\{\w+\}", " ", template).lower()))


def test_at_least_200_train_surface_forms_per_family_and_kind():
    for family, kind in KINDS:
        n = len(abstract_forms(family, kind, "train", 3000, typos=False))  # typos not counted
        assert n >= 200, (family, kind, n)
        assert len(abstract_forms(family, kind, "heldout", 3000)) >= 100, (family, kind)


def test_heldout_rule_partitions_pairs_and_keeps_every_intent_and_frame_in_both():
    for family, kind in KINDS:
        train, held = pairs(family, kind, False), pairs(family, kind, True)
        n = len(intents(family, kind))
        assert len(train) + len(held) == n * len(FRAMES) and not set(train) & set(held)
        assert all((i + f) % HELDOUT_MOD == 0 for i, f in held)
        for group in (train, held):  # vocabulary shared: every intent and frame occurs in both groups
            assert {i for i, _ in group} == set(range(n)) and {f for _, f in group} == set(range(len(FRAMES)))


def test_no_train_prompt_uses_a_heldout_combination_and_every_heldout_prompt_does():
    train = TASKS.tasks("train", 1500, 0) + TASKS.tasks("golden", 84, 0)
    held = TASKS.tasks("heldout", 500, 0) + TASKS.tasks("hidden", 500, 0)
    for t in train:
        w = t.reference["wording"]
        assert not is_heldout_pair(w["intent"], w["frame"]) and not w["heldout"], t.prompt
    for t in held:
        w = t.reference["wording"]
        assert is_heldout_pair(w["intent"], w["frame"]) and w["heldout"], t.prompt


def test_all_splits_share_the_vocabulary():
    rng = random.Random(1)
    train_words: set[str] = set()
    for _ in range(20000):
        family, kind = rng.choice(KINDS)
        r = random.Random(rng.random())
        tpl, _ = compose(family, kind, r, "train")
        train_words |= _words(tpl)
    # typo-free held-out prompts (a typo can make a word of its own)
    held_words: set[str] = set()
    for _ in range(5000):
        family, kind = rng.choice(KINDS)
        tpl, w = compose(family, kind, random.Random(rng.random()), "heldout", typo_rate=0.0)
        held_words |= _words(tpl)
        # the recorded intent and frame are the ones the prompt was built from
        act = intents(family, kind)[w["intent"]]
        assert act.split("{")[0].strip().lower() in tpl.lower(), (tpl, act)
        frame_head = FRAMES[w["frame"]].split("{")[0].strip()
        assert not frame_head or frame_head in tpl, (tpl, frame_head)
    assert held_words <= train_words, sorted(held_words - train_words)


def test_novel_words_only_in_the_novel_wording_split():
    pattern = re.compile(r"\b(?:" + "|".join(re.escape(w) for w in NOVEL_ONLY_WORDS) + r")\b", re.I)
    for split in ("train", "heldout", "hidden", "golden"):
        for t in TASKS.tasks(split, 400, 1):
            assert not pattern.search(t.prompt), (split, t.prompt)
    novel = TASKS.tasks("novel_wording", 400, 1)
    assert sum(bool(pattern.search(t.prompt)) for t in novel) > 100


def test_slots_are_copied_exactly():  # (a product may be pluralised with a final "s", as before)
    for split in ("train", "heldout", "hidden", "golden", "novel_wording"):
        for t in TASKS.tasks(split, 300, 2):
            req = t.reference["request"]
            for key in ("email", "order_id", "address", "product"):
                if key in req:
                    assert re.search(r"(?<![\w.@-])" + re.escape(str(req[key])) + r"s?(?![\w@-])", t.prompt), (
                        key,
                        req[key],
                        t.prompt,
                    )
            if "amount" in req:
                amt = req["amount"]
                text = f"{amt:.0f}" if float(amt).is_integer() else f"{amt:.2f}"
                assert f"${text}" in t.prompt, t.prompt
            if "quantity" in req:
                assert re.search(rf"\b{req['quantity']}\b", t.prompt), t.prompt


def test_typos_are_light_and_never_touch_slots():
    rng = random.Random(3)
    tpl = "Hello. I'm {email}. Please refund ${amt} on order {oid}. Thanks a lot."
    for _ in range(300):
        out = add_typo(tpl, rng)
        assert out != tpl
        assert re.findall(r"\{\w+\}|\$", out) == re.findall(r"\{\w+\}|\$", tpl)
        assert abs(len(out) - len(tpl)) <= 1
    assert add_typo("{oid} {email}", rng) == "{oid} {email}"


def test_golden_is_clean_and_cycles_train_pairs():
    golden = TASKS.tasks("golden", 3 * 21, 0)
    for t in golden:
        w = t.reference["wording"]
        assert not w["heldout"]
    first, second = golden[0].reference["wording"], golden[21].reference["wording"]
    assert (first["intent"], first["frame"]) != (second["intent"], second["frame"])
    assert first["position"] != second["position"]


def test_generation_stays_fast():
    t0 = time.perf_counter()
    tasks = TASKS.tasks("train", 3000, 5)
    assert len(tasks) == 3000
    assert time.perf_counter() - t0 < 10.0
