"""Damaged checkpoints: every kind of damage is named and the previous intact checkpoint is used.

Checkpoints carry ``checksums.sha256``; a flipped bit, a truncated or garbage weights file, a
truncated trainer state all end in a :class:`CorruptCheckpointError` naming the file, and
``run_stage(resume=True)`` falls back to the checkpoint before it (the damaged one is moved aside).
A checkpoint without a manifest is refused the same way (nothing in it could be checked), on every
path that loads one: the stage's checkpoints, its final weights, ``load_weights_into`` (another
rank's resume, evolve's rollback, RFT's best weights) and a cached teacher; a model directory from
elsewhere is verified when it carries a manifest (``load_policy``)."""

from __future__ import annotations

import copy
import io
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rich.console import Console
from test_resume import Interrupt, _stage, _steps, workspace  # noqa: F401  (workspace is a fixture)

from mentorrl.core.checksums import TENSOR_SUFFIXES
from mentorrl.train.rundir import (
    MANIFEST,
    CorruptCheckpointError,
    latest_checkpoint,
    require_manifest,
    restore_checkpoint,
    verify_manifest,
    write_manifest,
)


def _two_checkpoints(ws, model):
    """A run of 5 steps checkpointed every 2, killed in step 5: checkpoints at steps 2 and 4."""
    with pytest.raises(Interrupt):
        _stage(ws, copy.deepcopy(model), steps=6, checkpoint_every=2, resume=False, crash_at=4)
    ckpts = ws.run_dir / "grpo" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-000002", "step-000004"]
    return ckpts / "step-000002", ckpts / "step-000004"


def _flip_bit_in_tensor_data(path):
    import json
    import struct

    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    name, info = next((k, v) for k, v in header.items() if k != "__metadata__")
    lo, hi = info["data_offsets"]
    data[8 + n + lo + (hi - lo) // 2] ^= 0x10  # one bit of one weight: still a valid safetensors file
    path.write_bytes(bytes(data))


DAMAGE = {
    "truncated-weights": ("model.safetensors", lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])),
    "garbage-weights": ("model.safetensors", lambda p: p.write_bytes(b"\x07garbage" * 999)),
    "flipped-bit-weights": ("model.safetensors", _flip_bit_in_tensor_data),
    "truncated-trainer-state": ("trainer_state.pt", lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 3])),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_latest_checkpoint_is_named_and_the_previous_one_resumes(workspace, model, damage):
    ws, buf = workspace
    older, newer = _two_checkpoints(ws, model)
    fname, hurt = DAMAGE[damage]
    hurt(newer / fname)

    seen: list[int] = []
    m = copy.deepcopy(model)
    _stage(ws, m, steps=6, checkpoint_every=2, resume=True, seen=seen)
    out = buf.getvalue().replace("\n", "")
    assert fname in out and "step-000004" in out, out  # the bad file is named
    assert "resuming from step-000002 (step 2/6)" in out
    assert seen == [2, 3, 4, 5]
    ckpts = ws.run_dir / "grpo" / "checkpoints"
    assert (ckpts / "corrupt-step-000004").is_dir()  # kept for inspection, out of the way
    assert latest_checkpoint(ws.run_dir / "grpo").name == "step-000006"
    assert _steps(ws.metrics.read(), "grpo") == [1, 2, 3, 4, 5, 6]
    # the resumed weights are exactly the older checkpoint's plus four steps: nothing of the damaged one
    assert torch.equal(next(m.parameters()).detach(), _plus_ones(model, 6))


def _plus_ones(model, n: int) -> torch.Tensor:
    """The first parameter after ``n`` steps of ``_stage`` (each adds 1.0, in turn)."""
    expected = next(model.parameters()).detach().clone()
    for _ in range(n):
        expected += 1.0
    return expected


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_with_no_intact_checkpoint_the_error_names_the_file_and_nothing_is_moved(workspace, model, damage):
    ws, _ = workspace
    with pytest.raises(Interrupt):
        _stage(ws, copy.deepcopy(model), steps=4, checkpoint_every=2, resume=False, crash_at=3)
    only = latest_checkpoint(ws.run_dir / "grpo")
    fname, hurt = DAMAGE[damage]
    hurt(only / fname)
    with pytest.raises(CorruptCheckpointError, match=f"step-000002/{fname}"):
        _stage(ws, copy.deepcopy(model), steps=4, checkpoint_every=2, resume=True)
    assert only.is_dir() and latest_checkpoint(ws.run_dir / "grpo") == only


