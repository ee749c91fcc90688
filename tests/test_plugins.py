"""Plugins: a package of its own defines a stage (with its own config section) and an environment, and
`mentorrl train` runs them from a recipe's YAML: once named by the recipe's ``plugins``, once found
through installed entry points (``mentorrl.stages`` / ``mentorrl.envs``). A typo in the plugin's section
is a dotted config error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

ENV_MODULE = '''
"""A tiny environment: one tool that echoes, success when the answer names the task's word."""
from mentorrl.envs import EnvEntry
from mentorrl.envs.base import Environment, FinalAnswer, Task, Tool, ToolAction, ToolRegistry, Verdict


class EchoEnv(Environment):
    name, version, system_prompt = "echoplug", "1", "Use the tool, then answer."

    def __init__(self, tool_timeout_s: float = 5.0, **_):
        self.registry = ToolRegistry([Tool("echo", "echo a word", {
            "type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"],
            "additionalProperties": False}, lambda word: {"word": word})], timeout_s=tool_timeout_s)
        self.task = None

    def reset(self, task):
        self.task = task
        return task.prompt

    def step(self, name, arguments):
        return self.registry.call(name, arguments)

    def verify(self, final_answer):
        return Verdict(success=self.task.reference["word"] in (final_answer or ""))

    def close(self):
        self.registry.close()


class EchoTasks:
    def tasks(self, split, n, seed):
        return [Task(id=f"echo-{split}-{seed}-{i}", family="echo", split=split, prompt=f"Say word{i}.",
                     seed=i, reference={"word": f"word{i}"}) for i in range(n)]


class EchoExpert:
    def act(self, task):
        yield ToolAction("echo", {"word": task.reference["word"]})
        yield FinalAnswer(task.reference["word"])


def echo_entry():
    return EnvEntry(EchoEnv, EchoTasks, EchoExpert)
'''

STAGE_MODULE = '''
"""A stage with its own config section: its metrics report the settings it ran with."""
from typing import Any, ClassVar

from pydantic import Field

from mentorrl.config import StepStageConfig
from mentorrl.train.learner import Learner
from mentorrl.train.registry import register_stage
from mentorrl.train.loop import run_stage


class CountConfig(StepStageConfig):
    defaults: ClassVar[dict[str, Any]] = {"steps": 5}

    scale: float = Field(1.0, gt=0, description="each step's loss is scale * step")


@register_stage("count", config=CountConfig, title="Counting", label="Count")
def count_stage(ws, model, resume: bool = False):
    c = ws.cfg.count
    env = ws.make_env()
    timeout, tools = env.registry.timeout_s, sorted(env.registry.tools)
    env.close()
    learner = Learner(model, c.optim, ws.contract.pad_token_id, ws.contract.sampling.temperature)

    def step_fn(step):
        return {"loss": c.scale * step, "lr": c.optim.lr, "tool_timeout": timeout, "echo_tool": float(tools == ["echo"])}

    return run_stage(ws, "count", model, learner, c.steps, step_fn, c.checkpoint_every, resume)
'''

PLUGIN_MODULE = '''
"""What a recipe's ``plugins:`` names: importing it registers the stage and the environment."""
from mentorrl.envs import register_env

from myplug import stage  # noqa: F401  (registers the stage)
from myplug.env import echo_entry

