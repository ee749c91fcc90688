"""Token log-probabilities, entropy and masked reductions.

Pure functions on tensors. Shapes: ``B`` batch, ``T`` sequence length, ``V`` vocab.

Masks may be ``bool`` or numeric (0/1). Positions where the mask is zero are
*selected out* with ``torch.where`` rather than multiplied by zero, so an
``inf``/``nan`` sitting at a masked position cannot leak into the result, and
the gradient at masked positions is exactly zero.
"""

from __future__ import annotations

import torch

__all__ = [
    "gather_token_logprobs",
    "gather_row_logprobs",
    "entropy_from_logits",
    "masked_sum",
    "masked_mean",
]

# Rows of [N, V] processed at once. Bounds the extra fp32 working memory to
# about ``_CHUNK_ROWS * V * 4`` bytes when the logits are bf16/fp16 or a
# temperature is applied (each of which needs a fresh copy of the logits).
_CHUNK_ROWS = 1024


def _scaled_fp32(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    return x


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")


def gather_token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` gathered at ``targets``, in fp32.

    Args:
        logits: ``[B, T, V]`` (any float dtype).
        targets: ``[B, T]`` integer token ids.
        temperature: softmax temperature (> 0).

    Returns:
        ``[B, T]`` fp32 log-probabilities.

    Computed as ``z[target] - logsumexp(z)`` so no ``[B, T, V]`` log-softmax
    tensor is materialised; rows are processed in chunks so the fp32 upcast /
    temperature scaling copy stays bounded. Differentiable w.r.t. ``logits``.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree")
    V = logits.shape[-1]
    return gather_row_logprobs(logits.reshape(-1, V), targets.reshape(-1), temperature=temperature).reshape(
        targets.shape
    )


def gather_row_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    rows: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """``log_softmax(logits[rows[i]] / temperature)[targets[i]]`` for each i, in fp32: ``[n]``.

    ``logits`` ``[U, V]`` may be shared by several positions (``rows`` ``[n]`` indexes them; None:
    position i reads row i): each row's ``logsumexp`` is computed once, in chunks of rows as in
    :func:`gather_token_logprobs`. Differentiable w.r.t. ``logits``."""
    _check_temperature(temperature)
    n = targets.shape[0]
    if rows is None:
        if logits.shape[0] != n:
            raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree")
        rows = torch.arange(n, device=logits.device)
    if n == 0:
        return logits.new_zeros(0, dtype=torch.float32)
    lse = torch.cat(
        [
            torch.logsumexp(_scaled_fp32(logits[start : start + _CHUNK_ROWS], temperature), dim=-1)
            for start in range(0, logits.shape[0], _CHUNK_ROWS)
        ]
    )
    picked = _scaled_fp32(logits[rows, targets.long()], temperature)
    return picked - lse[rows]


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy (nats) of ``softmax(logits / temperature)`` over the last dim.

    ``H = logsumexp(z) - sum_v softmax(z)_v * z_v``, with tokens of probability 0 (logit -inf,
    e.g. banned) adding 0. Input ``[..., V]``, output ``[...]`` in fp32. Chunked over rows like
    :func:`gather_token_logprobs`.
    """
    _check_temperature(temperature)
    lead = logits.shape[:-1]
    V = logits.shape[-1]
    flat = logits.reshape(-1, V)
    out = []
    for start in range(0, flat.shape[0], _CHUNK_ROWS):
        z = _scaled_fp32(flat[start : start + _CHUNK_ROWS], temperature)
        p = torch.softmax(z, dim=-1)
        # a token with probability 0 (logit -inf) adds 0, not 0 * -inf = NaN; z is selected before the
        # product so the backward pass does not meet 0 * -inf either
        z0 = torch.where(p > 0, z, torch.zeros((), dtype=z.dtype, device=z.device))
        out.append(torch.logsumexp(z, dim=-1) - (p * z0).sum(-1))
    if not out:
        return flat.new_zeros(lead, dtype=torch.float32)
    return torch.cat(out).reshape(lead)


def _select(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(x * mask with masked-out positions forced to 0, float mask)``."""
    m = mask.to(x.dtype) if x.is_floating_point() else mask.float()
    prod = x * m
    xm = torch.where(mask != 0, prod, torch.zeros((), dtype=prod.dtype, device=prod.device))
    return xm, m


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Sum of ``x * mask`` over ``dim`` (all elements when ``dim is None``)."""
    xm, _ = _select(x, mask)
    return xm.sum() if dim is None else xm.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """``sum(x * mask) / sum(mask)`` over ``dim``; 0 where the mask is empty (never NaN)."""
    xm, m = _select(x, mask)
    if dim is None:
        num, den = xm.sum(), m.sum()
    else:
        num, den = xm.sum(dim=dim), m.sum(dim=dim)
    return torch.where(den > 0, num / den.clamp_min(torch.finfo(num.dtype).tiny), torch.zeros_like(num))
