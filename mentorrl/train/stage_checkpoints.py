"""A stage's checkpoints, resume point, metrics records and final weights: what
:func:`mentorrl.train.loop.run_stage` (the step loop) calls around every step.

Every stage is resumable: batches and task samples are a pure function of (seed, step), the
weights, optimiser and RNG state come back from the latest intact checkpoint (complete, its
checksums verified, loadable; a damaged one is named, moved aside and the one before it used), and
``metrics.jsonl`` is cut back to that step, so a resumed run continues the same step
count and the same metrics file. Each record also goes to the configured trackers
(``logging.trackers``, :mod:`mentorrl.train.trackers`), which are never sent a step twice.

Under a data-parallel launch (``ws.dp``, see :mod:`mentorrl.train.distributed`) rank 0 alone decides
where to resume and writes (metrics, checkpoints, final weights); the other ranks follow it. A sharded
learner (``distributed.strategy: fsdp2``) checkpoints with every rank: each writes its shards of the
weights and optimizer state (:func:`mentorrl.train.fsdp.save_shards`), then rank 0 the trainer state and
the manifest over every rank's files; on resume every rank reads its shards of the checkpoint rank 0 chose.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from rich.markup import escape

from mentorrl.models.lora import check_weights_kind
from mentorrl.train.fsdp import is_sharded_checkpoint, load_full_weights, load_shards, save_shards
from mentorrl.train.learner import Learner
from mentorrl.train.parallelism import cpu_cores
from mentorrl.train.rundir import (
    KEEP_CHECKPOINTS,
    CorruptCheckpointError,
    MetricsLog,
    begin_checkpoint,
    finish_checkpoint,
    latest_checkpoint,
    load_trainer_state,
    prune_checkpoints,
    require_manifest,
    restore_checkpoint,
    save_checkpoint,
    write_manifest,
)
from mentorrl.train.trackers import TrackerSet, config_params, open_trackers, resolve_settings
from mentorrl.train.workspace import Workspace, load_weights_into


def run_trackers(ws: Workspace) -> TrackerSet | None:
    """The run's trackers (``logging.trackers``; opened once, on the writing rank), or None."""
    section = getattr(ws.cfg, "logging", None)
    names = getattr(section, "trackers", None) or []
    warn = lambda msg: ws.console.print(f"[red]warning: {escape(msg)}[/red]")  # noqa: E731
    return open_trackers(ws.run_dir, names, warn, lambda: resolve_settings(section, params=config_params(ws.cfg)))


def metrics_log(ws: Workspace) -> MetricsLog:
    """``metrics.jsonl`` with the run's trackers attached (call on the writing rank only)."""
    return MetricsLog(ws.metrics.path, trackers=run_trackers(ws))


