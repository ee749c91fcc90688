"""Teachers and the learner on Ray actors, on a local Ray (``ray.init(num_cpus=2)``).

White-box OPD teachers (``distributed: {backend: ray, teacher_workers: K}``), compared with the same
teacher scoring in this process:

- same-tokenizer (with top-k; two actors, contiguous shares) and cross-tokenizer (one actor) teachers: the
  actors' signals equal the local ones (the actors run the same ``teacher_row`` on the same checkpoint);
- an actor killed between steps is replaced and its share scored again: nothing missing, nothing twice;
- more teacher actors than free CPUs is a ConfigError before any actor starts (it would wait forever);
- an OPD stage with ``teacher_workers: 1`` runs on Ray and logs the same signal counters.

The learner in its own actor (``learner_actor: true``): ``[sft, grpo]`` runs inside it (with its own
rollout actor) and writes the run directory; an error in the recipe comes back as its own type.

Skipped only where ``import ray`` fails (``pip install "mentorrl[ray]"``).
"""

from __future__ import annotations

import json

import pytest
import torch
from test_resume import TINY_OVERRIDES

from mentorrl.config import ConfigError, DistributedConfig, TeacherConfig, load_config
from mentorrl.models.spec import ModelSpec

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning")
    yield ray
    from mentorrl.distributed.ray_workers import kill_idle_actors

    kill_idle_actors()
    ray.shutdown()


@pytest.fixture(scope="module")
def other_dir(orders_entry, tmp_path_factory):
    """A teacher checkpoint with its own tokenizer (another vocabulary size)."""
    from mentorrl.train.models_init import build_tiny_model

    path = tmp_path_factory.mktemp("other") / "model"
    spec = ModelSpec(
        hidden_size=48, intermediate_size=96, num_layers=2, num_heads=2, num_kv_heads=1, vocab_size=450, seed=7
    )
    return build_tiny_model(orders_entry, path, spec, corpus_tasks=40, seed=3)


@pytest.fixture(scope="module")
def trajs(make_demos):
    _, demos = make_demos(7, seed=11)
    return demos


def _same_rows(a, b) -> None:
    assert len(a) == len(b)
    for (sa, ka, fa), (sb, kb, fb) in zip(a, b):
        assert fa == fb and (sa is None) == (sb is None) and (ka is None) == (kb is None)
        if sa is not None:
            assert torch.equal(sa.chunk_of, sb.chunk_of)
            assert torch.equal(sa.teacher_lp, sb.teacher_lp) and sa.teacher_tokens == sb.teacher_tokens
        if ka is not None:
            assert torch.equal(ka.topk_ids, kb.topk_ids) and torch.equal(ka.topk_logprobs, kb.topk_logprobs)


@pytest.fixture(scope="module")
def served(ray_local):
    """Teachers on actors, shared by the tests below in file order (2 CPUs: at most 2 actors at a time)."""
    out: dict = {}
    yield out
    for r in out.values():
        r.close()


def _check_against_local(served_teacher, local, trajs, cross: bool) -> None:
    from mentorrl.opd.scoring import teacher_row

    for top_k in (None, 3):
        got = served_teacher.row(trajs, top_k)
        _same_rows(got, teacher_row(local, trajs, top_k))
        assert sum(s is not None for s, _, _ in got) >= len(trajs) - 1  # scored, not skipped
    assert all(s is None for s, _, _ in served_teacher.row(trajs, None, skip_cross=True)) == cross


def test_same_tokenizer_teacher_actors_give_the_local_signals(served, tiny_model_dir, tokenizer, trajs):
    from mentorrl.distributed.ray_teachers import RayTeacher
    from mentorrl.opd.scoring import teacher_from_checkpoint

    t = TeacherConfig(name="same")
    served["same"] = RayTeacher(
        DistributedConfig(backend="ray", teacher_workers=2, rollout_workers=1), tiny_model_dir, tokenizer, t
    )
    _check_against_local(served["same"], teacher_from_checkpoint(tiny_model_dir, tokenizer, t), trajs, cross=False)


