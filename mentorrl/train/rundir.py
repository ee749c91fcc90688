"""Run directory: config, metrics.jsonl, Hugging Face checkpoints, trajectory samples.

Layout::

    RUN_DIR/config.yaml
    RUN_DIR/metrics.jsonl              one JSON object per logged step ({"stage", "step", ...})
    RUN_DIR/samples/grpo-step-N.jsonl  a sample of each step's trajectories (Trajectory JSONL)
    RUN_DIR/<stage>/checkpoints/step-000010/   save_pretrained + trainer_state.pt
    RUN_DIR/<stage>/final/             the stage's last weights (a plain HF directory)

A checkpoint is written to a temporary directory and renamed into place, so a run killed
mid-write leaves the previous checkpoint as the latest complete one.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch


class MetricsLog:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, record: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

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


def save_checkpoint(stage_dir: Path, step: int, model, tokenizer, trainer_state: dict[str, Any]) -> Path:
    ckpts = stage_dir / "checkpoints"
    ckpts.mkdir(parents=True, exist_ok=True)
    final = ckpts / f"step-{step:06d}"
    tmp = ckpts / f".tmp-step-{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    torch.save({**trainer_state, "step": step, "rng": _rng_state()}, tmp / "trainer_state.pt")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def latest_checkpoint(stage_dir: Path) -> Path | None:
    ckpts = stage_dir / "checkpoints"
    if not ckpts.is_dir():
        return None
    done = sorted(p for p in ckpts.iterdir() if p.name.startswith("step-") and (p / "trainer_state.pt").exists())
    return done[-1] if done else None


def load_trainer_state(ckpt: Path) -> dict[str, Any]:
    state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    _set_rng_state(state["rng"])
    return state


def prune_checkpoints(stage_dir: Path, keep: int = 2) -> None:
    ckpts = stage_dir / "checkpoints"
    done = sorted(p for p in ckpts.iterdir() if p.name.startswith("step-"))
    for p in done[:-keep]:
        shutil.rmtree(p, ignore_errors=True)
