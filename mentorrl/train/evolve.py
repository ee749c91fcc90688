"""The self-evolving loop (``recipe: [sft, evolve]``): each accepted version of the student
becomes the next iteration's teacher.

One iteration is ``steps_per_iteration`` learning steps, then a held-out check and a gate:

* tasks come from a :class:`~mentorrl.train.curriculum.Curriculum` whose levels grow with
  the scripted expert's solution length (tasks solved in fewer tool calls first, adversarial
  tasks last); it raises the level when windowed success exceeds ``raise_above`` and lowers
  it when success drops below ``lower_below``;
* the student rolls out; each token's advantage is ``reward_coef * A_env`` (group-relative)
  plus ``kl_coef * A_kl`` towards the current teacher (the last accepted version, frozen);
* verifier-passed trajectories are admitted into a SQLite replay buffer (the verifier is the
  gate: failures never enter), and ``replay_batch`` of them are replayed as an SFT step;
* at the end of the iteration the student is evaluated on held-out tasks. It is accepted
  unless it falls more than ``accept_margin`` below the best accepted score; an accepted
  version is saved to ``evolve/versions/vN`` and becomes the teacher, a rejected one is rolled
  back to the last accepted weights. ``evolve/versions.json`` lists every version with its
  held-out score, its teacher and the verdict.

Crash safety: a checkpoint records, besides weights, optimiser, curriculum and version list, the
replay buffer's mark (:meth:`ReplayBuffer.mark`). On resume the persisted state is brought back
to that checkpoint: the buffer is rolled back in one transaction (entries admitted by the
discarded steps are gone, entries they evicted are back), ``versions.json`` is rewritten from
the restored list and ``versions/vN`` directories of versions the checkpoint does not list as
accepted are removed. A stage that starts from step 0 starts from an empty buffer and no version
directories. A buffer file that was replaced raises :class:`ReplayBufferError` naming it.
"""

from __future__ import annotations

import copy
import json
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from mentorrl.algos.advantages import get_advantage_estimator, group_reward_stats, sanitize_group_rewards
from mentorrl.opd.advantage import kl_advantages
from mentorrl.opd.signals import same_tokenizer_signal
from mentorrl.opd.teacher import HFTeacher
from mentorrl.replay.buffer import ReplayBuffer, ReplayConfig
from mentorrl.rollout.runner import expert_demonstrations, rollout_tasks
from mentorrl.train.consistency import policy_lag
from mentorrl.train.curriculum import Curriculum
from mentorrl.train.learner import Learner
from mentorrl.replay.checkpointing import BufferCheckpoints
from mentorrl.train.rundir import KEEP_CHECKPOINTS
from mentorrl.train.stages import (
    TRAIN_POOL_SEED_OFFSET,
    Workspace,
    _load_weights_into,
    _minibatches,
    _reduce_updates,
    _require_consistent,
    heldout_check,
    rollout_metrics,
    run_stage,
)


def curriculum_levels(tasks, expert_calls: dict[str, int]) -> list[list]:
    """Levels, easiest first: normal tasks whose expert solution needs at most 1, 2, ... tool calls,
    then every task (adversarial ones included). Levels that add nothing are dropped."""
    normal = [t for t in tasks if t.difficulty == "normal"]
    levels: list[list] = []
    for c in sorted({expert_calls.get(t.id, 0) for t in normal}):
        level = [t for t in normal if expert_calls.get(t.id, 0) <= c]
        if not levels or len(level) > len(levels[-1]):
            levels.append(level)
    if not levels or len(tasks) > len(levels[-1]):
        levels.append(list(tasks))
    return levels


_VERSION_DIR = re.compile(r"v[0-9]+")


def stale_version_dirs(versions_dir: Path, versions: list[dict[str, Any]]) -> list[Path]:
    """The ``vN`` directories under ``versions_dir`` that ``versions`` does not list as accepted
    (written by steps a resumed run discarded, or by an earlier attempt of a restarted stage)."""
    if not versions_dir.is_dir():
        return []
    keep = {f"v{v['version']}" for v in versions if v.get("accepted")}
    return sorted(p for p in versions_dir.iterdir() if _VERSION_DIR.fullmatch(p.name) and p.name not in keep)


