"""The learner's memory levers: token-budget micro-batches, gradient checkpointing (the model's own
and the prefix-tree forward's) and CPU-offloaded optimizer state. Each must leave the update unchanged."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mentorrl.config import OptimConfig
from mentorrl.train import memory
from mentorrl.train.learner import Learner, make_optimizer
from mentorrl.train.memory import (
    OffloadedAdamW,
    enable_gradient_checkpointing,
    micro_batch_slices,
    offload_applies,
    token_budget_slices,
)

EXACT = dict(lr=1e-3, max_grad_norm=1e9)


# ------------------------------------------------------------------ token-budget packing ----
@settings(max_examples=300, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 400), min_size=0, max_size=40),
    budget=st.integers(1, 2000),
    lo_frac=st.floats(0, 1),
    hi_frac=st.floats(0, 1),
)
def test_token_budget_slices_cover_every_row_once_in_order_within_budget(lengths, budget, lo_frac, hi_frac):
    n = len(lengths)
    lo, hi = sorted((int(lo_frac * n), int(hi_frac * n)))
    slices = token_budget_slices(lengths, lo, hi, budget)
    rows = [i for s in slices for i in range(s.start, s.stop)]
    assert rows == list(range(lo, hi))  # every row exactly once, in order
    for s in slices:
        assert s.stop > s.start
        size = (s.stop - s.start) * max(lengths[s])
        assert size <= budget or s.stop - s.start == 1  # within budget unless one row alone exceeds it
    for a, b in zip(slices, slices[1:]):  # greedy: the next row did not fit
        assert (b.start - a.start + 1) * max(lengths[a.start : b.start + 1]) > budget


def test_micro_batch_slices_by_rows_without_a_budget():
    cfg = OptimConfig(micro_batch_size=3)
    assert micro_batch_slices([5] * 7, 1, 7, cfg) == [slice(1, 4), slice(4, 7)]
    cfg = OptimConfig(micro_batch_size=3, micro_batch_tokens=10)
    assert micro_batch_slices([5] * 7, 0, 7, cfg) == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 7)]
    with pytest.raises(ValueError):
        token_budget_slices([1], 0, 1, 0)


def _grads(m) -> list[torch.Tensor]:
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in m.parameters()]


def _close(a: list[torch.Tensor], b: list[torch.Tensor], tol: float = 1e-5) -> bool:
    return all(torch.allclose(x, y, rtol=tol, atol=tol) for x, y in zip(a, b))


@pytest.mark.parametrize("kind", ["sft", "token", "seq"])
def test_token_budget_update_equals_the_row_count_update(make_demos, model, tokenizer, kind):
    """The loss weighting in ``_accumulate`` stays exact: micro-batches cut by a token budget (of
    uneven row counts) give the same gradient and the same updated weights as fixed row counts."""
    _, demos = make_demos(6)
    g = torch.Generator().manual_seed(0)
    token_adv = [torch.randn(len(d.token_ids), generator=g) * torch.tensor(d.loss_mask) for d in demos]
    seq_adv = torch.randn(len(demos), generator=g)
    kw = {"agg": "token-mean", "eps_low": 1.0, "eps_high": 1e9}
    longest = max(len(d.token_ids) for d in demos)
    out = []
    for cfg in (
        OptimConfig(micro_batch_size=2, **EXACT),
        OptimConfig(micro_batch_tokens=2 * longest + 1, **EXACT),
        OptimConfig(micro_batch_tokens=3 * longest, **EXACT),
        OptimConfig(micro_batch_tokens=1, **EXACT),  # every row alone
    ):
        m = copy.deepcopy(model)
        learner = Learner(m, cfg, tokenizer.pad_token_id)
        if cfg.micro_batch_tokens:
            sizes = [s.stop - s.start for s in learner.micro_batches(demos, 0, len(demos))]
            assert sum(sizes) == len(demos)
        if kind == "sft":
            learner.sft_step(demos)
        elif kind == "token":
            learner.token_policy_step(demos, token_adv, "clipped", **kw)
        else:
            learner.policy_step(demos, seq_adv, "grpo", **kw)
        out.append((_grads(m), [p.detach().clone() for p in m.parameters()]))
    ref_g, ref_w = out[0]
    assert max(x.abs().max().item() for x in ref_g) > 0
    for grads, weights in out[1:]:
        assert _close(ref_g, grads) and _close(ref_w, weights)


# ------------------------------------------------------------------ gradient checkpointing ----
@pytest.mark.parametrize("pack", [True, "dense", False])
def test_gradient_checkpointing_gives_the_same_gradients(make_demos, model, tokenizer, pack, monkeypatch):
    """With ``optim.gradient_checkpointing`` the gradients equal the plain ones (1e-5) in every forward
    the learner runs: the block-sparse tree forward (which checkpoints its own layers), the dense tree
    mask and the padded forward (the model's own checkpointing)."""
    import mentorrl.models.tree as tree

    calls = {"n": 0}
    real = tree.checkpoint

    def counting(*a, **kw):
        calls["n"] += 1
        return real(*a, **kw)

    monkeypatch.setattr(tree, "checkpoint", counting)
    _, demos = make_demos(4)
    grads = []
    for gc in (False, True):
        m = copy.deepcopy(model)
        cfg = OptimConfig(
            gradient_checkpointing=gc, pack_prefixes=pack is not False, tree_attention=pack is True, **EXACT
        )
        learner = Learner(m, cfg, tokenizer.pad_token_id)
        assert learner.checkpointing_problem is None
        learner.sft_step(demos)
        grads.append(_grads(m))
        if gc:
            assert tree.checkpointing_on(m)
    assert _close(grads[0], grads[1])
    layers = model.config.num_hidden_layers
    assert calls["n"] == (layers if pack is True else 0)  # the tree forward checkpointed each layer once


def test_gradient_checkpointing_reports_a_model_without_it():
    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)

    assert "no Hugging Face activation checkpointing" in enable_gradient_checkpointing(Plain())


