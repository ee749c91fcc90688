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
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mentorrl.algos.advantages import get_advantage_estimator
from mentorrl.opd.advantage import kl_advantages
from mentorrl.opd.signals import same_tokenizer_signal
from mentorrl.opd.teacher import HFTeacher
from mentorrl.replay.buffer import ReplayBuffer, ReplayConfig
from mentorrl.replay.checkpointing import BufferCheckpoints
from mentorrl.train.curriculum import Curriculum
from mentorrl.train.loop import Stage, StepBatch, StepData, run_on_loop
from mentorrl.train.rundir import KEEP_CHECKPOINTS, require_manifest, write_manifest
from mentorrl.train.stage_helpers import PG_METRICS, pg_update
from mentorrl.train.workspace import Workspace, heldout_check, load_weights_into


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


EVOLVE_METRICS = PG_METRICS


@dataclass(slots=True)
class EvolveStepData(StepData):
    """``level_before``: the curriculum's level when the step's tasks were drawn (``after`` reports a change)."""

    level_before: int = 0


class EvolveStage(Stage):
    """The self-evolving loop on :class:`~mentorrl.train.loop.RLLoop`: the curriculum chooses the
    tasks, the advantages add a reverse-KL term towards the frozen teacher (the last accepted
    version), the update is a policy-gradient pass and a replay SFT step, and the iteration gate
    (held-out check: accept as the next teacher, or roll back) runs in ``after``."""

    name = "evolve"
    step_data = EvolveStepData
    update_metrics = EVOLVE_METRICS
    pool_least = 128

    def __init__(self, ws: Workspace, model):
        super().__init__(ws, model)
        e = self.cfg
        demos = ws.rollout.demonstrations(ws.env_entry.make_expert(), self.pool)
        levels = curriculum_levels(self.pool, {d.task_id: len(d.tool_calls) for d in demos})
        self.curriculum = Curriculum(levels, e.raise_above, e.lower_below, e.window, seed=self.seeds("curriculum"))
        self.estimator = get_advantage_estimator("grpo")
        self.root = ws.run_dir / "evolve"
        self.versions_dir = self.root / "versions"
        self.buffer = ReplayBuffer(self.root / "replay.sqlite", ReplayConfig(min_reward=None))
        self.state: dict[str, Any] = {"versions": [], "best": None, "teacher": 0, "rollout_tokens": 0}
        self.teacher = _frozen_teacher(model, ws.tokenizer, 0)
        self.replay = BufferCheckpoints(self.buffer, KEEP_CHECKPOINTS, "evolve", ws.console.print)

    @property
    def steps(self) -> int:
        return self.cfg.iterations * self.cfg.steps_per_iteration

    @property
    def checkpoint_every(self) -> int:
        return self.cfg.steps_per_iteration

    # ---- versions on disk ---------------------------------------------------------------------
    def save_version(self, k: int) -> Path:
        path = self.versions_dir / f"v{k}"
        self.model.save_pretrained(path, safe_serialization=True)
        self.ws.tokenizer.save_pretrained(path)
        write_manifest(path)  # verified when the version is loaded again (a rollback, a resumed teacher)
        return path

    def write_versions(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "versions.json").write_text(json.dumps(self.state["versions"], indent=2))

    def sync_versions(self) -> None:
        """Make ``versions.json`` and ``versions/`` say what ``state["versions"]`` says."""
        for stale in stale_version_dirs(self.versions_dir, self.state["versions"]):
            shutil.rmtree(stale)
        if self.state["versions"] or (self.root / "versions.json").exists():
            self.write_versions()

    def begin(self, b: StepBatch) -> None:
        """A stage started from scratch empties its buffer and version dirs; the first step scores v0
        (the starting checkpoint, like every later version)."""
        state = self.state
        if self.replay.start():  # no checkpoint was restored: the stage starts from scratch
            self.sync_versions()
        if b.step == 0 and not state["versions"]:
            score = heldout_check(self.ws, self.model, self.cfg.eval_tasks)
            state["versions"].append(
                {
                    "version": 0,
                    "iteration": 0,
                    "heldout_success": score,
                    "accepted": True,
                    "teacher": None,
                    "path": str(self.save_version(0)),
                }
            )
            state["best"] = score
            self.write_versions()

    # ---- hooks --------------------------------------------------------------------------------
    def tasks(self, b: StepBatch) -> None:
        """The curriculum's tasks at its current level."""
        self.begin(b)
        b.data.level_before = self.curriculum.level
        b.tasks = self.curriculum.sample(self.cfg.tasks_per_step)

    def rollout(self, b: StepBatch) -> None:
        """The rollouts; the curriculum sees their successes and the verified ones enter the replay buffer."""
        self.collect(b, self.cfg.samples_per_task)
        self.state["rollout_tokens"] += b.policy_tokens
        self.curriculum.observe([bool(t.reward and t.reward.success) for t in b.trajs])
        b.metrics["admitted"] = float(
            sum(bool(self.buffer.add(t)) for t in b.trajs if t.reward and t.reward.success)
        )  # the verifier gates

    def advantages(self, b: StepBatch) -> None:
        """``reward_coef * A_env`` (group-relative) plus ``kl_coef * A_kl`` towards the frozen teacher, per token."""
        e, trajs = self.cfg, b.trajs
        env_adv = self.estimator(b.rewards, normalize_std=True).reshape(-1)
        signals = [[same_tokenizer_signal(self.teacher, t) for t in trajs]]
        kl = kl_advantages(trajs, signals, torch.ones(len(trajs), 1, dtype=torch.float64), [True])
        b.adv = [
            e.reward_coef * float(env_adv[i]) * torch.tensor(t.loss_mask, dtype=torch.float32) + e.kl_coef * kl[i]
            for i, t in enumerate(trajs)
        ]
        b.metrics["opd_reverse_kl"] = -sum(float(k.sum()) for k in kl if k is not None) / max(b.policy_tokens, 1)

    def update(self, b: StepBatch) -> None:
        """Two policy-gradient minibatches, then an SFT step on ``replay_batch`` replayed successes."""
        e = self.cfg
        b.updates += pg_update(
            self.learner, b.trajs, b.adv, 2, b.seeds("minibatches"), eps_low=e.eps_low, eps_high=e.eps_high
        )
        replayed = self.buffer.sample(e.replay_batch, rng=b.seeds.rng("replay")) if e.replay_batch else []
        if replayed and e.replay_coef > 0:
            b.metrics["replay_sft_loss"] = self.learner.sft_step(replayed)["loss"]
        b.metrics["replayed"] = float(len(replayed))

    def after(self, b: StepBatch) -> None:
        """The curriculum's and the buffer's metrics; at the end of an iteration, the gate."""
        c, state = self.curriculum, self.state
        b.metrics.update(
            curriculum_level=float(c.level),
            level_changed=float(c.level != b.data.level_before),
            curriculum_success=c.success_rate if c.success_rate is not None else -1.0,
            replay_size=float(len(self.buffer)),
            teacher_version=float(state["teacher"]),
            rollout_tokens_total=float(state["rollout_tokens"]),
        )
        b.metrics.update(self.replay.take_metrics())  # the first step after a resume: what it dropped
        if (b.step + 1) % self.cfg.steps_per_iteration == 0:
            b.metrics.update(self.close_iteration(b.step))

    def close_iteration(self, step: int) -> dict[str, float]:
        """The held-out check and gate at the end of an iteration: accept (save, new teacher) or roll back."""
        e, state = self.cfg, self.state
        it = (step + 1) // e.steps_per_iteration
        score = heldout_check(self.ws, self.model, e.eval_tasks)
        accepted = score >= state["best"] - e.accept_margin
        entry = {
            "version": it,
            "iteration": it,
            "heldout_success": score,
            "accepted": accepted,
            "teacher": state["teacher"],
            "path": None,
        }
        if accepted:
            entry["path"] = str(self.save_version(it))
            state["best"], state["teacher"] = max(state["best"], score), it
            self.teacher = _frozen_teacher(self.model, self.ws.tokenizer, it)
        else:  # roll back to the last accepted version
            load_weights_into(self.model, self.versions_dir / f"v{state['teacher']}")
        state["versions"] = [v for v in state["versions"] if v["version"] != it] + [entry]
        self.write_versions()
        self.ws.console.print(
            f"evolve iteration {it}: held-out {100 * score:.1f}% -> "
            f"{'accepted as the next teacher' if accepted else 'rejected, rolled back'}"
        )
        return {"heldout_success": score, "version_accepted": float(accepted)}

    # ---- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {**self.state, "curriculum": self.curriculum.state_dict(), **self.replay.state()}

    def load_state_dict(self, st: dict[str, Any]) -> None:
        self.replay.restore(st, self.learner.version)  # the learner was restored first
        self.state.update({k: st[k] for k in self.state if k in st})
        self.sync_versions()
        if st.get("curriculum"):
            self.curriculum.load_state_dict(st["curriculum"])
        path = self.versions_dir / f"v{self.state['teacher']}"
        if (path / "config.json").exists():
            from mentorrl.models.build import load_policy
            from mentorrl.models.device import teacher_placement

            require_manifest(path)
            place = teacher_placement(self.ws.cfg, None)  # an earlier policy version, where the learner's teachers go
            model = load_policy(path, place.dtype, place.device)[1]
            self.teacher = HFTeacher(model, self.ws.tokenizer, f"v{self.state['teacher']}")

    def close(self) -> None:
        self.buffer.close()


evolve_stage = run_on_loop(EvolveStage)
