"""The learner's memory levers (``optim:`` settings), each a small piece the :class:`~mentorrl.train.learner.Learner` composes:

* :func:`token_budget_slices` -- micro-batches sized by a token budget (``optim.micro_batch_tokens``)
  instead of a row count: rows are taken in order while the micro-batch's padded size (rows x its
  longest row, what the padded forward holds; a packed forward holds at most that) stays within the budget;
* :func:`enable_gradient_checkpointing` -- ``optim.gradient_checkpointing``: the model's own
  (Hugging Face) activation checkpointing, non-reentrant; the learner's prefix-tree forward
  (:func:`mentorrl.models.tree.tree_hidden_states`) checkpoints its layers the same way;
* :class:`OffloadedAdamW` -- ``optim.offload_optimizer``: AdamW whose state (and an fp32 copy of the
  parameters it updates) lives in CPU memory while the model sits on a GPU; the gradients come to the
  CPU for the step and the new weights go back. On a model already on the CPU it changes nothing, so
  :func:`offload_applies` is False there and the plain optimizer is used;
* :func:`set_malloc_mmap_threshold` -- the run's ``malloc_mmap_threshold``: glibc's allocator gives every
  block at least this large a mapping of its own, returned to the OS when it is freed. By default glibc
  raises that threshold each time such a block is freed (up to 32 MiB), after which a step's
  activations and gradients come from the heap and stay there, fragmented; at Qwen2-0.5B's shape
  under LoRA that retained 1.5 GiB, half of the step's peak (docs/scaling.md#memory). A low threshold
  has a price: every large tensor is a fresh mapping whose pages the kernel faults in and zeroes; a
  SmolLM2-135M LoRA SFT step under bf16 spent 40% of its time there (1.8x slower than with 1 GiB).
  :func:`choose_malloc_mmap_threshold` resolves ``auto``: 1 MiB (lean) when a stage asks to save memory
  (gradient checkpointing, a token budget or an offloaded optimizer), else 1 GiB (fast: freed blocks are
  reused from the heap, never faulted in again).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Iterable, Sequence

import torch

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters, glibc's malloc.h
MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")  # an explicit allocator setting wins
LEAN_MMAP_THRESHOLD = 1 << 20  # freed blocks of 1 MiB and more go back to the OS at once
FAST_MMAP_THRESHOLD = 1 << 30  # freed blocks stay in the heap and are reused without page faults
MEMORY_LEVERS = ("gradient_checkpointing", "micro_batch_tokens", "offload_optimizer")


def _glibc():
    """The process's C library when it is glibc (``mallopt`` and ``gnu_get_libc_version``), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 -- glibc only (musl has mallopt but not this)
        return libc
    except (OSError, AttributeError):
        return None


def set_malloc_mmap_threshold(nbytes: int | None, environ=os.environ) -> str | None:
    """Fix glibc's mmap threshold (and its trim threshold) at ``nbytes``, which also turns off glibc's
    dynamic raising of it. None when it is set; else why not (``nbytes`` None, the environment sets the
    allocator itself, or the C library is not glibc), and the process keeps its allocator as it is."""
    if nbytes is None:
        return "malloc_mmap_threshold is null"
    if any(k in environ for k in MALLOC_ENV):
        return "the environment sets the allocator (" + ", ".join(k for k in MALLOC_ENV if k in environ) + ")"
    libc = _glibc()
    if libc is None:
        return "the C library is not glibc"
    ok = libc.mallopt(_M_MMAP_THRESHOLD, int(nbytes)) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, int(nbytes)) == 1
    return None if ok else f"mallopt refused {nbytes} bytes"


def choose_malloc_mmap_threshold(setting: int | str | None, optims: dict[str, object]) -> tuple[int | None, str]:
    """``(bytes or None, why)`` for the run's ``malloc_mmap_threshold`` ``setting``; ``auto`` is
    :data:`LEAN_MMAP_THRESHOLD` when any of ``optims`` (section name -> its ``optim`` config) turns on a
    memory lever (:data:`MEMORY_LEVERS`), else :data:`FAST_MMAP_THRESHOLD`."""
    if setting != "auto":
        return setting, "set in the config"  # type: ignore[return-value]
    lean = [f"{name}.optim.{lever}" for name, o in optims.items() for lever in MEMORY_LEVERS if getattr(o, lever, None)]
    if lean:
        return (
            LEAN_MMAP_THRESHOLD,
            f"auto: 1 MiB, freed tensors return to the OS ({', '.join(lean)} asks to save memory)",
        )
    return FAST_MMAP_THRESHOLD, "auto: 1 GiB, freed tensors are reused from the heap (no stage sets a memory lever)"


