"""Teacher signals on student trajectories: same-tokenizer token chunks, cross-tokenizer chunks
(one teacher pass + prefix sums), special tokens and the sequence-level fallback's re-tokenisation."""

from __future__ import annotations

import copy

import pytest
import torch

from mentorrl.algos.distill import sampled_reverse_kl_advantage
from mentorrl.contract import IM_END, TOOL_CALL_OPEN
from mentorrl.models.build import ModelSpec, load_policy
from mentorrl.opd import AlignmentError, HFTeacher
from mentorrl.opd.retokenize import retokenize
from mentorrl.opd.signals import (
    CrossTokenizerTeacher,
    chunk_advantages,
    same_tokenizer_signal,
    sampled_token_ends,
    student_chunk_logprobs,
)


@pytest.fixture(scope="module")
def demos(make_demos):
    contract, trajs = make_demos(12, seed=5)
    # give the "student" log-probs something non-trivial to subtract
    for i, t in enumerate(trajs):
        t.logprobs = [(-0.1 - 0.01 * ((i + j) % 7)) if m else 0.0 for j, m in enumerate(t.loss_mask)]
    return contract, trajs


@pytest.fixture(scope="module")
def other(orders_entry, tmp_path_factory):
    """A teacher with its own tokenizer (another vocabulary size, so other merges) and model."""
    from mentorrl.train.models_init import build_tiny_model

    path = tmp_path_factory.mktemp("other") / "model"
    spec = ModelSpec(
        hidden_size=48, intermediate_size=96, num_layers=2, num_heads=2, num_kv_heads=1, vocab_size=450, seed=7
    )
    build_tiny_model(orders_entry, path, spec, corpus_tasks=40, seed=3)
    return load_policy(path)


def test_same_tokenizer_chunks_are_tokens_and_reproduce_the_sampled_estimator(demos, policy):
    tok, model = policy
    teacher = HFTeacher(copy.deepcopy(model), tok)
    for t in demos[1][:4]:
        sig = same_tokenizer_signal(teacher, t)
        assert sig.num_chunks == t.num_policy_tokens
        adv = chunk_advantages(sig, torch.tensor(t.logprobs))
        want = sampled_reverse_kl_advantage(
            torch.tensor(t.logprobs), teacher.score(t).token_logprobs, torch.tensor(t.loss_mask)
        )
        assert torch.allclose(adv, want, atol=1e-6)


def test_cross_teacher_with_the_students_own_tokenizer_reduces_to_token_level(demos, policy):
    """Re-tokenising canonical text with the same tokenizer gives back the student's ids: every chunk is
    one token and the chunk log-probs equal the same-tokenizer path's."""
    tok, model = policy
    same = HFTeacher(copy.deepcopy(model), tok)
    cross = CrossTokenizerTeacher(copy.deepcopy(model), tok, tok)
    for t in demos[1][:4]:
        ids, _, _ = cross.alignment(t)
        assert ids == t.token_ids
        a, b = cross.score(t), same_tokenizer_signal(same, t)
        assert torch.equal(a.chunk_of, b.chunk_of)
        assert (a.teacher_lp - b.teacher_lp).abs().max() < 1e-5


def test_cross_tokenizer_chunks_cover_policy_tokens_and_match_one_forward_per_chunk(demos, policy, other):
    tok, _ = policy
    t_tok, t_model = other
    assert t_tok.get_vocab() != tok.get_vocab()
    cross = CrossTokenizerTeacher(t_model, t_tok, tok)
    merged = 0
    for t in demos[1][:6]:
        t_ids, chunk_of, bounds = cross.alignment(t)
        mask = torch.tensor(t.loss_mask, dtype=torch.bool)
        assert bool((chunk_of[mask] >= 0).all()) and bool((chunk_of[~mask] == -1).all())
        assert len(set(chunk_of[mask].tolist())) == len(bounds)
        # each chunk is the same text on both sides
        for k, (lo, hi) in enumerate(bounds):
            s_idx = (chunk_of == k).nonzero().flatten().tolist()
            assert s_idx == list(range(s_idx[0], s_idx[-1] + 1))
            s_text = tok.decode([t.token_ids[i] for i in s_idx])
            assert s_text == t_tok.decode(t_ids[lo:hi])
            merged += len(s_idx) > 1 or hi - lo > 1
        sig = cross.score(t)
        with torch.no_grad():  # reference: one teacher forward per chunk
            for k, (lo, hi) in enumerate(bounds):
                lp = torch.log_softmax(t_model(input_ids=torch.tensor([t_ids[:hi]])).logits[0].double(), -1)
                want = sum(lp[j - 1, t_ids[j]].item() for j in range(lo, hi))
                assert abs(sig.teacher_lp[k].item() - want) < 1e-4
    assert merged > 0  # the tokenizations really differ somewhere


