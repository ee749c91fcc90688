"""The data-parallel learner (``distributed.backend: ddp``) against the single-process learner.

A real ``torchrun`` launches 2 ranks (gloo, 1 thread each, ``tests/ddp_worker.py``). Each rank
trains on its share of the batch; the averaged gradients and the weights after several
optimizer steps equal the single-process learner's on the same full batch -- with uneven token
counts across ranks, so the loss stays the *global* token mean, not a mean of rank means (checked
to differ here). A bad distributed setting is a ConfigError naming the field, and only rank 0
writes metrics and checkpoints."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import ddp_worker as W
import pytest
import torch

from mentorrl.algos.losses import sft_loss
from mentorrl.config import ConfigError, DistributedConfig, RunConfig, load_config
from mentorrl.models.batch import collate, forward_logprobs
from mentorrl.train.distributed import distributed_plan

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[dict, dict, Path]:
    out = tmp_path_factory.mktemp("ddp")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "OMP_WAIT_POLICY": "PASSIVE",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(ROOT / "tests" / "ddp_worker.py"),
        str(out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    return ranks[0], ranks[1], out


@pytest.fixture(scope="module")
def single() -> dict:
    return W.run_updates(W.tiny_model(), None)


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float, rtol: float = 1e-4) -> None:
    assert a.keys() == b.keys() and a
    for k in a:
        assert torch.allclose(a[k], b[k], atol=atol, rtol=rtol), (k, (a[k] - b[k]).abs().max().item())


def test_two_rank_gradients_and_weights_equal_the_single_process_learner(two_ranks, single):
    r0, r1, _ = two_ranks
    assert (r0["rank"], r1["rank"], r0["world_size"]) == (0, 1, 2)
    # each rank ran forward on its own share only (2 and 3 of the 5 sequences), not on the whole batch
    assert (r0["rows_sft"], r1["rows_sft"], single["rows_sft"]) == (2, 3, 5)
    # the gradients every rank applies are the full batch's (after the all-reduce)
    for key in ("grads_sft", "grads_grpo"):
        _close(r0[key], single[key], atol=1e-6)
        _close(r1[key], single[key], atol=1e-6)
    # after 4 optimizer steps (one where rank 0 had no trajectory) the weights agree, and the ranks agree exactly
    _close(r0["weights"], single["weights"], atol=2e-5)
    for k in r0["weights"]:
        assert torch.equal(r0["weights"][k], r1["weights"][k]), k
    # the logged metrics are the full batch's, on every rank
    for m0, m1, ms in zip(r0["metrics"], r1["metrics"], single["metrics"]):
        for k in ("loss", "entropy", "grad_norm"):
            if k in ms:
                assert m0[k] == pytest.approx(ms[k], rel=1e-4, abs=1e-6), k
                assert m1[k] == pytest.approx(m0[k], rel=1e-6), k


def test_the_parity_test_would_catch_a_mean_of_rank_means(single):
    """With these token counts (32 vs 45 policy tokens) averaging each rank's token-mean gradient
    is measurably not the global token mean, so the parity above is not vacuous."""
    model = W.tiny_model()
    model.train()
    trajs = W.trajectories()
    per_rank = []
    for shard in (trajs[:2], trajs[2:]):
        model.zero_grad(set_to_none=True)
        mb = collate(shard, 0)
        lp, _ = forward_logprobs(model, mb)
        sft_loss(lp, mb.loss_mask)[0].backward()
        per_rank.append(W.grads(model))
    fake = {k: (per_rank[0][k] + per_rank[1][k]) / 2 for k in per_rank[0]}
    worst = max((fake[k] - single["grads_sft"][k]).abs().max().item() for k in fake)
    assert worst > 1e-3


def test_only_rank_zero_writes_metrics_and_checkpoints(two_ranks):
    _, _, out = two_ranks
    main, other = out / "run-rank0", out / "run-rank1"
    assert (main / "metrics.jsonl").read_text().count("\n") == 2
    assert (main / "sft" / "checkpoints" / "step-000002" / "trainer_state.pt").exists()
    assert (main / "sft" / "final" / "DONE").exists()
    assert not other.exists() or not [p for p in other.rglob("*") if p.is_file()]


def test_a_failure_on_rank_zero_reaches_the_other_ranks(two_ranks):
    r0, r1, _ = two_ranks
    assert r0["on_main_error"].startswith("ZeroDivisionError")
    assert r1["on_main_error"].startswith("RankZeroFailed: rank 0 failed: ZeroDivisionError")


# ---------------------------------------------------------------- config -----
def test_a_distributed_backend_that_does_not_exist_names_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"distributed\.backend"):
        load_config(None, ["distributed.backend=fsdp"])


def _cfg(backend: str = "auto", recipe=("sft", "grpo")) -> RunConfig:
    return RunConfig(recipe=list(recipe), distributed=DistributedConfig(backend=backend))


TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_distributed_plan_is_detected_from_torchrun_or_refused_with_the_field_named():
    assert distributed_plan(_cfg("auto"), {}) is None  # a plain run: one process
    assert distributed_plan(_cfg("auto"), {**TORCHRUN, "WORLD_SIZE": "1", "RANK": "0"}) is None
    assert distributed_plan(_cfg("auto"), TORCHRUN) == (1, 2)
    assert distributed_plan(_cfg("ddp"), TORCHRUN) == (1, 2)
    assert distributed_plan(_cfg("none"), {}) is None
    with pytest.raises(ConfigError, match=r"distributed\.backend.*torchrun"):
        distributed_plan(_cfg("ddp"), {})
    with pytest.raises(ConfigError, match=r"distributed\.backend"):
        distributed_plan(_cfg("none"), TORCHRUN)  # every rank would train alone into the same run_dir
    with pytest.raises(ConfigError, match=r"recipe.*ppo.*distributed\.backend|distributed\.backend.*recipe.*ppo"):
        distributed_plan(_cfg("auto", ("sft", "ppo")), TORCHRUN)
    with pytest.raises(ConfigError, match="WORLD_SIZE"):
        distributed_plan(_cfg("ddp"), {**TORCHRUN, "WORLD_SIZE": "two"})
    with pytest.raises(ConfigError, match="RANK"):
        distributed_plan(_cfg("ddp"), {**TORCHRUN, "RANK": "2"})


# ------------------------------------------------------------ end to end -----
@pytest.mark.slow
def test_torchrun_train_runs_sft_and_grpo_data_parallel_with_the_single_process_sft_losses(tmp_path):
    """`torchrun --nproc-per-node 2 -m mentorrl.cli train` runs [sft, grpo] (a GRPO update every step:
    kl_coef > 0 keeps every trajectory); its SFT losses and gradient norms are the one-process run's
    (same batches, 5 demonstrations split 2 / 3), and one metrics record is written per step."""
    import json

    import yaml

    from mentorrl.envs import get_env
    from mentorrl.models.build import ModelSpec
    from mentorrl.models.pretrain import PretrainSpec
    from mentorrl.train.models_init import build_tiny_model

    model_dir = build_tiny_model(
        get_env("orders"),
        tmp_path / "model",
        ModelSpec(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1, vocab_size=600),
        corpus_tasks=60,
        pretrain=PretrainSpec(steps=0),
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(
        OMP_NUM_THREADS="1",
        OMP_WAIT_POLICY="PASSIVE",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )

    def train(name: str, launcher: list[str], recipe: list[str], extra: dict | None = None) -> list[dict]:
        cfg = {
            "run_dir": str(tmp_path / name),
            "recipe": recipe,
            "threads": 1,
            "model": {"path": str(model_dir)},
            "audit": {"preflight": False},
            "eval": {"num_tasks": 0},
            "limits": {"max_turns": 2},
            "sampling": {"max_new_tokens": 16},
            "sft": {
                "num_demos": 8,
                "steps": 2,
                "batch_size": 5,
                "checkpoint_every": 1,
                "optim": {"micro_batch_size": 2},
            },
            "grpo": {"steps": 2, "tasks_per_step": 2, "samples_per_task": 2, "updates_per_step": 1, "kl_coef": 0.05},
        }
        cfg.update(extra or {})
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        proc = subprocess.run(
            [*launcher, "-m", "mentorrl.cli", "train", str(path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
            cwd=tmp_path,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    # the evaluations (after each stage, the final split, the gap monitor's checks) are dealt over the ranks
    evals = {
        "eval": {"num_tasks": 5, "batch_size": 2, "stratify": False, "final_splits": ["hidden"]},
        "audit": {"preflight": False, "eval_every": 1, "eval_tasks": 3},
    }
    ddp = train(
        "ddp",
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
        ["sft", "grpo"],
        evals,
    )
    one = train("one", [sys.executable], ["sft"])
    assert [(r["stage"], r["step"]) for r in ddp] == [("sft", 1), ("sft", 2), ("grpo", 1), ("grpo", 2)]
    # the same launch with each unit in fresh processes (one a rank; the SFT stage, then its evaluation, whose
    # group forms at a store of its own): the same SFT steps, and the evaluation dealt over both ranks
    units = train(
        "units",
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
        ["sft"],
        {**evals, "eval": {**evals["eval"], "final_splits": []}, "stage_processes": True},
    )
    assert [(r["stage"], r["step"]) for r in units] == [("sft", 1), ("sft", 2)]
    for a, b in zip(units, ddp):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (a, b)
    assert json.loads((tmp_path / "units" / "eval_sft.json").read_text())["n"] == 5
    for a, b in zip(ddp[:2], one):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    # every GRPO step ran a policy update through the DDP learner on the gathered rollouts (the
    # untrained policy earns no reward, so its gradient here is the KL term's: 0 at the reference)
    assert all(r["rollouts"] == 4 and r["trained_trajectories"] == 4 and "grad_norm" in r for r in ddp[2:])
    assert (tmp_path / "ddp" / "grpo" / "final" / "DONE").exists()
    for label in ("sft", "grpo", "grpo_hidden"):
        ev = json.loads((tmp_path / "ddp" / f"eval_{label}.json").read_text())
        lines = (tmp_path / "ddp" / f"eval_{label}.jsonl").read_text().splitlines()
        assert ev["n"] == 5 and len(lines) == 5, label  # every rank's batches, written once by rank 0
    assert all("heldout_success" in r for r in ddp[2:])


@pytest.mark.parametrize(
    "device, cuda, want",
    [
        ("cpu", False, "gloo"),
        ("auto", False, "gloo"),
        ("cpu", True, "gloo"),
        ("auto", True, "cpu:gloo,cuda:nccl"),
        ("cuda", True, "cpu:gloo,cuda:nccl"),
        ("cuda:1", True, "cpu:gloo,cuda:nccl"),
    ],
)
def test_the_process_group_uses_nccl_on_cuda(device, cuda, want):
    from mentorrl.train.distributed import process_group_backend

    assert process_group_backend(device, cuda) == want
