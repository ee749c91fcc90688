"""Token sampling from the contract's settings, returning behaviour log-probabilities.

The recorded log-probability is that of the chosen token under the temperature-scaled
full distribution, ``log_softmax(logits / T)``; the learner recomputes exactly this
(see :func:`mentorrl.algos.logprobs.gather_token_logprobs`). Greedy decoding
(temperature 0) records log-probabilities at temperature 1. top-p / top-k truncate what
can be sampled but do not change the recorded value (the convention vLLM follows);
keep them off for on-policy RL.
"""

from __future__ import annotations

import torch

from mentorrl.contract import SamplingParams


def nucleus(logp: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """``logp`` [B, V] with -inf outside each row's top-p nucleus: the most likely tokens, taken in
    order while the mass before each is at most ``top_p`` (the token that crosses ``top_p`` stays;
    so does one whose preceding mass equals it exactly). ``top_p`` is a number or a [B, 1] tensor;
    a row with ``top_p >= 1`` keeps everything. The one top-p cut of the project: rollouts
    (:func:`sample_tokens`) and ``mentorrl serve`` (:class:`mentorrl.serve.RowSampler`) use it."""
    sorted_lp, idx = torch.sort(logp, dim=-1, descending=True)
    cum = sorted_lp.softmax(-1).cumsum(-1)
    drop = cum - sorted_lp.softmax(-1) > top_p  # keep the token that crosses top_p
    if isinstance(top_p, torch.Tensor):
        drop &= top_p < 1.0
    return logp.scatter(-1, idx, sorted_lp.masked_fill(drop, float("-inf")))


def sample_tokens(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | list[torch.Generator] | None = None,
):
    """logits [B, V] -> (tokens [B], logprobs [B]).

    With a list of generators (one per row), each row draws its own noise (Gumbel-max), so a
    trajectory's samples do not depend on which other rows share the step. The noise is drawn into
    one buffer and transformed in place (``argmax(filt - log(-log u))``, the same floats as
    ``argmax(filt + -log(-log u))``); tests/test_sampling_fast.py holds the plain form it must equal.
    """
    logits = logits.float()
    temperature = params.temperature if params.temperature > 0 else 1.0
    logp = torch.log_softmax(logits if temperature == 1.0 else logits / temperature, dim=-1)  # x / 1 is x
    if params.temperature == 0:
        tokens = logp.argmax(dim=-1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
    filt = logp  # each cut below makes a new tensor: logp itself is never written
    if params.top_k > 0 and params.top_k < filt.shape[-1]:
        kth = torch.topk(filt, params.top_k, dim=-1).values[:, -1:]
        filt = filt.masked_fill(filt < kth, float("-inf"))
    if params.top_p < 1.0:
        filt = nucleus(filt, params.top_p)
    if isinstance(generator, list):
        u = torch.empty(len(generator), filt.shape[-1])
        for row, g in zip(u, generator):
            torch.rand(filt.shape[-1], generator=g, out=row)
        u = u.to(filt.device)
        u.clamp_(1e-20, 1.0 - 1e-7).log_().neg_().log_()  # -u is the Gumbel noise
        tokens = torch.sub(filt, u, out=u).argmax(dim=-1)
    else:
        probs = torch.softmax(filt, dim=-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