# ------------------------------------------------------------------ optimizer offload ----
def test_offloaded_adamw_keeps_its_state_on_the_cpu_and_steps_like_adamw():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    a, b = copy.deepcopy(net), copy.deepcopy(net)
    oa = torch.optim.AdamW(a.parameters(), lr=1e-2, weight_decay=0.1)
    ob = OffloadedAdamW(b.parameters(), lr=1e-2, weight_decay=0.1)
    x = torch.randn(16, 4)
    for _ in range(3):
        for m, o in ((a, oa), (b, ob)):
            o.zero_grad(set_to_none=True)
            m(x).pow(2).mean().backward()
            o.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.allclose(p, q, atol=1e-6)
    state = ob.state_dict()["state"]
    assert state and all(v.device.type == "cpu" for s in state.values() for v in s.values() if torch.is_tensor(v))
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for g in ob.param_groups for p in g["params"])
    # the optimizer steps copies: the module's own parameters are not the ones it holds
    assert {id(p) for p in b.parameters()}.isdisjoint({id(p) for g in ob.param_groups for p in g["params"]})
    # a weight load between steps is seen (the copies are refreshed from the parameters)
    with torch.no_grad():
        for p in b.parameters():
            p.zero_()
    ob.zero_grad()
    b(x).pow(2).mean().backward()
    ob.step()
    assert max(p.abs().max().item() for p in b.parameters()) < 0.05
    ob.load_state_dict(ob.state_dict())  # round-trips like AdamW's


def test_offload_is_a_no_op_for_a_cpu_learner(model, tokenizer):
    m = copy.deepcopy(model)
    assert not offload_applies(m)
    opt, _ = make_optimizer(m, OptimConfig(offload_optimizer=True))
    assert type(opt) is torch.optim.AdamW
    assert (
        Learner(m, OptimConfig(offload_optimizer=True), tokenizer.pad_token_id).optimizer.__class__ is torch.optim.AdamW
    )


