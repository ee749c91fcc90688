"""The rollout sampler's in-place Gumbel-max (rollout/sampling.sample_tokens) gives the same tokens and
log-probs, bit for bit, as the plain form it replaced (kept here as the reference), for any logits,
temperature, top-k, top-p and per-row seeds."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mentorrl.contract import SamplingParams
from mentorrl.rollout.sampling import nucleus, sample_tokens


def reference_sample(logits: torch.Tensor, params: SamplingParams, generator: list[torch.Generator]):
    """The sampler before the in-place rewrite, verbatim (the per-row-generator path)."""
    logits = logits.float()
    temperature = params.temperature if params.temperature > 0 else 1.0
    logp = torch.log_softmax(logits / temperature, dim=-1)
    if params.temperature == 0:
        tokens = logp.argmax(dim=-1)
    else:
        filt = logp.clone()
        if params.top_k > 0 and params.top_k < filt.shape[-1]:
            kth = torch.topk(filt, params.top_k, dim=-1).values[:, -1:]
            filt = filt.masked_fill(filt < kth, float("-inf"))
        if params.top_p < 1.0:
            filt = nucleus(filt, params.top_p)
        u = torch.stack([torch.rand(filt.shape[-1], generator=g) for g in generator]).to(filt.device)
        gumbel = -torch.log(-torch.log(u.clamp(1e-20, 1.0 - 1e-7)))
        tokens = (filt + gumbel).argmax(dim=-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 6),
    vocab=st.sampled_from([2, 7, 16, 33, 100, 1024]),
    scale=st.sampled_from([0.01, 1.0, 5.0, 40.0]),
    temperature=st.sampled_from([0.0, 0.25, 0.7, 1.0, 1.6]),
    top_k=st.integers(0, 40),
    top_p=st.sampled_from([1.0, 0.95, 0.5, 0.1]),
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_sampler_equals_the_plain_form(rows, vocab, scale, temperature, top_k, top_p, seed, dtype):
    logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    gens_a = [torch.Generator().manual_seed(seed + r) for r in range(rows)]
    gens_b = [torch.Generator().manual_seed(seed + r) for r in range(rows)]
    want_t, want_lp = reference_sample(logits, params, gens_a)
    got_t, got_lp = sample_tokens(logits, params, gens_b)
    assert torch.equal(got_t, want_t)
    assert torch.equal(got_lp, want_lp)
    # the generators advanced alike: the next draws agree too
    assert all(torch.equal(torch.rand(3, generator=a), torch.rand(3, generator=b)) for a, b in zip(gens_a, gens_b))


def test_sampler_does_not_write_its_input():
    logits = torch.randn(4, 50)
    before = logits.clone()
    sample_tokens(logits, SamplingParams(temperature=1.0), [torch.Generator().manual_seed(i) for i in range(4)])
    assert torch.equal(logits, before)
