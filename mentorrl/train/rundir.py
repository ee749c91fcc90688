"""Run directory: config, metrics.jsonl, Hugging Face checkpoints, trajectory samples.

Layout::

    RUN_DIR/config.yaml
    RUN_DIR/metrics.jsonl              one JSON object per logged step ({"stage", "step", ...})
    RUN_DIR/trackers/                  the same step metrics in TensorBoard / W&B / MLflow / trackio
                                       (``logging.trackers``, :mod:`mentorrl.train.trackers`)
    RUN_DIR/samples/grpo-step-N.jsonl  a sample of each step's trajectories (Trajectory JSONL)
    RUN_DIR/<stage>/checkpoints/step-000010/   save_pretrained + trainer_state.pt + checksums.sha256
                                       (a sharded learner's: DCP shards + .metadata instead of
                                       save_pretrained, :mod:`mentorrl.train.fsdp`)
    RUN_DIR/<stage>/checkpoints/corrupt-step-000012/   a checkpoint that failed its checks (kept, never used)
    RUN_DIR/<stage>/final/             the stage's last weights (a plain HF directory, + checksums.sha256)

A checkpoint is written to a temporary directory and renamed into place, so a run killed
mid-write leaves the previous checkpoint as the latest complete one. The last
:data:`KEEP_CHECKPOINTS` are kept. Every checkpoint carries ``checksums.sha256`` (``sha256sum``
format, one line per file), written last and verified on load; :func:`restore_checkpoint` takes
the newest checkpoint that passes its checksums *and* loads, names every bad file it skipped
(:class:`CorruptCheckpointError`), moves those aside as ``corrupt-step-N``, and raises when no
intact checkpoint is left. A checkpoint without a manifest (written before checksums, or its
manifest removed) is refused like a damaged one: nothing in it could be checked
(:func:`mentorrl.core.checksums.require_manifest`, whose message says how to vouch for it).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable

import torch

from mentorrl.core.checksums import (
    MANIFEST,
    CorruptCheckpointError,
    require_manifest,
    sha256_file,
    verify_manifest,
    write_manifest,
)


class MetricsLog:
    """``metrics.jsonl``: the one place step metrics are written. With ``trackers`` (a
    :class:`mentorrl.train.trackers.TrackerSet`), every record logged also goes to each tracker."""

    def __init__(self, path: str | Path, trackers: Any = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.trackers = trackers

    def log(self, record: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self.trackers is not None:
            self.trackers.log(record)  # never raises: a failing tracker is warned about and dropped

    def read(self, stage: str | None = None) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by a kill mid-write
            if stage is None or rec.get("stage") == stage:
                out.append(rec)
        return out

    def truncate_after(self, stage: str, step: int) -> None:
        """On resume: drop this stage's records past the checkpoint (and any torn line)."""
        if not self.path.exists():
            return
        keep = [r for r in self.read() if not (r.get("stage") == stage and r.get("step", -1) > step)]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in keep), encoding="utf-8")
        os.replace(tmp, self.path)


def _rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "torch": torch.get_rng_state()}


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])


KEEP_CHECKPOINTS = 2  # the latest and the one before it, to fall back to
TRAINER_STATE = "trainer_state.pt"


def begin_checkpoint(stage_dir: Path, step: int) -> Path:
    """The empty temporary directory checkpoint ``step`` is written into (:func:`finish_checkpoint`)."""
    ckpts = stage_dir / "checkpoints"
    ckpts.mkdir(parents=True, exist_ok=True)
    tmp = ckpts / f".tmp-step-{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def finish_checkpoint(tmp: Path, step: int, trainer_state: dict[str, Any]) -> Path:
    """Add the trainer state (with the RNG state) and the manifest to ``tmp``, then rename it into place."""
    torch.save({**trainer_state, "step": step, "rng": _rng_state()}, tmp / TRAINER_STATE)
    write_manifest(tmp)
    final = tmp.with_name(f"step-{step:06d}")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def save_checkpoint(stage_dir: Path, step: int, model, tokenizer, trainer_state: dict[str, Any]) -> Path:
    tmp = begin_checkpoint(stage_dir, step)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    return finish_checkpoint(tmp, step, trainer_state)


def _checkpoints(stage_dir: Path) -> list[Path]:
    """Complete checkpoints (renamed into place, with a trainer state), oldest first."""
    ckpts = stage_dir / "checkpoints"
    if not ckpts.is_dir():
        return []
    return sorted(p for p in ckpts.iterdir() if p.name.startswith("step-") and (p / TRAINER_STATE).exists())


def latest_checkpoint(stage_dir: Path) -> Path | None:
    done = _checkpoints(stage_dir)
    return done[-1] if done else None