def test_a_killed_teacher_actor_is_replaced_and_its_share_scored_again(
    ray_local, served, tiny_model_dir, tokenizer, trajs
):
    from mentorrl.opd.scoring import teacher_from_checkpoint, teacher_row

    want = teacher_row(teacher_from_checkpoint(tiny_model_dir, tokenizer, TeacherConfig(name="same")), trajs, None)
    same = served["same"]
    ray_local.kill(same.actors[1], no_restart=True)
    _same_rows(same.row(trajs, None), want)
    assert same.replaced == 1
    served.pop("same").close()  # the CPUs back for the next tests


def test_cross_tokenizer_teacher_actors_give_the_local_signals(served, other_dir, tokenizer, trajs):
    from mentorrl.distributed.ray_teachers import RayTeacher
    from mentorrl.opd.scoring import teacher_from_checkpoint
    from mentorrl.opd.signals import CrossTokenizerTeacher

    t = TeacherConfig(name="cross")
    local = teacher_from_checkpoint(other_dir, tokenizer, t)
    assert isinstance(local, CrossTokenizerTeacher)
    served["cross"] = RayTeacher(
        DistributedConfig(backend="ray", teacher_workers=1, rollout_workers=1), other_dir, tokenizer, t
    )
    _check_against_local(served["cross"], local, trajs, cross=True)
    served.pop("cross").close()


def test_more_teacher_actors_than_free_cpus_is_a_config_error(ray_local):
    import time

    from mentorrl.distributed.ray_teachers import check_cpus

    deadline = time.time() + 120  # the earlier tests' actors are killed; Ray reports their CPUs free a little later
    while ray_local.available_resources().get("CPU", 0.0) < 2 and time.time() < deadline:
        time.sleep(0.5)
    with pytest.raises(ConfigError, match="need 3 free CPUs, the Ray cluster has 2 free"):
        check_cpus(DistributedConfig(backend="ray", teacher_workers=1), teachers=3)
    check_cpus(DistributedConfig(backend="ray", teacher_workers=1), teachers=2)


def test_opd_stage_with_a_teacher_actor(ray_local, tmp_path, tiny_model_dir):
    """``recipe: [opd]`` on Ray: rollouts on one rollout actor, the teacher on one teacher actor; the run
    logs its teacher counters and the actors are gone (their CPUs back) when the stage ends."""
    from mentorrl.train.pipeline import run_recipe

    run = tmp_path / "opd"
    cfg = load_config(
        None,
        TINY_OVERRIDES
        + [
            f"run_dir={run}",
            f"model.path={tiny_model_dir}",
            "recipe=[opd]",
            "opd.steps=2",
            "opd.tasks_per_step=2",
            "opd.samples_per_task=2",
            f"opd.teachers=[{{name: t, path: {tiny_model_dir}}}]",
            "eval.num_tasks=0",
            "audit.preflight=false",
            "distributed.backend=ray",
            "distributed.rollout_workers=1",
            "distributed.teacher_workers=1",
        ],
    )
    run_recipe(cfg, show_progress=False)  # closing its workspace releases the rollout actors
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    opd = [r for r in recs if r.get("stage") == "opd"]
    assert [r["step"] for r in opd] == [1, 2]
    assert all(r["teacher_tokens"] > 0 and r["alignment_failures"] == 0 for r in opd)
    # the student starts as its own teacher: step 1's distillation signal is 0 on every token (float noise)
    assert abs(opd[0]["opd_reverse_kl"]) < 1e-4
    import time

    deadline = time.time() + 60  # the teacher actor's CPU comes back (the idle rollout actor keeps its own)
    while ray_local.available_resources().get("CPU", 0.0) < 1.0 and time.time() < deadline:
        time.sleep(0.5)
    assert ray_local.available_resources().get("CPU", 0.0) >= 1.0


