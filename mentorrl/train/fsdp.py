"""The sharded learner (``distributed.strategy: fsdp2``): FSDP2 (``torch.distributed.fsdp.fully_shard``)
over a training copy of the policy, under ``torchrun`` (gloo on CPU, NCCL where there are GPUs).

:class:`ShardedModule` deep-copies the policy and shards the copy: each decoder layer is one
``fully_shard`` group and the root (embeddings, final norm, head) another, every parameter a
``DTensor`` sharded on dim 0 over the ranks. The optimizer holds only this rank's shards (so its
AdamW state and the gradients are 1/world of the model's); each forward all-gathers a layer's
weights just before it runs and frees them after, and backward reduce-scatters the gradients.

The policy itself (the model every stage holds: the rollout, evaluation, the reference copy and
the final weights read it) stays a plain, full model on every rank: after each optimizer step
:meth:`ShardedModule.publish` all-gathers the updated weights (``full_tensor()``) into it. That is
the cost of a rollout on every rank: one all-gather of the whole model per step (the same volume
as one forward's), and a full copy of the weights in memory beside the shards -- parameters cost
``(1 + 1/W)`` of the model's, gradients and optimizer state ``1/W``.

Every rank must issue the same collectives in the same order, so under FSDP2 the learner
(:class:`~mentorrl.train.learner.Learner`) runs the same number of micro-batches on every rank
(a rank with fewer runs zero-weight ones) and each micro-batch's forward is one plain call of
every layer (:func:`~mentorrl.models.batch.plain_forwards`: no prefix packing, no shared-prefix
KV reuse, which call layers a data-dependent number of times).

Checkpoints (:func:`save_shards` / :func:`load_shards`) are ``torch.distributed.checkpoint`` (DCP)
directories: every rank writes its shards of the model and the optimizer state
(``__<rank>_0.distcp``) and rank 0 the ``.metadata``; :func:`load_full_weights` reads the full
weights back in one process (no process group), e.g. to check a checkpoint or rebuild the final dir.
"""

from __future__ import annotations

import copy
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

DCP_METADATA = ".metadata"


class CallThrough(torch.nn.Module):
    """Lets a wrapper run any forward function of the model: ``W(CallThrough(m))(fn, *args) == fn(m, *args)``.

    The learner's forwards (split decoder / head, shared-prefix KV reuse, top-k selection) call
    submodules, not ``model(...)``; going through the wrapper's own forward is what arms DDP's
    gradient all-reduce, or FSDP2's all-gather of the root's parameters, for what follows."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(self.model, *args)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a Hugging Face causal LM (its ``_no_split_modules`` classes, else
    the decoder's ``layers``): one FSDP2 group each."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        layers = list(getattr(decoder, "layers", None) or [])
    return layers


class ShardedModule:
    """The FSDP2 training copy of a policy and what the learner does with it (see the module doc)."""

    sharded = True  # the learner's marker: lockstep micro-batches, sharded clipping, publish, DCP checkpoints

    def __init__(self, model: torch.nn.Module):
        from torch.distributed.fsdp import fully_shard

        self.module = copy.deepcopy(model)
        for layer in decoder_layers(self.module):
            fully_shard(layer)
        self.root = fully_shard(CallThrough(self.module))

    def __call__(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(training copy, *args)`` with every layer called once (see the module doc)."""
        from mentorrl.models.batch import plain_forwards

        with plain_forwards():
            return self.root(fn, *args)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate this micro-batch's gradients locally (unsharded): no reduce-scatter until the last."""
        self.root.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.root.set_requires_gradient_sync(True)

    def parameters(self):
        return self.module.parameters()

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip the sharded gradients to a global L2 norm of ``max_norm``; returns the norm before clipping
        (the same on every rank: the per-rank partial norms are reduced over the ranks)."""
        from torch.distributed.tensor import DTensor

        params = [p for p in self.module.parameters() if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad for p in params])
        if isinstance(total, DTensor):
            total = total.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return float(total)

    @torch.no_grad()
    def publish(self, full: torch.nn.Module) -> None:
        """All-gather the training copy's weights into ``full`` (the plain policy), on every rank."""
        from torch.distributed.tensor import DTensor

        dest = dict(full.named_parameters())
        for name, p in self.module.named_parameters():
            value = p.full_tensor() if isinstance(p, DTensor) else p
            dest[name].copy_(value.detach())

    @torch.no_grad()
    def load_full(self, full: torch.nn.Module) -> None:
        """Set the training copy's shards from ``full``'s weights (every rank holds the same ``full``)."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        src = dict(full.named_parameters())
        for name, p in self.module.named_parameters():
            if isinstance(p, DTensor):
                p.copy_(distribute_tensor(src[name].detach(), p.device_mesh, p.placements))
            else:
                p.copy_(src[name])


def _states(sharded: ShardedModule, optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(sharded.module, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def save_shards(path: Path, sharded: ShardedModule, optimizer) -> None:
    """Every rank: write its shards of the model and the optimizer state into the DCP directory ``path``."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_states(sharded, optimizer), checkpoint_id=str(path))


def load_shards(path: Path, sharded: ShardedModule, optimizer) -> None:
    """Every rank: read its shards of the model and the optimizer state from the DCP directory ``path``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _states(sharded, optimizer)
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(sharded.module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def is_sharded_checkpoint(path: Path) -> bool:
    """Whether ``path`` holds a DCP (sharded) checkpoint rather than Hugging Face weights."""
    return (Path(path) / DCP_METADATA).is_file()


@torch.no_grad()
def load_full_weights(model: torch.nn.Module, path: Path) -> None:
    """Read a sharded checkpoint's full weights into the plain ``model``, in this process alone
    (no process group); every tensor of ``model`` must be in the checkpoint."""
    import torch.distributed.checkpoint as dcp

    state = {"model": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    model.load_state_dict(state["model"])


__all__ = [
    "DCP_METADATA",
    "CallThrough",
    "ShardedModule",
    "decoder_layers",
    "is_sharded_checkpoint",
    "load_full_weights",
    "load_shards",
    "save_shards",
]
