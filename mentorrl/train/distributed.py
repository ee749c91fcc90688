"""A data-parallel learner through ``torchrun``: torch DDP over gloo (CPU), one process per rank.

Launch::

    torchrun --standalone --nproc-per-node 2 -m mentorrl.cli train recipe.yaml --set threads=1

``distributed.backend`` (``auto`` by default) turns it on when torchrun's environment says there is
more than one rank (:func:`distributed_plan` checks the setting against that environment and
refuses, naming the field, what cannot work). Every rank holds the whole model and the whole
batch of trajectories; the learner (:class:`~mentorrl.train.learner.Learner` with ``dp=``) runs
forward/backward on this rank's contiguous share (:meth:`DataParallel.shard`) and DDP all-reduces
the gradients once per optimizer step. Each micro-batch's loss is weighted by its share of the
*global* batch (tokens for ``token-mean``) and multiplied by the world size, so DDP's average is
exactly the single-process full-batch gradient, whatever the token counts of the ranks. Gradients
are then identical on every rank, so clipping and the AdamW step keep the replicas identical.

Only rank 0 writes (metrics, checkpoints, final weights, evaluations, the report); the others wait
for it through :meth:`DataParallel.on_main`, which also carries rank 0's failure to them. GRPO
rollouts are split the same way and gathered, so every rank sees the same trajectories.

``distributed.strategy: fsdp2`` shards the learner instead (FSDP2, :mod:`mentorrl.train.fsdp`): the
weighting above is unchanged because FSDP2's reduce-scatter also averages gradients over ranks.
"""

from __future__ import annotations

import datetime
import os
from contextlib import nullcontext
from typing import Any, Callable, Mapping, TypeVar

import torch
import torch.distributed as dist

from mentorrl.config import ConfigError, RunConfig
from mentorrl.config.stages import stages_supporting
from mentorrl.train.fsdp import CallThrough, ShardedModule

T = TypeVar("T")

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _env_int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except (KeyError, ValueError):
        raise ConfigError(
            f"distributed: environment variable {name}={env.get(name)!r} is not an integer "
            f"(launch with torchrun, which sets RANK and WORLD_SIZE)"
        ) from None


def distributed_plan(cfg: RunConfig, env: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    """``(rank, world_size)`` when this process is one rank of a data-parallel run, None for a plain
    one-process run. A setting that cannot work is a :class:`ConfigError` naming the field."""
    env = os.environ if env is None else env
    backend = cfg.distributed.backend
    launched = "WORLD_SIZE" in env
    if not launched:
        if backend == "ddp":
            raise ConfigError(
                "distributed.backend: ddp needs a torchrun launch (WORLD_SIZE and RANK are not set); "
                "run `torchrun --nproc-per-node N -m mentorrl.cli train CONFIG`, or set "
                "distributed.backend: auto (or none) for one process"
            )
        return None
    world, rank = _env_int(env, "WORLD_SIZE"), _env_int(env, "RANK")
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"distributed: RANK={rank} is not a rank of WORLD_SIZE={world}")
    if world == 1 and backend != "ddp":
        return None
    if backend == "ray":
        raise ConfigError(
            f"distributed.backend: ray runs the learner in one process (rollouts on Ray actors); "
            f"launch it without torchrun, not as {world} ranks"
        )
    if backend == "none":
        raise ConfigError(
            f"distributed.backend: none, but torchrun launched {world} ranks: each would train alone "
            f"and write the same run_dir; set distributed.backend: ddp (or auto), or launch one process"
        )
    strategy = cfg.distributed.strategy
    missing = [s for s in dict.fromkeys(cfg.recipe) if s not in stages_supporting(strategy)]
    if missing:
        raise ConfigError(
            f"recipe: stage(s) {', '.join(missing)} cannot run under distributed.backend {backend} "
            f"(distributed.strategy {strategy}) with {world} ranks; stages that support {strategy}: "
            f"{', '.join(stages_supporting(strategy))}"
        )
    return rank, world