def _frozen_teacher(model, tokenizer, version: int) -> HFTeacher:
    return HFTeacher(copy.deepcopy(model), tokenizer, f"v{version}")


def evolve_stage(ws: Workspace, model, resume: bool = False) -> Path:
    cfg, e, audit = ws.cfg, ws.cfg.evolve, ws.cfg.audit
    steps = e.iterations * e.steps_per_iteration
    pool = ws.train_tasks(max(e.tasks_per_step * steps, 128), cfg.seed + TRAIN_POOL_SEED_OFFSET + 1)
    demos = expert_demonstrations(ws.contract, ws.make_env, ws.env_entry.make_expert(), pool, weights=cfg.reward)
    levels = curriculum_levels(pool, {d.task_id: len(d.tool_calls) for d in demos})
    curriculum = Curriculum(levels, e.raise_above, e.lower_below, e.window, seed=cfg.seed)
    learner = Learner(model, e.optim, ws.contract.pad_token_id, ws.contract.sampling.temperature)
    estimator = get_advantage_estimator("grpo")
    root = ws.run_dir / "evolve"
    versions_dir = root / "versions"
    buffer = ReplayBuffer(root / "replay.sqlite", ReplayConfig(min_reward=None))
    state: dict[str, Any] = {"policy": 0, "versions": [], "best": None, "teacher": 0, "rollout_tokens": 0}
    box = {"teacher": _frozen_teacher(model, ws.tokenizer, 0)}
    replay = BufferCheckpoints(buffer, KEEP_CHECKPOINTS, "evolve", ws.console.print)

    def save_version(k: int) -> Path:
        path = versions_dir / f"v{k}"
        model.save_pretrained(path, safe_serialization=True)
        ws.tokenizer.save_pretrained(path)
        return path

    def write_versions() -> None:
        root.mkdir(parents=True, exist_ok=True)
        (root / "versions.json").write_text(json.dumps(state["versions"], indent=2))

    def sync_versions() -> None:
        """Make ``versions.json`` and ``versions/`` say what ``state["versions"]`` says."""
        for stale in stale_version_dirs(versions_dir, state["versions"]):
            shutil.rmtree(stale)
        if state["versions"] or (root / "versions.json").exists():
            write_versions()

    def step_fn(step: int) -> dict[str, float]:
        if replay.start():  # no checkpoint was restored: the stage starts from scratch
            sync_versions()
        if step == 0 and not state["versions"]:  # v0: the starting checkpoint, scored like every later version
            score = heldout_check(ws, model, e.eval_tasks)
            state["versions"].append({"version": 0, "iteration": 0, "heldout_success": score, "accepted": True,
                                      "teacher": None, "path": str(save_version(0))})
            state["best"] = score
            write_versions()
        chosen = curriculum.sample(e.tasks_per_step)
        grouped = [t for t in chosen for _ in range(e.samples_per_task)]
        t0 = time.perf_counter()
        trajs = rollout_tasks(model, ws.contract, ws.make_env, grouped, policy_version=state["policy"],
                              seed=cfg.seed * 5_003 + step, batch_size=len(grouped), weights=cfg.reward)
        t_roll = time.perf_counter() - t0
        _require_consistent(ws, trajs, state["policy"], f"evolve step {step + 1}")
        state["rollout_tokens"] += sum(t.num_policy_tokens for t in trajs)
        level_before = curriculum.level
        curriculum.observe([bool(t.reward and t.reward.success) for t in trajs])
        admitted = sum(bool(buffer.add(t)) for t in trajs if t.reward and t.reward.success)  # the verifier gates
        raw = torch.tensor([t.reward.total for t in trajs], dtype=torch.float32).view(len(chosen), e.samples_per_task)
        rewards, clipped = sanitize_group_rewards(raw, audit.reward_low, audit.reward_high, audit.outlier_z)
        env_adv = estimator(rewards, normalize_std=True).reshape(-1)
        teacher = box["teacher"]
        signals = [[same_tokenizer_signal(teacher, t) for t in trajs]]
        kl = kl_advantages(trajs, signals, torch.ones(len(trajs), 1, dtype=torch.float64), [True])
        adv = [e.reward_coef * float(env_adv[i]) * torch.tensor(t.loss_mask, dtype=torch.float32) + e.kl_coef * kl[i]
               for i, t in enumerate(trajs)]
        ups = []
        for idx in _minibatches(list(range(len(trajs))), 2, seed=step * 5 + 1):
            batch = [trajs[i] for i in idx]
            ups.append({**learner.token_policy_step(batch, [adv[i] for i in idx], "clipped", eps_low=e.eps_low,
                                                    eps_high=e.eps_high), **policy_lag(batch, state["policy"])})
            state["policy"] += 1
        m: dict[str, float] = {f"reward_{k}": v for k, v in group_reward_stats(rewards).items()}
        m.update(rollout_metrics(trajs), rollouts=float(len(trajs)), rollout_s=t_roll, reward_clipped=clipped["clipped"])
        m.update(_reduce_updates(ups, ("pg_loss", "clip_frac", "entropy", "grad_norm", "logprob_abs_gap",
                                       "policy_lag_max")))
        policy_tokens = sum(t.num_policy_tokens for t in trajs)
        m["opd_reverse_kl"] = -sum(float(k.sum()) for k in kl if k is not None) / max(policy_tokens, 1)
        replayed = buffer.sample(e.replay_batch, rng=random.Random(cfg.seed * 7 + step)) if e.replay_batch else []
        if replayed and e.replay_coef > 0:
            m["replay_sft_loss"] = learner.sft_step(replayed)["loss"]
        m.update(curriculum_level=float(curriculum.level), level_changed=float(curriculum.level != level_before),
                 curriculum_success=curriculum.success_rate if curriculum.success_rate is not None else -1.0,
                 admitted=float(admitted), replay_size=float(len(buffer)), replayed=float(len(replayed)),
                 teacher_version=float(state["teacher"]), rollout_tokens_total=float(state["rollout_tokens"]))
        if (step + 1) % e.steps_per_iteration == 0:
            m.update(_close_iteration(step))
        return m

    def _close_iteration(step: int) -> dict[str, float]:
        it = (step + 1) // e.steps_per_iteration
        score = heldout_check(ws, model, e.eval_tasks)
        accepted = score >= state["best"] - e.accept_margin
        entry = {"version": it, "iteration": it, "heldout_success": score, "accepted": accepted,
                 "teacher": state["teacher"], "path": None}
        if accepted:
            entry["path"] = str(save_version(it))
            state["best"], state["teacher"] = max(state["best"], score), it
            box["teacher"] = _frozen_teacher(model, ws.tokenizer, it)
        else:  # roll back to the last accepted version
            _load_weights_into(model, versions_dir / f"v{state['teacher']}")
        state["versions"] = [v for v in state["versions"] if v["version"] != it] + [entry]
        write_versions()
        ws.console.print(f"evolve iteration {it}: held-out {100 * score:.1f}% -> "
                         f"{'accepted as the next teacher' if accepted else 'rejected, rolled back'}")
        return {"heldout_success": score, "version_accepted": float(accepted)}

    def extra_state() -> dict[str, Any]:
        return {**state, "curriculum": curriculum.state_dict(), **replay.state()}

    def restore(st: dict[str, Any]) -> None:
        replay.restore(st)
        state.update({k: st[k] for k in state if k in st})
        sync_versions()
        if st.get("curriculum"):
            curriculum.load_state_dict(st["curriculum"])
        path = versions_dir / f"v{state['teacher']}"
        if (path / "config.json").exists():
            from mentorrl.models.build import load_policy

            box["teacher"] = HFTeacher(load_policy(path)[1], ws.tokenizer, f"v{state['teacher']}")

    try:
        return run_stage(ws, "evolve", model, learner, steps, step_fn, e.steps_per_iteration, resume,
                         extra_state=extra_state, restore_extra=restore)
    finally:
        buffer.close()


__all__ = ["curriculum_levels", "evolve_stage", "stale_version_dirs"]
