"""Run by ``tests/test_fsdp.py`` under a real ``torchrun`` (2 ranks, gloo, 1 thread each): the sharded
learner (``distributed.strategy: fsdp2``).

``parity OUT``: the updates of :func:`ddp_worker.run_updates` through the FSDP2 learner; saves this
rank's full (gathered) gradients after the first two updates, every update's metrics and the final
weights of the policy (the full copy the learner publishes into) to ``OUT/rank{R}.pt``; then the
uninterrupted ``stage`` run below into ``OUT/full`` (6 steps).

``stage RUN_DIR STEPS [KILL_AT] [resume]``: a ``run_stage`` of STEPS SFT steps checkpointed every
2 steps (sharded checkpoints) into RUN_DIR; with KILL_AT, rank 0 SIGKILLs itself when step KILL_AT
(1-based) begins. Every rank saves the policy's weights at the end to ``RUN_DIR/weights-rank{R}.pt``."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

import ddp_worker as W  # noqa: E402

from mentorrl.config import DistributedConfig, RunConfig  # noqa: E402


def full_grads(learner) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = {}
    for n, p in learner.trained.named_parameters():
        if p.grad is not None:
            g = p.grad
            out[n] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    return out


def run_updates(dp) -> dict:
    from mentorrl.train.learner import Learner

    model = W.tiny_model()
    trajs = W.trajectories()
    learner = Learner(model, W.OPTIM, pad_id=0, dp=dp)
    assert learner.sharded is not None
    out: dict = {"metrics": []}
    out["metrics"].append(learner.sft_step(trajs, agg="token-mean"))
    out["grads_sft"] = full_grads(learner)
    out["metrics"].append(learner.policy_step(trajs, W.ADVANTAGES, "grpo", agg="token-mean"))
    out["grads_grpo"] = full_grads(learner)
    out["metrics"].append(learner.policy_step(trajs[3:4], W.ADVANTAGES[3:4], "grpo", agg="token-mean"))
    out["metrics"].append(learner.sft_step(trajs, agg="seq-mean-token-mean"))
    out["weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["local_numel"] = sum(p.to_local().numel() for p in learner.trained.parameters())
    out["full_numel"] = sum(p.numel() for p in model.parameters())
    return out


def stage_batch(step: int) -> list:
    """A different batch at every step (a rotation of the five trajectories, four of them)."""
    trajs = W.trajectories()
    k = step % len(trajs)
    return (trajs[k:] + trajs[:k])[:4]


def run_sharded_stage(dp, run_dir: Path, steps: int, kill_at: int | None, resume: bool) -> None:
    from mentorrl.train.learner import Learner
    from mentorrl.train.loop import run_stage
    from mentorrl.train.workspace import Workspace

    cfg = RunConfig(distributed=DistributedConfig(backend="auto", strategy="fsdp2", timeout_s=120))
    ws = Workspace(cfg=cfg, run_dir=run_dir, env_entry=None, show_progress=False, dp=dp)
    ws.tokenizer = W.StubTokenizer()
    model = W.tiny_model()
    learner = Learner(model, W.OPTIM, pad_id=0, dp=dp)

    def step_fn(step: int) -> dict:
        if kill_at is not None and step + 1 == kill_at and dp.is_main:
            os.kill(os.getpid(), signal.SIGKILL)
        return learner.sft_step(stage_batch(step))

    run_stage(ws, "sft", model, learner, steps, step_fn, checkpoint_every=2, resume=resume)
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, run_dir / f"weights-rank{dp.rank}.pt")


def main(argv: list[str]) -> None:
    from mentorrl.train.distributed import setup_distributed, shutdown_distributed

    cfg = RunConfig(distributed=DistributedConfig(backend="auto", strategy="fsdp2", timeout_s=120))
    dp = setup_distributed(cfg)
    assert dp is not None and dp.world_size == 2 and dp.strategy == "fsdp2", "torchrun should have launched 2 ranks"
    if argv[0] == "parity":
        out = Path(argv[1])
        torch.save(run_updates(dp), out / f"rank{dp.rank}.pt")
        run_sharded_stage(dp, out / "full", 6, None, resume=False)
    else:
        run_dir, steps = Path(argv[1]), int(argv[2])
        kill_at = int(argv[3]) if len(argv) > 3 and argv[3] != "-" else None
        run_sharded_stage(dp, run_dir, steps, kill_at, resume="resume" in argv[4:])
    shutdown_distributed()


if __name__ == "__main__":
    main(sys.argv[1:])
