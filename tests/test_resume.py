"""Resuming after an interruption continues the step count, the weights and the metrics."""

from __future__ import annotations

import copy
import io
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
from rich.console import Console

from mentorrl.config import OptimConfig, load_config
from mentorrl.train.learner import Learner
from mentorrl.train.loop import run_stage
from mentorrl.train.rundir import MetricsLog, latest_checkpoint
from mentorrl.train.workspace import Workspace

REPO = Path(__file__).resolve().parents[1]

TINY_OVERRIDES = [
    "threads=1",
    "model.spec.hidden_size=64",
    "model.spec.intermediate_size=128",
    "model.spec.num_layers=2",
    "model.spec.num_heads=2",
    "model.spec.num_kv_heads=1",
    "model.spec.vocab_size=600",
    "model.tokenizer_corpus_tasks=60",
    "model.pretrain.steps=0",
    "sft.steps=4",
    "sft.num_demos=16",
    "sft.batch_size=4",
    "grpo.steps=4",
    "grpo.tasks_per_step=2",
    "grpo.samples_per_task=2",
    "grpo.checkpoint_every=2",
    "eval.num_tasks=4",
    "sampling.max_new_tokens=24",
    "limits.max_turns=3",
    "limits.max_total_tokens=512",
    "prompt.tool_descriptions=false",
]

# Runs the real CLI, but blocks (waiting to be SIGKILLed) right after metrics.jsonl got the
# record of GRPO step 3, i.e. after the step-2 checkpoint and before the step-4 one.
BLOCKING_CLI = """
import os, sys, time
from mentorrl.train import rundir
_log = rundir.MetricsLog.log
def log(self, rec):
    _log(self, rec)
    if rec.get("stage") == "grpo" and rec.get("step") == 3:
        open(os.environ["MENTORRL_TEST_MARKER"], "w").write("blocked")
        time.sleep(600)
rundir.MetricsLog.log = log
from mentorrl.cli import app
app()
"""


def _sample_task_ids(run_dir) -> dict[int, list[str]]:
    out = {}
    for f in sorted((run_dir / "samples").glob("grpo-step-*.jsonl")):
        out[int(f.stem.split("-")[-1])] = [json.loads(x)["task_id"] for x in f.read_text().splitlines()]
    return out


def _sample_tokens(run_dir) -> dict[int, list[tuple[list[int], list[float]]]]:
    out = {}
    for f in sorted((run_dir / "samples").glob("grpo-step-*.jsonl")):
        out[int(f.stem.split("-")[-1])] = [
            (t["token_ids"], t["logprobs"]) for t in map(json.loads, f.read_text().splitlines())
        ]
    return out


def _steps(records: list[dict], stage: str) -> list[int]:
    return [r["step"] for r in records if r.get("stage") == stage]


