"""The slot decoder's weights for one rollout: each decoder layer's projections as four fused groups.

A LoRA policy (``peft``) runs every adapted Linear as three kernels and a Python wrapper: the base
matmul, ``A`` then ``B``, scaled and added. At rollout batch sizes on a CPU each of those is
overhead-bound, so per layer seven wrapped Linears cost more than their arithmetic. The decoder
instead takes, once per rollout (and again at every weight sync), each layer's projections as four
groups (q/k/v, o, gate/up, down), each one base matmul over the stacked base weights and, where
adapters are active, one low-rank pair: the stacked ``A`` and a block-diagonal ``scale * B``.

The arithmetic is ``peft``'s own (the base output in the base dtype, the adapter path in the
adapter's dtype, added and rounded once to the base dtype), so the logits are the module path's up
to summation order; the weights are never merged (in bf16 a merged ``W + BA`` would round the
update away). The policy itself is never changed. Anything this cannot express (a quantized
Linear, DoRA, a LoRA bias, dropout in training mode, an MLP that is not
``down(act(gate(x)) * up(x))``) leaves the decoder on the model's own modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

_MLP_TYPES = ("LlamaMLP", "Qwen2MLP")  # down_proj(act_fn(gate_proj(x)) * up_proj(x)), nothing else


class _Unfusable(Exception):
    pass


@dataclass(frozen=True)
class LinearParts:
    """What one Linear computes: ``x @ weight.T + bias`` plus, per active adapter, ``(A, scale * B)``."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    adapters: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()


@dataclass(frozen=True)
class FusedLinear:
    """Several Linears over the same input as one: stacked base weights (and biases), and where any
    adapter is active, the stacked ``A`` [ranks, in] with a block-diagonal scaled ``B`` [out, ranks]."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    a: torch.Tensor | None = None
    b: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if self.a is None:
            return y
        return (y + F.linear(F.linear(x.to(self.a.dtype), self.a), self.b)).to(y.dtype)


@dataclass(frozen=True)
class FusedLayer:
    """One decoder layer's projections: ``qkv`` (q, k and v stacked, output widths ``splits``), ``o``,
    ``gate_up`` (gate then up, ``inter`` wide each) and ``down``; ``act`` the MLP's activation."""

    qkv: FusedLinear
    splits: tuple[int, int, int]
    o: FusedLinear
    gate_up: FusedLinear
    inter: int
    down: FusedLinear
    act: Callable[[torch.Tensor], torch.Tensor]


def linear_parts(mod) -> LinearParts:
    """What ``mod`` computes, when it is a plain ``nn.Linear`` or a ``peft`` LoRA Linear over one;
    raises :class:`_Unfusable` otherwise."""
    if type(mod) is torch.nn.Linear:
        return LinearParts(mod.weight, mod.bias)
    base = getattr(mod, "base_layer", None)
    if type(base) is not torch.nn.Linear or not hasattr(mod, "lora_A"):
        raise _Unfusable
    if getattr(mod, "disable_adapters", False) or getattr(mod, "merged", False):
        return LinearParts(base.weight, base.bias)  # merged: the base weight holds the update already
    pairs = []
    for name in mod.active_adapters:
        if name not in mod.lora_A:
            continue
        if getattr(mod, "use_dora", {}).get(name, False):
            raise _Unfusable
        drop = mod.lora_dropout[name]
        if not isinstance(drop, torch.nn.Identity) and drop.training and drop.p > 0:
            raise _Unfusable
        la, lb = mod.lora_A[name], mod.lora_B[name]
        if type(la) is not torch.nn.Linear or type(lb) is not torch.nn.Linear or la.bias is not None:
            raise _Unfusable
        if lb.bias is not None:
            raise _Unfusable
        pairs.append((la.weight, lb.weight * mod.scaling[name]))
    return LinearParts(base.weight, base.bias, tuple(pairs))


def fuse_linears(parts: list[LinearParts]) -> FusedLinear:
    """One :class:`FusedLinear` computing every Linear in ``parts`` (same input), outputs stacked."""
    ws = [p.weight for p in parts]
    if any(w.dtype != ws[0].dtype or w.device != ws[0].device or w.shape[1] != ws[0].shape[1] for w in ws):
        raise _Unfusable
    weight = ws[0] if len(ws) == 1 else torch.cat(ws)
    bias = None
    if any(p.bias is not None for p in parts):
        bias = torch.cat([p.bias if p.bias is not None else p.weight.new_zeros(p.weight.shape[0]) for p in parts])
    pairs = [(i, a, b) for i, p in enumerate(parts) for a, b in p.adapters]
    if not pairs:
        return FusedLinear(weight, bias)
    adt = pairs[0][1].dtype
    if any(a.dtype != adt or b.dtype != adt for _, a, b in pairs):
        raise _Unfusable
    a = torch.cat([a for _, a, _ in pairs])
    b = a.new_zeros(weight.shape[0], a.shape[0])
    out_at = [0]
    for w in ws:
        out_at.append(out_at[-1] + w.shape[0])
    r_at = 0
    for i, ai, bi in pairs:
        b[out_at[i] : out_at[i + 1], r_at : r_at + ai.shape[0]] = bi
        r_at += ai.shape[0]
    return FusedLinear(weight, bias, a, b)


@torch.no_grad()
def fuse_layers(layers) -> list[FusedLayer] | None:
    """Every layer's :class:`FusedLayer`, or None when one of them cannot be expressed exactly."""
    out: list[FusedLayer] = []
    try:
        for layer in layers:
            att, mlp = layer.self_attn, layer.mlp
            if type(mlp).__name__ not in _MLP_TYPES or not callable(getattr(mlp, "act_fn", None)):
                return None
            q, k, v, o, g, u, d = (
                linear_parts(m)
                for m in (att.q_proj, att.k_proj, att.v_proj, att.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
            )
            out.append(
                FusedLayer(
                    qkv=fuse_linears([q, k, v]),
                    splits=(q.weight.shape[0], k.weight.shape[0], v.weight.shape[0]),
                    o=fuse_linears([o]),
                    gate_up=fuse_linears([g, u]),
                    inter=g.weight.shape[0],
                    down=fuse_linears([d]),
                    act=mlp.act_fn,
                )
            )
    except _Unfusable:
        return None
    return out


def fused_bytes(layers) -> int:
    """Bytes a :func:`fuse_layers` copy of ``layers`` takes (each projection's weight once)."""
    total = 0
    for layer in layers:
        att, mlp = layer.self_attn, layer.mlp
        for m in (att.q_proj, att.k_proj, att.v_proj, att.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            w = getattr(m, "base_layer", m).weight
            total += w.numel() * w.element_size()
    return total


__all__ = ["FusedLayer", "FusedLinear", "LinearParts", "fuse_layers", "fuse_linears", "fused_bytes", "linear_parts"]
