"""How the rollout engine runs the model: a batch of rows, each with its own growing context.

The engine (:class:`mentorrl.rollout.engine.RolloutEngine`) decides *what* each row is fed next
(its prompt, the token it sampled, a tool observation); a decoder turns one such step into the
next-token logits of every fed row and keeps the rows' KV caches. Two implementations:

- :class:`SlotDecoder` (the default for Qwen2 and Llama checkpoints): every row owns a slot of
  a preallocated KV cache that is written in place; a step's tokens are packed into one flat
  sequence, so the linear layers see only real tokens (no padding), and attention reads each
  row's slot directly (decode rows in one batched call, multi-token chunks one row at a time).
  It runs the checkpoint's own ``transformers`` modules (norms, projections, MLP, rotary
  embedding, LM head) and computes attention with ``scaled_dot_product_attention``, as the
  model's ``sdpa`` path does; only the cache layout and the batching are its own. It checks
  itself against the model's ``forward`` once per model object (:func:`slot_decoder_checks`).
- :class:`DynamicCacheDecoder`: any causal LM through its ``forward`` with a ``DynamicCache``.
  Rows are left-padded to the widest chunk of the step; pads are masked and take no position,
  and the cache is compacted when the holes grow.

Both give every real token exactly the context it would see alone, so the same seeds sample
the same trajectories up to float noise (tests/test_decoders.py).
"""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from mentorrl.rollout.adapters import base_module
from mentorrl.rollout.fused import fuse_layers, fused_bytes
from mentorrl.rollout.kvcache import add_rows, cache_kwarg, compact, expand_batch, make_cache

log = logging.getLogger(__name__)

SLOT_MODEL_TYPES = ("qwen2", "llama")
GATHER_SHARE = 0.5  # decode rows at most this share of the slots: attention reads copies of their slots only


class Decoder(Protocol):
    """``pads_wide``: a multi-token chunk widens the step for every row (the engine then gathers
    observations into fewer wide steps). ``stats``: counters the engine reports."""

    pads_wide: bool
    stats: dict

    def reset(self, n: int) -> None:
        """``n`` rows, every context empty (a new rollout, or new weights)."""

    def prefill_shared(self, prefix: list[int]) -> bool:
        """Put ``prefix`` in every (empty) row's context with one forward pass of one row.
        False (and nothing changed) where the decoder cannot."""

    def add_rows(self, n: int) -> None:
        """Append ``n`` rows with empty contexts."""

    def drop(self, keep: list[int]) -> list[int]:
        """Keep the rows ``keep`` (ascending) and free the others. Returns the new row order as
        old row indices: row ``j`` is now old row ``order[j]``."""

    def forward(self, chunks: list[list[int]]) -> torch.Tensor:
        """Feed row ``i`` the tokens ``chunks[i]`` (empty: not fed this step). Returns the
        next-token logits after each fed row's last token, [rows fed, vocab], in row order."""

    def close(self) -> None:
        """The rollout is over (its buffers may serve the next one)."""

    def refresh_weights(self) -> None:
        """The model's weights changed: whatever the decoder derived from them is taken again."""


