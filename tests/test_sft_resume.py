"""SFT checkpoints every ``sft.checkpoint_every`` steps (weights, optimizer, scheduler and RNG
state), and ``--resume`` after a SIGKILL continues from the last checkpoint -- not step 0 -- to
the same weights as an uninterrupted run. ``eval.num_tasks: 0`` / ``--no-eval`` skip the held-out
evaluation, and a one-stage recipe reports the stage's own numbers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

STEPS, EVERY = 24, 4


def _config(tmp: Path, model_dir: Path, name: str, **extra) -> Path:
    cfg = {
        "run_dir": str(tmp / name),
        "recipe": ["sft"],
        "threads": 1,
        "model": {"path": str(model_dir)},
        "audit": {"preflight": False},
        "sft": {"num_demos": 24, "steps": STEPS, "batch_size": 8, "checkpoint_every": EVERY},
        "eval": {"num_tasks": 0},
        **extra,
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _cmd(cfg: Path, *flags: str) -> list[str]:
    return [sys.executable, "-m", "mentorrl.cli", "train", str(cfg), *flags]


def _env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[1])
    return {
        **os.environ,
        "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
        "OMP_WAIT_POLICY": "PASSIVE",
        "COLUMNS": "200",
    }


def _sft_records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("stage") == "sft":
            out.append(rec)
    return out


def _weights(d: Path) -> dict[str, torch.Tensor]:
    return load_file(str(d / "model.safetensors"))


def test_sigkill_mid_sft_then_resume_continues_to_the_same_weights(tiny_model_dir, tmp_path):
    env = _env()
    # the reference: one uninterrupted run
    ref_cfg = _config(tmp_path, tiny_model_dir, "ref")
    done = subprocess.run(_cmd(ref_cfg), env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "held-out evaluation skipped" in done.stdout and "changed held-out success" not in done.stdout
    assert not list((tmp_path / "ref").glob("eval_*.json"))

    # the same run, SIGKILLed once it has logged a step past its second checkpoint
    cfg = _config(tmp_path, tiny_model_dir, "killed")
    run = tmp_path / "killed"
    proc = subprocess.Popen(_cmd(cfg), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 90
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if len(_sft_records(run)) >= 2 * EVERY + 1:
                break
            time.sleep(0.005)
        assert proc.poll() is None, "the run ended before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not (run / "sft" / "final" / "DONE").exists()
    ckpts = sorted(p.name for p in (run / "sft" / "checkpoints").glob("step-*"))
    assert ckpts, "no periodic checkpoint before the kill"
    last = int(ckpts[-1].split("-")[1])
    assert 2 * EVERY <= last < STEPS and last % EVERY == 0
    state = torch.load(run / "sft" / "checkpoints" / ckpts[-1] / "trainer_state.pt", weights_only=False)
    assert state["step"] == last and {"python", "torch"} <= set(state["rng"])
    assert state["learner"]["optimizer"]["state"], "the optimizer's moments are saved"
    before = [r for r in _sft_records(run) if r["step"] <= last]

    resumed = subprocess.run(_cmd(cfg, "--resume"), env=env, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resuming from {ckpts[-1]} (step {last}/{STEPS})" in resumed.stdout
    recs = _sft_records(run)
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))  # each step logged once
    assert recs[:last] == before  # the steps up to the checkpoint were not redone (their timings are the killed run's)
    ref, got = _weights(tmp_path / "ref" / "sft" / "final"), _weights(run / "sft" / "final")
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    from transformers import AutoTokenizer

    from mentorrl.contract import CHAT_TEMPLATE

    assert AutoTokenizer.from_pretrained(run / "sft" / "final").chat_template == CHAT_TEMPLATE


def test_eval_num_tasks_zero_is_accepted_and_negative_is_named():
    from mentorrl.config import RunConfig

    assert RunConfig(eval={"num_tasks": 0}).eval.num_tasks == 0
    with pytest.raises(Exception, match="num_tasks"):
        RunConfig(eval={"num_tasks": -1})
    with pytest.raises(Exception, match="checkpoint_every"):
        RunConfig(sft={"checkpoint_every": 0})


def test_no_eval_flag_and_one_stage_report(tiny_model_dir, tmp_path):
    """--no-eval skips evaluation; with evaluation on, a one-stage recipe reports its own
    held-out numbers and training loss, never a comparison with itself."""
    from typer.testing import CliRunner

    from mentorrl.cli import app

    cfg = _config(
        tmp_path,
        tiny_model_dir,
        "one",
        eval={"num_tasks": 4, "batch_size": 4},
        sft={"num_demos": 8, "steps": 2, "batch_size": 4},
    )
    out = CliRunner().invoke(app, ["train", str(cfg), "--no-eval"])
    assert out.exit_code == 0, out.output
    assert not list((tmp_path / "one").glob("eval_*.json")) and "held-out evaluation skipped" in out.output
    out = CliRunner().invoke(app, ["train", str(cfg), "--set", f"run_dir={tmp_path / 'two'}"])
    assert out.exit_code == 0, out.output
    assert "changed held-out success" not in out.output
    assert "sft: 2 steps, loss" in out.output and "held-out success" in out.output
