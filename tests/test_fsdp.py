"""The sharded learner (``distributed.strategy: fsdp2``) against the single-process learner, and its
sharded checkpoints.

Real ``torchrun`` launches of 2 ranks (gloo, CPU, 1 thread each, ``tests/fsdp_worker.py``): the
FSDP2 gradients (gathered) and the weights after several optimizer steps equal the single-process
learner's on the same full batch (with uneven token counts and micro-batch counts across ranks, and
a step where one rank has no trajectory); a 6-step stage with sharded checkpoints every 2 steps,
SIGKILLed in step 5 and resumed, ends on exactly the uninterrupted run's weights; a flipped bit in
one rank's shard file is refused, named, moved aside, and the checkpoint before it used."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import ddp_worker as W
import pytest
import torch

from mentorrl.config import ConfigError, DistributedConfig, RunConfig, load_config
from mentorrl.config.stages import stages_supporting
from mentorrl.train.distributed import distributed_plan
from mentorrl.train.rundir import MANIFEST, TRAINER_STATE, verify_manifest

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env.update(
        OMP_NUM_THREADS="1",
        OMP_WAIT_POLICY="PASSIVE",
        PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    return subprocess.run(
        [*cmd, str(ROOT / "tests" / "fsdp_worker.py"), *args], env=env, capture_output=True, text=True, timeout=300
    )


def _ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout + proc.stderr


def _flip_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x04
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The parity updates and an uninterrupted 6-step stage; the same stage SIGKILLed in step 5 (after
    the step-4 checkpoint), resumed as it is and, from a copy, with a bit of rank 1's step-4 shard flipped."""
    out = tmp_path_factory.mktemp("fsdp")
    _ok(_torchrun("parity", str(out)))
    killed = _torchrun("stage", str(out / "kill"), "6", "5")
    shutil.copytree(out / "kill", out / "damaged")
    _flip_bit(out / "damaged" / "sft" / "checkpoints" / "step-000004" / "__1_0.distcp")
    resumed = _ok(_torchrun("stage", str(out / "kill"), "6", "-", "resume"))
    damaged = _ok(_torchrun("stage", str(out / "damaged"), "6", "-", "resume"))
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    return {"out": out, "ranks": ranks, "killed": killed, "resumed": resumed, "damaged": damaged}


@pytest.fixture(scope="module")
def single() -> dict:
    return W.run_updates(W.tiny_model(), None)


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    assert a.keys() == b.keys() and a
    for k in a:
        assert torch.allclose(a[k], b[k], atol=atol, rtol=0), (k, (a[k] - b[k]).abs().max().item())


