"""The base checkpoint shipped in the package: found only by its build-config hash, verified by
digest, rebuilt by the same code when anything differs; and the shipped one is what the demo uses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import TINY_SPEC

from mentorrl.models.build import ModelSpec, dir_digest, load_policy
from mentorrl.models.pretrain import PretrainSpec, config_hash
from mentorrl.models.shipped import find_shipped_base, shipped_bases
from mentorrl.train.models_init import build_tiny_model

SMALL = dict(steps=2, batch_size=2, block_size=64, transcripts=4, worlds=2, eval_transcripts=0)


def _tiny(orders_entry, path: Path, **kw) -> Path:
    return build_tiny_model(
        orders_entry, path, ModelSpec(**TINY_SPEC), corpus_tasks=30, pretrain=PretrainSpec(**SMALL), **kw
    )


@pytest.fixture(scope="module")
def built(orders_entry, tmp_path_factory):
    return _tiny(orders_entry, tmp_path_factory.mktemp("shipped") / "built")


def test_a_base_is_found_by_its_config_hash_only(built, tmp_path):
    root = tmp_path / "bases"
    shutil.copytree(built, root / "tiny")
    rec = json.loads((built / "mentorrl_build.json").read_text())
    assert rec["config_hash"] == config_hash(rec["config"])
    assert find_shipped_base(rec["config_hash"], root) == root / "tiny"
    assert find_shipped_base("0" * 16, root) is None
    assert find_shipped_base(rec["config_hash"], tmp_path / "nowhere") is None


def test_a_damaged_shipped_base_is_skipped_with_its_name(built, tmp_path):
    root = tmp_path / "bases"
    shutil.copytree(built, root / "tiny")
    w = root / "tiny" / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-1] ^= 0xFF
    w.write_bytes(bytes(data))
    rec = json.loads((built / "mentorrl_build.json").read_text())
    with pytest.warns(UserWarning, match="tiny"):
        assert find_shipped_base(rec["config_hash"], root) is None
    (root / "tiny" / "mentorrl_build.json").write_text("{not json")
    with pytest.warns(UserWarning, match="unreadable"):
        assert shipped_bases(root) == []


def test_build_copies_a_matching_shipped_base_and_rebuilds_otherwise(orders_entry, built, tmp_path, monkeypatch):
    root = tmp_path / "bases"
    shutil.copytree(built, root / "tiny")
    import mentorrl.train.models_init as pipeline

    calls = []
    monkeypatch.setattr(pipeline, "find_shipped_base", lambda h: calls.append(h) or find_shipped_base(h, root))
    got = _tiny(orders_entry, tmp_path / "copy")
    assert dir_digest(got) == dir_digest(built)
    assert json.loads((got / "mentorrl_build.json").read_text())["source"] == {"shipped": "tiny"}
    load_policy(got)
    # --rebuild: the same config built from scratch gives the same files (one thread: bit for bit)
    again = _tiny(orders_entry, tmp_path / "again", use_shipped=False)
    assert dir_digest(again) == dir_digest(built) and "source" not in json.loads(
        (again / "mentorrl_build.json").read_text()
    )
    # any other config is built, never served from the cache
    other = build_tiny_model(
        orders_entry,
        tmp_path / "other",
        ModelSpec(**TINY_SPEC),
        corpus_tasks=30,
        pretrain=PretrainSpec(**{**SMALL, "steps": 3}),
    )
    assert "source" not in json.loads((other / "mentorrl_build.json").read_text())
    assert dir_digest(other) != dir_digest(built)


def _demo_build_config():
    from mentorrl.cli_common import load_run_config
    from mentorrl.train.models_init import build_config

    cfg = load_run_config(None, [], None, "demo.yaml")
    return cfg, build_config(
        cfg.env.name,
        cfg.model.spec,
        cfg.model.tokenizer_corpus_tasks,
        cfg.model.spec.seed,
        cfg.prompt,
        cfg.model.pretrain,
    )


def test_the_demo_runs_on_the_shipped_base():
    """`mentorrl demo` must find its pretrained base in the package (else it would spend far longer than the
    demo rebuilding it): the demo's build config hashes to the shipped base's recorded hash."""
    from transformers import AutoTokenizer

    cfg, config = _demo_build_config()
    if cfg.model.pretrain.steps == 0:
        pytest.fail("the demo no longer pretrains its base; drop the shipped base and this test together")
    d = find_shipped_base(config_hash(config))
    assert d is not None, (
        "the demo's build config does not match any shipped base: rebuild it with the command "
        "recorded in mentorrl/models/bases/*/mentorrl_build.json"
    )
    rec = json.loads((d / "mentorrl_build.json").read_text())
    assert rec["config"] == config and rec["command"].startswith("mentorrl init-model")
    assert (
        rec["pretrain"]["tokens_seen"]
        == config["pretrain"]["steps"] * config["pretrain"]["batch_size"] * config["pretrain"]["block_size"]
    )
    tok, model = load_policy(d)
    assert model.config.vocab_size >= len(tok)
    raw = AutoTokenizer.from_pretrained(d)
    assert raw.encode("Refund $12.50 on O-354, chloe.kim@mail.com") == tok.encode(
        "Refund $12.50 on O-354, chloe.kim@mail.com"
    )


def test_a_shortened_shipped_build_goes_through_the_same_command(tmp_path):
    """The shipped base's own command, shortened (few steps, few worlds), rebuilds through `init-model`: the
    build record differs from the shipped one only in those budget fields."""
    import shlex

    from typer.testing import CliRunner

    from mentorrl.cli import app

    cfg, config = _demo_build_config()
    d = find_shipped_base(config_hash(config))
    assert d is not None
    rec = json.loads((d / "mentorrl_build.json").read_text())
    argv = shlex.split(rec["command"])[1:]
    assert argv[0] == "init-model"
    short = {
        "model.pretrain.steps": 2,
        "model.pretrain.worlds": 3,
        "model.pretrain.eval_transcripts": 0,
        "model.pretrain.batch_size": 2,
    }
    args = ["init-model", str(tmp_path / "short"), "--rebuild"]
    rest = argv[2:]
    i = 0
    while i < len(rest):  # keep the recorded flags, minus the output dir, budgets shortened
        if rest[i] == "--pretrain-steps":
            i += 2
            continue
        if rest[i] == "--set" and rest[i + 1].split("=")[0] in short:
            i += 2
            continue
        args.append(rest[i])
        i += 1
    for k, v in short.items():
        args += ["--set", f"{k}={v}"]
    res = CliRunner().invoke(app, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    got = json.loads((tmp_path / "short" / "mentorrl_build.json").read_text())
    want = json.loads(json.dumps(rec["config"]))
    for k, v in short.items():
        want["pretrain"][k.split(".")[-1]] = v
    assert got["config"] == want and "source" not in got
    assert got["pretrain"]["loss_curve"][-1]["step"] == 2