# ------------------------------------------------------------------------ transformers forward --
class DynamicCacheDecoder:
    """Any causal LM through its own ``forward``: left-padded steps over a ``DynamicCache``."""

    pads_wide = True

    def __init__(self, model, compact_ratio: float = 1.25, pad_token_id: int = 0):
        self.model = model
        self.pad_token_id = pad_token_id
        self.device = next(model.parameters()).device
        self.cache_kw = cache_kwarg(model)
        self.compact_ratio = compact_ratio
        self.stats = {"compactions": 0}
        self.reset(0)

    def close(self) -> None:
        self.reset(0)

    def refresh_weights(self) -> None:  # runs the model's forward: nothing derived to take again
        pass

    def reset(self, n: int) -> None:
        self.cache = make_cache(self.model)
        self.attn = torch.zeros(n, 0, dtype=torch.long, device=self.device)
        self.pos = torch.zeros(n, dtype=torch.long, device=self.device)

    def prefill_shared(self, prefix: list[int]) -> bool:
        n = self.attn.shape[0]
        ids = torch.tensor([prefix], device=self.device)
        self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **{self.cache_kw: self.cache})
        if not expand_batch(self.cache, n):
            self.reset(n)
            return False
        self.attn = torch.ones(n, len(prefix), dtype=torch.long, device=self.device)
        self.pos = torch.full((n,), len(prefix), dtype=torch.long, device=self.device)
        return True

    def add_rows(self, n: int) -> None:
        if self.cache.get_seq_length() > 0 and not add_rows(self.cache, n):
            raise RuntimeError("this KV-cache type cannot take new rows; use run() per batch instead")
        self.attn = torch.cat([self.attn, self.attn.new_zeros(n, self.attn.shape[1])], dim=0)
        self.pos = torch.cat([self.pos, self.pos.new_zeros(n)], dim=0)

    def drop(self, keep: list[int]) -> list[int]:
        if not keep:
            self.reset(0)
            return []
        idx = torch.tensor(keep, device=self.device)
        if self.cache.get_seq_length() > 0:
            self.cache.batch_select_indices(idx)
        self.attn, self.pos = self.attn[idx], self.pos[idx]
        if self.attn.shape[1] and not bool(self.attn.any()):
            self.reset(len(keep))  # only rows never fed are left: no real entry to keep
        return list(keep)

    def forward(self, chunks: list[list[int]]) -> torch.Tensor:
        attn = self.attn
        # keep attention cost proportional to real context, not to accumulated pads
        if attn.shape[1] > 64 and attn.shape[1] > self.compact_ratio * int(attn.sum(1).max()):
            packed = compact(self.cache, attn)
            if packed is not None:
                attn = packed
                self.stats["compactions"] += 1
        n = len(chunks)
        width = max(len(c) for c in chunks)
        inp = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        new_mask = torch.zeros(n, width, dtype=torch.long)
        for i, c in enumerate(chunks):
            if c:
                inp[i, width - len(c) :] = torch.tensor(c)
                new_mask[i, width - len(c) :] = 1
        inp, new_mask = inp.to(self.device), new_mask.to(self.device)
        position_ids = self.pos[:, None] + (new_mask.cumsum(1) - 1).clamp(min=0)
        self.attn = torch.cat([attn, new_mask], dim=1)
        out = self.model(
            input_ids=inp,
            attention_mask=self.attn,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_kw: self.cache},
        )  # the DynamicCache is updated in place
        self.pos = self.pos + new_mask.sum(1)
        fed = [i for i, c in enumerate(chunks) if c]
        return out.logits[fed, -1, :]


# ------------------------------------------------------------------------------- slot cache --
def slot_support(model) -> str | None:
    """None when :class:`SlotDecoder` can run ``model`` (a ``peft`` wrapper: the model it wraps, whose
    Linear modules apply the adapters); else why not."""
    model = base_module(model)
    why = decoder_config_problem(getattr(model, "config", None))
    if why is not None:
        return why
    core = getattr(model, "model", None)
    if core is None or not hasattr(model, "lm_head"):
        return "not the standard causal-LM layout (model.model, lm_head)"
    return decoder_layout_problem(core)


def decoder_config_problem(cfg) -> str | None:
    """None when a model's config is one the slot decoder and the learner's tree forward run module
    by module (Qwen2 or Llama, full attention in every layer, no tensor-parallel pretraining split);
    else why not."""
    mt = getattr(cfg, "model_type", None)
    if mt not in SLOT_MODEL_TYPES:
        return f"model type {mt!r} (supported: {', '.join(SLOT_MODEL_TYPES)})"
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        return "sliding-window attention layers"
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    return None