register_env("echoplug", echo_entry)
'''


def write_plugin(root: Path, entry_points: bool) -> None:
    pkg = root / "myplug"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "env.py").write_text(ENV_MODULE)
    (pkg / "stage.py").write_text(STAGE_MODULE)
    (pkg / "plugin.py").write_text(PLUGIN_MODULE)
    if entry_points:
        info = root / "myplug-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: myplug\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(
            "[mentorrl.stages]\ncount = myplug.stage\n\n[mentorrl.envs]\nechoplug = myplug.env:echo_entry\n"
        )


def recipe(root: Path, model_dir: Path, plugins: list[str], count: str) -> Path:
    text = textwrap.dedent(f"""\
        run_dir: {json.dumps(str(root / "run"))}
        threads: 1
        recipe: [count]
        plugins: {json.dumps(plugins)}
        model: {{path: {json.dumps(str(model_dir))}}}
        env: {{name: echoplug, tool_timeout_s: 2.5}}
        eval: {{num_tasks: 0}}
        audit: {{preflight: false}}
        limits: {{max_total_tokens: 512}}
        count: {count}
        """)
    path = root / "recipe.yaml"
    path.write_text(text)
    return path


def train(root: Path, path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mentorrl.cli", "train", str(path), *args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def count_records(root: Path) -> list[dict]:
    lines = (root / "run" / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("stage") == "count"]


@pytest.mark.parametrize("how", ["recipe", "entry_points"])
def test_a_plugin_stage_and_environment_train_from_yaml(tmp_path, tiny_model_dir, how):
    write_plugin(tmp_path, entry_points=how == "entry_points")
    plugins = ["myplug.plugin"] if how == "recipe" else []
    path = recipe(tmp_path, tiny_model_dir, plugins, "{steps: 3, scale: 2.0, checkpoint_every: 2, optim: {lr: 0.01}}")
    res = train(tmp_path, path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    records = count_records(tmp_path)
    assert [r["loss"] for r in records] == [0.0, 2.0, 4.0]  # steps and scale from the YAML
    assert {r["lr"] for r in records} == {0.01} and {r["tool_timeout"] for r in records} == {2.5}
    assert {r["echo_tool"] for r in records} == {1.0}  # the plugin's environment
    assert (tmp_path / "run" / "count" / "final" / "DONE").exists()


def test_the_cli_plugin_option_and_a_typo_in_the_plugin_section(tmp_path, tiny_model_dir):
    write_plugin(tmp_path, entry_points=False)
    path = recipe(tmp_path, tiny_model_dir, [], "{steps: 1, scael: 2.0}")
    res = train(tmp_path, path, "--plugin", "myplug.plugin")
    assert res.returncode == 2
    assert "count.scael: Extra inputs are not permitted" in res.stderr, res.stderr
    path = recipe(tmp_path, tiny_model_dir, [], "{steps: many}")
    res = train(tmp_path, path, "--plugin", "myplug.plugin")
    assert res.returncode == 2 and "count.steps: Input should be a valid integer" in res.stderr, res.stderr
    res = train(tmp_path, path)  # without the plugin: its stage, section and environment are unknown
    assert res.returncode == 2 and "unknown stage" in res.stderr and "count: Extra inputs" in res.stderr, res.stderr
    res = train(tmp_path, path, "--plugin", "myplug.nope")
    assert res.returncode == 2 and "cannot import plugin 'myplug.nope'" in res.stderr, res.stderr


def test_schema_names_equal_the_runtime_registries():
    """The config checks names without importing the runtime registries: its built-in names are theirs."""
    code = (
        "import json; from mentorrl.algos.advantages import ADVANTAGE_ESTIMATORS; "
        "from mentorrl.algos.losses import POLICY_LOSSES; from mentorrl.envs import registered_envs; "
        "print(json.dumps([sorted(ADVANTAGE_ESTIMATORS), registered_envs(), sorted(POLICY_LOSSES)]))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    advantages, envs, losses = json.loads(res.stdout)
    from mentorrl.config.names import ADVANTAGE, BUILTIN_NAMES, ENVIRONMENT, POLICY_LOSS

    assert sorted(BUILTIN_NAMES[ADVANTAGE]) == advantages
    assert sorted(BUILTIN_NAMES[ENVIRONMENT]) == envs
    assert sorted(BUILTIN_NAMES[POLICY_LOSS]) == losses


def test_a_registered_estimator_validates():
    import torch

    from mentorrl.algos.advantages import ADVANTAGE_ESTIMATORS, register_advantage
    from mentorrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="grpo.advantage: .*unknown advantage estimator 'plug_adv'"):
        load_config(None, ["grpo.advantage=plug_adv"])
    register_advantage("plug_adv")(lambda rewards, **_: torch.zeros_like(rewards))
    try:
        assert load_config(None, ["grpo.advantage=plug_adv"]).grpo.advantage == "plug_adv"
    finally:
        ADVANTAGE_ESTIMATORS.unregister("plug_adv")
    with pytest.raises(ConfigError, match="unknown advantage estimator 'plug_adv'"):  # the registry is the list
        load_config(None, ["grpo.advantage=plug_adv"])


def test_the_old_group_size_key_names_the_new_one():
    from mentorrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="grpo: .*group_size was renamed: write samples_per_task"):
        load_config(None, ["grpo.group_size=4"])
