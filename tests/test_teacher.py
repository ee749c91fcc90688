"""The teacher protocol's capability ladder and the local Hugging Face teacher."""

from __future__ import annotations

import copy

import pytest
import torch

from mentorrl.opd.teacher import Capability, HFTeacher, MissingCapability, Teacher, require, tokenizer_fingerprint
from mentorrl.train.batch import collate, forward_logprobs


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
