"""One-step-off-policy GRPO (``grpo.overlap: one_step``, mentorrl/train/overlap.py): batch k+1 rolled out
by the weights after step k-1 while the learner trains on batch k; reproducible bit for bit, resumable
after SIGKILL, and really overlapped."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mentorrl.config import load_config
from mentorrl.train.loop import RLLoop, StepSeeds, loop_for
from mentorrl.train.overlap import OverlapLoop, RolloutAhead, batch_from_state, batch_state, check_overlap
from mentorrl.train.recipes.grpo import GRPOStage
from mentorrl.train.workspace import open_workspace

REPO = Path(__file__).resolve().parents[1]
TIMING = ("_s", "cpu_util", "cpu_cores")  # wall / CPU time metrics: not part of what a seed fixes

OVERRIDES = [
    "threads=1",
    "grpo.steps=4",
    "grpo.tasks_per_step=2",
    "grpo.samples_per_task=2",
    "grpo.updates_per_step=1",
    "grpo.checkpoint_every=2",
    "grpo.sample_trajectories=0",
    "grpo.overlap=one_step",
    "sampling.max_new_tokens=16",
    "limits.max_turns=2",
    "limits.max_total_tokens=512",
    "prompt.tool_descriptions=false",
    "audit.eval_every=0",
]


def make_ws(run_dir: Path, tokenizer, extra: list[str] = ()):
    cfg = load_config(None, OVERRIDES + [f"run_dir={run_dir}", *extra])
    ws = open_workspace(cfg, show_progress=False)
    ws.bind_tokenizer(tokenizer)
    return ws


class Recording(GRPOStage):
    """GRPO that records what each step trains on (its trajectories' tokens, log-probs and versions)."""

    def __init__(self, ws, model, slow_rollout_s: float = 0.0):
        super().__init__(ws, model)
        self.trained: dict[int, list[tuple]] = {}
        self.slow_rollout_s = slow_rollout_s

    def rollout(self, b):
        super().rollout(b)
        time.sleep(self.slow_rollout_s)

    def score(self, b):
        """The verifier's rewards, plus a deterministic function of the tokens (the untrained model
        fails every task: without it no group would carry a signal and no update would run)."""
        self.trained[b.step] = [(t.token_ids, t.logprobs, t.policy_version) for t in b.trajs]
        super().score(b)
        b.rewards = b.rewards + torch.tensor([sum(t.token_ids) % 7 / 7 for t in b.trajs]).view_as(b.rewards)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def seeded(recs: list[dict]) -> list[dict]:
    """The records without their timings."""
    return [{k: v for k, v in r.items() if not k.endswith(TIMING)} for r in recs]


def run(tmp_path: Path, name: str, model, tokenizer, extra: list[str] = (), **kw):
    ws = make_ws(tmp_path / name, tokenizer, extra)
    stage = Recording(ws, copy.deepcopy(model), **kw)
    loop = loop_for(stage)
    assert isinstance(loop, OverlapLoop)
    final = loop.run()
    return stage, loop, final


WITH_STATE = ["grpo.hard_pool={boost: 4.0}", "grpo.guide=expert", "grpo.kl_coef=0.01"]  # a pool, demos, a reference


@pytest.mark.parametrize(
    "extra",
    [[], WITH_STATE, ["grpo.dynamic_sampling={max_rounds: 2}"]],
    ids=["plain", "hard-pool-guide-kl", "dynamic-sampling"],
)
def test_overlapped_grpo_is_bitwise_reproducible_and_rolls_out_by_the_previous_weights(
    tmp_path, model, tokenizer, extra
):
    a, loop, final = run(tmp_path, "a", model, tokenizer, extra)
    b, _, _ = run(tmp_path, "b", model, tokenizer, extra)
    assert a.trained == b.trained  # the same tokens, log-probs (floats, exactly) and versions
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)
    ra, rb = records(tmp_path / "a"), records(tmp_path / "b")
    assert seeded(ra) == seeded(rb)
    # batch s is rolled out by the weights after step s-2 (the start of step s-1): their version
    after = [0] + [int(r["policy_version"]) for r in ra]  # the learner's version after step s-1, s = 0..
    for s, trajs in a.trained.items():
        want = after[max(s - 1, 0)]
        assert {v for _, _, v in trajs} == {want}, (s, want)
        assert ra[s]["behaviour_version"] == want
    # one update a step here, so the version that rolled batch s out is s - 1 (batch 0: the start, 0)
    assert after == [0, 1, 2, 3, 4]
    assert {s: {v for _, _, v in t} for s, t in a.trained.items()} == {0: {0}, 1: {0}, 2: {1}, 3: {2}}
    assert a.trained.keys() == {0, 1, 2, 3}
    if extra == WITH_STATE:
        assert [r["hard_pool_size"] for r in ra] == [r["hard_pool_size"] for r in rb]
    if "dynamic" in " ".join(extra):  # the verifier fails every rollout here: each step spends both rounds
        assert [r["dynamic_rounds"] for r in ra] == [2.0] * 4
    assert ra[2]["policy_lag_max"] >= 1  # trained a step off-policy
    assert loop.pending is None  # nothing rolled out past the last step