def test_the_recipe_runs_in_a_learner_actor(ray_local, tmp_path):
    import os

    from mentorrl.train.pipeline import train

    run = tmp_path / "learner"
    cfg = load_config(
        None,
        TINY_OVERRIDES
        + [
            f"run_dir={run}",
            "recipe=[sft, grpo]",
            "sft.steps=2",
            "grpo.steps=1",
            "eval.num_tasks=0",
            "audit.preflight=false",
            "distributed.backend=ray",
            "distributed.rollout_workers=1",
            "distributed.learner_actor=true",
        ],
    )
    result = train(cfg, show_progress=False)
    assert result["learner"]["pid"] != os.getpid()  # the recipe ran in another process
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if r.get("stage") == "grpo"] == [1]
    assert (run / "grpo" / "final" / "DONE").exists() and (run / "report.json").exists()


def test_an_error_in_the_learner_actor_keeps_its_type(ray_local, tmp_path):
    from mentorrl.train.pipeline import train

    cfg = load_config(
        None,
        TINY_OVERRIDES
        + [
            f"run_dir={tmp_path / 'bad'}",
            f"model.path={tmp_path / 'no-such-checkpoint'}",
            "recipe=[sft]",
            "distributed.backend=ray",
            "distributed.learner_actor=true",
        ],
    )
    with pytest.raises(ConfigError, match="no-such-checkpoint") as e:  # the preflight check, inside the actor
        train(cfg, show_progress=False)
    assert type(e.value) is ConfigError and "ray::" not in str(e.value)  # the error itself, not Ray's wrapper


def test_a_served_teacher_on_an_actor_needs_its_token(ray_local, tiny_model_dir):
    """``serve_on_actor``: the checkpoint served by ``mentorrl serve`` from a Ray actor (127.0.0.1 on this
    single-node Ray), behind a fresh bearer token held in an environment variable of this process only
    while the server lives; no token is a 401; afterwards the server is gone."""
    import os

    import httpx

    from mentorrl.distributed.ray_serve import serve_on_actor

    body = {"model": "m", "messages": [{"role": "user", "content": "Where is order O-1?"}], "max_tokens": 4}
    with serve_on_actor(DistributedConfig(backend="ray", teacher_workers=1), tiny_model_dir) as (url, token_env):
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
        token = os.environ[token_env]
        assert len(token) >= 24
        assert httpx.post(f"{url}/chat/completions", json=body, timeout=60).status_code == 401
        ok = httpx.post(f"{url}/chat/completions", json=body, timeout=60, headers={"Authorization": f"Bearer {token}"})
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["role"] == "assistant"
    assert token_env not in os.environ
    with pytest.raises(httpx.TransportError):
        httpx.get(url.removesuffix("/v1") + "/health", timeout=5)


def test_a_blackbox_stage_reaches_its_served_teacher_on_an_actor(ray_local, tmp_path, tiny_model_dir, monkeypatch):
    from mentorrl.distributed import ray_serve
    from mentorrl.train.pipeline import run_recipe

    secret = "tok-7f3a9c-never-in-a-file-0123456789"
    monkeypatch.setattr(ray_serve.secrets, "token_urlsafe", lambda n: secret)
    run = tmp_path / "bb"
    cfg = load_config(
        None,
        TINY_OVERRIDES
        + [
            f"run_dir={run}",
            f"model.path={tiny_model_dir}",
            "recipe=[blackbox]",
            "blackbox.recipe=score",
            "blackbox.steps=1",
            "blackbox.tasks_per_step=2",
            "blackbox.samples_per_task=2",
            f"blackbox.teacher.serve={{path: {tiny_model_dir}}}",
            "blackbox.teacher.samples=2",
            "blackbox.teacher.max_tokens=8",
            "eval.num_tasks=0",
            "audit.preflight=false",
            "distributed.backend=ray",
            "distributed.rollout_workers=1",
            "distributed.teacher_workers=1",
        ],
    )
    run_recipe(cfg, show_progress=False)
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    bb = [r for r in recs if r.get("stage") == "blackbox"]
    assert [r["step"] for r in bb] == [1]
    assert bb[0]["teacher_requests"] > 0 and bb[0]["teacher_failures"] == 0  # every request authenticated
    for f in run.rglob("*"):  # the token reached no file of the run (config, logs, metrics, cache)
        if f.is_file():
            assert secret.encode() not in f.read_bytes(), f