def read_trainer_state(ckpt: Path) -> dict[str, Any]:
    """``trainer_state.pt`` of ``ckpt``, checked for shape; nothing is applied (see :func:`apply_rng`)."""
    path = ckpt / TRAINER_STATE
    try:
        state = torch.load(path, weights_only=False)
    except Exception as e:  # truncated or garbage: EOFError, UnpicklingError, RuntimeError, ...
        raise CorruptCheckpointError(path, f"does not load ({type(e).__name__}: {e})") from e
    if not isinstance(state, dict) or not isinstance(state.get("step"), int) or not isinstance(state.get("rng"), dict):
        raise CorruptCheckpointError(path, "is not a trainer state (no step / rng)")
    return state


def apply_rng(state: dict[str, Any]) -> None:
    _set_rng_state(state["rng"])


def load_trainer_state(ckpt: Path) -> dict[str, Any]:
    state = read_trainer_state(ckpt)
    apply_rng(state)
    return state


def quarantine(ckpt: Path) -> Path:
    """Move a bad checkpoint aside (``corrupt-step-N``): kept for inspection, never loaded or pruned."""
    dest = ckpt.with_name("corrupt-" + ckpt.name)
    n = 1
    while dest.exists():
        n += 1
        dest = ckpt.with_name(f"corrupt{n}-" + ckpt.name)
    os.replace(ckpt, dest)
    return dest


def check_checkpoint(ckpt: Path, load_weights: Callable[[Path], None]) -> dict[str, Any]:
    """Verify ``ckpt`` (checksums, then the trainer state, then the weights through ``load_weights``)
    and return its trainer state; :class:`CorruptCheckpointError` names the bad file."""
    require_manifest(ckpt, required=(TRAINER_STATE,))
    state = read_trainer_state(ckpt)
    try:
        load_weights(ckpt)
    except CorruptCheckpointError:
        raise
    except Exception as e:  # truncated or garbage safetensors, missing or mismatched tensors, ...
        weights = next((p for p in sorted(ckpt.glob("*.safetensors"))), ckpt / "model.safetensors")
        raise CorruptCheckpointError(weights, f"weights do not load ({type(e).__name__}: {e})") from e
    return state


def restore_checkpoint(
    stage_dir: Path, load_weights: Callable[[Path], None], warn: Callable[[str], None] = print
) -> tuple[Path, dict[str, Any]] | None:
    """The newest intact checkpoint of ``stage_dir`` and its trainer state (RNG state applied), its
    weights loaded through ``load_weights``; None when the stage has no checkpoint.

    A checkpoint that fails (:func:`check_checkpoint`) is reported through ``warn``, and the one
    before it is tried. When one passes, the failed newer ones are moved aside (:func:`quarantine`);
    when none passes, nothing is moved and :class:`CorruptCheckpointError` names every bad file."""
    bad: list[tuple[Path, CorruptCheckpointError]] = []
    for ckpt in reversed(_checkpoints(stage_dir)):
        try:
            state = check_checkpoint(ckpt, load_weights)
        except CorruptCheckpointError as e:
            warn(f"checkpoint {ckpt.name} is not intact: {e}")
            bad.append((ckpt, e))
            continue
        for b, _ in bad:
            warn(f"falling back to {ckpt.name}; {b.name} moved aside to {quarantine(b).name}")
        apply_rng(state)
        return ckpt, state
    if not bad:
        return None
    if len(bad) == 1:
        raise bad[0][1]
    raise CorruptCheckpointError(
        bad[0][1].path, "no intact checkpoint to resume from: " + "; ".join(str(e) for _, e in bad)
    )


def prune_checkpoints(stage_dir: Path, keep: int = KEEP_CHECKPOINTS) -> None:
    ckpts = stage_dir / "checkpoints"
    done = sorted(p for p in ckpts.iterdir() if p.name.startswith("step-"))
    for p in done[:-keep]:
        shutil.rmtree(p, ignore_errors=True)


__all__ = [  # the checksum names are mentorrl.core.checksums', re-exported for the run directory's users
    "KEEP_CHECKPOINTS",
    "MANIFEST",
    "TRAINER_STATE",
    "CorruptCheckpointError",
    "MetricsLog",
    "apply_rng",
    "begin_checkpoint",
    "check_checkpoint",
    "finish_checkpoint",
    "latest_checkpoint",
    "load_trainer_state",
    "prune_checkpoints",
    "quarantine",
    "read_trainer_state",
    "require_manifest",
    "restore_checkpoint",
    "save_checkpoint",
    "sha256_file",
    "verify_manifest",
    "write_manifest",
]