def not_overlapped(loop: OverlapLoop, steps: int) -> list[int]:
    """The steps k whose update did not run while the rollout of k+1 ran (it must start before the update
    of k ends, and end after it starts)."""
    at = {(e.name, e.step): e.t for e in loop.events}
    return [
        k
        for k in range(steps - 1)
        if not (at["rollout_start", k + 1] < at["update_end", k] and at["rollout_end", k + 1] > at["update_start", k])
    ]


def test_the_rollout_ahead_runs_while_the_previous_batch_trains(tmp_path, model, tokenizer, monkeypatch):
    _, loop, _ = run(tmp_path, "slow", model, tokenizer, slow_rollout_s=0.3)
    assert not_overlapped(loop, 4) == []
    assert all(r["overlap_s"] > 0 for r in records(tmp_path / "slow")[:3])
    # the cheapest fake, a rollout ahead that runs to its end before the update starts, is caught
    monkeypatch.setattr(RolloutAhead, "start", RolloutAhead.run)
    monkeypatch.setattr(RolloutAhead, "join", lambda self, timeout=None: None)
    _, fake, _ = run(tmp_path, "fake", model, tokenizer, slow_rollout_s=0.3)
    assert not_overlapped(fake, 4) == [0, 1, 2]
    assert all(r["overlap_s"] == 0 for r in records(tmp_path / "fake"))