def test_vocab_map_pairs_tokens_that_spell_the_same_text(policy, other):
    from mentorrl.opd.signals import vocab_map

    tok, _ = policy
    t_tok, _ = other
    same = vocab_map(tok, tok)
    plain = [i for i in range(len(tok)) if same[i] >= 0]
    assert all(same[i] == i for i in plain)
    # every ordinary token that spells whole characters maps to itself (only lone bytes of a
    # multi-byte character, which decode to U+FFFD, have no spelling)
    whole = [i for i in range(len(tok)) if i not in tok.all_special_ids and "\ufffd" not in tok.decode([i])]
    texts = [tok.decode([i]) for i in whole]
    assert [i for i, x in zip(whole, texts) if texts.count(x) == 1] == [
        i for i in plain if i not in tok.all_special_ids
    ]
    m = vocab_map(t_tok, tok)
    hits = (m >= 0).nonzero().flatten().tolist()
    assert 0 < len(hits) < len(t_tok)
    for i in hits:
        if i not in t_tok.all_special_ids:
            assert t_tok.decode([i]) == tok.decode([int(m[i])])
    assert m[t_tok.convert_tokens_to_ids(IM_END)] == tok.convert_tokens_to_ids(IM_END)


def test_cross_teacher_topk_on_one_to_one_chunks_matches_the_teachers_own_distribution(demos, policy, other):
    """Top-k targets exist exactly where a chunk is one token on both sides; there they are the
    teacher's most likely student-spellable next tokens, with the log-probs of one teacher forward
    per position; with the student's own tokenizer they are the same-tokenizer top-k everywhere."""
    tok, model = policy
    t_tok, t_model = other
    cross = CrossTokenizerTeacher(t_model, t_tok, tok)
    covered = 0
    for t in demos[1][:4]:
        sig, top = cross.score(t, top_k=5)
        t_ids, chunk_of, bounds = cross.alignment(t)
        assert torch.equal(sig.chunk_of, chunk_of)
        sizes = torch.bincount(chunk_of[chunk_of >= 0], minlength=len(bounds))
        for pos in range(len(t.token_ids)):
            c = int(chunk_of[pos])
            one = c >= 0 and sizes[c] == 1 and bounds[c][1] - bounds[c][0] == 1
            assert bool(top.topk_mask[pos]) == one
            if not one:
                continue
            covered += 1
            j = bounds[c][0]
            with torch.no_grad():
                lp = torch.log_softmax(t_model(input_ids=torch.tensor([t_ids[:j]])).logits[0, -1].double(), -1)
            spell = cross.to_student
            want = lp.masked_fill(spell < 0, float("-inf")).topk(5)
            assert top.topk_ids[pos].tolist() == spell[want.indices].tolist()
            assert (top.topk_logprobs[pos].double() - want.values).abs().max() < 1e-4
    assert 0 < covered < sum(t.num_policy_tokens for t in demos[1][:4])  # some chunks merge tokens
    same = HFTeacher(copy.deepcopy(model), tok)
    own = CrossTokenizerTeacher(copy.deepcopy(model), tok, tok)
    for t in demos[1][:3]:
        _, top = own.score(t, top_k=4)
        ref = same.score(t, top_k=4)
        mask = torch.tensor(t.loss_mask, dtype=torch.bool)
        assert torch.equal(top.topk_mask, mask)
        spellable = mask & (own.to_student[ref.topk_ids] >= 0).all(-1)  # (a few tokens decode to part of a character)
        # not vacuous: an untrained tiny model puts lone bytes of multi-byte characters (128 of its
        # 600 tokens, never spellable) in its top 4 often, so about (472/600)^4 of positions qualify
        assert spellable.sum() >= 0.2 * mask.sum()
        assert torch.equal(top.topk_ids[spellable], ref.topk_ids[spellable])
        assert (top.topk_logprobs[spellable] - ref.topk_logprobs[spellable]).abs().max() < 1e-5


