"""The teacher protocol's capability ladder and the local Hugging Face teacher."""

from __future__ import annotations

import copy

import pytest
import torch

from mentorrl.models.batch import collate, forward_logprobs
from mentorrl.opd.teacher import Capability, HFTeacher, MissingCapability, Teacher, require, tokenizer_fingerprint


class ApiOnly:
    name = "api-judge"
    capabilities = frozenset({Capability.SCORING, Capability.RANKING})


def test_require_names_what_is_missing_and_what_is_there():
    assert isinstance(ApiOnly(), Teacher)
    require(ApiOnly(), ["scoring"], "score-as-reward")
    with pytest.raises(MissingCapability) as e:
        require(ApiOnly(), [Capability.TOKEN_LOGPROBS, "topk_logprobs", "scoring"], "token-opd")
    msg = str(e.value)
    assert "'token-opd' needs teacher 'api-judge' to provide token_logprobs, topk_logprobs" in msg
    assert "it provides ranking, scoring" in msg
    with pytest.raises(ValueError):
        require(ApiOnly(), ["telepathy"], "x")


def test_hf_teacher_one_forward_per_trajectory_matches_the_learner(model, tokenizer, make_demos):
    _, demos = make_demos(3)
    teacher = HFTeacher(copy.deepcopy(model), tokenizer, "self")
    assert Capability.TOKEN_LOGPROBS in teacher.capabilities
    calls = []
    handle = teacher.model.register_forward_hook(lambda *a: calls.append(1))
    try:
        signals = teacher.score_batch(demos, top_k=4)
    finally:
        handle.remove()
    assert len(calls) == len(demos)  # one forward pass per trajectory
    for t, sig in zip(demos, signals):
        mask = torch.tensor(t.loss_mask) != 0
        with torch.no_grad():
            ref = forward_logprobs(model, collate([t], tokenizer.pad_token_id), 1.0)[0][0]
        assert sig.token_logprobs.shape == (len(t.token_ids),)
        assert torch.allclose(sig.token_logprobs[mask], ref[mask], atol=1e-5)
        assert sig.token_logprobs[~mask].abs().sum() == 0
        assert sig.topk_ids.shape == (len(t.token_ids), 4) and sig.topk_logprobs.shape == (len(t.token_ids), 4)
        pos = torch.nonzero(mask).flatten()
        # the sampled token's log-prob is at most the best one, and top-k is sorted
        assert (sig.topk_logprobs[pos, 0] >= sig.token_logprobs[pos] - 1e-6).all()
        assert (sig.topk_logprobs[pos, :-1] >= sig.topk_logprobs[pos, 1:]).all()
        assert torch.exp(sig.topk_logprobs[pos]).sum(-1).max() <= 1.0 + 1e-5


def test_hf_teacher_refuses_another_tokenizer(model, tokenizer):
    from mentorrl.models.build import train_tokenizer

    teacher = HFTeacher(copy.deepcopy(model), tokenizer)
    teacher.check_tokenizer(tokenizer)
    other = train_tokenizer(["hello world, order 12 shipped"] * 20, 300)
    assert tokenizer_fingerprint(other) != teacher.fingerprint
    with pytest.raises(ValueError, match="cross-tokenizer"):
        teacher.check_tokenizer(other)
    with pytest.raises(ValueError, match="temperature"):
        HFTeacher(model, tokenizer, temperature=0)


def _signals(teacher_model, tokenizer, trajs, k=8):
    t = HFTeacher(copy.deepcopy(teacher_model), tokenizer, "teacher")
    sig = t.score_batch(trajs, top_k=k)
    return [s.topk_ids for s in sig], [s.topk_logprobs for s in sig]


def test_distill_step_moves_the_student_towards_the_teacher(model, tool_happy_model, tokenizer, make_demos):
    from mentorrl.config import OptimConfig
    from mentorrl.train.learner import Learner

    _, demos = make_demos(6)
    ids, lps = _signals(tool_happy_model, tokenizer, demos)
    student = copy.deepcopy(model)
    learner = Learner(student, OptimConfig(lr=3e-3, micro_batch_size=4), tokenizer.pad_token_id)
    first = learner.distill_step(demos, ids, lps, "reverse")["distill_loss"]
    for _ in range(15):
        last = learner.distill_step(demos, ids, lps, "reverse")["distill_loss"]
    assert first > 0.05 and last < 0.5 * first, (first, last)
    # a teacher identical to the student: nothing to distil
    same_ids, same_lps = _signals(student, tokenizer, demos)
    assert learner.distill_step(demos, same_ids, same_lps, "forward")["distill_loss"] < 1e-5


def test_distill_step_is_exact_whatever_the_micro_batching(model, tool_happy_model, tokenizer, make_demos):
    from mentorrl.config import OptimConfig
    from mentorrl.train.learner import Learner

    _, demos = make_demos(5)
    ids, lps = _signals(tool_happy_model, tokenizer, demos, k=4)
    weights = [torch.linspace(0.0, 2.0, len(t.token_ids)) for t in demos]  # e.g. ShortOPD / MOPD step weights
    results = []
    for mbs in (1, 5):
        student = copy.deepcopy(model)
        learner = Learner(
            student, OptimConfig(lr=1e-3, micro_batch_size=mbs, max_grad_norm=1e9), tokenizer.pad_token_id
        )
        m = learner.distill_step(demos, ids, lps, "jsd", beta=0.3, token_weights=weights)
        grads = [p.grad.detach().clone() for p in student.parameters() if p.grad is not None]
        results.append((m["distill_loss"], m["grad_norm"], grads))
    (l1, g1, p1), (l5, g5, p5) = results
    assert l1 == pytest.approx(l5, rel=1e-5) and g1 == pytest.approx(g5, rel=1e-4)
    assert len(p1) == len(p5) > 0
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(p1, p5))  # the same gradient
    with pytest.raises(ValueError, match="no policy token"):
        Learner(copy.deepcopy(model), OptimConfig(), tokenizer.pad_token_id).distill_step(
            demos, ids, lps, token_weights=[torch.zeros(len(t.token_ids)) for t in demos]
        )