def decoder_layout_problem(core) -> str | None:
    """None when ``core`` (a causal LM's ``model``) has the standard decoder layout the slot
    decoder and the learner's tree forward run module by module; else what it lacks."""
    need = ("embed_tokens", "layers", "norm", "rotary_emb")
    if not all(hasattr(core, a) for a in need):
        return "not the standard decoder layout (embed_tokens, layers, norm, rotary_emb)"
    for layer in core.layers:
        att = getattr(layer, "self_attn", None)
        if att is None or not all(hasattr(att, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling")):
            return "an attention module without q/k/v/o projections"
        if not all(hasattr(layer, a) for a in ("input_layernorm", "post_attention_layernorm", "mlp")):
            return "a decoder layer without the standard norms and MLP"
    return None


# Slot buffers outlive a rollout: zero-filling a fresh cache of a few hundred MB costs more than a
# rollout step. A decoder takes its model's buffers out of the pool and puts them back on close(),
# so two decoders never share them. Stale entries are finite values of earlier rollouts, always
# masked out (a pass whose logits are not finite raises, and its buffers are not returned).
_POOL: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[list[torch.Tensor], list[torch.Tensor]]]" = (
    weakref.WeakKeyDictionary()
)
_POOL_LOCK = threading.Lock()
_STATIC_ROPE = ("default", "linear", "llama3")  # rotary tables that do not depend on the sequence length


