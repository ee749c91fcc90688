"""Structure rules for mentorrl/train: registered stages, one loop. (The function-length and private-import
rules cover the whole package: tests/test_package_structure.py.)"""

from __future__ import annotations

import pytest

from mentorrl.config import ConfigError


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
    from mentorrl.train.loop import run_stage
    from mentorrl.train.pipeline import run_recipe
    from mentorrl.train.registry import register_stage, unregister_stage
    from mentorrl.train.rundir import MetricsLog

    @register_stage("toy", title="A toy stage", label="Toy")
    def toy_stage(ws, model, resume: bool = False):
        learner = Learner(model, OptimConfig(), ws.contract.pad_token_id, ws.contract.sampling.temperature)
        return run_stage(
            ws, "toy", model, learner, 3, lambda step: {"loss": float(step)}, checkpoint_every=2, resume=resume
        )

    try:
        cfg = load_config(
            None,
            [
                "threads=1",
                f"model.path={tiny_model_dir}",
                "eval.num_tasks=0",
                "recipe=[toy]",
                "audit.preflight=false",
                "limits.max_total_tokens=1024",
                f"run_dir={tmp_path / 'run'}",
            ],
        )
        result = run_recipe(cfg, show_progress=False)
        records = MetricsLog(tmp_path / "run" / "metrics.jsonl").read("toy")
        assert [r["loss"] for r in records] == [0.0, 1.0, 2.0]
        assert (tmp_path / "run" / "toy" / "final" / "DONE").exists()
        assert result["run_dir"] == str(tmp_path / "run")
    finally:
        unregister_stage("toy")
    with pytest.raises(ConfigError, match="unknown stage"):  # gone from the registry: the config refuses it
        load_config(None, ["recipe=[toy]"])
