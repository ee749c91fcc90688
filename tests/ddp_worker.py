"""Run by ``tests/test_distributed.py`` under a real ``torchrun`` (2 ranks, gloo, 1 thread each).

Each rank joins the process group through :func:`mentorrl.train.distributed.setup_distributed`
(detected from torchrun's environment), runs the same learner updates as the single-process
reference (:func:`run_updates`), then a 2-step SFT stage through ``run_stage`` into its *own*
run directory (so the test can see which ranks wrote anything), and saves what it saw to
``OUT/rank{R}.pt``. The helpers are imported by the test for the single-process reference."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

from mentorrl.config import OptimConfig  # noqa: E402
from mentorrl.trajectory import Trajectory  # noqa: E402

# (total tokens, policy tokens): rank 0 of 2 gets the first two (32 policy tokens), rank 1 the
# last three (45), so a mean of the two ranks' token means differs from the global token mean.
LENGTHS = [(6, 2), (40, 30), (9, 3), (50, 41), (12, 1)]
OPTIM = OptimConfig(lr=1e-2, micro_batch_size=2, max_grad_norm=1e9)
VOCAB = 97


def tiny_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    return Qwen2ForCausalLM(cfg).float()


def trajectories() -> list[Trajectory]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i, (n, k) in enumerate(LENGTHS):
        ids = torch.randint(1, VOCAB, (n,), generator=g).tolist()
        mask = [0] * (n - k) + [1] * k
        lps = [0.0] * (n - k) + (-torch.rand(k, generator=g) * 3 - 1).tolist()
        out.append(
            Trajectory(
                id=f"t{i}",
                task_id=f"task{i}",
                family="f",
                token_ids=ids,
                loss_mask=mask,
                logprobs=lps,
                env_name="test",
                env_version="0",
            )
        )
    return out


ADVANTAGES = torch.tensor([1.0, -0.5, 0.7, -1.2, 0.3])


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def run_updates(model, dp=None) -> dict:
    """The updates compared across 1 and 2 processes: SFT (token-mean), GRPO (token-mean), GRPO on
    one trajectory (a rank with nothing to do), SFT (seq-mean-token-mean). Returns the gradients
    after the first update, every update's metrics, and the final weights."""
    from mentorrl.train.learner import Learner

    trajs = trajectories()
    learner = Learner(model, OPTIM, pad_id=0, dp=dp)
    out: dict = {"metrics": [], "rows_sft": 0}

    import mentorrl.train.learner as learner_mod

    collate = learner_mod.collate

    def counting_collate(batch, pad_id):  # sequences this process runs forward on (however its forward packs them)
        out["rows_sft"] += len(batch)
        return collate(batch, pad_id)

    learner_mod.collate = counting_collate
    try:
        out["metrics"].append(learner.sft_step(trajs, agg="token-mean"))
    finally:
        learner_mod.collate = collate
    out["grads_sft"] = grads(model)
    out["metrics"].append(learner.policy_step(trajs, ADVANTAGES, "grpo", agg="token-mean"))
    out["grads_grpo"] = grads(model)
    out["metrics"].append(learner.policy_step(trajs[3:4], ADVANTAGES[3:4], "grpo", agg="token-mean"))
    out["metrics"].append(learner.sft_step(trajs, agg="seq-mean-token-mean"))
    out["weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


class StubTokenizer:
    def save_pretrained(self, path) -> None:
        Path(path, "tokenizer.json").write_text("{}")


def main(out_dir: Path) -> None:
    from mentorrl.config import DistributedConfig, RunConfig
    from mentorrl.train.distributed import setup_distributed, shutdown_distributed
    from mentorrl.train.learner import Learner
    from mentorrl.train.loop import run_stage
    from mentorrl.train.workspace import Workspace

    cfg = RunConfig(distributed=DistributedConfig(backend="auto", timeout_s=120))
    dp = setup_distributed(cfg)
    assert dp is not None and dp.world_size == 2, "torchrun should have launched 2 ranks"
    result = run_updates(tiny_model(), dp)

    # only rank 0 writes: each rank gets its own run dir here, so the test sees who wrote what
    run_dir = out_dir / f"run-rank{dp.rank}"
    ws = Workspace(cfg=cfg, run_dir=run_dir, env_entry=None, show_progress=False, dp=dp)
    ws.tokenizer = StubTokenizer()
    model = tiny_model()
    learner = Learner(model, OPTIM, pad_id=0, dp=dp)
    trajs = trajectories()
    run_stage(ws, "sft", model, learner, 2, lambda step: learner.sft_step(trajs), checkpoint_every=1, resume=False)
    result["rank"], result["world_size"] = dp.rank, dp.world_size
    try:  # rank 0 failing in work the others wait for: they raise with its message instead of hanging
        dp.on_main(lambda: 1 / 0)
    except Exception as e:
        result["on_main_error"] = f"{type(e).__name__}: {e}"
    torch.save(result, out_dir / f"rank{dp.rank}.pt")
    shutdown_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