def _weights(run: Path, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(run / f"weights-rank{rank}.pt", weights_only=True)


def test_fsdp2_gradients_and_weights_equal_the_single_process_learner(runs, single):
    r0, r1 = runs["ranks"]
    # each rank holds half of the parameters (dim-0 shards), the policy it publishes into all of them
    assert r0["local_numel"] + r1["local_numel"] == r0["full_numel"] and 0 < r0["local_numel"] < r0["full_numel"]
    for key in ("grads_sft", "grads_grpo"):  # the full-batch gradients (gathered), fp32
        _close(r0[key], single[key], atol=1e-5)
        _close(r1[key], single[key], atol=1e-5)
    # after 4 optimizer steps (one where rank 0 had no trajectory) the weights agree; the ranks exactly
    _close(r0["weights"], single["weights"], atol=1e-5)
    for k in r0["weights"]:
        assert torch.equal(r0["weights"][k], r1["weights"][k]), k
    for m0, ms in zip(r0["metrics"], single["metrics"]):
        for k in ("loss", "entropy", "grad_norm"):
            assert m0[k] == pytest.approx(ms[k], rel=1e-5, abs=1e-6), k


def test_a_sigkilled_run_resumes_to_exactly_the_uninterrupted_weights(runs):
    out, killed = runs["out"], runs["killed"]
    assert killed.returncode != 0 and "SIGKILL" in killed.stdout + killed.stderr
    assert "resuming from step-000004 (step 4/6)" in runs["resumed"]
    full = _weights(out / "full", 0)
    for rank in (0, 1):
        got = _weights(out / "kill", rank)
        assert got.keys() == full.keys()
        assert all(torch.equal(got[k], full[k]) for k in full)
    records = [json.loads(line) for line in (out / "kill" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]  # steps past the checkpoint redone, logged once


def test_a_flipped_bit_in_a_shard_is_refused_named_and_the_checkpoint_before_it_used(runs):
    out, log = runs["out"], runs["damaged"].replace("\n", "")
    assert "step-000004/__1_0.distcp: sha256" in log and "resuming from step-000002 (step 2/6)" in log
    assert (out / "damaged" / "sft" / "checkpoints" / "corrupt-step-000004").is_dir()  # kept aside
    full = _weights(out / "full", 0)
    got = _weights(out / "damaged", 1)
    assert all(torch.equal(got[k], full[k]) for k in full)


def test_sharded_checkpoints_hold_every_rank_s_shards_under_one_manifest_and_the_final_dir_is_plain(runs):
    from transformers import AutoModelForCausalLM

    from mentorrl.train.fsdp import is_sharded_checkpoint, load_full_weights

    stage = runs["out"] / "full" / "sft"
    ckpt = stage / "checkpoints" / "step-000006"
    listed = {line.split("  ", 1)[1] for line in (ckpt / MANIFEST).read_text().splitlines()}
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", TRAINER_STATE, "config.json"} <= listed
    assert is_sharded_checkpoint(ckpt) and verify_manifest(ckpt)
    learner_state = torch.load(ckpt / TRAINER_STATE, weights_only=False)["learner"]
    assert learner_state["sharded"] is True and "optimizer" not in learner_state  # the optimizer is in the shards
    full = _weights(runs["out"] / "full", 0)
    m = W.tiny_model()
    load_full_weights(m, ckpt)  # one process, no process group: the full weights of the shards
    assert all(torch.equal(p, full[n]) for n, p in m.named_parameters())
    final = stage / "final"
    assert not is_sharded_checkpoint(final) and verify_manifest(final) and (final / "model.safetensors").is_file()
    hf = AutoModelForCausalLM.from_pretrained(final)
    assert all(torch.equal(p, full[n]) for n, p in hf.named_parameters())


# ---------------------------------------------------------------- config -----
TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_fsdp2_is_a_strategy_of_the_data_parallel_stages_and_refused_elsewhere():
    assert set(stages_supporting("fsdp2")) >= {"sft", "grpo"}
    cfg = RunConfig(recipe=["sft", "grpo"], distributed=DistributedConfig(strategy="fsdp2"))
    assert distributed_plan(cfg, TORCHRUN) == (1, 2)
    ppo = RunConfig(recipe=["sft", "ppo"], distributed=DistributedConfig(strategy="fsdp2"))
    with pytest.raises(ConfigError, match=r"recipe.*ppo.*distributed\.strategy fsdp2"):
        distributed_plan(ppo, TORCHRUN)
    with pytest.raises(ConfigError, match=r"distributed\.strategy"):
        load_config(None, ["distributed.strategy=zero3"])


def test_a_learner_refuses_optimizer_state_of_the_other_strategy():
    from mentorrl.train.learner import Learner

    learner = Learner(W.tiny_model(), W.OPTIM, pad_id=0)
    with pytest.raises(ValueError, match="fsdp2"):
        learner.load_state_dict({"scheduler": learner.scheduler.state_dict(), "version": 3, "sharded": True})
    assert "sharded" not in learner.state_dict() and "optimizer" in learner.state_dict()


# ------------------------------------------------------------ end to end -----
@pytest.mark.slow
def test_torchrun_train_runs_sft_and_grpo_sharded_with_the_single_process_sft_losses(tmp_path):
    """`torchrun --nproc-per-node 2 -m mentorrl.cli train` with `distributed.strategy: fsdp2` runs
    [sft, grpo] (rollouts on every rank from the published full weights, sharded checkpoints every
    step); its SFT losses and gradient norms are the one-process run's, and it resumes as complete."""
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
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))

    def train(name: str, launcher: list[str], recipe: list[str], *extra: str) -> list[dict]:
        cfg = {
            "run_dir": str(tmp_path / name),
            "recipe": recipe,
            "threads": 1,
            "model": {"path": str(model_dir)},
            "audit": {"preflight": False},
            "eval": {"num_tasks": 0},
            "limits": {"max_turns": 2},
            "sampling": {"max_new_tokens": 16},
            "distributed": {"strategy": "fsdp2"},
            "sft": {"num_demos": 8, "steps": 2, "batch_size": 5, "checkpoint_every": 1},
            "grpo": {"steps": 2, "tasks_per_step": 2, "samples_per_task": 2, "updates_per_step": 1, "kl_coef": 0.05},
        }
        cfg["sft"]["optim"] = {"micro_batch_size": 2}
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        proc = subprocess.run(
            [*launcher, "-m", "mentorrl.cli", "train", str(path), *extra],
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
            cwd=tmp_path,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    sharded = train("fsdp", torchrun, ["sft", "grpo"])
    one = train("one", [sys.executable], ["sft"])
    assert [(r["stage"], r["step"]) for r in sharded] == [("sft", 1), ("sft", 2), ("grpo", 1), ("grpo", 2)]
    for a, b in zip(sharded[:2], one):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert all(r["rollouts"] == 4 and r["trained_trajectories"] == 4 and "grad_norm" in r for r in sharded[2:])
    ckpt = tmp_path / "fsdp" / "grpo" / "checkpoints" / "step-000002"
    assert (ckpt / "__1_0.distcp").is_file() and verify_manifest(ckpt)
    assert (tmp_path / "fsdp" / "grpo" / "final" / "model.safetensors").is_file()
    again = train("fsdp", torchrun, ["sft", "grpo"], "--resume")  # both stages complete: nothing redone
    assert again == sharded
