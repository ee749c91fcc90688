"""Ray rollout workers (``distributed.backend: ray``): GRPO and SAO on real Ray actors of a local Ray
(``ray.init(num_cpus=2)``), compared with mentorrl's own single-process rollouts, and the actor-kill fault.

Skipped only where ``import ray`` fails (``pip install "mentorrl[ray]"``).

Why the 2-actor comparison is with per-share single-process rollouts: the engine seeds episode ``e``
of a call with ``seed * 1_000_003 + e``; a worker's share is one call seeded ``seed + offset`` (the
data-parallel learner's rule), so 2 actors sample different random streams than one process decoding
the whole step in one call. One actor is exactly that one call, and is compared with the plain run.
Log-probs are compared to 1e-4 (float noise: the batch layout of a decode step depends on tool-call
timing, see tests/test_rollout.py); token ids exactly.
"""

from __future__ import annotations

import copy
import json
import threading
from pathlib import Path

import pytest
import torch
from test_resume import TINY_OVERRIDES

from mentorrl.config import ConfigError, load_config
from mentorrl.train.distributed import distributed_plan
from mentorrl.trajectory import read_jsonl

pytestmark = pytest.mark.ray

LOGPROB_TOL = 1e-4
# How long a streaming pool may go without a trajectory while every actor is up (starting actors --
# a new process, imports, a policy copy -- stop that clock): generous, for a loaded 2-core machine.
GET_TIMEOUT_S = 300
# A CLI run (its own Ray, a tiny model, 3 GRPO steps on 2 actors) takes about 30 s on an idle 2-core machine.
CLI_TIMEOUT_S = 600


def test_ray_backend_refuses_a_torchrun_launch():
    cfg = load_config(None, ["distributed.backend=ray"])
    assert distributed_plan(cfg, {}) is None  # a plain launch: one learner process
    with pytest.raises(ConfigError, match="distributed.backend: ray"):
        distributed_plan(cfg, {"WORLD_SIZE": "2", "RANK": "0"})


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning")
    yield ray
    from mentorrl.distributed.ray_workers import kill_idle_actors

    kill_idle_actors()  # the tests share rollout actors (a closed pool's are reused by the next)
    ray.shutdown()


def _cfg(run_dir: Path, extra: list[str]):
    return load_config(
        None,
        TINY_OVERRIDES
        + [
            f"run_dir={run_dir}",
            "recipe=[grpo]",
            "grpo.steps=2",
            "grpo.checkpoint_every=1",
            "grpo.sample_trajectories=1000",
            "grpo.kl_coef=0.1",
            "eval.num_tasks=0",
            "audit.preflight=false",
        ]
        + extra,
    )


def _run(run_dir: Path, extra: list[str]):
    from mentorrl.train.pipeline import run_recipe

    cfg = _cfg(run_dir, extra)
    run_recipe(cfg, show_progress=False)  # closing its workspace releases the rollout actors
    return cfg


def _samples(run_dir: Path, step: int) -> list:
    return list(read_jsonl(run_dir / "samples" / f"grpo-step-{step:06d}.jsonl"))


def _same(a: list, b: list) -> float:
    """Asserts equal task ids, token ids and policy versions; returns the largest log-prob gap."""
    assert [t.task_id for t in a] == [t.task_id for t in b]
    assert [t.token_ids for t in a] == [t.token_ids for t in b]
    assert [t.policy_version for t in a] == [t.policy_version for t in b]
    gap = max((abs(x - y) for ta, tb in zip(a, b) for x, y in zip(ta.logprobs, tb.logprobs)), default=0.0)
    assert gap < LOGPROB_TOL
    return gap


