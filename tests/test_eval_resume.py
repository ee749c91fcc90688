"""A resumed run reuses a finished evaluation only when it is the same evaluation: the same split,
eval seed and task count. A run resumed with more tasks (a recipe's eval grown between sittings)
evaluates again instead of reporting the old, smaller figure."""

from __future__ import annotations

import json

import pytest

import mentorrl.train.workspace as workspace_mod
from mentorrl.config import RunConfig
from mentorrl.models.build import load_policy
from mentorrl.train.workspace import evaluate, open_workspace


@pytest.fixture
def ws_model(tiny_model_dir, tmp_path):
    tok, model = load_policy(tiny_model_dir)
    ws = open_workspace(RunConfig(run_dir=str(tmp_path / "run"), eval={"num_tasks": 3}), show_progress=False)
    ws.bind_tokenizer(tok)
    return ws, model


def test_resume_reuses_only_the_same_evaluation(ws_model, monkeypatch):
    ws, model = ws_model
    first = evaluate(ws, model, "sft", resume=True)
    assert first["n"] == 3
    real = workspace_mod.eval_rollout

    def refuse(_ws):
        raise AssertionError("the same evaluation was run again")

    monkeypatch.setattr(workspace_mod, "eval_rollout", refuse)
    assert evaluate(ws, model, "sft", resume=True) == first
    monkeypatch.setattr(workspace_mod, "eval_rollout", real)
    ws.cfg.eval.num_tasks = 5
    again = evaluate(ws, model, "sft", resume=True)
    assert again["n"] == 5
    assert json.loads((ws.run_dir / "eval_sft.json").read_text())["n"] == 5
    ws.cfg.eval.seed += 1
    monkeypatch.setattr(workspace_mod, "eval_rollout", refuse)
    with pytest.raises(AssertionError, match="run again"):
        evaluate(ws, model, "sft", resume=True)  # another eval seed: not the same evaluation
