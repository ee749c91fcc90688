"""Damaged checkpoints: every kind of damage is named and the previous intact checkpoint is used.

Checkpoints carry ``checksums.sha256``; a flipped bit, a truncated or garbage weights file, a
truncated trainer state all end in a :class:`CorruptCheckpointError` naming the file, and
``run_stage(resume=True)`` falls back to the checkpoint before it (the damaged one is moved aside)."""

from __future__ import annotations

import copy
import subprocess

import pytest
import torch
from test_resume import Interrupt, _stage, _steps, workspace  # noqa: F401  (workspace is a fixture)

from mentorrl.train.rundir import (
    MANIFEST,
    CorruptCheckpointError,
    latest_checkpoint,
    restore_checkpoint,
    verify_manifest,
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


# Without checksums (a checkpoint from before them) a flipped weight bit is undetectable: that is
# what the manifest adds, so that one case is only run checksummed.
CASES = [(d, True) for d in sorted(DAMAGE)] + [(d, False) for d in sorted(DAMAGE) if d != "flipped-bit-weights"]


@pytest.mark.parametrize(
    "damage,with_manifest", CASES, ids=[f"{d}-{'checksummed' if w else 'legacy'}" for d, w in CASES]
)
def test_a_damaged_latest_checkpoint_is_named_and_the_previous_one_resumes(workspace, model, damage, with_manifest):
    ws, buf = workspace
    older, newer = _two_checkpoints(ws, model)
    fname, hurt = DAMAGE[damage]
    if not with_manifest:
        for c in (older, newer):
            (c / MANIFEST).unlink()
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