def _load(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_grpo_two_steps_on_two_rollout_actors_matches_single_process_rollouts(ray_local, tmp_path):
    """GRPO for 2 steps with 2 rollout actors: every trajectory equals the one this process samples
    for the same share, seed and weights (step 2 with the weights broadcast after step 1)."""
    from mentorrl.envs import get_env
    from mentorrl.models.build import load_policy
    from mentorrl.rollout.runner import rollout_tasks
    from mentorrl.train.loop import StepSeeds, pool_size
    from mentorrl.train.workspace import Workspace

    run = tmp_path / "ray2"
    cfg = _run(run, ["distributed.backend=ray", "distributed.rollout_workers=2"])
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("stage") == "grpo"] == [1, 2]

    tokenizer, _ = load_policy(run / "base_model")
    ws = Workspace(cfg=cfg, run_dir=run, env_entry=get_env(cfg.env.name), show_progress=False)
    ws.bind_tokenizer(tokenizer)
    seeds = StepSeeds(cfg.seed, "grpo")  # the GRPO stage's pool and rollout seeds
    pool = ws.train_tasks(pool_size(cfg.grpo.tasks_per_step, cfg.grpo.steps), seeds("pool"))
    by_id = {t.id: t for t in pool}
    weights = [run / "base_model", run / "grpo" / "checkpoints" / "step-000001"]
    for step in (1, 2):
        got = _samples(run, step)
        assert len(got) == cfg.grpo.tasks_per_step * cfg.grpo.samples_per_task
        tasks = [by_id[t.task_id] for t in got]
        model = _load(weights[step - 1])
        seed = seeds.at(step - 1)("rollout")
        ref = []
        for lo, hi in ((0, len(tasks) // 2), (len(tasks) // 2, len(tasks))):  # the two actors' shares
            ref += rollout_tasks(
                model,
                ws.contract,
                ws.make_env,
                tasks[lo:hi],
                policy_version=got[0].policy_version,
                seed=seed + lo,
                batch_size=hi - lo,
                weights=cfg.reward,
            )
        _same(got, ref)
    assert _samples(run, 2)[0].policy_version > _samples(run, 1)[0].policy_version  # versioned broadcast


def test_grpo_on_one_rollout_actor_equals_the_plain_run(ray_local, tmp_path):
    """One rollout actor decodes the step as the plain single-process run does: the same
    trajectories both steps and the same weights after them."""
    _run(tmp_path / "plain", [])
    _run(tmp_path / "ray1", ["distributed.backend=ray", "distributed.rollout_workers=1"])
    for step in (1, 2):
        _same(_samples(tmp_path / "ray1", step), _samples(tmp_path / "plain", step))
    a = _load(tmp_path / "plain" / "grpo" / "final").state_dict()
    b = _load(tmp_path / "ray1" / "grpo" / "final").state_dict()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


# ------------------------------------------------------------------ faults -------
def _perturbed(model, seed: int):
    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return m


def _per_share(model, contract, make_env, tasks, version: int, seed: int, workers: int = 2) -> list:
    from mentorrl.distributed.ray_workers import shares
    from mentorrl.rollout.runner import rollout_tasks

    out = []
    for part in shares(len(tasks), workers):
        out += rollout_tasks(
            model,
            contract,
            make_env,
            tasks[part.start : part.stop],
            policy_version=version,
            seed=seed + part.start,
            batch_size=max(len(part), 1),
        )
    return out


def _kill_when_in_flight(ray, pool, victim) -> threading.Thread:
    def kill():
        assert pool.in_flight.wait(120)
        ray.kill(victim)

    t = threading.Thread(target=kill, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("which", ["rollout", "env"])
def test_actor_killed_mid_step_is_replaced_and_its_episodes_rerun(
    ray_local, which, tool_happy_model, make_contract, orders_entry, orders_tasks
):
    """ray.kill a rollout actor (or the environment actor) while a step's shares are in flight: the
    replacement loads the current weights and re-runs the share with its seed, so the step returns
    exactly the trajectories of an undisturbed run (none lost, none twice)."""
    from mentorrl.config import DistributedConfig
    from mentorrl.distributed.ray_workers import RayRollouts
    from mentorrl.rollout import RolloutSpec

    ray = ray_local
    contract = make_contract()
    tasks = orders_tasks[:8]
    model = copy.deepcopy(tool_happy_model)
    dist = DistributedConfig(backend="ray", rollout_workers=2, env_workers=1 if which == "env" else 0)
    pool = RayRollouts(dist, model, RolloutSpec(contract, orders_entry.make_env))
    try:
        first = pool.rollout(tasks, 0, seed=3)
        _same(first, _per_share(model, contract, orders_entry.make_env, tasks, 0, 3))
        with torch.no_grad():  # the learner's update: the replacement must get these weights
            model.load_state_dict(_perturbed(model, 1).state_dict())
        ref = _per_share(model, contract, orders_entry.make_env, tasks, 1, 3)
        victim = pool.actors[0] if which == "rollout" else pool.env_actors[0]
        killer = _kill_when_in_flight(ray, pool, victim)
        got = pool.rollout(tasks, 1, seed=3)
        killer.join(timeout=60)
        if which == "rollout":
            assert pool.replaced == 1 and pool.actors[0]._actor_id != victim._actor_id
        else:
            assert pool.env_replaced == 1 and pool.env_actors[0]._actor_id != victim._actor_id
        assert len(got) == len(tasks) and len({t.id for t in got}) == len(got)
        assert sum(len(t.token_ids) for t in got) > 0
        _same(got, ref)
        assert pool.weights.broadcasts == 2  # one object-store copy per version, whatever the restarts
    finally:
        pool.close()


# ------------------------------------------------------------------ SAO -------
def test_sao_stream_across_actors_versions_and_staleness(
    ray_local, tool_happy_model, make_contract, orders_entry, orders_tasks
):
    """Two streaming rollout actors: trajectories carry the version that started them, a newer
    version reaches every actor through the object store, trajectories started under it are
    sampled from the new weights, and the staleness rule drops the ones older than the bound."""
    from mentorrl.config import DistributedConfig
    from mentorrl.distributed.ray_workers import RayRolloutPool
    from mentorrl.rollout import Rollout
    from mentorrl.train.async_rl import WeightBox, staleness_weights
    from mentorrl.train.stage_helpers import relabel_behaviour

    contract = make_contract()
    model = copy.deepcopy(tool_happy_model)
    box = WeightBox()
    box.publish(model, 0)
    tasks = orders_tasks[:120]
    pool = RayRolloutPool(
        model,
        Rollout(contract, orders_entry.make_env),
        iter(tasks),
        box,
        slots=2,
        queue_size=4,
        seed=1,
        dist=DistributedConfig(backend="ray", rollout_workers=2),
    )
    pool.start()
    try:
        first = pool.get(4, GET_TIMEOUT_S)
        assert {t.policy_version for t in first} == {0}
        # the actors hold version-0 episodes (in flight or in their outboxes) when version 3 is published
        new = _perturbed(model, 2)
        box.publish(new, 3)
        later: list = []
        for _ in range(60):
            later += pool.get(2, GET_TIMEOUT_S)
            # both actors synced (on a busy machine one actor can produce all four first)
            if sum(t.policy_version == 3 for t in later) >= 4 and pool.syncs >= 2:
                break
        versions = [t.policy_version for t in later]
        assert set(versions) <= {0, 3} and 0 in versions and versions.count(3) >= 4
        weights = staleness_weights([3 - v for v in versions], max_staleness=1, mode="drop")
        assert weights == [0.0 if v == 0 else 1.0 for v in versions]  # the bound holds across processes
        assert pool.syncs >= 2  # each actor loaded version 3
        seen = [t.task_id for t in first + later]
        assert len(seen) == len(set(seen))  # every task once (the driver deals them out)
        fresh = [t for t in later if t.policy_version == 3]
        relabelled = relabel_behaviour(new, fresh, contract.pad_token_id, contract.sampling.temperature)
        gap = max(
            abs(a - b) for t, r in zip(fresh, relabelled) for a, b, m in zip(t.logprobs, r.logprobs, t.loss_mask) if m
        )
        assert gap < LOGPROB_TOL  # sampled from the broadcast weights, not the old ones
    finally:
        pool.close()


def test_sao_stream_survives_a_killed_actor(ray_local, tool_happy_model, make_contract, orders_entry, orders_tasks):
    """Kill a streaming actor between two gets: its replacement gets the tasks it held (in flight or
    finished but not yet collected), so every task of the stream comes back exactly once."""
    from mentorrl.config import DistributedConfig
    from mentorrl.distributed.ray_workers import RayRolloutPool
    from mentorrl.rollout import Rollout
    from mentorrl.train.async_rl import WeightBox

    ray = ray_local
    contract = make_contract()
    model = copy.deepcopy(tool_happy_model)
    box = WeightBox()
    box.publish(model, 0)
    tasks = orders_tasks[200:216]
    pool = RayRolloutPool(
        model,
        Rollout(contract, orders_entry.make_env),
        iter(tasks),
        box,
        slots=2,
        queue_size=4,
        seed=5,
        dist=DistributedConfig(backend="ray", rollout_workers=2),
    )
    pool.start()
    try:
        got = pool.get(3, GET_TIMEOUT_S)
        victim = pool.actors[0]
        assert pool.given[0]  # it holds tasks now
        ray.kill(victim)
        got += pool.get(len(tasks) - 3, GET_TIMEOUT_S)
        assert pool.replaced == 1 and pool.actors[0]._actor_id != victim._actor_id
        assert sorted(t.task_id for t in got) == sorted(t.id for t in tasks)
        assert not any(pool.given) and pool.spill == []
    finally:
        pool.close()


def test_sao_stage_on_ray_actors(ray_local, tmp_path):
    """``recipe: [grpo, sao]`` with ``distributed.backend: ray``: the SAO learner trains on what two
    actors stream, and no trajectory it trains on lags more than ``max_staleness`` versions. The
    GRPO stage's two actors hold both CPUs of this Ray: the stream reuses them (it would wait forever
    for CPUs otherwise).

    How stale each step's trajectories are depends on when the actors load the weights they are sent
    (between forward passes, not while their outbox is full), so a loaded machine may drop a whole step's
    batch as stale, which then trains nothing and publishes no version. What holds whatever the timing:
    the staleness rule drops exactly the trajectories over ``max_staleness``, the update's lag metric is the
    kept ones' (no replay nor expert items here), and the version moves once per step that trained."""
    from mentorrl.train.pipeline import run_recipe

    run = tmp_path / "sao"
    cfg = load_config(
        None,
        TINY_OVERRIDES
        + [
            f"run_dir={run}",
            "recipe=[grpo, sao]",
            "grpo.steps=1",
            "sao.steps=4",
            "sao.batch_size=4",
            "sao.rollout.slots=2",
            "sao.rollout.max_staleness=1",
            "sao.critic.warmup_steps=0",
            "eval.num_tasks=0",
            "audit.preflight=false",
            "distributed.backend=ray",
            "distributed.rollout_workers=2",
        ],
    )
    run_recipe(cfg, show_progress=False)
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if r.get("stage") == "grpo"] == [1]
    sao = [r for r in recs if r.get("stage") == "sao"]
    assert [r["step"] for r in sao] == [1, 2, 3, 4]
    version = 0
    for r in sao:
        lags = {int(k): n for k, n in r["policy_lag_hist"].items()}
        kept = [lag for lag in lags if lag <= 1]  # sao.rollout.max_staleness=1, stale: drop
        assert min(lags) >= 0 and sum(lags.values()) == r["rollouts"] == 4, r
        assert r["stale_dropped"] == sum(n for lag, n in lags.items() if lag > 1), r
        assert r["online_items"] == r["rollouts"] - r["stale_dropped"], r
        assert r["replay_items"] == r["expert_items"] == 0, r  # the batch is the kept online trajectories
        assert r["actor_updated"] == float(bool(kept)), r
        if kept:  # what the learner trained on lagged at most max_staleness versions
            assert r["policy_lag_max"] == max(kept) <= 1, r
        version += int(r["actor_updated"])  # sync_every=1: each step that trained sends a new version
        assert r["policy_version"] == version, r
    # a trajectory never lags more versions than the learner has: steps 1 and 2 always train
    assert sao[0]["actor_updated"] == sao[1]["actor_updated"] == 1.0
    syncs = [r["worker_syncs"] for r in sao]
    assert syncs == sorted(syncs) and syncs[-1] <= 2 * sao[-2]["policy_version"]  # two actors, each version once
    assert (run / "sao" / "final" / "DONE").exists()


# ------------------------------------------------------------------ a killed driver -------
def test_driver_sigkilled_mid_grpo_on_ray_resumes(ray_local, tmp_path):
    """The driver (learner + Ray head it started) SIGKILLed after the last GRPO step (3) was logged and
    before it was saved; ``--resume`` starts new actors, continues from the step-2 checkpoint, and redoes
    step 3 exactly: the same tasks and, since Ray rollouts are a function of (weights, tasks, seed,
    workers), the same tokens."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import yaml
    from test_resume import BLOCKING_CLI, _env, _sample_task_ids, _steps

    run_dir = tmp_path / "run"
    cfg = _cfg(
        run_dir, ["grpo.steps=3", "grpo.checkpoint_every=2", "distributed.backend=ray", "distributed.rollout_workers=2"]
    )
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    marker = tmp_path / "blocked"
    env = _env()
    env["MENTORRL_TEST_MARKER"] = str(marker)
    env.pop("RAY_ADDRESS", None)  # the CLI starts its own local Ray, as a user's run would
    proc = subprocess.Popen(
        [sys.executable, "-c", BLOCKING_CLI, "train", str(cfg_path)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + CLI_TIMEOUT_S
        while not marker.exists():
            if proc.poll() is not None:
                pytest.fail(f"run ended before it could be interrupted (rc={proc.returncode}):\n{proc.stdout.read()}")
            if time.monotonic() > deadline:
                pytest.fail("run did not reach GRPO step 3 in time")
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and every process of the Ray it started
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    killed = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert _steps(killed, "grpo") == [1, 2, 3]
    killed_step3 = _samples(run_dir, 3)
    killed_ids = _sample_task_ids(run_dir)

    res = subprocess.run(
        [sys.executable, "-m", "mentorrl.cli", "train", str(cfg_path), "--resume"],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        start_new_session=True,
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "grpo: resuming from step-000002 (step 2/3)" in out, out
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert _steps(records, "grpo") == [1, 2, 3]  # exactly once each
    assert _sample_task_ids(run_dir)[3] == killed_ids[3]
    _same(_samples(run_dir, 3), killed_step3)  # the redone step, token for token
    assert (run_dir / "grpo" / "final" / "DONE").exists()
