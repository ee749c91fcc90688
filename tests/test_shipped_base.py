"""The base checkpoint shipped in the package: found only by its build-config hash, verified by
digest, rebuilt by the same code when anything differs; and the shipped one is what the demo uses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mentorrl.models.build import ModelSpec, dir_digest, load_policy
from mentorrl.models.pretrain import PretrainSpec, config_hash
from mentorrl.models.shipped import find_shipped_base, shipped_bases
from mentorrl.train.pipeline import build_tiny_model
from conftest import TINY_SPEC

SMALL = dict(steps=2, batch_size=2, block_size=64, transcripts=4, worlds=2, eval_transcripts=0)


def _tiny(orders_entry, path: Path, **kw) -> Path:
    return build_tiny_model(orders_entry, path, ModelSpec(**TINY_SPEC), corpus_tasks=30,
                            pretrain=PretrainSpec(**SMALL), **kw)


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
    import mentorrl.train.pipeline as pipeline

    calls = []
    monkeypatch.setattr(pipeline, "find_shipped_base", lambda h: calls.append(h) or find_shipped_base(h, root))
    got = _tiny(orders_entry, tmp_path / "copy")
    assert dir_digest(got) == dir_digest(built)
    assert json.loads((got / "mentorrl_build.json").read_text())["source"] == {"shipped": "tiny"}
    load_policy(got)
    # --rebuild: the same config built from scratch gives the same files (one thread: bit for bit)
    again = _tiny(orders_entry, tmp_path / "again", use_shipped=False)
    assert dir_digest(again) == dir_digest(built) and "source" not in json.loads((again / "mentorrl_build.json").read_text())
    # any other config is built, never served from the cache
    other = build_tiny_model(orders_entry, tmp_path / "other", ModelSpec(**TINY_SPEC), corpus_tasks=30,
                             pretrain=PretrainSpec(**{**SMALL, "steps": 3}))
    assert "source" not in json.loads((other / "mentorrl_build.json").read_text())
    assert dir_digest(other) != dir_digest(built)
