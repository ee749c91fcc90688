"""Learner-side views of trajectories: padded tensors and recomputed log-probabilities.

The learner works only on ``Trajectory.token_ids``; nothing here renders or tokenises text.
Tensors are aligned to token positions: ``logprobs[b, t]`` is the log-probability of
``token_ids[b, t]`` given the tokens before it (0 at t = 0, which is never a policy token).
"""

from __future__ import annotations

import contextvars
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from mentorrl.algos.logprobs import entropy_from_logits, gather_row_logprobs
from mentorrl.models.tree import (
    BLOCK_COST,
    Segment,
    TreePlan,
    checkpointing_on,
    plan_blocks,
    tree_hidden_states,
    tree_support,
)
from mentorrl.rollout.kvcache import cache_kwarg, common_prefix_len, expand_batch, make_cache
from mentorrl.trajectory import Trajectory


@dataclass
class TokenBatch:
    input_ids: torch.Tensor  # [B, T] right-padded
    attention_mask: torch.Tensor  # [B, T]
    loss_mask: torch.Tensor  # [B, T] float, 1 on policy tokens
    old_logprobs: torch.Tensor  # [B, T] behaviour log-probs (0 off-policy-token)

    def to(self, device) -> "TokenBatch":
        return TokenBatch(
            *(t.to(device) for t in (self.input_ids, self.attention_mask, self.loss_mask, self.old_logprobs))
        )


def collate(trajs: Sequence[Trajectory], pad_id: int) -> TokenBatch:
    T = max(len(t.token_ids) for t in trajs)
    B = len(trajs)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    attn = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.float32)
    old = torch.zeros(B, T, dtype=torch.float32)
    for b, t in enumerate(trajs):
        n = len(t.token_ids)
        ids[b, :n] = torch.tensor(t.token_ids)
        attn[b, :n] = 1
        mask[b, :n] = torch.tensor(t.loss_mask, dtype=torch.float32)
        old[b, :n] = torch.tensor(t.logprobs, dtype=torch.float32)
    return TokenBatch(ids, attn, mask, old)