def test_the_manifest_is_sha256sum_compatible_and_catches_a_flipped_bit(workspace, model):
    ws, _ = workspace
    older, newer = _two_checkpoints(ws, model)
    assert verify_manifest(newer) is True
    names = {line.split("  ", 1)[1] for line in (newer / MANIFEST).read_text().splitlines()}
    assert {"model.safetensors", "trainer_state.pt", "config.json"} <= names
    ok = subprocess.run(["sha256sum", "--check", "--quiet", MANIFEST], cwd=newer, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    _flip_bit_in_tensor_data(newer / "model.safetensors")
    with pytest.raises(CorruptCheckpointError, match="step-000004/model.safetensors.*sha256"):
        verify_manifest(newer)
    (older / MANIFEST).write_text("not a manifest\n")
    with pytest.raises(CorruptCheckpointError, match=f"step-000002/{MANIFEST}"):
        verify_manifest(older)
    with pytest.raises(CorruptCheckpointError, match="no intact checkpoint"):
        restore_checkpoint(ws.run_dir / "grpo", lambda c: None, warn=lambda m: None)


def test_a_damaged_final_directory_is_rebuilt_from_the_last_checkpoint(workspace, model):
    ws, buf = workspace
    final = _stage(ws, copy.deepcopy(model), steps=2, checkpoint_every=2, resume=False)
    assert verify_manifest(final)
    (final / "model.safetensors").write_bytes(b"junk")
    m = copy.deepcopy(model)
    seen: list[int] = []
    _stage(ws, m, steps=2, checkpoint_every=2, resume=True, seen=seen)
    assert seen == [] and "final" in buf.getvalue() and "model.safetensors" in buf.getvalue()
    assert torch.equal(next(m.parameters()).detach(), _plus_ones(model, 2))
    assert verify_manifest(final)


# ------------------------------------------------ checkpoints without checksums are refused -----
def test_checkpoints_without_a_manifest_are_refused_named_and_resume_once_vouched_for(workspace, model):
    """Without a manifest a flipped weight bit would be undetectable, so such a checkpoint (written
    before checksums, or its manifest removed) is refused like a damaged one, naming the manifest and
    how to vouch for the files; nothing is moved while no checkpoint passes. Once vouched for, it resumes."""
    ws, buf = workspace
    older, newer = _two_checkpoints(ws, model)
    for c in (older, newer):
        (c / MANIFEST).unlink()
    _flip_bit_in_tensor_data(newer / "model.safetensors")  # what a legacy checkpoint could hide
    with pytest.raises(CorruptCheckpointError, match="no intact checkpoint") as e:
        _stage(ws, copy.deepcopy(model), steps=6, checkpoint_every=2, resume=True)
    assert f"step-000004/{MANIFEST}: missing" in str(e.value) and f"step-000002/{MANIFEST}: missing" in str(e.value)
    assert "write_manifest" in str(e.value)  # how to vouch for a checkpoint one trusts
    assert older.is_dir() and newer.is_dir()  # nothing moved aside
    write_manifest(older)  # the user vouches for the older one only
    m, seen = copy.deepcopy(model), []
    _stage(ws, m, steps=6, checkpoint_every=2, resume=True, seen=seen)
    assert "resuming from step-000002 (step 2/6)" in buf.getvalue().replace("\n", "")
    assert seen == [2, 3, 4, 5] and torch.equal(next(m.parameters()).detach(), _plus_ones(model, 6))


def test_a_final_directory_without_a_manifest_is_rebuilt_from_the_last_checkpoint(workspace, model):
    ws, buf = workspace
    final = _stage(ws, copy.deepcopy(model), steps=2, checkpoint_every=2, resume=False)
    (final / MANIFEST).unlink()
    _flip_bit_in_tensor_data(final / "model.safetensors")
    m = copy.deepcopy(model)
    _stage(ws, m, steps=2, checkpoint_every=2, resume=True, seen=[])
    assert MANIFEST in buf.getvalue().replace("\n", "") and "rewriting" in buf.getvalue()
    assert torch.equal(next(m.parameters()).detach(), _plus_ones(model, 2)) and verify_manifest(final)


@pytest.fixture()
def hf_dir(tmp_path, model):
    """A tiny model's Hugging Face directory with its manifest (like a run's final weights)."""
    out = tmp_path / "hf"
    model.save_pretrained(out, safe_serialization=True)
    write_manifest(out)
    return out


def test_load_weights_into_verifies_the_manifest_and_requires_one(hf_dir, model):
    from mentorrl.train.workspace import load_weights_into

    m = copy.deepcopy(model)
    load_weights_into(m, hf_dir)  # intact: loads
    _flip_bit_in_tensor_data(hf_dir / "model.safetensors")
    with pytest.raises(CorruptCheckpointError, match="hf/model.safetensors: sha256"):
        load_weights_into(m, hf_dir)
    (hf_dir / MANIFEST).unlink()
    with pytest.raises(CorruptCheckpointError, match=f"hf/{MANIFEST}: missing"):
        load_weights_into(m, hf_dir)


def test_load_policy_verifies_a_directory_that_carries_a_manifest(hf_dir):
    from mentorrl.models.build import load_policy
    from mentorrl.models.value import ValueModel

    _flip_bit_in_tensor_data(hf_dir / "model.safetensors")
    with pytest.raises(CorruptCheckpointError, match="model.safetensors: sha256"):
        load_policy(hf_dir)
    with pytest.raises(CorruptCheckpointError, match="model.safetensors: sha256"):
        ValueModel.from_pretrained_decoder(hf_dir)


def test_a_tensor_file_the_manifest_does_not_list_is_refused(hf_dir):
    (hf_dir / "extra.safetensors").write_bytes((hf_dir / "model.safetensors").read_bytes())
    with pytest.raises(CorruptCheckpointError, match="extra.safetensors: not listed"):
        verify_manifest(hf_dir)


def test_a_damaged_cached_teacher_is_not_used(tmp_path, hf_dir):
    from mentorrl.train.teachers import cached_build_intact

    out = io.StringIO()
    ws = SimpleNamespace(console=Console(file=out, width=400))
    t = SimpleNamespace(name="big")
    assert cached_build_intact(ws, t, hf_dir)
    _flip_bit_in_tensor_data(hf_dir / "model.safetensors")
    assert not cached_build_intact(ws, t, hf_dir)
    assert "teacher 'big'" in out.getvalue() and "model.safetensors" in out.getvalue()


# ------------------------------------------------------- any flipped byte is caught (hypothesis) -----
@pytest.fixture(scope="module")
def checkpoint_dirs(tmp_path_factory):
    """A plain checkpoint (save_checkpoint) and a sharded-format one (DCP, written in one process)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from mentorrl.train.rundir import save_checkpoint

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    m = Qwen2ForCausalLM(cfg)
    root = tmp_path_factory.mktemp("ckpts")

    class Tok:
        def save_pretrained(self, path):
            (Path(path) / "tokenizer.json").write_text("{}")

    plain = save_checkpoint(root / "plain", 1, m, Tok(), {"learner": {}})
    import torch.distributed.checkpoint as dcp

    sharded = root / "sharded"
    dcp.save({"model": m.state_dict()}, checkpoint_id=str(sharded), no_dist=True)
    torch.save({"step": 1, "rng": {}}, sharded / "trainer_state.pt")
    write_manifest(sharded)
    return {"plain": plain, "sharded": sharded}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    kind=st.sampled_from(["plain", "sharded"]), pick=st.integers(0, 10**6), at=st.floats(0, 1), bit=st.integers(0, 7)
)
def test_any_flipped_bit_in_any_tensor_file_is_caught_and_named(checkpoint_dirs, kind, pick, at, bit):
    d = checkpoint_dirs[kind]
    files = sorted(p for p in d.iterdir() if p.name.endswith(TENSOR_SUFFIXES))
    assert files
    f = files[pick % len(files)]
    data = f.read_bytes()
    i = min(int(at * len(data)), len(data) - 1)
    f.write_bytes(data[:i] + bytes([data[i] ^ (1 << bit)]) + data[i + 1 :])
    try:
        with pytest.raises(CorruptCheckpointError, match=f"{d.name}/{re.escape(f.name)}: sha256"):
            require_manifest(d)
    finally:
        f.write_bytes(data)
    require_manifest(d)
