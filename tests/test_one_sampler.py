"""One top-p cut: rollouts (rollout/sampling.sample_tokens) and `mentorrl serve` (serve.RowSampler)
keep the same tokens, also when the mass before a token equals top_p exactly (a tie at the cut)."""

from __future__ import annotations

import math

import torch

from mentorrl.contract import SamplingParams
from mentorrl.rollout.sampling import nucleus, sample_tokens
from mentorrl.serve import RowSampler


def _tied_logits() -> tuple[torch.Tensor, float]:
    """Logits over 6 tokens and a top_p equal to the mass of the two most likely ones, bit for bit."""
    logits = torch.tensor([[math.log(p) for p in (0.4, 0.3, 0.15, 0.1, 0.03, 0.02)]], dtype=torch.float32)
    sorted_lp = torch.sort(torch.log_softmax(logits, -1), -1, descending=True).values
    top_p = float(sorted_lp.softmax(-1).cumsum(-1)[0, 1])  # mass before the third token, exactly
    return logits, top_p


def _rollout_support(logits: torch.Tensor, top_p: float, draws: int = 400) -> set[int]:
    params = SamplingParams(temperature=1.0, top_p=top_p, top_k=0)
    gens = [torch.Generator().manual_seed(i) for i in range(draws)]
    tokens, _ = sample_tokens(logits.expand(draws, -1), params, gens)
    return set(tokens.tolist())


def _serve_support(logits: torch.Tensor, top_p: float) -> set[int]:
    sampler = RowSampler([1.0], [top_p], [torch.Generator().manual_seed(0)], device="cpu")
    out = sampler(None, logits.clone())
    return set(torch.isfinite(out[0]).nonzero().flatten().tolist())


def test_both_paths_keep_the_same_tokens_on_a_tie_at_the_cut():
    logits, top_p = _tied_logits()
    kept = set(torch.isfinite(nucleus(torch.log_softmax(logits, -1), top_p)[0]).nonzero().flatten().tolist())
    assert kept == {0, 1, 2}  # the token whose preceding mass equals top_p stays (it crosses top_p)
    assert _serve_support(logits, top_p) == kept
    assert _rollout_support(logits, top_p) == kept


def test_both_paths_agree_off_the_tie():
    logits, top_p = _tied_logits()
    for p in (top_p - 1e-3, top_p + 1e-3, 0.95):
        kept = set(torch.isfinite(nucleus(torch.log_softmax(logits, -1), p)[0]).nonzero().flatten().tolist())
        assert _serve_support(logits, p) == kept
        assert _rollout_support(logits, p) <= kept