def test_chunk_advantage_flows_to_every_token_of_the_chunk():
    from mentorrl.opd.signals import ChunkSignal

    sig = ChunkSignal(torch.tensor([-1, 0, 0, 1, -1, 2]), torch.tensor([-1.0, -0.5, -2.0], dtype=torch.float64), 9)
    student = torch.tensor([0.0, -0.25, -0.25, -1.0, 0.0, -0.5])
    assert torch.allclose(
        student_chunk_logprobs(student, sig.chunk_of, 3), torch.tensor([-0.5, -1.0, -0.5], dtype=torch.float64)
    )
    assert torch.allclose(chunk_advantages(sig, student), torch.tensor([0.0, -0.5, -0.5, 0.5, 0.0, -1.5]))


def test_non_canonical_sampled_tokens_align_by_their_own_ends(tokenizer):
    text = "cancel order 12345"
    canon = tokenizer.encode(text, add_special_tokens=False)
    # spell the first word one byte-token at a time: not how the tokenizer would encode it
    spelled = [tokenizer.convert_tokens_to_ids(c) for c in "cancel"] + tokenizer.encode(
        " order 12345", add_special_tokens=False
    )
    assert spelled != canon and tokenizer.decode(spelled) == text
    ends = sampled_token_ends(tokenizer, spelled, text)
    assert ends[:6] == [1, 2, 3, 4, 5, 6] and ends[-1] == len(text)


def test_missing_special_token_is_a_clear_alignment_error(demos, policy, other):
    tok, _ = policy
    t_tok, t_model = other
    cross = CrossTokenizerTeacher(t_model, t_tok, tok, special_tokens={TOOL_CALL_OPEN: "<|no such token|>"})
    with_call = next(t for t in demos[1] if TOOL_CALL_OPEN in tok.decode(t.token_ids))
    with pytest.raises(AlignmentError, match="no special token '<\\|no such token\\|>'"):
        cross.score(with_call)


def test_special_token_map_reaches_the_teachers_own_spelling(demos, policy, other):
    tok, _ = policy
    t_tok, t_model = other
    plain = CrossTokenizerTeacher(t_model, t_tok, tok)
    mapped = CrossTokenizerTeacher(t_model, t_tok, tok, special_tokens={IM_END: "<|endoftext|>"})
    t = demos[1][0]
    a, _, _ = plain.alignment(t)
    b, _, _ = mapped.alignment(t)
    im_end, eot = t_tok.convert_tokens_to_ids(IM_END), t_tok.convert_tokens_to_ids("<|endoftext|>")
    assert a.count(im_end) == b.count(eot) > 0 and im_end not in b


def test_retokenize_carries_text_roles_and_masks(demos, policy, other, orders_entry, make_contract):
    """The sequence-level fallback: a trajectory in the teacher's tokens becomes an SFT target in the student's."""
    tok, _ = policy
    t_tok, _ = other
    t_contract = make_contract(tok=t_tok, max_turns=8, max_total_tokens=2048)
    env = orders_entry.make_env()
    try:
        task = orders_entry.make_tasks().tasks("train", 3, 11)[0]
        from mentorrl.rollout.episode import run_scripted_episode

        t_traj = run_scripted_episode(t_contract, env, task, orders_entry.make_expert())
    finally:
        env.close()
    s_contract = demos[0]
    s_traj = retokenize(t_traj, t_tok, s_contract)
    assert s_traj.source == "teacher" and s_traj.contract_fingerprint == s_contract.fingerprint()
    assert t_tok.decode(t_traj.token_ids) == tok.decode(s_traj.token_ids)
    for a, b in zip(t_traj.segments, s_traj.segments):
        assert a.role == b.role
        assert t_tok.decode(t_traj.token_ids[a.start : a.end]) == tok.decode(s_traj.token_ids[b.start : b.end])
        assert set(s_traj.loss_mask[b.start : b.end]) == {1 if b.role == "policy" else 0}
    assert all(lp == 0.0 for lp in s_traj.logprobs)
    # and it equals the student's own rendering of the same expert episode
    env = orders_entry.make_env()
    try:
        from mentorrl.rollout.episode import run_scripted_episode

        direct = run_scripted_episode(s_contract, env, task, orders_entry.make_expert())
    finally:
        env.close()
    assert s_traj.token_ids == direct.token_ids and s_traj.loss_mask == direct.loss_mask
