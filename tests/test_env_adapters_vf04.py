"""verifiers 0.4 (``verifiers.v1``): an installed verifiers environment package loaded by id
(``env: {name: verifiers, id: ..., args: ...}``), scored by the package's own rewards, evaluated
with ``mentorrl eval`` and trained with ``mentorrl train`` (GRPO). The package is
``tests/fixtures/vf_reverse_text`` (a v1 taskset, no PyPI package qualified: see
docs/bring-your-env.md), pip-installed into a temporary directory; its tasks are generated
offline from a word list it ships."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mentorrl.config import ConfigError, load_config
from mentorrl.contract import ContractLimits, contract_for_env
from mentorrl.envs import resolve_env
from mentorrl.rollout.episode import run_text_turns

vf = pytest.importorskip("verifiers.v1")

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "vf_reverse_text"
ENV = ["env.name=verifiers", "env.id=vf-reverse-text"]


@pytest.fixture(scope="module")
def vf_pkg(tmp_path_factory):
    """The environment package installed (pip, into a temp dir on sys.path): its directory."""
    target = tmp_path_factory.mktemp("vf_pkg")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target)]
        + [str(FIXTURE)],
        check=True,
        timeout=300,
    )
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    yield target
    sys.path.remove(str(target))


def _entry(*overrides: str):
    return resolve_env(load_config(None, [*ENV, *overrides]).env)


def _play(entry, tokenizer, reply: str):
    env = entry.make_env(tool_timeout_s=2.0)
    contract = contract_for_env(tokenizer, env, limits=ContractLimits(max_turns=4, max_total_tokens=1024))
    task = entry.make_tasks().tasks("train", 1, 0)[0]
    return task, run_text_turns(contract, env, task, [reply])


def test_load_by_id_and_args(vf_pkg):
    entry = _entry("env.args={num_tasks: 5, words: 3}")
    tasks = entry.make_tasks().tasks("train", 10, 0)
    assert len({t.reference["row"] for t in tasks}) == 5  # num_tasks reached the package's config
    assert all(len(t.prompt.split(": ", 1)[1].split()) == 3 for t in tasks)  # so did words
    env = entry.make_env()
    assert env.system_prompt.startswith("Reverse the text") and env.version.startswith("0.1.0+")
    assert entry.make_tasks().tasks("heldout", 2, 0)


def test_reward_is_the_packages_own(vf_pkg, tokenizer):
    """The adapter's reward is the package's own scoring (its partial-credit similarity), not a
    stand-in such as exact match: a reply that is half right gets the package's fraction."""
    from vf_reverse_text.taskset import similarity

    entry = _entry("env.args={num_tasks: 4}")
    for make_reply in (lambda a: a, lambda a: a[: len(a) // 2], lambda a: a[::-1], lambda a: "x"):
        task = entry.make_tasks().tasks("train", 1, 0)[0]
        answer = task.reference["vf_data"]["answer"]
        reply = make_reply(answer)
        _, traj = _play(entry, tokenizer, reply)
        d = traj.reward.details
        want = similarity(reply, answer)
        assert d["vf_reward"] == pytest.approx(want) and d["vf_rewards"]["lcs"] == pytest.approx(want)
        assert d["vf_rewards"]["exact"] == float(reply == answer)
        assert d["vf_metrics"] == {"reply_chars": float(len(reply))}
        assert traj.reward.success == (reply == answer)  # success_threshold 1.0
    half = answer[: len(answer) // 2]
    assert 0 < similarity(half, answer) < 1  # the case an exact-match fake gets wrong


def test_reward_equals_verifiers_scoring_of_the_same_completion(vf_pkg, tokenizer):
    """verifiers scores the same completion the same way (its Task.score on its own trace)."""
    import asyncio

    from vf_reverse_text import ReverseTextTaskset

    entry = _entry()
    task, traj = _play(entry, tokenizer, "lisab evorg")
    row = task.reference["row"]
    ts = vf.load_taskset(vf.taskset_config_type("vf-reverse-text").model_validate({"id": "vf-reverse-text"}))
    assert isinstance(ts, ReverseTextTaskset)
    vf_task = list(ts)[row]
    from mentorrl.envs.adapters.verifiers_v1 import build_trace

    trace = build_trace(vf_task, "lisab evorg")
    asyncio.run(vf_task.score(trace))
    assert traj.reward.details["vf_reward"] == pytest.approx(trace.reward)
    assert trace.last_reply == "lisab evorg"


def test_threshold_and_violations(vf_pkg, tokenizer):
    entry = _entry("env.args={num_tasks: 2, success_threshold: 0.3, violation_metrics: [reply_chars]}")
    task, traj = _play(entry, tokenizer, "abc")
    assert traj.reward.violations == ["reply_chars = 3"] and traj.reward.total == -1.0


@pytest.mark.parametrize(
    ("overrides", "field", "says"),
    [
        (["env.id=no-such-vf-env"], "env.id", "no installed verifiers environment 'no-such-vf-env'"),
        (["env.id=json"], "env.id", "is not a verifiers environment"),
        (["env.args={num_tasks: 0}"], "env.args.num_tasks", "greater than or equal to 1"),
        (["env.args={colour: red}"], "env.args.colour", "Extra inputs are not permitted"),
        (["env.args={max_tasks: -1}"], "env.args.max_tasks", "positive integer"),
    ],
)
def test_bad_input_is_a_config_error_naming_the_field(vf_pkg, overrides, field, says):
    with pytest.raises(ConfigError) as e:
        _entry(*overrides)
    assert str(e.value).startswith(f"{field}:") and says in str(e.value), e.value


def test_id_misuse_is_a_config_error(vf_pkg):
    with pytest.raises(ConfigError, match=r"^env\.id: environment 'verifiers' loads .* set env\.id"):
        resolve_env(load_config(None, ["env.name=verifiers"]).env).make_tasks()
    with pytest.raises(ConfigError, match=r"^env\.id: environment 'orders' takes no id"):
        resolve_env(load_config(None, ["env.name=orders", "env.id=x"]).env)
    with pytest.raises(ConfigError, match=r"^env\.args: set only with env\.id"):
        resolve_env(load_config(None, ["env.name=orders", "env.args={a: 1}"]).env)


def _cli(*args: str, pkg: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(pkg)]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", "from mentorrl.cli import app; app()", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_train_refuses_a_bad_id_before_the_first_step(vf_pkg, tmp_path, tiny_model_dir):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("recipe: [grpo]\naudit: {preflight: false}\n")
    res = _cli(
        "train", str(recipe), "--set", "env.name=verifiers", "--set", "env.id=no-such-vf-env",
        "--set", f"model.path={tiny_model_dir}", "--set", f"run_dir={tmp_path / 'run'}", pkg=vf_pkg, cwd=tmp_path,
    )  # fmt: skip
    assert res.returncode == 2, res.stderr[-2000:]
    assert "env.id: no installed verifiers environment 'no-such-vf-env'" in res.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_mentorrl_eval_and_train_on_it(vf_pkg, tmp_path, tiny_model_dir):
    """`mentorrl eval` of the tiny base, then `mentorrl train` (three GRPO steps) on the package."""
    common = ["--set", "env.name=verifiers", "--set", "env.id=vf-reverse-text", "--set", "eval.stratify=false"]
    common += ["--set", "threads=1"]
    res = _cli(
        "eval", str(tiny_model_dir), "--on", "heldout", "--num-tasks", "4", *common, "--out", str(tmp_path / "ev"),
        pkg=vf_pkg, cwd=tmp_path,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((tmp_path / "ev" / "eval_summary.json").read_text())
    assert summary["sets"]["heldout"]["metrics"]["overall"]["n"] == 4
    trajs = [json.loads(line) for line in (tmp_path / "ev" / "trajectories-heldout.jsonl").read_text().splitlines()]
    assert len(trajs) == 4 and all("vf_reward" in t["reward"]["details"] for t in trajs)

    recipe = tmp_path / "r.yaml"
    recipe.write_text("recipe: [grpo]\naudit: {preflight: false, eval_every: 0}\n")
    sets = ["grpo.steps=3", "grpo.tasks_per_step=2", "grpo.samples_per_task=2", "eval.num_tasks=0"]
    sets += ["sampling.max_new_tokens=16", "limits.max_turns=2", "limits.max_total_tokens=512"]
    sets += [f"model.path={tiny_model_dir}", f"run_dir={tmp_path / 'run'}"]
    res = _cli("train", str(recipe), *common, *[a for s in sets for a in ("--set", s)], pkg=vf_pkg, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    from mentorrl.train.rundir import MetricsLog

    steps = MetricsLog(tmp_path / "run" / "metrics.jsonl").read("grpo")
    assert len(steps) == 3 and all(r["rollouts"] == 4 for r in steps), steps