def test_threads_auto_gives_the_overlapped_stage_half_the_cores_while_it_runs(tmp_path, model, tokenizer):
    before = torch.get_num_threads()
    seen = []
    try:
        ws = make_ws(tmp_path / "auto", tokenizer, ["threads=auto", "grpo.steps=2"])
        run_threads = torch.get_num_threads()
        stage = GRPOStage(ws, copy.deepcopy(model))
        stage.after = lambda b: seen.append(torch.get_num_threads())
        loop_for(stage).run()
        plans = json.loads((tmp_path / "auto" / "parallelism.json").read_text())
        assert plans["run"]["threads"] == run_threads == plans["run"]["cores"]
        assert seen == [plans["grpo"]["threads"]] * 2 == [max(1, plans["grpo"]["cores"] // 2)] * 2
        assert "rollout ahead" in plans["grpo"]["reason"]
        assert torch.get_num_threads() == run_threads  # undone when the stage ends
    finally:
        torch.set_num_threads(before)


def test_a_pending_batch_round_trips_through_checkpoint_state(tmp_path, model, tokenizer):
    stage, loop, _ = run(tmp_path, "rt", model, tokenizer)
    ws = make_ws(tmp_path / "rt2", tokenizer, ["grpo.steps=2"])
    st = GRPOStage(ws, copy.deepcopy(model))
    lp = OverlapLoop(st)
    lp.step(0)
    state = batch_state(lp.pending)
    back = batch_from_state(state, st)
    assert back.trajs == lp.pending.trajs and back.tasks == lp.pending.tasks
    assert type(back.data) is type(lp.pending.data) and back.data == lp.pending.data
    assert back.behaviour_version == lp.pending.behaviour_version == 0 and back.step == 1
    assert back.seeds == StepSeeds(st.seeds.run, "grpo", 1)


def test_overlap_is_refused_before_the_first_step_where_it_cannot_run(tmp_path, model, tokenizer):
    ws = make_ws(tmp_path / "x", tokenizer)
    stage = GRPOStage(ws, copy.deepcopy(model))
    stage.overlappable = False
    with pytest.raises(ValueError, match="cannot roll its batches out a step ahead"):
        check_overlap(stage)
    stage.overlappable = True
    stage.ws.dp = object()
    with pytest.raises(ValueError, match="torchrun"):
        check_overlap(stage)
    stage.ws.dp = None
    assert type(loop_for(GRPOStage(make_ws(tmp_path / "y", tokenizer, ["grpo.overlap=off"]), model))) is RLLoop
    with pytest.raises(Exception, match="overlap"):
        load_config(None, ["grpo.overlap=two_steps"])


def test_an_interrupted_overlapped_run_resumes_to_the_uninterrupted_run(tmp_path, model, tokenizer):
    """In-process (the SIGKILL test below is the slow one): interrupted in step 3 (after the step-2
    checkpoint, whose state holds batch 3), resumed: the same trajectories, metrics and weights."""
    full, _, _ = run(tmp_path, "full", model, tokenizer)

    class Interrupted(Recording):
        def after(self, b):
            super().after(b)
            if b.step == 2:
                raise KeyboardInterrupt

    ws = make_ws(tmp_path / "cut", tokenizer)
    with pytest.raises(KeyboardInterrupt):
        loop_for(Interrupted(ws, copy.deepcopy(model))).run()
    again = Recording(make_ws(tmp_path / "cut", tokenizer), copy.deepcopy(model))
    loop_for(again).run(resume=True)
    assert again.trained == {k: v for k, v in full.trained.items() if k >= 2}
    assert seeded(records(tmp_path / "cut")) == seeded(records(tmp_path / "full"))
    for pa, pb in zip(again.model.parameters(), full.model.parameters()):
        assert torch.equal(pa, pb)


# ------------------------------------------------------------- SIGKILL -------
KILLABLE = """
import json, os, sys, time
sys.path.insert(0, {tests!r})
from mentorrl.models.build import load_policy
from mentorrl.train import rundir
from mentorrl.train.loop import loop_for
from test_overlap import Recording, make_ws

run_dir, model_dir, block, resume = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
if block:
    _log = rundir.MetricsLog.log
    def log(self, rec):
        _log(self, rec)
        if rec.get("step") == block:
            open(os.path.join(run_dir, "blocked"), "w").write("blocked")
            time.sleep(600)
    rundir.MetricsLog.log = log
tokenizer, model = load_policy(model_dir)
stage = Recording(make_ws(__import__("pathlib").Path(run_dir), tokenizer), model)
loop_for(stage).run(resume=resume)
json.dump({{str(k): v for k, v in stage.trained.items()}}, open(os.path.join(run_dir, "trained.json"), "w"))
"""


def _script(tmp_path: Path) -> Path:
    p = tmp_path / "killable.py"
    p.write_text(KILLABLE.format(tests=str(REPO / "tests")))
    return p


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run(script: Path, run_dir: Path, model_dir: Path, block: int = 0, resume: bool = False) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(script), str(run_dir), str(model_dir), str(block), "1" if resume else "0"],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.slow
def test_a_sigkilled_overlapped_run_resumes_to_the_uninterrupted_run_bit_for_bit(tmp_path, tiny_model_dir):
    """Killed after step 3 was logged (the step-2 checkpoint holds batch 3, rolled out ahead by the weights
    after step 1): the resumed run trains on that checkpointed batch and ends with the same weights,
    metrics and trajectories as a run never interrupted."""
    script = _script(tmp_path)
    full = _run(script, tmp_path / "full", tiny_model_dir)
    killed = _run(script, tmp_path / "killed", tiny_model_dir, block=3)
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / "killed" / "blocked").exists():
            assert killed.poll() is None, killed.stdout.read()
            assert time.monotonic() < deadline, "the run did not reach step 3 in time"
            time.sleep(0.05)
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait(timeout=30)
    finally:
        if killed.poll() is None:
            killed.kill()
            killed.wait()
    assert full.wait(timeout=300) == 0, full.stdout.read()
    ckpt = torch.load(
        tmp_path / "killed" / "grpo" / "checkpoints" / "step-000002" / "trainer_state.pt", weights_only=False
    )
    assert ckpt["extra"]["overlap"]["step"] == 2  # batch 3 (0-based 2), rolled out ahead, is in the checkpoint
    resumed = _run(script, tmp_path / "killed", tiny_model_dir, resume=True)
    out = resumed.stdout.read()
    assert resumed.wait(timeout=300) == 0, out
    assert "resuming from step-000002" in out, out

    assert seeded(records(tmp_path / "killed")) == seeded(records(tmp_path / "full"))
    done = json.loads((tmp_path / "full" / "trained.json").read_text())
    again = json.loads((tmp_path / "killed" / "trained.json").read_text())
    assert again == {k: v for k, v in done.items() if int(k) >= 2}  # the steps after the checkpoint, exactly
    for f in ("model.safetensors",):
        assert (tmp_path / "killed" / "grpo" / "final" / f).read_bytes() == (
            tmp_path / "full" / "grpo" / "final" / f
        ).read_bytes()