def token_budget_slices(lengths: Sequence[int], lo: int, hi: int, budget: int) -> list[slice]:
    """Rows ``[lo, hi)`` in order, cut into consecutive micro-batches: a micro-batch takes the next row
    while ``rows x longest row`` stays within ``budget`` tokens; a row longer than the budget on its
    own is a micro-batch of one. Every row is in exactly one slice."""
    if budget < 1:
        raise ValueError(f"token budget must be >= 1, got {budget}")
    out: list[slice] = []
    start, longest = lo, 0
    for i in range(lo, hi):
        n = max(int(lengths[i]), 1)
        if i > start and (i - start + 1) * max(longest, n) > budget:
            out.append(slice(start, i))
            start, longest = i, 0
        longest = max(longest, n)
    if hi > start:
        out.append(slice(start, hi))
    return out


def row_count_slices(lo: int, hi: int, rows: int) -> list[slice]:
    """Rows ``[lo, hi)`` in micro-batches of ``rows``."""
    return [slice(s, min(s + rows, hi)) for s in range(lo, hi, rows)]


def micro_batch_slices(lengths: Sequence[int], lo: int, hi: int, cfg) -> list[slice]:
    """The micro-batches of rows ``[lo, hi)`` an ``optim:`` section asks for: by ``micro_batch_tokens``
    when it is set, else by ``micro_batch_size`` rows."""
    budget = getattr(cfg, "micro_batch_tokens", None)
    if budget:
        return token_budget_slices(lengths, lo, hi, budget)
    return row_count_slices(lo, hi, cfg.micro_batch_size)


def enable_gradient_checkpointing(model) -> str | None:
    """Turn on non-reentrant activation checkpointing in ``model`` (a Hugging Face model, or a module
    with one as its ``decoder``, e.g. a critic). None when it is on; else why it cannot be (the model
    then trains without it)."""
    names = ("activation_checkpointing_enable", "gradient_checkpointing_enable")
    target = model if any(hasattr(model, n) for n in names) else getattr(model, "decoder", None)
    if target is None or not any(hasattr(target, n) for n in names):
        return f"{type(model).__name__} has no Hugging Face activation checkpointing"
    if not getattr(target, "supports_gradient_checkpointing", False):
        return f"{type(target).__name__} does not support gradient checkpointing"
    enable = getattr(target, "activation_checkpointing_enable", None)  # transformers >= 5.x; the older name before
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        target.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return None


def offload_applies(model) -> bool:
    """Whether offloading ``model``'s optimizer state moves anything: its parameters are not on the CPU."""
    return any(p.device.type != "cpu" for p in model.parameters())


class OffloadedAdamW(torch.optim.AdamW):
    """AdamW stepping in CPU memory for parameters that live elsewhere (a GPU).

    It optimises fp32 CPU copies of the parameters: :meth:`step` refreshes each copy from its
    parameter (so a checkpoint load or weight sync in between is seen), brings the gradient over,
    steps on the CPU and writes the result back. The moments (``exp_avg``, ``exp_avg_sq``: twice the
    parameters in fp32) never occupy device memory. ``state_dict`` / ``load_state_dict`` are AdamW's, over
    the copies (same layout as a plain AdamW's)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], **kwargs):
        self.device_params = [p for p in params if p.requires_grad]
        copies = [p.detach().to("cpu", torch.float32, copy=True) for p in self.device_params]
        super().__init__(copies, **kwargs)

    def _copies(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("OffloadedAdamW.step takes no closure")
        for dev, cpu in zip(self.device_params, self._copies()):
            cpu.copy_(dev)
            cpu.grad = None if dev.grad is None else dev.grad.detach().to("cpu", torch.float32)
        super().step()
        for dev, cpu in zip(self.device_params, self._copies()):
            dev.copy_(cpu, non_blocking=True)
            cpu.grad = None
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.device_params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        super().zero_grad(set_to_none=set_to_none)


__all__ = [
    "OffloadedAdamW",
    "enable_gradient_checkpointing",
    "micro_batch_slices",
    "offload_applies",
    "row_count_slices",
    "set_malloc_mmap_threshold",
    "choose_malloc_mmap_threshold",
    "token_budget_slices",
]