class SlotDecoder:
    """Per-row KV slots written in place; a step's real tokens packed into one flat batch."""

    pads_wide = False

    def __init__(self, model, max_len: int | None = None, fuse: bool = True):
        """``max_len``: the longest context a row can reach (the contract's token limit); the cache
        grows by doubling up to it, never past it unless a row needs more. ``fuse``: run each layer's
        projections as four matmuls of effective weights (:mod:`mentorrl.rollout.fused`, LoRA merged
        into a copy); False runs the model's own Linear modules."""
        why = slot_support(model)
        if why is not None:
            raise ValueError(f"the slot decoder cannot run this model: {why}")
        model = base_module(model)  # a peft wrapper's model: running its modules applies the adapters
        self.model = model
        self.max_len = max_len
        core = model.model
        self.layers = list(core.layers)
        self.embed, self.norm, self.rotary, self.lm_head = core.embed_tokens, core.norm, core.rotary_emb, model.lm_head
        cfg = model.config
        att = self.layers[0].self_attn
        self.nh, self.nkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = att.head_dim if hasattr(att, "head_dim") else cfg.hidden_size // self.nh
        self.rope = sys.modules[type(att).__module__].apply_rotary_pos_emb
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        with _POOL_LOCK:
            k, v = _POOL.pop(model, ([], []))
        if k and (k[0].dtype != self.dtype or k[0].device != self.device or len(k) != len(self.layers)):
            k, v = [], []
        self.k: list[torch.Tensor] = k  # per layer [slots, kv heads, capacity, head dim]
        self.v: list[torch.Tensor] = v
        self.static_rope = getattr(self.rotary, "rope_type", "default") in _STATIC_ROPE
        self._cos = self._sin = None  # rotary tables over the capacity (static rope types)
        self.closed = False
        self.fuse = fuse
        self.refresh_weights()
        self.reset(0)
        self.stats = {
            "slot_moves": 0,
            "cache_grows": 0,
            "shared_rows": 0,
            "fused": float(self.fused is not None),
            "computed_tokens": 0,  # tokens through the layers (a follower's chunk is not)
            "logit_rows": 0,  # rows through the LM head
            "attended": 0,  # (token, context position) pairs attention computed
        }

    def close(self) -> None:
        """Return the cache buffers to the model's pool (a later decoder reuses them)."""
        if self.closed:
            return
        self.closed = True
        if self.k:
            with _POOL_LOCK:
                _POOL[self.model] = (self.k, self.v)
        self.k, self.v = [], []

    # ---------------------------------------------------------------------------- rows --
    @property
    def lens(self) -> list[int]:
        """Each row's context length (row ``i`` lives in slot ``i``)."""
        return [len(c) for c in self.ctx]

    def refresh_weights(self) -> None:
        """Take the effective projection weights again (:mod:`mentorrl.rollout.fused`), or run the
        model's own modules where they cannot be fused or there is no memory for the copy."""
        self.fused = None  # the old copy goes first
        self._weights_key = self._layers_key()
        if self.fuse and _room_for_copy(self.layers, self.device):
            self.fused = fuse_layers(self.layers)

    def _layers_key(self) -> tuple:
        """Where the layers' parameters live and how often each was written: any weight change (an optimizer
        step, ``load_state_dict``, a new ``.data``) changes it, whoever made it and whether or not the engine
        was told (an SAO actor loads new weights and keeps its KV cache)."""
        return tuple((p.data_ptr(), p._version) for layer in self.layers for p in layer.parameters())

    def reset(self, n: int) -> None:
        self.ctx: list[list[int]] = [[] for _ in range(n)]  # each row's context (what its slot holds)
        self.keys: list[int] = [0] * n  # a running hash of it

    def add_rows(self, n: int) -> None:
        self.ctx += [[] for _ in range(n)]
        self.keys += [0] * n

    def truncate(self, row: int, length: int) -> None:
        """Cut row ``row``'s context back to its first ``length`` tokens: attention reads a slot up to its
        row's context length, so the entries past it are ignored, and the next tokens fed overwrite them."""
        if not 0 <= length <= len(self.ctx[row]):
            raise ValueError(f"row {row} holds {len(self.ctx[row])} tokens; cannot cut it to {length}")
        if length < len(self.ctx[row]):
            del self.ctx[row][length:]
            self.keys[row] = hash(("truncated", tuple(self.ctx[row])))  # a leader is matched token by token

    def drop(self, keep: list[int]) -> list[int]:
        n = len(keep)
        kept = set(keep)
        holes = [j for j in range(n) if j not in kept]  # freed slots below the new row count
        movers = [i for i in keep if i >= n]  # kept rows above it, moved down into the holes
        order = list(range(n))
        for h, m in zip(holes, movers):
            length = len(self.ctx[m])
            for k, v in zip(self.k, self.v) if length else ():  # an unfed row may have no slot yet
                k[h, :, :length] = k[m, :, :length]
                v[h, :, :length] = v[m, :, :length]
            order[h] = m
            self.stats["slot_moves"] += 1
        self.ctx = [self.ctx[o] for o in order]
        self.keys = [self.keys[o] for o in order]
        return order

    def _ensure(self, slots: int, capacity: int) -> None:
        have_s = self.k[0].shape[0] if self.k else 0
        have_c = self.k[0].shape[2] if self.k else 0
        if slots <= have_s and capacity <= have_c:
            return
        s = max(slots, have_s)
        c = max(have_c, 64)
        while c < capacity:
            c *= 2
        if self.max_len is not None:  # never below what the buffers hold (pooled ones may be longer)
            c = max(have_c, capacity, min(c, self.max_len))
        if self.k:
            self.stats["cache_grows"] += 1
        for li in range(len(self.layers)):
            for store in (self.k, self.v):
                new = torch.zeros(s, self.nkv, c, self.hd, dtype=self.dtype, device=self.device)
                if li < len(store):
                    old = store[li]
                    new[: old.shape[0], :, : old.shape[2]] = old
                    store[li] = new
                else:
                    store.append(new)

    # ------------------------------------------------------------------------- forward --
    def prefill_shared(self, prefix: list[int]) -> bool:
        n = len(self.ctx)
        if n == 0 or any(self.ctx):
            return False
        self._forward([list(prefix)] + [[] for _ in range(n - 1)])
        m = len(prefix)
        for k, v in zip(self.k, self.v):
            k[1:n, :, :m] = k[0:1, :, :m]
            v[1:n, :, :m] = v[0:1, :, :m]
        self.ctx = [list(prefix) for _ in range(n)]
        self.keys = [hash((0, tuple(prefix)))] * n
        return True

    def forward(self, chunks: list[list[int]]) -> torch.Tensor:
        """Rows whose context and chunk are the same (a GRPO group's members share their prompt,
        and often their first tokens) are computed once: the first such row runs, the others get
        a copy of its new cache entries and its logits."""
        leader: dict[int, int] = {}
        follows: dict[int, int] = {}
        keys = list(self.keys)
        for i, c in enumerate(chunks):
            if not c:
                continue
            keys[i] = hash((self.keys[i], tuple(c)))
            j = leader.get(keys[i])
            if j is None:
                leader[keys[i]] = i
            elif chunks[j] == c and self.ctx[j] == self.ctx[i]:  # equal hashes are checked token by token
                follows[i] = j
        logits = self._forward([[] if i in follows else c for i, c in enumerate(chunks)] if follows else chunks)
        self.keys = keys
        if not follows:
            return logits
        at = {i: j for j, i in enumerate(i for i, c in enumerate(chunks) if c and i not in follows)}
        # copy the leaders' new cache entries: every copied position in one indexed op per layer
        dst_rows: list[int] = []
        src_rows: list[int] = []
        at_pos: list[int] = []
        for f, src in follows.items():
            a, b = len(self.ctx[f]), len(self.ctx[src])  # the leader's chunk is in already
            dst_rows.extend([f] * (b - a))
            src_rows.extend([src] * (b - a))
            at_pos.extend(range(a, b))
            self.ctx[f].extend(chunks[f])
        dev = self.device
        dst_t, src_t, pos_t = (torch.tensor(x, device=dev) for x in (dst_rows, src_rows, at_pos))
        for k, v in zip(self.k, self.v):
            k[dst_t, :, pos_t] = k[src_t, :, pos_t]
            v[dst_t, :, pos_t] = v[src_t, :, pos_t]
        self.stats["shared_rows"] += len(follows)
        pick = [at[follows.get(i, i)] for i, c in enumerate(chunks) if c]
        return logits[torch.tensor(pick, device=logits.device)]

    def _plan(self, chunks: list[list[int]]) -> "_Packed":
        """The fed rows' tokens packed flat, with where each goes in its slot and how it attends."""
        n = len(chunks)
        dev = self.device
        fed = [i for i, c in enumerate(chunks) if c]
        start = self.lens
        end = [start[i] + len(chunks[i]) for i in range(n)]
        self._ensure(n, max(end))
        ids: list[int] = []
        tok_row: list[int] = []
        tok_pos: list[int] = []
        offsets: list[int] = []  # where each fed row's tokens begin in the flat batch
        for i in fed:
            offsets.append(len(ids))
            ids.extend(chunks[i])
            tok_row.extend([i] * len(chunks[i]))
            tok_pos.extend(range(start[i], end[i]))
        p = _Packed(
            n=n,
            fed=fed,
            chunks=chunks,
            end=end,
            offsets=offsets,
            ids=ids,
            rows_t=torch.tensor(tok_row, device=dev),
            pos_t=torch.tensor(tok_pos, device=dev),
            last=torch.tensor([o + len(chunks[i]) - 1 for o, i in zip(offsets, fed)], device=dev),
            dec=[j for j, i in enumerate(fed) if len(chunks[i]) == 1],  # positions in `fed`
            wide=[j for j, i in enumerate(fed) if len(chunks[i]) > 1],
            lmax=max((end[i] for i in fed), default=1),  # rows not fed (a server's retained rows) take no part
        )
        if p.dec:
            p.dec_tok = torch.tensor([offsets[j] for j in p.dec], device=dev)
            p.dec_rows = torch.tensor([fed[j] for j in p.dec], device=dev)
            p.all_rows = len(p.dec) == n
            # Few decode rows (the rest wait, prefill a chunk, or follow a leader with the same context):
            # attend over copies of their own slots up to their own longest context, instead of over
            # every slot up to the last fed one, up to the longest context of a fed row.
            p.gather = len(p.dec) <= GATHER_SHARE * n
            if p.gather and dev.type == "cpu":
                p.dec_own = [(fed[j], end[fed[j]]) for j in p.dec]
            elif p.gather:
                p.l_dec = max(end[fed[j]] for j in p.dec)
                ends = torch.tensor([end[fed[j]] for j in p.dec], device=dev)
                p.dec_mask = (torch.arange(p.l_dec, device=dev)[None, :] < ends[:, None])[:, None, None, :]
            else:
                p.n_att = fed[-1] + 1  # the rows after the last fed one are left out
                ends = torch.tensor(end[: p.n_att], device=dev).clamp(min=1)
                p.dec_mask = (torch.arange(p.lmax, device=dev)[None, :] < ends[:, None])[:, None, None, :]
        for j in p.wide:
            i = fed[j]
            if start[i] == 0:
                p.wide_masks.append(None)  # a fresh context: plain causal
            else:
                q_at = torch.arange(start[i], end[i], device=dev)[:, None]
                p.wide_masks.append(torch.arange(end[i], device=dev)[None, :] <= q_at)
        return p

    def _rotary(self, h: torch.Tensor, pos_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at each packed token's position, ``[N, head dim]``."""
        if self.static_rope:
            cap = self.k[0].shape[2]
            if self._cos is None or self._cos.shape[0] < cap:
                table = self.rotary(h, torch.arange(cap, device=self.device)[None])
                self._cos, self._sin = table[0][0], table[1][0]
            return self._cos[pos_t], self._sin[pos_t]
        cos, sin = self.rotary(h, pos_t[None])
        return cos[0], sin[0]

    def _attend(self, p: "_Packed", q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention output ``[N, heads, head dim]``: decode rows together (over their gathered slots,
        or every slot; few decode rows on a CPU: each over its own slot), each wide chunk over its own slot."""
        gqa = self.nkv != self.nh
        out = q.new_empty(len(p.ids), self.nh, self.hd)
        if p.dec and p.dec_own:
            # On a CPU, copying the decode rows' slots costs several times the attention itself (measured:
            # 50 rows of ~450 tokens, 10.6 ms to copy against 2 ms to attend in a loop): each row attends
            # over its own slot, a view up to its own context length, no mask.
            qd = q[p.dec_tok][:, :, None, :]
            od = torch.cat(
                [
                    F.scaled_dot_product_attention(
                        qd[j : j + 1], K[i : i + 1, :, :e], V[i : i + 1, :, :e], scale=scale, enable_gqa=gqa
                    )
                    for j, (i, e) in enumerate(p.dec_own)
                ]
            )
            out[p.dec_tok] = od[:, :, 0, :]
        elif p.dec and p.gather:
            # index_select copies whole contiguous runs: about twice as fast as K[p.dec_rows, :, : p.l_dec]
            od = F.scaled_dot_product_attention(
                q[p.dec_tok][:, :, None, :],
                torch.index_select(K[:, :, : p.l_dec], 0, p.dec_rows),
                torch.index_select(V[:, :, : p.l_dec], 0, p.dec_rows),
                attn_mask=p.dec_mask,
                scale=scale,
                enable_gqa=gqa,
            )
            out[p.dec_tok] = od[:, :, 0, :]
        elif p.dec:
            n, lmax = p.n_att, p.lmax
            if p.all_rows:
                qd = q[p.dec_tok][:, :, None, :]
            else:
                qd = q.new_zeros(n, self.nh, 1, self.hd)
                qd[p.dec_rows] = q[p.dec_tok][:, :, None, :]
            od = F.scaled_dot_product_attention(
                qd, K[:n, :, :lmax], V[:n, :, :lmax], attn_mask=p.dec_mask, scale=scale, enable_gqa=gqa
            )
            out[p.dec_tok] = od[:, :, 0, :] if p.all_rows else od[p.dec_rows][:, :, 0, :]
        for j, mask in zip(p.wide, p.wide_masks):
            i = p.fed[j]
            o, c, e = p.offsets[j], len(p.chunks[i]), p.end[i]
            qw = q[o : o + c].transpose(0, 1)[None]  # [1, heads, c, head dim]
            ow = F.scaled_dot_product_attention(
                qw,
                K[i : i + 1, :, :e],
                V[i : i + 1, :, :e],
                attn_mask=mask,
                is_causal=mask is None,
                scale=scale,
                enable_gqa=gqa,
            )
            out[o : o + c] = ow[0].transpose(0, 1)
        return out

    def _forward(self, chunks: list[list[int]]) -> torch.Tensor:
        if self.fused is not None and self._layers_key() != self._weights_key:
            self.refresh_weights()  # the fused groups are a copy: never decode with stale weights
        p = self._plan(chunks)
        N = len(p.ids)
        h = self.embed(torch.tensor(p.ids, device=self.device))  # [N, hidden]
        cos, sin = self._rotary(h, p.pos_t)
        for li, layer in enumerate(self.layers):
            att = layer.self_attn
            fl = self.fused[li] if self.fused is not None else None
            a = layer.input_layernorm(h)
            if fl is not None:
                q, k, v = fl.qkv(a).split(fl.splits, dim=-1)
            else:
                q, k, v = att.q_proj(a), att.k_proj(a), att.v_proj(a)
            q = q.reshape(N, self.nh, self.hd)
            k = k.reshape(N, self.nkv, self.hd)
            v = v.reshape(N, self.nkv, self.hd)
            q, k = self.rope(q, k, cos, sin, unsqueeze_dim=1)
            K, V = self.k[li], self.v[li]
            K[p.rows_t, :, p.pos_t] = k.to(K.dtype)
            V[p.rows_t, :, p.pos_t] = v.to(V.dtype)
            out = self._attend(p, q, K, V, att.scaling).reshape(N, self.nh * self.hd)
            if fl is None:
                h = h + att.o_proj(out)
                h = h + layer.mlp(layer.post_attention_layernorm(h))
                continue
            h = h + fl.o(out)
            gate, up = fl.gate_up(layer.post_attention_layernorm(h)).split(fl.inter, dim=-1)
            h = h + fl.down(fl.act(gate) * up)
        attended = 0
        for i in p.fed:
            c, s = len(chunks[i]), len(self.ctx[i])
            attended += c * s + c * (c + 1) // 2
            self.ctx[i].extend(chunks[i])
        self.stats["computed_tokens"] += N
        self.stats["attended"] += attended
        self.stats["logit_rows"] += len(p.fed)
        logits = self.lm_head(self.norm(h[p.last]))
        if not all_finite(logits):
            self.k, self.v, self.closed = [], [], True  # never pool buffers that may hold non-finite values
            raise FloatingPointError("the model's logits are not finite (NaN or inf) in this rollout step")
        return logits


@dataclass
class _Packed:
    """One slot-decoder pass: the fed rows' tokens flat (``ids``, their slot rows and positions, the
    last token of each fed row), the decode rows (one token each) and the wide chunks, with masks."""

    n: int  # rows in the batch
    fed: list[int]
    chunks: list[list[int]]
    end: list[int]  # each row's context length after the pass
    offsets: list[int]
    ids: list[int]
    rows_t: torch.Tensor
    pos_t: torch.Tensor
    last: torch.Tensor
    dec: list[int]  # positions in ``fed`` of the one-token rows
    wide: list[int]  # positions in ``fed`` of the multi-token chunks
    lmax: int  # the longest context of a fed row after the pass
    gather: bool = False
    n_att: int = 0  # the rows a decode step without gathering attends over
    all_rows: bool = False
    l_dec: int = 0
    dec_tok: torch.Tensor | None = None
    dec_rows: torch.Tensor | None = None
    dec_mask: torch.Tensor | None = None
    dec_own: list[tuple[int, int]] = field(default_factory=list)  # on a CPU: (row, context length) per decode row
    wide_masks: list = field(default_factory=list)


# ---------------------------------------------------------------------------------- choice --
_checked: "weakref.WeakKeyDictionary[torch.nn.Module, str | None]" = weakref.WeakKeyDictionary()


_CHECK_COPY_BYTES = 4 << 30  # a low-precision model up to this size (in float32) is checked as a float32 copy


@torch.no_grad()
def slot_decoder_checks(model) -> str | None:
    """None when :class:`SlotDecoder` gives ``model``'s own logits (checked once per model
    object, on a short two-row rollout against ``model.forward``); else why not.

    The check is of the decoder's algorithm (cache layout, positions, masks, fused projections), so it
    runs in float32: a bf16 or fp16 model is checked as a float32 copy of itself (on the CPU), or,
    past ``_CHECK_COPY_BYTES``, as a two-layer float32 replica of its architecture. Comparing in the
    model's own low precision would measure rounding, which 30 layers amplify past any useful
    tolerance on random tokens (SmolLM2 with bf16 LoRA: 0.375 on logits of 34, exactly what a rotary
    table one position off gives)."""
    if model in _checked:
        return _checked[model]
    why = slot_support(model)
    if why is None:
        try:
            ref = _float32_reference(model)
        except Exception as exc:  # noqa: BLE001 - a model that cannot be copied falls back, named in the log
            ref, why = None, f"no float32 copy to check against: {type(exc).__name__}: {exc}"
        if ref is not None:
            why = _compare_with_forward(ref)
    _checked[model] = why
    if why is not None:
        log.info("rollout decoder: the model's own forward (%s)", why)
    return why


def _float32_reference(model):
    """``model`` itself when it computes in float32; else a float32 CPU copy (the whole model up to
    ``_CHECK_COPY_BYTES``, else a two-layer replica of its architecture with random unit-scale weights)."""
    params = list(model.parameters())
    if all(p.dtype == torch.float32 for p in params if p.is_floating_point()):
        return model
    import copy

    if sum(p.numel() for p in params) * 4 <= _CHECK_COPY_BYTES:
        return copy.deepcopy(model).to(device="cpu", dtype=torch.float32).eval()
    base = base_module(model)
    cfg = copy.deepcopy(base.config)
    cfg.num_hidden_layers = 2
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types)[:2]
    replica = type(base)(cfg).to(dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    for p in replica.parameters():  # weights that make attention position-sensitive (the default init's do not)
        if p.dim() == 2:
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return replica


def _compare_with_forward(model) -> str | None:
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, vocab, (7,), generator=g).tolist()
    b = torch.randint(0, vocab, (3,), generator=g).tolist()
    c = torch.randint(0, vocab, (4,), generator=g).tolist()
    try:
        dec = SlotDecoder(model)
        dec.reset(2)
        first = dec.forward([a, b])  # two fresh prompts
        second = dec.forward([[5], c])  # a decode step beside a chunk on a non-empty context
    except Exception as exc:  # noqa: BLE001 - an unusual module falls back, named in the log
        return f"slot decoder failed: {type(exc).__name__}: {exc}"
    device = next(model.parameters()).device
    want = []
    for seq in (a, b, a + [5], b + c):
        out = model(input_ids=torch.tensor([seq], device=device), use_cache=False)
        want.append(out.logits[0, -1].float())
    got = [first[0], first[1], second[0], second[1]]
    for x, y in zip(got, want):
        scale = max(1.0, float(y.abs().max()))
        if not torch.allclose(x.float(), y, atol=2e-3 * scale, rtol=0):
            return f"slot decoder logits differ from the model's forward by {float((x.float() - y).abs().max()):.3g}"
    return None


def _room_for_copy(layers, device: torch.device) -> bool:
    """Whether a fused copy of ``layers``' projections fits: always on a CPU, on an accelerator when
    it takes at most half of the free memory."""
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return 2 * fused_bytes(layers) <= free


def all_finite(x: torch.Tensor) -> bool:
    """Whether every value of ``x`` is finite, read from one float32 sum: a NaN or an infinity anywhere
    makes the sum NaN or infinite. (A sum past float32's range would read as not finite too; logits that
    large are no distribution either.) About 6x cheaper than ``isfinite(x).all()`` on a decode pass's
    logits (128 rows x 49,152 words), which it ran on every pass."""
    return bool(torch.isfinite(x.sum(dtype=torch.float32)))


def make_decoder(
    model, kind: str = "auto", compact_ratio: float = 1.25, pad_token_id: int = 0, max_len: int | None = None
) -> Decoder:
    """``kind``: ``slots`` (:class:`SlotDecoder`, an error if the model does not support it),
    ``hf`` (:class:`DynamicCacheDecoder`), or ``auto`` (slots where the model passes
    :func:`slot_decoder_checks`, else hf)."""
    if kind == "hf":
        return DynamicCacheDecoder(model, compact_ratio, pad_token_id)
    if kind == "slots":
        return SlotDecoder(model, max_len)
    if kind != "auto":
        raise ValueError(f"unknown decoder {kind!r} (auto, slots, hf)")
    return (
        SlotDecoder(model, max_len)
        if slot_decoder_checks(model) is None
        else DynamicCacheDecoder(model, compact_ratio, pad_token_id)
    )
