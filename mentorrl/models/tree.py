"""Block-sparse attention over a prefix trie: the learner's tree forward.

:func:`mentorrl.models.batch.prefix_pack` lays a micro-batch out as one prefix trie in depth-first
order: every distinct token prefix is one node, and each trajectory adds one *segment*, the nodes
after the prefix it shares with the trajectory before it. Dense attention over that row under a
tree mask computes every (query, key) pair although most are masked (sibling branches); its cost
grows with the square of the whole micro-batch's nodes.

Here the row's queries are cut into blocks along the segments (:func:`plan_blocks`): a block
attends only to the union of its nodes' ancestors, under its own mask. Per layer, the keys and
values of every block are gathered in one indexed copy and each block is one
``scaled_dot_product_attention`` call; the work is about the pairs a tree mask allows, not the
square of the row.

:func:`tree_hidden_states` runs the checkpoint's own modules (embedding, norms, projections, rotary
embedding, MLP) layer by layer, as the rollout's slot decoder does
(:class:`mentorrl.rollout.decoders.SlotDecoder`); only attention is computed here. It serves the
decoder layouts :func:`tree_support` accepts; the learner checks it against the model's plain
forward on first use and falls back when they differ (:func:`mentorrl.models.batch.selected_states`).
When the model's gradient checkpointing is on (its layers' ``gradient_checkpointing``), each layer
here is checkpointed too (non-reentrant), so the tree forward saves the same activation memory.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from mentorrl.rollout.decoders import decoder_config_problem, decoder_layout_problem

BLOCK = 128  # longest query block
MIN_BLOCK = BLOCK // 4  # short segments are merged into a block until it is at least this long
BLOCK_COST = 64.0  # a block's fixed cost (calls, gathers), in node slots of :func:`mentorrl.models.batch.pack_cost`


@dataclass
class Segment:
    """Nodes ``[lo, hi)`` of a trie row, added by one trajectory after its shared prefix, whose
    nodes are ``anc`` (columns, root first)."""

    lo: int
    hi: int
    anc: list[int]


@dataclass
class TreePlan:
    """Query blocks covering a trie row of ``n`` nodes, in order: block ``i`` holds ``q_sizes[i]``
    queries and attends to ``k_sizes[i]`` keys, its slice of ``keys``, under ``masks[i]`` [q, k]."""

    n: int
    q_sizes: list[int]
    k_sizes: list[int]
    keys: torch.Tensor  # [sum(k_sizes)] long: key columns of every block, concatenated
    masks: list[torch.Tensor]

    @property
    def pairs(self) -> int:
        """(query, key) pairs computed: the attention work."""
        return sum(q * k for q, k in zip(self.q_sizes, self.k_sizes))

    def to(self, device) -> "TreePlan":
        return TreePlan(self.n, self.q_sizes, self.k_sizes, self.keys.to(device), [m.to(device) for m in self.masks])


def _spans(segments: list[Segment], n: int, block: int, min_block: int) -> list[tuple[int, int]]:
    """Query blocks ``[lo, hi)`` covering ``[0, n)``: a block starts at a segment start, takes
    following segments until it is ``min_block`` long, and is cut every ``block`` nodes."""
    spans: list[tuple[int, int]] = []
    cur = None
    for s in segments:
        if cur is None:
            cur = s.lo
        while s.hi - cur > block:
            spans.append((cur, cur + block))
            cur += block
        if s.hi - cur >= min_block:
            spans.append((cur, s.hi))
            cur = None
    if cur is not None and cur < n:
        spans.append((cur, n))
    return spans


def plan_blocks(segments: list[Segment], n: int, block: int | None = None, min_block: int | None = None) -> TreePlan:
    """The block plan of a trie row of ``n`` nodes whose ``segments`` (in order) cover it; ``block``
    and ``min_block`` (at most ``block``) default to :data:`BLOCK` and :data:`MIN_BLOCK`.

    A query node ``x`` of segment ``s`` attends to ``s.anc`` and to ``s``'s nodes up to itself; a
    block's keys are the union over its queries, in column order, so each block is exact."""
    block = BLOCK if block is None else block
    min_block = min(block, MIN_BLOCK if min_block is None else min_block)
    if block < 1 or min_block < 1:
        raise ValueError(f"query blocks need at least one node (block {block}, min_block {min_block})")
    if (
        not segments
        or segments[0].lo != 0
        or segments[-1].hi != n
        or any(s.lo >= s.hi for s in segments)
        or any(a.hi != b.lo for a, b in zip(segments, segments[1:]))
    ):
        raise ValueError("segments must cover the row in order, each non-empty")
    anc = [torch.tensor(s.anc, dtype=torch.long) for s in segments]
    q_sizes: list[int] = []
    k_sizes: list[int] = []
    keys: list[torch.Tensor] = []
    masks: list[torch.Tensor] = []
    j = 0  # first segment overlapping the current block
    for lo, hi in _spans(segments, n, block, min_block):
        while segments[j].hi <= lo:
            j += 1
        pieces = []
        k = j
        while k < len(segments) and segments[k].lo < hi:
            pieces.append(k)
            k += 1
        # the block's keys: its pieces' ancestors and their own nodes up to the block's end (work grows with
        # the keys, not with the row)
        cols = torch.cat([t for p in pieces for t in (anc[p], torch.arange(segments[p].lo, min(hi, segments[p].hi)))])
        cols = torch.unique(cols)  # sorted
        rows = []
        for p in pieces:
            s = segments[p]
            q = torch.arange(max(lo, s.lo), min(hi, s.hi))
            rows.append(torch.isin(cols, anc[p])[None, :] | ((cols[None, :] >= s.lo) & (cols[None, :] <= q[:, None])))
        q_sizes.append(hi - lo)
        k_sizes.append(len(cols))
        keys.append(cols)
        masks.append(torch.cat(rows, 0))
    return TreePlan(n, q_sizes, k_sizes, torch.cat(keys), masks)


