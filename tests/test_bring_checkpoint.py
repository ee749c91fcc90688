"""Bring your checkpoint: ``model.path`` as a hub id resolved offline from the local cache (a clear
error, before anything is written, when it is not there), and a run that keeps a checkpoint's own
tool-aware chat template (its saved checkpoints too)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from family_templates import PLAIN_CHATML, QWEN25_STYLE, family_tokenizer

from mentorrl.config import ConfigError, RunConfig
from mentorrl.contract import CHAT_TEMPLATE

SHIPPED = Path(__file__).resolve().parent.parent / "mentorrl" / "models" / "bases" / "orders-tiny"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An offline Hugging Face hub cache holding ``mentorrl-test/orders-tiny`` (the shipped tiny model),
    laid out as ``huggingface_hub`` writes it: models--org--name/{refs/main, snapshots/<rev>/...}."""
    from huggingface_hub import constants

    cache = tmp_path / "hf" / "hub"
    rev = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--mentorrl-test--orders-tiny"
    shutil.copytree(SHIPPED, repo / "snapshots" / rev)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(rev)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))  # read when huggingface_hub was imported
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_a_hub_id_in_the_local_cache_loads_offline(hub_cache, tmp_path):
    from mentorrl.models.build import load_policy
    from mentorrl.models.hub import cached_hub_checkpoint, checkpoint_problem
    from mentorrl.train.pipeline import preflight_config

    assert checkpoint_problem("model.path", "mentorrl-test/orders-tiny") is None
    assert cached_hub_checkpoint("mentorrl-test/orders-tiny").parent.name == "snapshots"
    preflight_config(RunConfig(run_dir=str(tmp_path / "run"), model={"path": "mentorrl-test/orders-tiny"}))
    tok, model = load_policy("mentorrl-test/orders-tiny")  # passed to from_pretrained as is
    # the template saved with the checkpoint, as it was saved (the shipped base predates verifier v4's typed line)
    assert tok.chat_template == (SHIPPED / "chat_template.jinja").read_text() and model.config.model_type == "qwen2"


def test_a_missing_hub_id_is_a_clear_error_before_anything_is_written(hub_cache, tmp_path):
    from mentorrl.train.pipeline import preflight_config

    run = tmp_path / "run"
    with pytest.raises(ConfigError) as e:
        preflight_config(RunConfig(run_dir=str(run), model={"path": "mentorrl-test/not-cached"}))
    msg = str(e.value)
    assert "model.path" in msg and "'mentorrl-test/not-cached'" in msg and str(hub_cache) in msg
    assert "`hf download mentorrl-test/not-cached`" in msg and "does not download" in msg
    assert not run.exists()


def test_a_missing_directory_is_still_named_as_one(tmp_path):
    from mentorrl.models.hub import checkpoint_problem

    assert "no such directory" in checkpoint_problem("model.path", str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    assert "no config.json" in checkpoint_problem("model.path", str(tmp_path / "empty"))


def test_base_model_dir_passes_a_hub_id_as_is(hub_cache, tmp_path):
    from mentorrl.train.models_init import base_model_dir
    from mentorrl.train.workspace import open_workspace

    ws = open_workspace(RunConfig(run_dir=str(tmp_path / "run"), model={"path": "mentorrl-test/orders-tiny"}), False)
    assert base_model_dir(ws) == "mentorrl-test/orders-tiny"
    ws = open_workspace(RunConfig(run_dir=str(tmp_path / "run2"), model={"path": "mentorrl-test/gone"}), False)
    with pytest.raises(FileNotFoundError, match="mentorrl-test/gone"):
        base_model_dir(ws)


def _workspace(tmp_path, **prompt):
    from mentorrl.train.workspace import open_workspace

    return open_workspace(RunConfig(run_dir=str(tmp_path / "run"), prompt=prompt), show_progress=False)


def test_a_run_keeps_a_tool_aware_template_and_saves_it_untouched(tmp_path):
    from transformers import AutoTokenizer

    tok = family_tokenizer(AutoTokenizer.from_pretrained(SHIPPED), "qwen25")
    ws = _workspace(tmp_path)
    ws.bind_tokenizer(tok)
    assert ws.contract.chat is not None and ws.contract.chat.name == "hermes"
    assert tok.chat_template == QWEN25_STYLE
    tok.save_pretrained(tmp_path / "ckpt")
    assert AutoTokenizer.from_pretrained(tmp_path / "ckpt").chat_template == QWEN25_STYLE
    # the fingerprint tells the two renderings apart
    plain = _workspace(tmp_path / "b", tool_format="mentorrl")
    tok2 = family_tokenizer(AutoTokenizer.from_pretrained(SHIPPED), "qwen25")
    plain.bind_tokenizer(tok2)
    assert plain.contract.chat is None and tok2.chat_template == CHAT_TEMPLATE
    assert plain.contract.fingerprint() != ws.contract.fingerprint()


def test_an_explicit_format_on_a_template_without_tools_is_a_config_error(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(SHIPPED)
    tok.chat_template = PLAIN_CHATML
    with pytest.raises(ConfigError, match="prompt.tool_format hermes: the checkpoint's chat template cannot render"):
        _workspace(tmp_path, tool_format="hermes").bind_tokenizer(tok)
