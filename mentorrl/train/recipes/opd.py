"""On-policy distillation stage (``recipe: [sft, opd]``): the student rolls out, white-box
teachers score what it actually did, and that signal trains it.

One step on :class:`~mentorrl.train.loop.RLLoop` (:class:`OPDStage`'s hooks):

1. **rollout**: ``tasks_per_step x samples_per_task`` episodes with the student (with a ``short``
   term, only each task family's adaptive share of the drawn tasks: whole episodes, none cut short).
2. **score**: the group rewards, and every teacher scores every trajectory in one forward pass: a
   same-tokenizer teacher per policy token, a cross-tokenizer teacher per shared-boundary chunk
   (:mod:`mentorrl.opd.signals`). A trajectory a teacher cannot align is counted and left to the
   other teachers (or to the reward terms). MOPD weights the teachers per trajectory (routing,
   confidence, success history); the weighted signals are the distillation advantage ``A_kl``.
   With ``opd.mopd.competence`` the routes are measured once, before the first step: every
   teacher rolls out the same train tasks of each family, scored by the verifier
   (:func:`measure_competence`; ``RUN_DIR/mopd_competence.json``, kept in the stage's state).
3. **advantages**: the inputs the configured terms need (only those), the token terms on ``A_kl``
   (``until_first_error``, ``step_weights``, ``center``, ``short``), and the sum of the advantage
   terms (``sampled_kl``, ``reward_weighted``, ``rlsd_selected``, ``env_advantage``).
4. **update**: the clipped policy gradient on that advantage when an advantage term is configured
   (``epochs`` passes, one when a ``topk`` term makes them), then the loss terms in list order
   (:data:`LOSS_TERMS`: ``topk``, ``rlsd_topk``, ``sequence_fallback``).
5. **after**: the held-out check every ``eval_every`` steps and the sample files.

The variants are not branches of one loop but one ordered list of terms, ``opd.terms`` (each
``{name: ..., its own settings}``, see ``docs/opd.md``); token and advantage terms are the pure
functions of :mod:`mentorrl.algos.opd_terms`, loss terms this module's :data:`LOSS_TERMS`. Each
declares the inputs it reads; the stage computes no other (e.g. the student-entropy pass runs only
for ``step_weights``).

Every step logs the student rollout tokens so far (the budget OPD is compared on), the
teacher tokens read, the reverse-KL estimate, alignment failures and the distilled share;
``opd/signals-step-N.jsonl`` keeps, for the sampled trajectories, each teacher's signal and
weight so a routing decision can be audited.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from mentorrl.algos.opd_terms import (
    ADVANTAGE_TERMS,
    TOKEN_TERMS,
    apply_token_terms,
    needed_inputs,
    rlsd_weights,
    token_advantages,
)
from mentorrl.config.registry import Registry
from mentorrl.contract import EFFECTIVE_BUDGET_KEY, contract_for_env
from mentorrl.opd.advantage import GapShare, kl_advantages, teacher_weights, tool_error_tokens, until_first_error
from mentorrl.opd.mopd import competence_routes
from mentorrl.opd.retokenize import retokenize
from mentorrl.opd.scoring import teacher_row
from mentorrl.opd.signals import CrossTokenizerTeacher
from mentorrl.opd.teacher import Capability, HFTeacher, require
from mentorrl.train.learner import Learner
from mentorrl.train.loop import Stage, StepBatch, StepData, run_on_loop
from mentorrl.train.stage_helpers import minibatches, pg_update, reduce_updates
from mentorrl.train.teachers import load_teacher, serve_teachers
from mentorrl.train.workspace import Workspace, heldout_check
from mentorrl.trajectory import Trajectory, write_jsonl


def needed_capabilities(cfg) -> list[Capability]:
    """What every white-box teacher must provide: a ``topk`` term reads its top-k."""
    if any(t.name == "topk" for t in cfg.opd.terms):
        return [Capability.TOPK_LOGPROBS]
    return [Capability.TOKEN_LOGPROBS]


@dataclass(frozen=True)
class LossTerm:
    """A loss term of the stage: ``run(stage, b, p)`` after the policy gradient; ``prepare(stage, b,
    p)`` in the advantages hook, before any update of the step; ``ready(stage)``: whether it can run
    with the loaded teachers (else it is skipped); ``needs``: the inputs it reads
    (:data:`mentorrl.algos.opd_terms.INPUTS`)."""

    run: Callable[["OPDStage", StepBatch, Any], None]
    needs: tuple[str, ...] = ()
    prepare: Callable[["OPDStage", StepBatch, Any], None] | None = None
    ready: Callable[["OPDStage"], bool] = lambda stage: True


@dataclass(slots=True)
class OPDStepData(StepData):
    """What OPD's hooks hand on within a step: ``drawn``, the tasks drawn before a ``short`` term kept its share
    of each family (else 0); the score hook's per-teacher ``signals`` (teacher x trajectory), MOPD's teacher weights
    ``w`` ([trajectories, teachers]), the distillation advantage ``kl`` (per trajectory; reshaped by the
    token terms) and ``topk_rows`` (per teacher, trajectory index -> the same pass's top-k); the
    advantages hook's term ``inputs`` and RLSD's start-of-step ``rlsd_targets``; and ``distill``, the
    last distillation update's metrics."""

    drawn: int = 0
    signals: list[list[Any]] = field(default_factory=list)
    w: torch.Tensor | None = None
    kl: list[torch.Tensor | None] = field(default_factory=list)
    topk_rows: list[dict[int, Any]] = field(default_factory=list)
    inputs: dict[str, Any] = field(default_factory=dict)
    rlsd_targets: list[tuple[Trajectory, Any, Any, torch.Tensor]] | None = None
    distill: dict[str, float] = field(default_factory=dict)


class OPDStage(Stage):
    """On-policy distillation: student rollouts, teacher scores, the configured terms (module doc)."""

    name = "opd"
    step_data = OPDStepData

    def __init__(self, ws: Workspace, model):
        super().__init__(ws, model)
        o = self.cfg
        (ws.run_dir / "opd").mkdir(parents=True, exist_ok=True)
        hf = [t for t in o.teachers if t.kind == "hf"]
        self.teachers = [load_teacher(ws, t, model) for t in hf]
        # distributed.backend ray with teacher_workers: each teacher also served by that many actors
        self.served = serve_teachers(ws, hf, model) if hf else []
        self.by_name = {t.name: t for t in o.terms}
        for t in self.teachers:
            require(t, needed_capabilities(ws.cfg), "opd (topk term)" if "topk" in self.by_name else "opd")
        self.cross = [t for t in self.teachers if isinstance(t, CrossTokenizerTeacher)]
        if self.cross and "sequence_fallback" in self.by_name:
            for t in self.cross:
                require(t, [Capability.SAMPLING], "opd (sequence_fallback)")
        self.names = [t.name for t in self.teachers]
        self.shared = [isinstance(t, HFTeacher) for t in self.teachers]
        self.token_terms = [t for t in o.terms if t.name in TOKEN_TERMS]
        self.advantage_terms = [t for t in o.terms if t.name in ADVANTAGE_TERMS]
        self.loss_terms = [t for t in o.terms if t.name in LOSS_TERMS and LOSS_TERMS[t.name].ready(self)]
        self.needs = needed_inputs([t.name for t in o.terms], LOSS_TERMS)
        if o.mopd.competence is not None:  # the competence rollouts sample from every teacher
            for t in self.teachers:
                require(t, [Capability.SAMPLING], "opd.mopd.competence")
        self.state: dict[str, Any] = {
            "rollout_tokens": 0,
            "teacher_tokens": 0,
            "history": {n: (0, 0) for n in self.names},
            "competence": None,  # opd.mopd.competence: family -> teacher -> successes, attempts, weight
        }
        short = self.by_name.get("short")
        self.budget = GapShare(short.min_share, short.full_gap, short.ema) if short is not None else None

    # ---- hooks --------------------------------------------------------------------------------
    def tasks(self, b: StepBatch) -> None:
        """The step's tasks from the pool; before the first step (not again on resume: the table is
        checkpointed) the teachers' competence with ``opd.mopd.competence``."""
        if self.cfg.mopd.competence is not None and self.state["competence"] is None:
            self.state["competence"] = self.measure_competence()
        super().tasks(b)

    def rollout(self, b: StepBatch) -> None:
        """The student's rollouts; with a ``short`` term only each family's share of the drawn tasks, whole
        episodes (:class:`~mentorrl.opd.advantage.GapShare`)."""
        if self.budget is not None:
            b.data.drawn = len(b.tasks)
            b.tasks = self.budget.select(b.tasks, b.seeds.rng("short-share"))
        self.collect(b, self.cfg.samples_per_task)
        self.state["rollout_tokens"] += b.policy_tokens

    def score(self, b: StepBatch) -> None:
        """The group rewards, then every teacher scores every trajectory in one forward pass; MOPD weights
        the teachers and the weighted signals become the distillation advantage ``b.data.kl``."""
        super().score(b)
        o, trajs = self.cfg, b.trajs
        t1 = time.perf_counter()
        topk, fallback = self.by_name.get("topk"), "sequence_fallback" in self.by_name
        b.data.topk_rows, signals, failures = [{} for _ in self.teachers], [], 0  # topk: the same pass's top-k
        for k, teacher in enumerate(self.teachers):
            top_k = topk.top_k if topk is not None else None
            row = (
                self.served[k].row(trajs, top_k, fallback)
                if self.served
                else teacher_row(teacher, trajs, top_k, fallback)
            )
            for i, (_, scored, failed) in enumerate(row):
                failures += failed
                if scored is not None:
                    b.data.topk_rows[k][i] = scored
            signals.append([sig for sig, _, _ in row])
        teacher_tokens = sum(x.teacher_tokens for row in signals for x in row if x is not None)
        self.state["teacher_tokens"] += teacher_tokens
        w = (
            teacher_weights(
                [t.family for t in trajs],
                self.names,
                signals,
                self.routes(),
                o.mopd.confidence_temperature,
                self.state["history"] if o.mopd.success_history else None,
            )
            if self.teachers
            else torch.zeros(len(trajs), 0)
        )
        b.data.signals, b.data.w = signals, w
        b.data.kl = kl_advantages(trajs, signals, w, self.shared) if self.teachers else [None] * len(trajs)
        b.metrics.update(
            teacher_s=time.perf_counter() - t1, teacher_tokens=float(teacher_tokens), alignment_failures=float(failures)
        )
        partial = [
            (int(sig.topk_mask.sum()), trajs[i].num_policy_tokens)
            for row in b.data.topk_rows
            for i, sig in row.items()
            if sig is not None and sig.topk_mask is not None
        ]
        if partial:  # cross-tokenizer top-k: the share of policy tokens with a target
            b.metrics["topk_coverage"] = sum(c for c, _ in partial) / max(sum(n for _, n in partial), 1)

    def advantages(self, b: StepBatch) -> None:
        """The inputs the terms need, the token terms on ``A_kl``, the advantage terms' sum into
        ``b.adv``, and the loss terms' preparation (before any update of the step)."""
        x = b.data.inputs = self.inputs(b)
        self.shape(b, x)
        if self.advantage_terms:
            b.adv, m = token_advantages(_masks(b.trajs), self.advantage_terms, b.data.kl, x)
            b.metrics.update(m)
        for p in self.loss_terms:
            prepare = LOSS_TERMS[p.name].prepare
            if prepare is not None:
                prepare(self, b, p)

    def update(self, b: StepBatch) -> None:
        """The policy gradient on ``b.adv`` (when an advantage term is configured), then the loss terms in order."""
        o = self.cfg
        if self.advantage_terms:
            for e in range(1 if "topk" in self.by_name else o.epochs):
                b.updates += pg_update(
                    self.learner,
                    b.trajs,
                    b.adv,
                    o.updates_per_step,
                    b.seeds(f"minibatches-{e}"),
                    skip_zero=True,
                    eps_low=o.eps_low,
                    eps_high=o.eps_high,
                    agg=o.loss_agg,
                )
        for p in self.loss_terms:
            LOSS_TERMS[p.name].run(self, b, p)
        distill = b.data.distill  # the last distillation update's metrics
        b.metrics.update({k: v for k, v in distill.items() if k in ("distill_loss", "divergence_max")})
        if distill and not b.updates:
            b.metrics["grad_norm"] = distill.get("grad_norm", 0.0)

    def after(self, b: StepBatch) -> None:
        o, st = self.cfg, self.state
        b.metrics.update(
            rollout_tokens_total=float(st["rollout_tokens"]), teacher_tokens_total=float(st["teacher_tokens"])
        )
        if o.eval_every and (b.step + 1) % o.eval_every == 0:
            b.metrics["heldout_success"] = heldout_check(self.ws, self.model, o.eval_tasks)
        if o.sample_trajectories:
            n = o.sample_trajectories
            _write_samples(self.ws.run_dir, b.step, b.trajs[:n], b.data.signals, self.names, b.data.w, b.data.kl)

    # ---- the steps of the advantages hook ----------------------------------------------------
    def inputs(self, b: StepBatch) -> dict[str, Any]:
        """The inputs (:data:`mentorrl.algos.opd_terms.INPUTS`) the configured terms read, and no other."""
        x: dict[str, Any] = {}
        for name in self.needs:
            x[name] = INPUT_BUILDERS[name](self, b, x)
        return x

    def shape(self, b: StepBatch, x: dict[str, Any]) -> None:
        """The token terms on ``b.data.kl``; a ``short`` term's family shares observe the step's gaps."""
        trajs, kl = b.trajs, b.data.kl
        b.metrics["opd_reverse_kl"] = -sum(float(k.sum()) for k in kl if k is not None) / max(
            sum(t.num_policy_tokens for t in trajs), 1
        )
        b.data.kl, tm = apply_token_terms(self.token_terms, kl, x)
        b.metrics.update(tm)
        if self.budget is not None:
            gaps, families = x["gaps"], [t.family for t in trajs]
            for fam in sorted(set(families)):  # not hash order: the same in every process
                idx = [i for i, f in enumerate(families) if f == fam and gaps[i] is not None]
                if idx:
                    self.budget.observe(
                        fam,
                        sum(float(gaps[i].sum()) for i in idx) / max(sum(trajs[i].num_policy_tokens for i in idx), 1),
                    )
            b.metrics["short_tasks_kept"] = len(b.tasks) / max(b.data.drawn, 1)
            b.metrics["teacher_tokens_per_trajectory"] = b.metrics["teacher_tokens"] / max(
                len(self.teachers) * len(trajs), 1
            )
        if self.cfg.mopd.success_history and self.teachers:
            _update_history(self.state["history"], self.names, b.data.w, trajs)

    # ---- competence routing -------------------------------------------------------------------------
    def measure_competence(self) -> dict[str, dict[str, dict[str, float]]]:
        """Every teacher rolls out the same ``tasks_per_family`` train tasks of each family of the pool
        (one seed for all); the verifier's successes become the routes (:func:`competence_table`),
        written to ``RUN_DIR/mopd_competence.json`` and summarised on the console."""
        c, ws = self.cfg.mopd.competence, self.ws
        tasks = competence_tasks(ws, self.pool, c.tasks_per_family, self.seeds(f"competence-tasks-{c.seed}"))
        counts, generated = teacher_successes(ws, self.teachers, tasks, self.seeds(f"competence-rollout-{c.seed}"))
        self.state["teacher_tokens"] += generated
        table = competence_table(counts, c.mode)
        if ws.is_main:
            doc = {"mode": c.mode, "tasks_per_family": c.tasks_per_family, "seed": c.seed, "families": table}
            (ws.run_dir / "mopd_competence.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
            ws.console.print(f"mopd competence ({c.mode}): {competence_summary(table)}", markup=False)
        return table

    def routes(self) -> dict[str, dict[str, float]]:
        """MOPD's routes: the measured competence table's weights with ``opd.mopd.competence``, else
        the static ``opd.mopd.routes``."""
        table = self.state["competence"]
        if table is None:
            return self.cfg.mopd.routes
        return {fam: {t: row["weight"] for t, row in per.items()} for fam, per in table.items()}

    # ---- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        st = self.state
        return {
            "rollout_tokens": st["rollout_tokens"],
            "teacher_tokens": st["teacher_tokens"],
            "history": {k: list(v) for k, v in st["history"].items()},
            "budget": self.budget.state_dict() if self.budget else None,
            "competence": copy.deepcopy(st["competence"]),
        }

    def load_state_dict(self, st: dict[str, Any]) -> None:
        for k in ("rollout_tokens", "teacher_tokens"):
            self.state[k] = st.get(k, 0)
        self.state["history"].update({k: tuple(v) for k, v in st.get("history", {}).items()})
        if self.budget is not None and st.get("budget"):
            self.budget.load_state_dict(st["budget"])
        if st.get("competence") is not None:  # measured before: a resumed run reuses it, never rerolls
            self.state["competence"] = copy.deepcopy(st["competence"])

    def close(self) -> None:
        for served in self.served:
            served.close()  # the teacher actors' CPUs go back to the cluster


opd_stage = run_on_loop(OPDStage)


# --------------------------------------------------------------- inputs -----
def _gaps(stage: OPDStage, b: StepBatch, x: dict[str, Any]) -> list[torch.Tensor | None]:
    """``|A_kl|`` on the tokens distilled: after ``until_first_error`` when it is configured."""
    kl = b.data.kl
    if "until_first_error" in stage.by_name:
        kl, _ = TOKEN_TERMS["until_first_error"].fn(kl, x)
    return [k.abs() if k is not None else None for k in kl]


INPUT_BUILDERS: dict[str, Callable[[OPDStage, StepBatch, dict[str, Any]], Any]] = {
    "masks": lambda stage, b, x: _masks(b.trajs),
    "first_error": lambda stage, b, x: [until_first_error(t) for t in b.trajs],
    "gaps": _gaps,
    "tool_errors": lambda stage, b, x: [tool_error_tokens(t) for t in b.trajs],
    "student_entropy": lambda stage, b, x: _student_entropy(stage.learner, b.trajs),
    "rewards": lambda stage, b, x: b.rewards,
    "success": lambda stage, b, x: torch.tensor(
        [bool(t.reward and t.reward.success) for t in b.trajs], dtype=torch.bool
    ),
    "lengths": lambda stage, b, x: torch.tensor([float(t.num_policy_tokens) for t in b.trajs]),
    "seed": lambda stage, b, x: b.seeds("terms"),
}


# ----------------------------------------------------------- loss terms -----
def _topk_loss(stage: OPDStage, b: StepBatch, p) -> None:
    """A top-k divergence to each trajectory's most-weighted teacher (the ``topk`` term)."""
    cut = b.data.inputs["first_error"] if "until_first_error" in stage.by_name else None
    b.data.distill = _topk_update(stage.learner, b, p, stage.cfg, cut, selected="short" in stage.by_name)


def _rlsd_prepare(stage: OPDStage, b: StepBatch, p) -> None:
    """RLSD's weights, and the start-of-step snapshot's targets (stored before any update)."""
    w = rlsd_weights(b.data.inputs, p)
    b.metrics["rlsd_distilled"] = float((w > 0).sum())
    b.data.rlsd_targets = (
        _rlsd_snapshot_targets(stage.model, stage.ws.tokenizer, b.trajs, w, p) if bool((w > 0).any()) else None
    )


def _rlsd_topk_loss(stage: OPDStage, b: StepBatch, p) -> None:
    """RLSD's forward KL to the start-of-step snapshot's top-k on the verified trajectories."""
    targets = b.data.rlsd_targets
    if targets is not None:
        b.data.distill = stage.learner.distill_step(
            [x[0] for x in targets],
            [x[1] for x in targets],
            [x[2] for x in targets],
            kind="forward",
            token_weights=[x[3] for x in targets],
            tail=p.tail,
        )


def _sequence_fallback_loss(stage: OPDStage, b: StepBatch, p) -> None:
    """The cross-tokenizer teachers' own verified episodes as one SFT update."""
    b.metrics.update(
        _sequence_fallback(stage.ws, stage.learner, stage.cross, b.tasks, b.seeds("fallback"), stage.state)
    )


LOSS_TERMS: Registry[LossTerm] = Registry("OPD loss term")
LOSS_TERMS.register("topk", LossTerm(_topk_loss, ready=lambda stage: bool(stage.teachers)))
LOSS_TERMS.register(
    "rlsd_topk", LossTerm(_rlsd_topk_loss, needs=("rewards", "success", "lengths", "seed"), prepare=_rlsd_prepare)
)
LOSS_TERMS.register("sequence_fallback", LossTerm(_sequence_fallback_loss, ready=lambda stage: bool(stage.cross)))


# ------------------------------------------------------------- helpers -----
@torch.no_grad()
def _student_entropy(learner: Learner, trajs: list[Trajectory]) -> list[torch.Tensor]:
    from mentorrl.models.batch import collate, forward_logprobs

    out = []
    mbs = learner.cfg.micro_batch_size
    device = next(learner.model.parameters()).device
    for lo in range(0, len(trajs), mbs):
        chunk = trajs[lo : lo + mbs]
        _, ent = forward_logprobs(
            learner.model, collate(chunk, learner.pad_id).to(device), learner.temperature, with_entropy=True
        )
        out += [ent[b, : len(t.token_ids)].cpu() for b, t in enumerate(chunk)]
    return out


def _masks(trajs) -> list[torch.Tensor]:
    return [torch.tensor(t.loss_mask, dtype=torch.float32) for t in trajs]


def _update_history(history, names, w, trajs) -> None:
    for b, t in enumerate(trajs):
        if w.shape[1] == 0 or float(w[b].sum()) == 0:
            continue
        top = names[int(w[b].argmax())]
        s, n = history[top]
        history[top] = (s + int(bool(t.reward and t.reward.success)), n + 1)


def _topk_items(b: StepBatch, p, cut, selected: bool) -> list[tuple[Trajectory, Any, Any, torch.Tensor]]:
    """Per trajectory that got a top-k: its most-weighted teacher's top-k (stored by the scoring pass) and
    the token weights (``p.coef`` on policy tokens, only where a cross-tokenizer teacher has a one-to-one
    chunk, up to the first error with ``cut``, on the ``short`` selection with ``selected``)."""
    topk_rows, w, kl = b.data.topk_rows, b.data.w, b.data.kl
    items = []
    for i, t in enumerate(b.trajs):
        ms = [m for m in range(len(topk_rows)) if w[i, m] > 0 and topk_rows[m].get(i) is not None]
        if not ms:
            continue
        sig = topk_rows[max(ms, key=lambda j: float(w[i, j]))][i]
        weight = torch.tensor(t.loss_mask, dtype=torch.float32) * p.coef
        if sig.topk_mask is not None:  # a cross-tokenizer teacher: only its one-to-one chunks have a top-k
            weight = weight * sig.topk_mask.float()
        if cut is not None:
            weight = weight * cut[i]
        if selected and kl[i] is not None:
            weight = weight * (kl[i] != 0).float()
        if float(weight.sum()) > 0:
            items.append((t, sig.topk_ids, sig.topk_logprobs, weight))
    return items


def _topk_update(learner, b: StepBatch, p, o, cut, selected: bool) -> dict[str, float]:
    """Top-k divergence (:func:`_topk_items`), ``o.epochs`` passes of ``o.updates_per_step``
    minibatches; the mean metrics."""
    items = _topk_items(b, p, cut, selected)
    ups = []
    for epoch in range(o.epochs):
        for idx in minibatches(list(range(len(items))), o.updates_per_step, seed=b.seeds(f"topk-{epoch}")):
            chosen = [items[i] for i in idx]
            ups.append(
                learner.distill_step(
                    [c[0] for c in chosen],
                    [c[1] for c in chosen],
                    [c[2] for c in chosen],
                    kind=p.divergence,
                    beta=p.beta,
                    token_weights=[c[3] for c in chosen],
                    tail=p.tail,
                )
            )
    return reduce_updates(ups, ("distill_loss", "divergence_max", "grad_norm"))


def _rlsd_snapshot_targets(model, tokenizer, trajs, sd_w, r) -> list[tuple[Trajectory, Any, Any, torch.Tensor]]:
    """RLSD's soft targets: the top-k of a frozen copy of the student as it was when the step's
    rollouts were made (called before any update of the step), at ``r.teacher_temperature``, on the
    verified trajectories, with their distillation weights."""
    snapshot = HFTeacher(copy.deepcopy(model), tokenizer, "self-snapshot", r.teacher_temperature)
    out = []
    for i in range(len(trajs)):
        if sd_w[i] > 0:
            sig = snapshot.score(trajs[i], top_k=r.top_k)
            out.append(
                (
                    trajs[i],
                    sig.topk_ids,
                    sig.topk_logprobs,
                    torch.full((len(trajs[i].token_ids),), float(sd_w[i]) * r.coef),
                )
            )
    return out


def teacher_rollout(ws, teacher, tasks, seed: int, batch_size: int | None = None) -> list[Trajectory]:
    """``teacher`` plays ``tasks`` itself under the run's rollout: the run's contract for a teacher
    that shares the student's tokenizer, the same settings rendered with its own tokenizer for a
    cross-tokenizer one."""
    rollout = ws.rollout
    if isinstance(teacher, CrossTokenizerTeacher):
        env = ws.make_env()
        try:
            contract = contract_for_env(teacher.tokenizer, env, ws.cfg.sampling, ws.cfg.limits, ws.cfg.prompt)
        finally:
            env.close()
        rollout = rollout.with_contract(contract)
    return rollout.run(teacher.model, tasks, seed=seed, batch_size=batch_size or max(len(tasks), 1))


def competence_tasks(ws, pool, per_family: int, seed: int, tries: int = 6) -> list:
    """``per_family`` train-split tasks of every family in ``pool`` (sorted by family), drawn from the
    run's task source with ``seed``; a family the source rarely draws gets fewer after ``tries`` ever
    larger draws."""
    families = sorted({t.family for t in pool})
    n = per_family * max(len(families), 1) * 2
    for _ in range(tries):
        drawn = ws.train_tasks(n, seed)
        by = {f: [t for t in drawn if t.family == f][:per_family] for f in families}
        if all(len(v) == per_family for v in by.values()):
            break
        n *= 4
    return [t for f in families for t in by[f]]


def teacher_successes(ws, teachers, tasks, seed: int) -> tuple[dict[str, dict[str, tuple[int, int]]], int]:
    """Per family, per teacher: (verified successes, attempts) of the teacher's own rollouts of
    ``tasks`` (one seed for every teacher), and the tokens the teachers generated."""
    counts: dict[str, dict[str, tuple[int, int]]] = {}
    generated = 0
    for teacher in teachers:
        trajs = teacher_rollout(ws, teacher, tasks, seed, ws.cfg.eval.batch_size)
        generated += sum(x.num_policy_tokens for x in trajs)
        for task, x in zip(tasks, trajs):
            s, n = counts.setdefault(task.family, {}).get(teacher.name, (0, 0))
            counts[task.family][teacher.name] = (s + int(bool(x.reward and x.reward.success)), n + 1)
    return counts, generated


def competence_table(counts: dict[str, dict[str, tuple[int, int]]], mode: str) -> dict[str, dict[str, dict]]:
    """``family -> teacher -> {successes, attempts, weight}``, the weights by :func:`competence_routes`."""
    routes = competence_routes(counts, mode)
    return {
        fam: {t: {"successes": s, "attempts": n, "weight": routes[fam][t]} for t, (s, n) in per.items()}
        for fam, per in counts.items()
    }


def competence_summary(table: dict[str, dict[str, dict]]) -> str:
    """One line: per family, each teacher's successes/attempts and weight."""
    return "; ".join(
        f"{fam}: " + ", ".join(f"{t} {r['successes']}/{r['attempts']} w={r['weight']:.2f}" for t, r in per.items())
        for fam, per in sorted(table.items())
    )


def _sequence_fallback(ws, learner, cross, tasks, seed: int, state) -> dict[str, float]:
    """Each cross-tokenizer teacher plays the step's tasks itself; its verified episodes, re-tokenised
    by the student, are one SFT update."""
    targets = []
    generated = 0
    for t in cross:
        own = teacher_rollout(ws, t, tasks, seed)
        generated += sum(x.num_policy_tokens for x in own)
        for x in own:
            if x.reward and x.reward.success:
                try:
                    targets.append(retokenize(x, t.tokenizer, ws.contract))
                except ValueError:
                    continue
    state["teacher_tokens"] += generated
    out = {"fallback_targets": float(len(targets)), "fallback_teacher_tokens": float(generated)}
    if targets:
        out["fallback_sft_loss"] = learner.sft_step(targets)["loss"]
    return out


def _write_samples(run_dir: Path, step: int, trajs, signals, names, w, kl) -> None:
    """samples/opd-step-N.jsonl (the trajectories) and opd/signals-step-N.jsonl (per trajectory: each
    teacher's weight and signal, and the distillation advantage), overwritten when a step is redone."""
    (run_dir / "samples").mkdir(exist_ok=True)
    (run_dir / "opd").mkdir(exist_ok=True)
    write_jsonl(run_dir / "samples" / f"opd-step-{step + 1:06d}.jsonl", trajs)
    rows = []
    for b, t in enumerate(trajs):
        teachers = {}
        for m, name in enumerate(names):
            s = signals[m][b]
            teachers[name] = {
                "weight": float(w[b, m]),
                "aligned": s is not None,
                "chunks": s.num_chunks if s is not None else 0,
                "teacher_chunk_logprob_mean": float(s.teacher_lp.mean()) if s is not None and s.num_chunks else None,
                "teacher_tokens": s.teacher_tokens if s is not None else 0,
            }
        k = kl[b]
        rows.append(
            {
                "trajectory_id": t.id,
                "task_id": t.task_id,
                "family": t.family,
                "reward": t.reward.total if t.reward else None,
                "success": bool(t.reward and t.reward.success),
                "teachers": teachers,
                "distill_advantage_mean": float(k[torch.tensor(t.loss_mask, dtype=torch.bool)].mean())
                if k is not None and t.num_policy_tokens
                else None,
                "distilled_tokens": int((k != 0).sum()) if k is not None else 0,
                "token_budget": t.sampling.get(EFFECTIVE_BUDGET_KEY, t.sampling.get("max_total_tokens")),
            }
        )
    with open(run_dir / "opd" / f"signals-step-{step + 1:06d}.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


__all__ = [
    "INPUT_BUILDERS",
    "LOSS_TERMS",
    "LossTerm",
    "OPDStage",
    "competence_summary",
    "competence_table",
    "competence_tasks",
    "needed_capabilities",
    "opd_stage",
    "teacher_rollout",
    "teacher_successes",
]
