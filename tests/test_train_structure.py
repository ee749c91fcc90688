"""Issue 18's structure rules for mentorrl/train: short functions, registered stages, one loop."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import mentorrl
from mentorrl.config import ConfigError

TRAIN = Path(mentorrl.__file__).parent / "train"
MAX_LINES = 80


def long_functions(root: Path, limit: int = MAX_LINES) -> list[str]:
    """``path:line name (n lines)`` of every function (nested ones too) under ``root`` longer than ``limit``."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_function_in_train_is_over_80_lines():
    assert long_functions(TRAIN) == []


def test_the_length_check_sees_a_long_function(tmp_path):
    (tmp_path / "m.py").write_text("def f():\n" + "    x = 1\n" * 85 + "\n\ndef g():\n    return 1\n")
    assert long_functions(tmp_path) == [f"{tmp_path.name}/m.py:1 f (86 lines)"]


def test_no_stage_imports_another_modules_private_names():
    """No module under mentorrl/train imports an _underscore name from another mentorrl.train module."""
    bad = []
    for path in sorted(TRAIN.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mentorrl.train"):
                bad += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert bad == []


def test_the_registry_holds_exactly_the_config_stage_names():
    from mentorrl.config import STAGE_NAMES, RunConfig
    from mentorrl.train.registry import resolve_runner, stage_names, stages

    assert stage_names() == STAGE_NAMES
    for name, spec in stages().items():  # each stage's section is its run-config field; its runner resolves
        assert spec.section is None or RunConfig.model_fields[name].annotation is spec.section, name
        assert callable(resolve_runner(spec)), name


def test_adding_a_stage_is_one_registered_function_and_runs_through_the_pipeline(tmp_path, tiny_model_dir):
    """A stage defined here (as in its own module), registered, then run by the recipe runner."""
    from mentorrl.config import OptimConfig, load_config
    from mentorrl.train.learner import Learner
    from mentorrl.train.pipeline import run_recipe
    from mentorrl.train.registry import register_stage, unregister_stage
    from mentorrl.train.rundir import MetricsLog
    from mentorrl.train.stage_runner import run_stage

    @register_stage("toy", title="A toy stage", label="Toy")
    def toy_stage(ws, model, resume: bool = False):
        learner = Learner(model, OptimConfig(), ws.contract.pad_token_id, ws.contract.sampling.temperature)
        return run_stage(ws, "toy", model, learner, 3, lambda step: {"loss": float(step)}, checkpoint_every=2,
                         resume=resume)

    try:
        cfg = load_config(None, ["threads=1", f"model.path={tiny_model_dir}", "eval.num_tasks=0", "recipe=[toy]",
                                 "audit.preflight=false", "limits.max_total_tokens=512", f"run_dir={tmp_path / 'run'}"])
        result = run_recipe(cfg, show_progress=False)
        records = MetricsLog(tmp_path / "run" / "metrics.jsonl").read("toy")
        assert [r["loss"] for r in records] == [0.0, 1.0, 2.0]
        assert (tmp_path / "run" / "toy" / "final" / "DONE").exists()
        assert result["run_dir"] == str(tmp_path / "run")
    finally:
        unregister_stage("toy")
    with pytest.raises(ConfigError, match="unknown stage"):  # gone from the registry: the config refuses it
        load_config(None, ["recipe=[toy]"])