def _env() -> dict:
    env = dict(os.environ, COLUMNS="200", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.mark.slow
def test_cli_resume_after_sigkill(tmp_path):
    run_dir = tmp_path / "run"
    cfg = load_config(None, TINY_OVERRIDES + [f"run_dir={run_dir}"])
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    marker = tmp_path / "blocked"
    env = _env()
    env["MENTORRL_TEST_MARKER"] = str(marker)

    # 1. a real run, killed with SIGKILL mid-GRPO (after step 3 was logged, step 2 checkpointed)
    proc = subprocess.Popen(
        [sys.executable, "-c", BLOCKING_CLI, "demo", "--config", str(cfg_path)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            if proc.poll() is not None:
                pytest.fail(f"run ended before it could be interrupted (rc={proc.returncode}):\n{proc.stdout.read()}")
            if time.monotonic() > deadline:
                pytest.fail("run did not reach GRPO step 3 in time")
            time.sleep(0.05)
        assert (run_dir / "grpo" / "checkpoints" / "step-000002" / "trainer_state.pt").exists()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL

    log = MetricsLog(run_dir / "metrics.jsonl")
    killed = log.read()
    assert _steps(killed, "sft") == [1, 2, 3, 4]
    assert _steps(killed, "grpo") == [1, 2, 3]  # step 3 is past the latest checkpoint
    assert latest_checkpoint(run_dir / "grpo").name == "step-000002"
    assert not (run_dir / "grpo" / "final").exists()
    assert (run_dir / "eval_sft.json").exists() and not (run_dir / "eval_grpo.json").exists()
    eval_sft_before = (run_dir / "eval_sft.json").read_text()
    per_step = cfg.grpo.tasks_per_step * cfg.grpo.samples_per_task
    killed_samples, killed_tokens = _sample_task_ids(run_dir), _sample_tokens(run_dir)
    assert sorted(killed_samples) == [1, 2, 3] and all(len(v) == per_step for v in killed_samples.values())

    # 2. resume with the ordinary entry point
    res = subprocess.run(
        [sys.executable, "-m", "mentorrl.cli", "demo", "--config", str(cfg_path), "--resume"],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "grpo: resuming from step-000002 (step 2/4)" in out, out
    assert "sft: already complete" in out, out

    records = log.read()
    assert _steps(records, "sft") == [1, 2, 3, 4]
    assert _steps(records, "grpo") == [1, 2, 3, 4]  # exactly once each, in order
    # records before the checkpoint are kept as they were
    grpo_killed = {r["step"]: r for r in killed if r["stage"] == "grpo"}
    grpo_now = {r["step"]: r for r in records if r["stage"] == "grpo"}
    assert grpo_now[1] == grpo_killed[1] and grpo_now[2] == grpo_killed[2]
    assert [r for r in records if r["stage"] == "sft"] == [r for r in killed if r["stage"] == "sft"]
    # the redone step 3 continues the same run: the same tasks as the killed step 3, the policy
    # version counter continues from the checkpoint, and (tool_sync next_step, the RNG state restored)
    # the same trajectories and the same logged values but the timings (issue 41, item 5)
    samples = _sample_task_ids(run_dir)
    assert sorted(samples) == [1, 2, 3, 4]  # one sample file per step: the redone step replaced its file
    assert samples[3] == killed_samples[3] and samples[1] == killed_samples[1]
    assert _sample_tokens(run_dir)[3] == killed_tokens[3]
    from test_reproducible import _differences

    assert not _differences([grpo_killed[3]], [grpo_now[3]])
    assert grpo_now[3]["policy_version"] >= grpo_killed[2]["policy_version"]
    assert grpo_now[4]["policy_version"] >= grpo_now[3]["policy_version"]

    # 3. the run finished: final weights, evaluations, result, checkpoints pruned to the last two
    assert (run_dir / "grpo" / "final" / "DONE").exists()
    for name in ("eval_sft.json", "eval_sft.jsonl", "eval_grpo.json", "eval_grpo.jsonl", "demo_result.json"):
        assert (run_dir / name).exists(), name
    assert (run_dir / "eval_sft.json").read_text() == eval_sft_before  # not re-evaluated
    summary = json.loads((run_dir / "eval_grpo.json").read_text())
    assert summary["label"] == "grpo" and summary["n"] == 4
    ckpts = sorted(p.name for p in (run_dir / "grpo" / "checkpoints").iterdir())
    assert ckpts == ["step-000002", "step-000004"]
    # the demo's outputs: the before/after table and a real PNG of the curves
    assert "Held-out evaluation" in out and "SFT + GRPO" in out
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # checkpoints are Hugging Face directories that load the ordinary way
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoTokenizer.from_pretrained(run_dir / "grpo" / "final")
    AutoModelForCausalLM.from_pretrained(run_dir / "grpo" / "checkpoints" / "step-000004")


# ------------------------------------------------------------- unit level -------
class Interrupt(Exception):
    pass


@pytest.fixture
def workspace(tmp_path, tokenizer, orders_entry):
    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}"])
    buf = io.StringIO()
    ws = Workspace(
        cfg=cfg,
        run_dir=tmp_path / "run",
        env_entry=orders_entry,
        tokenizer=tokenizer,
        console=Console(file=buf, width=200),
        show_progress=False,
    )
    ws.run_dir.mkdir(parents=True)
    return ws, buf


def _stage(ws, model, steps, checkpoint_every, resume, crash_at=None, seen=None, extra=None):
    learner = Learner(model, OptimConfig(lr=1e-3), pad_id=0)
    param = next(model.parameters())

    def step_fn(step: int) -> dict:
        if crash_at is not None and step == crash_at:
            raise Interrupt
        if seen is not None:
            seen.append(step)
        with torch.no_grad():
            param.add_(1.0)  # a visible, exact weight change per step
        return {"loss": float(step), "w": float(param.detach().flatten()[1])}

    kw = {}
    if extra is not None:
        kw = dict(extra_state=lambda: dict(extra), restore_extra=lambda s: extra.update(s))
    return run_stage(ws, "grpo", model, learner, steps, step_fn, checkpoint_every, resume, **kw)


def test_run_stage_resume_restores_weights_steps_and_metrics(workspace, model):
    ws, buf = workspace
    base = next(model.parameters()).detach().clone()
    m1 = copy.deepcopy(model)
    with pytest.raises(Interrupt):
        _stage(ws, m1, steps=5, checkpoint_every=2, resume=False, crash_at=3, extra={"policy": 7})
    assert _steps(ws.metrics.read(), "grpo") == [1, 2, 3]
    assert latest_checkpoint(ws.run_dir / "grpo").name == "step-000002"

    m2 = copy.deepcopy(model)  # a fresh process: the base weights again
    seen: list[int] = []
    extra = {"policy": 0}
    final = _stage(ws, m2, steps=5, checkpoint_every=2, resume=True, seen=seen, extra=extra)
    assert seen == [2, 3, 4]  # continues at the checkpoint's step
    assert extra == {"policy": 7}  # extra trainer state restored
    assert "resuming from step-000002 (step 2/5)" in buf.getvalue()
    recs = ws.metrics.read("grpo")
    assert _steps(recs, "grpo") == [1, 2, 3, 4, 5]
    assert [r["loss"] for r in recs] == [0.0, 1.0, 2.0, 3.0, 4.0]
    # weights: the checkpoint's (base + 1 + 1) plus three more steps, bit for bit
    expected, trace = base.clone(), []
    for _ in range(5):
        expected += 1.0
        trace.append(float(expected.flatten()[1]))
    assert torch.equal(next(m2.parameters()).detach(), expected)
    assert [r["w"] for r in recs] == trace
    assert (final / "DONE").exists()

    # resuming a finished stage loads its final weights and runs nothing
    m3 = copy.deepcopy(model)
    seen3: list[int] = []
    _stage(ws, m3, steps=5, checkpoint_every=2, resume=True, seen=seen3)
    assert seen3 == [] and torch.equal(next(m3.parameters()).detach(), expected)
    assert _steps(ws.metrics.read("grpo"), "grpo") == [1, 2, 3, 4, 5]


def test_fresh_run_replaces_old_metrics(workspace, model):
    ws, _ = workspace
    _stage(ws, copy.deepcopy(model), steps=2, checkpoint_every=2, resume=False)
    _stage(ws, copy.deepcopy(model), steps=3, checkpoint_every=2, resume=False)
    assert _steps(ws.metrics.read(), "grpo") == [1, 2, 3]


def test_metrics_truncate_drops_torn_line_and_later_steps(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    for s in (1, 2, 3):
        log.log({"stage": "sft", "step": s})
    for s in (1, 2, 3):
        log.log({"stage": "grpo", "step": s})
    with open(log.path, "a") as f:
        f.write('{"stage": "grpo", "st')  # torn by a kill mid-write
    assert _steps(log.read(), "grpo") == [1, 2, 3]
    log.truncate_after("grpo", 1)
    assert _steps(log.read(), "grpo") == [1] and _steps(log.read(), "sft") == [1, 2, 3]
    assert log.path.read_text().endswith("}\n")


def test_resume_before_first_checkpoint_does_not_duplicate_metrics(workspace, model):
    ws, _ = workspace
    with pytest.raises(Interrupt):
        _stage(ws, copy.deepcopy(model), steps=4, checkpoint_every=4, resume=False, crash_at=2)
    assert _steps(ws.metrics.read(), "grpo") == [1, 2]
    _stage(ws, copy.deepcopy(model), steps=4, checkpoint_every=4, resume=True)
    assert _steps(ws.metrics.read(), "grpo") == [1, 2, 3, 4]