def shared_prefix_len(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> int:
    """Length of the token prefix every row shares (all rows real there)."""
    same = (input_ids == input_ids[:1]).all(0) & attention_mask.bool().all(0)
    return int(same.long().cumprod(0).sum())


def _split_head(model):
    """(decoder, lm_head) when logits are a plain linear map of the decoder's last hidden state.

    Then the learner applies the head only where the loss mask is 1, instead of building
    [B, T, V] logits for every prompt and observation token. None for models whose logits
    need more (soft-capping, scaling), which take the full forward."""
    cfg = model.config
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None) not in (None, 1, 1.0):
        return None
    get_decoder = getattr(model, "get_decoder", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if get_decoder is None or head is None or not isinstance(head, torch.nn.Linear):
        return None
    decoder = get_decoder()
    return (decoder, head) if decoder is not None and decoder is not model else None


_PLAIN = contextvars.ContextVar("plain_forwards", default=False)


@contextmanager
def plain_forwards() -> Iterator[None]:
    """Within: every forward of this module is one plain call of the model (no prefix packing, no
    shared-prefix KV reuse), so each layer runs exactly once per forward whatever the data (a
    sharded learner's ranks must all-gather each layer the same number of times)."""
    token = _PLAIN.set(True)
    try:
        yield
    finally:
        _PLAIN.reset(token)


def next_token_states(module, batch: TokenBatch, attr: str, min_shared: int = 32) -> torch.Tensor:
    """``module``'s output (``attr``: "logits" or "last_hidden_state") at positions 0..T-2, [B, T-1, *].

    When every row starts with the same prompt (the system turn), the prefix runs once at
    batch size 1 and its KV cache is broadcast to all rows; gradients flow back through the
    broadcast, so the result and its gradient equal the plain full-batch forward.
    """
    ids, attn = batch.input_ids, batch.attention_mask
    B, T = ids.shape
    P = min(shared_prefix_len(ids, attn) if B > 1 and not _PLAIN.get() else 0, T - 1)
    # under gradient checkpointing in training the layers drop the KV cache: the plain forward
    if P >= min_shared and not (module.training and torch.is_grad_enabled() and checkpointing_on(module)):
        cache, kw = make_cache(module), cache_kwarg(module)
        head = getattr(module(input_ids=ids[:1, :P], use_cache=True, **{kw: cache}), attr)  # [1, P, *]
        if expand_batch(cache, B, copy=False):
            pos = torch.arange(P, T, device=ids.device)[None].expand(B, T - P)
            tail = getattr(
                module(input_ids=ids[:, P:], attention_mask=attn, position_ids=pos, use_cache=True, **{kw: cache}), attr
            )
            return torch.cat([head.expand(B, -1, -1), tail[:, :-1]], dim=1)
    return getattr(module(input_ids=ids, attention_mask=attn, use_cache=False), attr)[:, :-1]


# ------------------------------------------------------------ prefix-tree packing -----
@dataclass
class PrefixPack:
    """A micro-batch's rows packed as prefix trees: every distinct token prefix is one node.

    Rollouts of one task share their prompt and often their first turns too; the plain forward
    runs those tokens once per row. Here rows are sorted lexicographically and each packed row
    holds consecutive trajectories as a trie in depth-first order: a trajectory adds only the
    tokens after its longest common prefix with the one before it. Each node attends to its
    ancestors and itself at its depth (``position_ids``), so its hidden state is the one every
    trajectory through it would compute; the gradient of a node sums over them.

    Two forms: a dense tree mask (``allowed``) over rows of bounded length, for any model whose
    attention takes a 4-D mask; or one row for the whole micro-batch with a block-sparse
    attention ``plan`` (:mod:`mentorrl.models.tree`), which computes only the pairs the tree allows."""

    input_ids: torch.Tensor  # [R, N] node tokens (pad_id after a row's last node)
    position_ids: torch.Tensor  # [R, N] node depth = position in its trajectories
    allowed: torch.Tensor | None  # [R, N, N] bool: query node -> key node (ancestors and itself; pads see themselves)
    node: torch.Tensor  # [B, T] long: flat index r * N + c of token (b, t)'s node, -1 on padding
    plan: TreePlan | None = None  # the block-sparse form (R = 1, ``allowed`` None)

    def to(self, device) -> "PrefixPack":
        return PrefixPack(
            self.input_ids.to(device),
            self.position_ids.to(device),
            None if self.allowed is None else self.allowed.to(device),
            self.node.to(device),
            None if self.plan is None else self.plan.to(device),
        )


PACK_CAPS = (1.0, 1.5, 2.0)  # packed-row lengths tried, as multiples of the longest input row
DEFAULT_ATTN_WEIGHT = 1.0 / 1024  # attention's cost per slot and key, relative to a slot's linear layers


def _layout(rows: list[list[int]], order: list[int], cap: int):
    """Greedy prefix-tree layout of ``rows`` taken in ``order`` (lexicographic): each packed row holds
    consecutive rows as a trie of at most ``cap`` nodes. Returns (node tokens per packed row, node
    depths per packed row, per input row (packed row, node columns, first column it added))."""
    packed: list[list[int]] = []
    depth: list[list[int]] = []
    paths: list[tuple[int, list[int], int]] = [(0, [], 0)] * len(rows)
    prev: list[int] = []
    prev_path: list[int] = []
    for b in order:
        seq = rows[b]
        shared = common_prefix_len([prev, seq]) if packed else 0
        if not packed or len(packed[-1]) + len(seq) - shared > cap:
            packed.append([])
            depth.append([])
            shared = 0
        row = packed[-1]
        path = prev_path[:shared] + list(range(len(row), len(row) + len(seq) - shared))
        row.extend(seq[shared:])
        depth[-1].extend(range(shared, len(seq)))
        paths[b] = (len(packed) - 1, path, shared)
        prev, prev_path = seq, path
    return packed, depth, paths


def pack_cost(rows: int, length: int, attn_weight: float) -> float:
    """Estimated forward cost of ``rows`` sequences of ``length`` slots: the linear layers grow with
    the slots, attention with slots times keys (``attn_weight``: its cost per key relative to a
    slot's linear layers; :func:`attention_weight`)."""
    return rows * length * (1.0 + attn_weight * length)


def attention_weight(module) -> float:
    """``attn_weight`` of :func:`pack_cost` for a decoder: per layer, a slot's linear layers cost about
    2 x (the layer's parameters) FLOPs and its attention 4 x (heads x head dim) per key."""
    cfg = getattr(module, "config", None)
    layers = getattr(cfg, "num_hidden_layers", None)
    heads = getattr(cfg, "num_attention_heads", None)
    hidden = getattr(cfg, "hidden_size", None)
    if not (layers and heads and hidden):
        return DEFAULT_ATTN_WEIGHT
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    emb = module.get_input_embeddings() if hasattr(module, "get_input_embeddings") else None
    params = sum(p.numel() for p in module.parameters()) - (emb.weight.numel() if emb is not None else 0)
    per_layer = params / layers
    return 2.0 * heads * head_dim / per_layer if per_layer > 0 else DEFAULT_ATTN_WEIGHT


def prefix_pack(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    pad_id: int = 0,
    attn_weight: float = DEFAULT_ATTN_WEIGHT,
    tree: bool = False,
) -> PrefixPack | None:
    """Pack right-padded rows ``[B, T]`` into prefix trees.

    ``tree``: one trie row for the whole batch with a block-sparse attention plan (:mod:`mentorrl.models.tree`);
    its cost counts the nodes, the (query, key) pairs its blocks compute and a fixed cost per block.
    Otherwise packed rows hold at most ``c * T`` nodes, ``c`` in :data:`PACK_CAPS`, under a dense
    tree mask: longer rows split fewer groups (each split runs the shared prompt again) but cost more
    attention per slot. The layout with the lowest :func:`pack_cost` is kept; None when none costs
    less than the padded batch (then the plain forward is as cheap)."""
    B, T = input_ids.shape
    if B < 2:
        return None
    lens = attention_mask.sum(1).tolist()
    if not any(lens):
        return None
    rows = [input_ids[b, : lens[b]].tolist() for b in range(B)]
    order = sorted(range(B), key=lambda b: rows[b])
    plain_cost = pack_cost(B, T, attn_weight)
    if tree:
        return _tree_pack(rows, order, T, pad_id, attn_weight, plain_cost)
    best, best_cost = None, plain_cost
    for c in PACK_CAPS:
        layout = _layout(rows, order, max(int(c * T), T))
        cost = pack_cost(len(layout[0]), max(len(r) for r in layout[0]), attn_weight)
        if cost < best_cost:
            best, best_cost = layout, cost
    if best is None:
        return None
    packed, depth, paths = best
    ids, pos = _node_rows(packed, depth, pad_id)
    R, N = ids.shape
    allowed = torch.zeros(R, N, N, dtype=torch.bool)
    tril = torch.ones(T, T, dtype=torch.bool).tril()
    for r, path, shared in paths:
        cols = torch.tensor(path, dtype=torch.long)
        L = len(path)
        if L > shared:  # the rows of the nodes this trajectory added: each sees its ancestors and itself
            allowed[r, cols[shared:, None], cols[None, :]] = tril[shared:L, :L]
    for r, toks in enumerate(packed):  # a pad slot attends to itself only (a fully masked row would be NaN)
        c = torch.arange(len(toks), N)
        allowed[r, c, c] = True
    return PrefixPack(ids, pos, allowed, _node_index(paths, T, N))


def _node_rows(packed: list[list[int]], depth: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    R, N = len(packed), max(len(r) for r in packed)
    ids = torch.full((R, N), pad_id, dtype=torch.long)
    pos = torch.zeros(R, N, dtype=torch.long)
    for r, (toks, dep) in enumerate(zip(packed, depth)):
        ids[r, : len(toks)] = torch.tensor(toks, dtype=torch.long)
        pos[r, : len(dep)] = torch.tensor(dep, dtype=torch.long)
    return ids, pos


def _node_index(paths, T: int, N: int) -> torch.Tensor:
    node = torch.full((len(paths), T), -1, dtype=torch.long)
    for b, (r, path, _shared) in enumerate(paths):
        node[b, : len(path)] = r * N + torch.tensor(path, dtype=torch.long)
    return node


def _tree_pack(
    rows: list[list[int]], order: list[int], T: int, pad_id: int, attn_weight: float, plain_cost: float
) -> PrefixPack | None:
    """The whole batch as one trie row with a block-sparse plan; None when the padded batch costs less."""
    packed, depth, paths = _layout(rows, order, sum(len(r) for r in rows))
    n = len(packed[0])
    segments = [
        Segment(path[shared], path[-1] + 1, path[:shared])  # _layout adds them in ``order``, column by column
        for _r, path, shared in (paths[b] for b in order)
        if len(path) > shared
    ]
    plan = plan_blocks(segments, n)
    if n + attn_weight * plan.pairs + BLOCK_COST * len(plan.q_sizes) >= plain_cost:
        return None
    ids, pos = _node_rows(packed, depth, pad_id)
    return PrefixPack(ids, pos, None, _node_index(paths, T, n), plan)


def packable(model) -> bool:
    """Whether the learner's forward of ``model`` can take a tree mask (:func:`selected_states`)."""
    split = _split_head(model)
    return _packable(split[0] if split is not None else model) is not None


def _packable(module, tree: bool = True) -> str | None:
    """How ``module``'s forward runs a prefix trie: ``"tree"`` (block-sparse attention, for the decoder
    layouts :func:`mentorrl.models.tree.tree_support` accepts; not when ``tree`` is False), else the
    4-D mask form it takes (``"bool"`` for SDPA, ``"additive"`` for eager attention); None when a custom
    tree mask cannot stand in for its causal one (sliding-window or other layer types, kernels that
    ignore a 4-D mask)."""
    if tree and tree_support(module) is None:
        return "tree"
    cfg = getattr(module, "config", None)
    impl = getattr(cfg, "_attn_implementation", None)
    if impl not in ("sdpa", "eager"):
        return None
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        return None
    if layer_types is None and getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
        return None
    return "bool" if impl == "sdpa" else "additive"


# per module and form: does its packed forward match its plain one (checked once, on the first packed batch)?
_PACK_VERIFIED: "weakref.WeakKeyDictionary[torch.nn.Module, dict[str, bool]]" = weakref.WeakKeyDictionary()


def _packed_outputs(module, pack: PrefixPack, attr: str, form: str) -> torch.Tensor:
    """``module``'s ``attr`` at every node, flattened ``[R * N, *]``."""
    if form == "tree":
        if attr != "last_hidden_state" or pack.plan is None:
            raise ValueError("the tree forward gives a decoder's last_hidden_state over a planned trie row")
        out = tree_hidden_states(module, pack.input_ids, pack.position_ids, pack.plan)
        return out.reshape(-1, *out.shape[2:])
    mask = pack.allowed[:, None].to(pack.input_ids.device)
    if form == "additive":
        dtype = next(module.parameters()).dtype
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    out = getattr(
        module(input_ids=pack.input_ids, position_ids=pack.position_ids, attention_mask=mask, use_cache=False), attr
    )
    return out.reshape(-1, *out.shape[2:])


def _packing_matches(module, batch: TokenBatch, pack: PrefixPack, attr: str, form: str) -> bool:
    """One no-grad comparison of the packed and plain forwards at the real positions (eval mode, so
    dropout cannot tell them apart); cached per module and form."""
    ok = _PACK_VERIFIED.setdefault(module, {}).get(form)
    if ok is None:
        was = module.training
        module.eval()
        try:
            with torch.no_grad():
                real = batch.attention_mask[:, :-1].bool()
                plain = next_token_states(module, batch, attr)[real].float()
                packed = _packed_outputs(module, pack, attr, form)[pack.node[:, :-1][real].to(plain.device)].float()
            dev = plain.device.type
            exact = next(module.parameters()).dtype == torch.float32 and not torch.is_autocast_enabled(dev)
            tol = 1e-3 if exact else 5e-2  # under autocast (mixed precision) both run in bf16 / fp16
            ok = bool(torch.isfinite(packed).all()) and bool(
                (packed - plain).abs().max() <= tol * (1 + plain.abs().max())
            )
        finally:
            module.train(was)
        _PACK_VERIFIED[module][form] = ok
    return ok


def selected_states(
    module, batch: TokenBatch, attr: str, sel: torch.Tensor, pack: bool | str = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``module``'s ``attr`` at the positions ``sel`` ([B, T-1] bool: the next token is scored) as
    ``(states [U, *], inverse)``: position i's state is ``states[inverse[i]]`` (``inverse`` None: one
    state per position, in ``sel``'s row-major order).

    ``pack``: run each distinct prefix once (:func:`prefix_pack`; block-sparse for the decoders
    :mod:`mentorrl.models.tree` runs, else under a dense tree mask) when the model takes one and its
    packed forward matched its plain one on first use; positions sharing a prefix share
    one state (and their gradients add up there), so values and gradients equal the plain forward's.
    ``pack="dense"``: the dense tree mask even where the block-sparse forward would serve."""
    if pack not in (True, False, "dense"):
        raise ValueError(f"pack: True, False or 'dense' (got {pack!r})")
    # the tree forward gives a decoder's last hidden states; anything else takes the dense mask
    form = (
        _packable(module, tree=pack is True and attr == "last_hidden_state")
        if pack and not _PLAIN.get() and bool(sel.any())
        else None
    )
    packed = (
        prefix_pack(batch.input_ids, batch.attention_mask, attn_weight=attention_weight(module), tree=form == "tree")
        if form is not None
        else None
    )
    if packed is not None:
        packed = packed.to(batch.input_ids.device)
    if packed is None or not _packing_matches(module, batch, packed, attr, form):
        return next_token_states(module, batch, attr)[sel], None
    nodes, inverse = torch.unique(packed.node[:, :-1][sel], return_inverse=True)
    return _packed_outputs(module, packed, attr, form)[nodes], inverse


def _scored_logits(
    model, batch: TokenBatch, sel: torch.Tensor, pack: bool | str
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits ``[U, V]`` predicting each scored token (``sel``) and their ``inverse`` (see
    :func:`selected_states`). When logits are a plain linear map of the decoder's last hidden state
    the head runs only on those states, not on every prompt and observation token."""
    split = _split_head(model)
    if split is None:
        return selected_states(model, batch, "logits", sel, pack)
    decoder, head = split
    states, inverse = selected_states(decoder, batch, "last_hidden_state", sel, pack)
    return head(states), inverse


def _selected_logprobs(
    logits: torch.Tensor, inverse: torch.Tensor | None, targets: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``targets`` [n] (and entropies, detached) from ``logits`` [U, V], position i reading
    row ``inverse[i]`` (``inverse`` None: row i)."""
    lp = gather_row_logprobs(logits, targets, inverse, temperature=temperature)
    ent = _at(entropy_from_logits(logits.detach(), temperature=temperature), inverse) if with_entropy else None
    return lp, ent


def forward_logprobs(
    model, batch: TokenBatch, temperature: float = 1.0, with_entropy: bool = False, pack: bool | str = True
):
    """Per-token log-probs (and optionally entropies) aligned to token positions, [B, T].

    Values are exact on loss-mask positions (the policy's tokens) and 0 elsewhere, which the losses
    never read. ``pack``: run shared prefixes once (:func:`selected_states`); the result is the same.
    """
    targets = batch.input_ids[:, 1:]
    t = temperature if temperature > 0 else 1.0
    sel = batch.loss_mask[:, 1:] > 0
    logits, inverse = _scored_logits(model, batch, sel, pack)
    lp_sel, ent_sel = _selected_logprobs(logits, inverse, targets[sel], t, with_entropy)
    lp = torch.zeros(targets.shape, dtype=torch.float32, device=targets.device).masked_scatter(sel, lp_sel)
    zero = lp.new_zeros(lp.shape[0], 1)  # position 0 is never scored (also when T = 1)
    logprobs = torch.cat([zero, lp], dim=1)
    if ent_sel is None:
        return logprobs, None
    return logprobs, torch.cat([zero, torch.zeros_like(lp).masked_scatter(sel, ent_sel)], dim=1)


def forward_selected_logprobs(
    model, batch: TokenBatch, ids: torch.Tensor, temperature: float = 1.0, pack: bool | str = True
) -> torch.Tensor:
    """The student's full-vocabulary log-probs of the given candidate ``ids`` ``[B, T, k]`` at every
    position ``t`` (predicting token ``t`` from tokens ``< t``): ``[B, T, k]``, exact on loss-mask
    positions and 0 elsewhere. For top-k distillation against a teacher's top-k token ids."""
    t = temperature if temperature > 0 else 1.0
    sel = batch.loss_mask[:, 1:] > 0
    logits, inverse = _scored_logits(model, batch, sel, pack)
    lp = _at(torch.log_softmax(logits.float() / t, dim=-1), inverse).gather(-1, ids[:, 1:][sel].long())  # [N, k]
    out = torch.zeros(ids.shape, dtype=torch.float32, device=lp.device)
    out[:, 1:][sel] = lp
    return out


def _at(x: torch.Tensor, inverse: torch.Tensor | None) -> torch.Tensor:
    return x if inverse is None else x[inverse]