def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: TreePlan,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Attention of a trie row under ``plan``: ``q`` [1, heads, n, head dim], ``k``/``v``
    [1, kv heads, n, head dim] (grouped-query heads allowed) -> [1, heads, n, head dim]."""
    gqa = k.shape[1] != q.shape[1]
    ks = k.index_select(2, plan.keys).split(plan.k_sizes, dim=2)
    vs = v.index_select(2, plan.keys).split(plan.k_sizes, dim=2)
    qs = q.split(plan.q_sizes, dim=2)
    out = [
        F.scaled_dot_product_attention(qb, kb, vb, attn_mask=m, dropout_p=dropout_p, scale=scale, enable_gqa=gqa)
        for qb, kb, vb, m in zip(qs, ks, vs, plan.masks)
    ]
    return torch.cat(out, dim=2)


def tree_support(module) -> str | None:
    """None when :func:`tree_hidden_states` can run ``module`` (a Qwen2 or Llama decoder, the
    ``get_decoder()`` of a causal LM, with full attention); else why not."""
    cfg = getattr(module, "config", None)
    why = decoder_config_problem(cfg)
    if why is not None:
        return why
    if getattr(cfg, "_attn_implementation", None) not in ("sdpa", "eager"):
        return f"attention implementation {getattr(cfg, '_attn_implementation', None)!r}"
    if hasattr(module, "lm_head"):
        return "a causal LM, not its decoder"
    return decoder_layout_problem(module)


def tree_hidden_states(decoder, input_ids: torch.Tensor, position_ids: torch.Tensor, plan: TreePlan) -> torch.Tensor:
    """The decoder's last hidden states [1, n, hidden] at every node of a trie row ``input_ids``
    [1, n] with node depths ``position_ids`` [1, n]: each node sees exactly its ancestors."""
    h = decoder.embed_tokens(input_ids)
    cos, sin = decoder.rotary_emb(h, position_ids)
    for layer in decoder.layers:
        if getattr(layer, "gradient_checkpointing", False) and layer.training and torch.is_grad_enabled():
            # the model's gradient checkpointing (optim.gradient_checkpointing), as its own forward does it
            h = checkpoint(_tree_layer, layer, decoder.config, h, cos, sin, plan, use_reentrant=False)
        else:
            h = _tree_layer(layer, decoder.config, h, cos, sin, plan)
    return decoder.norm(h)


def checkpointing_on(module) -> bool:
    """Whether any layer of ``module`` has (Hugging Face) activation checkpointing turned on."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in module.modules())


def _tree_layer(layer, cfg, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, plan: TreePlan) -> torch.Tensor:
    """One decoder layer over a trie row: its own norms, projections and MLP, attention under ``plan``."""
    n = h.shape[1]
    att = layer.self_attn
    rope = sys.modules[type(att).__module__].apply_rotary_pos_emb
    x = layer.input_layernorm(h)
    shape = (1, n, -1, getattr(att, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    q = att.q_proj(x).view(shape).transpose(1, 2)
    k = att.k_proj(x).view(shape).transpose(1, 2)
    v = att.v_proj(x).view(shape).transpose(1, 2)
    q, k = rope(q, k, cos, sin)
    p = float(getattr(att, "attention_dropout", 0.0) or 0.0) if att.training else 0.0
    o = tree_attention(q, k, v, plan, scale=att.scaling, dropout_p=p)
    h = h + att.o_proj(o.transpose(1, 2).reshape(1, n, -1))
    return h + layer.mlp(layer.post_attention_layernorm(h))