class DataParallel:
    """This process's rank in an initialised gloo process group, and the collectives the learner uses.

    ``strategy``: ``"ddp"`` (every rank holds the whole model; gradients all-reduced) or ``"fsdp2"``
    (parameters, gradients and optimizer state sharded, :mod:`mentorrl.train.fsdp`)."""

    def __init__(self, rank: int, world_size: int, strategy: str = "ddp"):
        self.rank, self.world_size, self.strategy = rank, world_size, strategy

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, n: int) -> range:
        """This rank's contiguous share of ``n`` items (sizes differ by at most one; may be empty)."""
        return range(self.rank * n // self.world_size, (self.rank + 1) * n // self.world_size)

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module | ShardedModule:
        """A DDP module over ``model`` (rank 0's weights broadcast to all ranks now), or under
        ``fsdp2`` a :class:`~mentorrl.train.fsdp.ShardedModule` (a sharded training copy of ``model``).

        ``broadcast_buffers=False``: a buffer broadcast in every forward would be a collective per
        micro-batch, and ranks run different numbers of micro-batches."""
        if self.strategy == "fsdp2":
            return ShardedModule(model)
        import inspect

        from torch.nn.parallel import DistributedDataParallel

        params = inspect.signature(DistributedDataParallel.__init__).parameters
        no_buffer_sync = (
            {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}
        )
        return DistributedDataParallel(CallThrough(model), **no_buffer_sync)

    @staticmethod
    def no_sync(ddp: torch.nn.Module | None, sync: bool):
        return ddp.no_sync() if ddp is not None and not sync else nullcontext()

    def all_gather(self, obj: T) -> list[T]:
        """Every rank's ``obj`` (picklable), in rank order."""
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def max_over_ranks(self, n: int) -> int:
        """The largest ``n`` of any rank, on every rank."""
        t = torch.tensor([n], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def broadcast(self, obj: T) -> T:
        """Rank 0's ``obj`` on every rank."""
        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def on_main(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on rank 0 only and return its result on every rank. When it raises, rank 0
        re-raises it and the other ranks raise :class:`RankZeroFailed` with its message, instead
        of waiting for a collective that never comes."""
        if self.is_main:
            try:
                value = fn()
            except BaseException as e:
                self.broadcast(("error", f"{type(e).__name__}: {e}"))
                raise
            return self.broadcast(("ok", value))[1]
        status, value = self.broadcast(None)
        if status == "error":
            raise RankZeroFailed(f"rank 0 failed: {value}")
        return value

    def barrier(self) -> None:
        dist.barrier()


class RankZeroFailed(RuntimeError):
    """Raised on ranks > 0 when rank 0 failed in work they were waiting for."""


class ProcessGroup:
    """This process's membership of the ``torch.distributed`` group, which is itself process-wide:
    :meth:`join` (by :func:`setup_distributed`) and :meth:`leave` (by :func:`shutdown_distributed`).
    One instance, :data:`PROCESS_GROUP`, owns it."""

    def __init__(self) -> None:
        self.joined: DataParallel | None = None

    def join(self, cfg: RunConfig, env: Mapping[str, str] | None = None) -> DataParallel | None:
        plan = distributed_plan(cfg, env)
        if plan is None:
            return None
        if self.joined is not None:
            return self.joined
        rank, world = plan
        if not dist.is_initialized():
            backend = process_group_backend(cfg.model.device, torch.cuda.is_available())
            dist.init_process_group(
                backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=cfg.distributed.timeout_s)
            )
        self.joined = DataParallel(dist.get_rank(), dist.get_world_size(), cfg.distributed.strategy)
        return self.joined

    def leave(self) -> None:
        if self.joined is not None and dist.is_initialized():
            import gc

            try:  # bounded: a rank that died must not hold the others here
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
            except Exception:  # noqa: BLE001 -- another rank is gone (it failed): leave anyway
                pass
            gc.collect()
            dist.destroy_process_group()
        self.joined = None


PROCESS_GROUP = ProcessGroup()


def current() -> DataParallel | None:
    """The data-parallel group this process joined (:func:`setup_distributed`), or None."""
    return PROCESS_GROUP.joined


def is_main_process() -> bool:
    """Whether this process writes run-level files: rank 0 of the group joined, else (no group, e.g.
    after the recipe left it) torchrun's ``RANK`` 0 or a plain launch."""
    if PROCESS_GROUP.joined is not None:
        return PROCESS_GROUP.joined.is_main
    return os.environ.get("RANK", "0").strip() in ("", "0")


def process_group_backend(device: str, cuda_available: bool) -> str:
    """The process group's backend for a learner on ``device`` (``model.device``: auto, cpu, cuda, cuda:N):
    NCCL for CUDA tensors, with gloo beside it for the CPU collectives the loop also makes (a flag, an
    object broadcast); gloo alone on CPU."""
    on_cuda = device.startswith("cuda") or (device == "auto" and cuda_available)
    return "cpu:gloo,cuda:nccl" if on_cuda and cuda_available else "gloo"


def setup_distributed(cfg: RunConfig, env: Mapping[str, str] | None = None) -> DataParallel | None:
    """Join the process group (:func:`process_group_backend`: NCCL on CUDA, gloo on CPU) when
    :func:`distributed_plan` says this is a data-parallel run.

    Idempotent: a second call returns the group already joined."""
    return PROCESS_GROUP.join(cfg, env)


def shutdown_distributed() -> None:
    """Leave the group: wait for every rank (no collective in flight anywhere), free what still holds the
    group (a DDP module's reducer left in a reference cycle), then destroy it. A group destroyed during
    interpreter exit instead, with gloo's worker threads still joinable, is a known way to abort at exit
    ("terminate called without an active exception", exit code -6), which rank 0 did twice here after
    a finished run (a mitigation: 16 runs were clean with and without it)."""
    PROCESS_GROUP.leave()


__all__ = [
    "DataParallel",
    "PROCESS_GROUP",
    "ProcessGroup",
    "RankZeroFailed",
    "current",
    "distributed_plan",
    "is_main_process",
    "setup_distributed",
    "shutdown_distributed",
]