def resume_stage(
    ws: Workspace,
    stage: str,
    model,
    learner: Learner,
    steps: int,
    restore_extra: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[Path | None, int]:
    """``--resume``: where the stage continues from, loaded into ``model`` / ``learner`` (see
    :func:`_resume_point`), and the step to start at. Under data parallel rank 0 alone decides (it may
    move a damaged checkpoint aside) and the other ranks load what it chose."""
    if ws.dp is None:
        return _resume_point(ws, stage, model, learner, steps, restore_extra)
    where, start = ws.on_main(lambda: _resume_point(ws, stage, model, learner, steps, restore_extra))
    _follow_resume(ws, where, ws.run_dir / stage / "final", model, learner, restore_extra)
    return where, start


def record_step(
    ws: Workspace,
    stage_dir: Path,
    rec: dict[str, Any],
    save: bool,
    model,
    learner: Learner,
    extra_state: Callable[[], dict[str, Any]] | None,
) -> None:
    """The step's metrics record and, when ``save``, its checkpoint (the writing rank only: the caller's
    ``on_main``; a sharded learner's checkpoint is :func:`save_sharded`, by every rank)."""
    metrics_log(ws).log(rec)
    if save and learner.sharded is None:
        state = {"learner": learner.state_dict(), "extra": extra_state() if extra_state else {}}
        save_checkpoint(stage_dir, rec["step"], model, ws.tokenizer, state)
        prune_checkpoints(stage_dir, keep=KEEP_CHECKPOINTS)


def _follow_resume(ws: Workspace, where: Path | None, final: Path, model, learner: Learner, restore_extra) -> None:
    """Every rank after rank 0 chose ``where`` (it may have moved a bad checkpoint aside): a sharded
    learner's ranks read their shards of it; the other ranks verify it and load the rest."""
    if where is None:
        return
    if where != final and learner.sharded is not None:
        load_shards(where, learner.sharded, learner.optimizer)
        learner.sharded.publish(model)
    if ws.is_main:
        return
    require_manifest(where)
    if where == final or learner.sharded is None:
        load_weights_into(model, where, verify=False)
    if where != final:
        state = load_trainer_state(where)
        learner.load_state_dict(state["learner"])
        if restore_extra is not None:
            restore_extra(state.get("extra", {}))


def save_sharded(ws: Workspace, stage_dir: Path, step: int, model, learner: Learner, extra_state) -> None:
    """A sharded learner's checkpoint: every rank writes its shards, then rank 0 the config, tokenizer,
    trainer state and the manifest over every rank's files, and renames it into place."""
    tmp = ws.on_main(lambda: begin_checkpoint(stage_dir, step))
    save_shards(tmp, learner.sharded, learner.optimizer)
    ws.dp.barrier()  # every rank's files are complete before the manifest is written over them

    def finish() -> None:
        if hasattr(model, "config"):
            model.config.save_pretrained(tmp)
        ws.tokenizer.save_pretrained(tmp)
        state = {"learner": learner.state_dict(), "extra": extra_state() if extra_state else {}}
        finish_checkpoint(tmp, step, state)
        prune_checkpoints(stage_dir, keep=KEEP_CHECKPOINTS)

    ws.on_main(finish)


def checkpoint_weights_into(model, ckpt: Path) -> None:
    """A checkpoint's full weights into ``model``: Hugging Face weights, or a sharded checkpoint's read in
    this process. The caller has verified ``ckpt`` (:func:`~mentorrl.train.rundir.check_checkpoint`)."""
    if is_sharded_checkpoint(ckpt):
        load_full_weights(model, ckpt)
    else:
        load_weights_into(model, ckpt, verify=False)


def rewind(ws: Workspace, stage: str, start: int, resume: bool) -> None:
    """Cut ``metrics.jsonl`` back to ``start``; a stage started over (not resumed) is sent to the
    trackers again from its first step (a resumed one never sends a step twice)."""
    ws.metrics.truncate_after(stage, start)
    trackers = run_trackers(ws)
    if trackers is not None and not resume:
        trackers.restart(stage)


def _resume_point(
    ws: Workspace,
    stage: str,
    model,
    learner: Learner,
    steps: int,
    restore_extra: Callable[[dict[str, Any]], None] | None,
) -> tuple[Path | None, int]:
    """Load what ``--resume`` continues from into ``model`` / ``learner`` and return it with the step
    to start at: the stage's final dir when it is complete, else its newest intact checkpoint,
    else ``(None, 0)``."""
    final = ws.run_dir / stage / "final"
    stage_dir = final.parent
    warn = lambda msg: ws.console.print(f"[red]{stage}: {escape(msg)}[/red]")  # noqa: E731
    for d in (final, latest_checkpoint(stage_dir)):  # a config changed to or from LoRA: named, nothing moved aside
        if d is not None and d.is_dir():
            check_weights_kind(model, d)
    if (final / "DONE").exists():
        try:
            require_manifest(final)  # a final dir without checksums is rebuilt too
            load_weights_into(model, final, verify=False)
            ws.console.print(f"[dim]{stage}: already complete, loaded {final}[/dim]")
            return final, steps
        except Exception as e:  # a damaged final dir: rewritten from the last checkpoint (the same weights)
            warn(f"final weights are not intact ({e}); rewriting them from the last checkpoint")
            if restore_checkpoint(stage_dir, lambda c: checkpoint_weights_into(model, c), warn) is None:
                raise CorruptCheckpointError(final, f"damaged and no checkpoint to rebuild it from ({e})") from e
            save_final(ws, model, final, steps)
            return final, steps
    restored = restore_checkpoint(stage_dir, lambda c: checkpoint_weights_into(model, c), warn)
    if restored is None:
        return None, 0
    ckpt, state = restored
    learner.load_state_dict(state["learner"])
    if restore_extra is not None:
        restore_extra(state.get("extra", {}))
    ws.console.print(f"[yellow]{stage}: resuming from {ckpt.name} (step {state['step']}/{steps})[/yellow]")
    return ckpt, int(state["step"])


CPU_KEYS = ("rollout_cpu_s", "update_cpu_s")  # per-process CPU seconds a step's metrics may hold


def ranks_cpu(dp, m: dict[str, Any], cpu_s: float) -> tuple[dict[str, Any], float]:
    """Under data parallel, a step's CPU seconds summed over the ranks (each rank times its own
    process), so ``cpu_util`` is the machine's share of busy cores, not rank 0's; unchanged in one
    process. Every rank calls it once a step (one collective)."""
    if dp is None:
        return m, cpu_s
    parts = dp.all_gather((cpu_s, {k: m[k] for k in CPU_KEYS if k in m}))
    out = dict(m)
    for k in CPU_KEYS:
        if k in m:
            out[k] = sum(p[1].get(k, 0.0) for p in parts)
    if "rollout_cpu_s" in out and "rollout_s" in out:
        out["rollout_cpu_util"] = out["rollout_cpu_s"] / max(out["rollout_s"], 1e-9) / cpu_cores()
    return out, sum(p[0] for p in parts)


def step_timing(m: dict[str, Any], step_s: float, cpu_s: float) -> dict[str, float]:
    """A step's wall and CPU time for ``metrics.jsonl``: ``step_s``; ``cpu_s`` (this process's CPU
    seconds, all threads, and its ended child processes' (:func:`~mentorrl.train.parallelism.cpu_clock`); every rank's under data parallel, :func:`ranks_cpu`); ``cpu_cores``; ``cpu_util`` = cpu_s / (step_s x cpu_cores), the share of
    the cores the step kept busy; and, for a stage that times its rollout but not its update,
    ``update_s`` = the rest of the step."""
    cores = cpu_cores()
    out = {"step_s": step_s, "cpu_s": cpu_s, "cpu_cores": float(cores), "cpu_util": cpu_s / max(step_s, 1e-9) / cores}
    if "rollout_s" in m and "update_s" not in m:
        out["update_s"] = max(0.0, step_s - m["rollout_s"])
    return out


def save_final(ws: Workspace, model, final: Path, steps: int) -> None:
    """The stage's last weights as a plain HF directory, with its checksum manifest, then ``DONE``."""
    final.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(final, safe_serialization=True)
    ws.tokenizer.save_pretrained(final)
    write_manifest(final)
    (final / "DONE").write_text(json.dumps({"steps": steps}))