# ---- the allocator: freed tensors go back to the OS (the run's malloc_mmap_threshold) ----------------
_FRAGMENT = r"""
import json, sys, torch
from mentorrl.train.memory import set_malloc_mmap_threshold

def rss_mib():
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("VmRSS")) / 1024

why = set_malloc_mmap_threshold(1 << 20 if sys.argv[1] == "fixed" else None, environ={})
t = torch.empty(16 << 20, dtype=torch.uint8).fill_(1)
del t  # glibc's default: freeing a 16 MiB mapping raises the threshold to 16 MiB
base = rss_mib()
big, small = [], []
for _ in range(32):  # a step's large tensors, with small long-lived blocks allocated between them
    big.append(torch.empty(8 << 20, dtype=torch.uint8).fill_(1))
    small.append(torch.ones(256))
del big
print(json.dumps({"why": why, "retained_mib": rss_mib() - base}))
"""


def _retained(mode: str) -> dict:
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _FRAGMENT, mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@pytest.mark.skipif(memory._glibc() is None, reason="glibc's allocator only")
def test_fixed_mmap_threshold_returns_freed_tensors_to_the_os():
    """With the run's threshold, 256 MiB of freed 8 MiB tensors leave the process, although small live
    blocks were allocated between them (glibc's default, after an earlier large free, keeps them in the heap)."""
    fixed = _retained("fixed")
    assert fixed["why"] is None
    assert fixed["retained_mib"] < 32, fixed  # glibc's default kept 32-256 MiB here, by the machine's load


def test_mmap_threshold_defers_to_the_environment_and_null():
    assert "MALLOC_MMAP_THRESHOLD_" in memory.set_malloc_mmap_threshold(1 << 20, {"MALLOC_MMAP_THRESHOLD_": "1"})
    assert memory.set_malloc_mmap_threshold(None, {}) == "malloc_mmap_threshold is null"


def test_mmap_threshold_is_validated_before_the_first_step():
    from mentorrl.config import ConfigError
    from mentorrl.config.loading import load_config

    with pytest.raises(ConfigError, match="malloc_mmap_threshold"):
        load_config(None, ["malloc_mmap_threshold=12"])
    assert load_config(None, ["malloc_mmap_threshold=null"]).malloc_mmap_threshold is None


def test_auto_mmap_threshold_is_lean_only_where_a_stage_asks_to_save_memory():
    """``auto`` (the default): 1 GiB, so a step's freed tensors are reused without page faults, unless a
    recipe stage turns on a memory lever; an explicit setting (bytes or null) is kept as written."""
    from mentorrl.config.loading import load_config
    from mentorrl.train.workspace import stage_optims

    cfg = load_config(None, [])
    assert cfg.malloc_mmap_threshold == "auto"
    nbytes, why = memory.choose_malloc_mmap_threshold("auto", stage_optims(cfg))
    assert nbytes == memory.FAST_MMAP_THRESHOLD and "auto" in why
    for lever, value in (
        ("gradient_checkpointing", "true"),
        ("micro_batch_tokens", "512"),
        ("offload_optimizer", "true"),
    ):
        cfg = load_config(None, [f"grpo.optim.{lever}={value}"])
        nbytes, why = memory.choose_malloc_mmap_threshold("auto", stage_optims(cfg))
        assert nbytes == memory.LEAN_MMAP_THRESHOLD and f"grpo.optim.{lever}" in why
    # a lever on a stage the recipe does not run changes nothing
    cfg = load_config(None, ["ppo.optim.gradient_checkpointing=true"])
    assert memory.choose_malloc_mmap_threshold("auto", stage_optims(cfg))[0] == memory.FAST_MMAP_THRESHOLD
    assert memory.choose_malloc_mmap_threshold(1 << 20, {})[0] == 1 << 20
    assert memory.choose_malloc_mmap_threshold(None, {})[0] is None


def test_mmap_threshold_setting_rejects_unknown_words():
    from mentorrl.config import ConfigError
    from mentorrl.config.loading import load_config

    with pytest.raises(ConfigError, match="malloc_mmap_threshold"):
        load_config(None, ["malloc_mmap_threshold=fast"])
    assert load_config(None, [f"malloc_mmap_threshold={1 << 20}"]).malloc_mmap_threshold == 1 << 20
