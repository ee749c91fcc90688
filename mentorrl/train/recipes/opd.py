"""On-policy distillation stage (``recipe: [sft, opd]``): the student rolls out, white-box
teachers score what it actually did, and that signal trains it.

One step:

1. Roll out ``tasks_per_step x samples_per_task`` episodes with the student (ShortOPD: each
   task family under its own adaptive token budget).
2. Every teacher scores every trajectory in one forward pass: a same-tokenizer teacher per
   policy token, a cross-tokenizer teacher per shared-boundary chunk
   (:mod:`mentorrl.opd.signals`). A trajectory a teacher cannot align is counted and left to
   the other teachers (or to the reward terms).
3. MOPD weights the teachers per trajectory (routing, confidence, success history) and,
   optionally, per token (tool errors, low reward, an unsure student).
4. The per-token advantage is ``kl_coef * A_kl + reward_coef * A_env + reward-weighted and
   RLSD terms``; ShortOPD keeps ``A_kl`` only on the tokens with the largest gap. One clipped
   policy-gradient update per minibatch (``loss: topk`` instead minimises a top-k divergence
   to the teacher with :meth:`~mentorrl.train.learner.Learner.distill_step`).

The variants are not branches of one loop but three lists of terms the config selects
(:func:`token_term_names`, :func:`sequence_term_names`, :func:`loss_term_names`): token terms
and sequence terms are the pure functions of :mod:`mentorrl.algos.opd_terms`
(``until_first_error``, ``step_weights``, ``center``, ``short``; ``reward_weighted``,
``rlsd_selected``), loss terms are this module's :data:`LOSS_TERMS` (``pg``, ``topk``,
``rlsd_topk``, ``sequence_fallback``), run in that order.

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
from typing import Any

import torch

from mentorrl.algos.advantages import get_advantage_estimator
from mentorrl.algos.opd_terms import (
    TermInputs,
    apply_token_terms,
    center_term,
    sequence_advantage,
    short_term,
    token_advantages,
)
from mentorrl.contract import contract_for_env
from mentorrl.opd.advantage import GapBudget, kl_advantages, teacher_weights, tool_error_tokens, until_first_error
from mentorrl.opd.mopd import step_weights
from mentorrl.opd.retokenize import retokenize
from mentorrl.opd.rlsd import distill_weights, exploration_split
from mentorrl.opd.scoring import teacher_row
from mentorrl.opd.signals import CrossTokenizerTeacher
from mentorrl.opd.teacher import Capability, HFTeacher, require
from mentorrl.train.learner import Learner
from mentorrl.train.loop import (
    PG_METRICS,
    collect_group,
    group_rewards,
    minibatches,
    pg_update,
    pick_tasks,
    reduce_updates,
    rollout_metrics,
    train_pool,
)
from mentorrl.train.registry import register_stage
from mentorrl.train.stage_runner import run_stage
from mentorrl.train.teachers import build_teacher, load_teacher, serve_teachers, weights_fingerprint
from mentorrl.train.workspace import Workspace, heldout_check
from mentorrl.trajectory import Trajectory, write_jsonl


def needed_capabilities(cfg) -> list[Capability]:
    o = cfg.opd
    if o.loss == "topk":
        return [Capability.TOPK_LOGPROBS]
    return [Capability.TOKEN_LOGPROBS]


# --------------------------------------------------------------- terms -----
def token_term_names(o, has_teachers: bool) -> list[str]:
    """The config's token terms on the distillation advantage, in the order they apply
    (:data:`mentorrl.algos.opd_terms.TOKEN_TERMS`)."""
    names = []
    if o.distill_until == "first_error":
        names.append("until_first_error")
    if o.mopd.step_weights is not None and has_teachers:
        names.append("step_weights")
    if o.loss == "sampled" and o.center:
        names.append("center")
    if o.short is not None:
        names.append("short")
    return names


def sequence_term_names(o) -> list[str]:
    """The config's per-trajectory advantage terms (:data:`mentorrl.algos.opd_terms.SEQUENCE_TERMS`)."""
    names = []
    if o.reward_weighted is not None:
        names.append("reward_weighted")
    if o.rlsd is not None and o.rlsd.target == "selected":
        names.append("rlsd_selected")
    return names


def loss_term_names(o, has_teachers: bool, has_cross: bool) -> list[str]:
    """The config's updates, in the order they run (:data:`LOSS_TERMS`)."""
    names = []
    if o.loss == "sampled" or o.reward_coef > 0 or sequence_term_names(o):
        names.append("pg")
    if o.loss == "topk" and has_teachers:
        names.append("topk")
    if o.rlsd is not None and o.rlsd.target == "topk":
        names.append("rlsd_topk")
    if o.cross_tokenizer == "sequence" and has_cross:
        names.append("sequence_fallback")
    return names


@dataclass
class OPDStep:
    """One step's data as it moves through scoring, the advantage terms and the updates."""

    step: int
    chosen: list
    trajs: list[Trajectory]
    rewards: torch.Tensor
    signals: list = field(default_factory=list)
    topk_rows: list = field(default_factory=list)
    w: Any = None
    kl: list = field(default_factory=list)
    token_adv: list = field(default_factory=list)
    rlsd_targets: Any = None
    m: dict = field(default_factory=dict)


# --------------------------------------------------------------- stage -----
@register_stage("opd", config="opd", title="On-policy distillation", label="OPD", rl=True)
def opd_stage(ws: Workspace, model, resume: bool = False) -> Path:
    run = OPDRun(ws, model)
    (ws.run_dir / "opd").mkdir(parents=True, exist_ok=True)
    try:
        return run_stage(ws, "opd", model, run.learner, run.o.steps, run.step, run.o.checkpoint_every, resume,
                         extra_state=run.extra_state, restore_extra=run.restore)
    finally:
        for served in run.served:
            served.close()  # the teacher actors' CPUs go back to the cluster


class OPDRun:
    """The OPD stage's state and its step: rollouts, teacher scores, advantage terms, updates."""

    def __init__(self, ws: Workspace, model):
        cfg, o = ws.cfg, ws.cfg.opd
        self.ws, self.model, self.o = ws, model, o
        self.pool = train_pool(ws, o.tasks_per_step, o.steps)
        self.learner = Learner(model, o.optim, ws.contract.pad_token_id, ws.contract.sampling.temperature)
        self.estimator = get_advantage_estimator("grpo")
        hf = [t for t in o.teachers if t.kind == "hf"]
        self.teachers = [load_teacher(ws, t, model) for t in hf]
        # distributed.backend ray with teacher_workers: each teacher also served by that many actors
        self.served = serve_teachers(ws, hf, model) if hf else []
        for t in self.teachers:
            require(t, needed_capabilities(cfg), f"opd (loss {o.loss})")
        self.cross = [t for t in self.teachers if isinstance(t, CrossTokenizerTeacher)]
        if self.cross and o.cross_tokenizer == "sequence":
            for t in self.cross:
                require(t, [Capability.SAMPLING], "opd (cross_tokenizer sequence)")
        self.names = [t.name for t in self.teachers]
        self.shared = [isinstance(t, HFTeacher) for t in self.teachers]
        self.state: dict[str, Any] = {"policy": 0, "rollout_tokens": 0, "teacher_tokens": 0,
                                      "history": {n: (0, 0) for n in self.names}}
        self.budget = None
        if o.short is not None:
            self.budget = GapBudget(o.short.min_budget, o.short.max_budget or cfg.limits.max_total_tokens,
                                    o.short.full_gap, o.short.ema)
        self.token_terms = token_term_names(o, bool(self.teachers))
        self.sequence_terms = sequence_term_names(o)
        self.loss_terms = loss_term_names(o, bool(self.teachers), bool(self.cross))

    def step(self, step: int) -> dict[str, float]:
        cfg, o, state = self.ws.cfg, self.o, self.state
        _, chosen = pick_tasks(self.pool, o.tasks_per_step, cfg.seed * 1_000_003 + 17 * step + 11)
        budgets = [self.budget.budget(t.family) for t in chosen for _ in range(o.samples_per_task)] \
            if self.budget is not None else None
        grp = collect_group(self.ws, self.model, chosen, o.samples_per_task, state["policy"], cfg.seed * 6_151 + step,
                            f"OPD step {step + 1}", token_budgets=budgets)
        state["rollout_tokens"] += grp.policy_tokens
        rewards, clipped, stats = group_rewards(grp.raw_rewards(), cfg.audit)
        s = OPDStep(step, chosen, grp.trajs, rewards)
        s.m.update(stats)
        s.m.update(rollout_metrics(s.trajs), rollouts=float(len(s.trajs)), rollout_s=grp.rollout_s)
        self._score(s)
        self._shape(s, budgets)
        self._advantages(s)
        t2 = time.perf_counter()
        self._update(s)
        s.m.update(update_s=time.perf_counter() - t2, policy_version=float(state["policy"]),
                   rollout_tokens_total=float(state["rollout_tokens"]),
                   teacher_tokens_total=float(state["teacher_tokens"]), reward_clipped=clipped["clipped"])
        if o.eval_every and (step + 1) % o.eval_every == 0:
            s.m["heldout_success"] = heldout_check(self.ws, self.model, o.eval_tasks)
        if o.sample_trajectories:
            _write_samples(self.ws.run_dir, step, s.trajs[: o.sample_trajectories], s.signals, self.names, s.w, s.kl)
        return s.m

    def _score(self, s: OPDStep) -> None:
        """Every teacher scores every trajectory in one forward pass; MOPD weights the teachers and
        the weighted signals become the distillation advantage ``s.kl``."""
        o, trajs = self.o, s.trajs
        t1 = time.perf_counter()
        s.topk_rows = [{} for _ in self.teachers]  # loss topk: the same pass's top-k
        failures = 0
        top_k = o.top_k if o.loss == "topk" else None
        for k, teacher in enumerate(self.teachers):
            served = self.served[k] if self.served else None
            row = served.row(trajs, top_k, o.cross_tokenizer == "sequence") if served is not None else \
                teacher_row(teacher, trajs, top_k, o.cross_tokenizer == "sequence")
            for b, (_, scored, failed) in enumerate(row):
                failures += failed
                if scored is not None:
                    s.topk_rows[k][b] = scored
            s.signals.append([sig for sig, _, _ in row])
        teacher_tokens = sum(x.teacher_tokens for row in s.signals for x in row if x is not None)
        self.state["teacher_tokens"] += teacher_tokens
        s.w = teacher_weights([t.family for t in trajs], self.names, s.signals, o.mopd.routes,
                              o.mopd.confidence_temperature, self.state["history"] if o.mopd.success_history else None) \
            if self.teachers else torch.zeros(len(trajs), 0)
        s.kl = kl_advantages(trajs, s.signals, s.w, self.shared) if self.teachers else [None] * len(trajs)
        s.m.update(teacher_s=time.perf_counter() - t1, teacher_tokens=float(teacher_tokens),
                   alignment_failures=float(failures))
        partial = [(int(sig.topk_mask.sum()), trajs[b].num_policy_tokens) for row in s.topk_rows
                   for b, sig in row.items() if sig is not None and sig.topk_mask is not None]
        if partial:  # cross-tokenizer top-k: the share of policy tokens with a target
            s.m["topk_coverage"] = sum(c for c, _ in partial) / max(sum(n for _, n in partial), 1)

    def _shape(self, s: OPDStep, budgets) -> None:
        """The token terms on ``s.kl`` (MOPD failure-aware weights, centring, ShortOPD selection)."""
        o, trajs, kl = self.o, s.trajs, s.kl
        s.m["opd_reverse_kl"] = -sum(float(k.sum()) for k in kl if k is not None) / max(
            sum(t.num_policy_tokens for t in trajs), 1)
        x = TermInputs(_masks(trajs))
        if "until_first_error" in self.token_terms:
            x.first_error = [until_first_error(t) for t in trajs]
        kl, _ = apply_token_terms([n for n in self.token_terms if n == "until_first_error"], kl, x)
        gaps = x.gaps = [k.abs() if k is not None else None for k in kl]
        if "step_weights" in self.token_terms:
            x.step_weights = _step_weight_tensors(self.learner, trajs, kl, s.rewards.view(-1), o.mopd.step_weights)
        if o.short is not None:
            x.short_threshold, x.short_top_frac = o.short.threshold, o.short.top_frac
        s.kl, tm = apply_token_terms([n for n in self.token_terms if n != "until_first_error"], kl, x)
        s.m.update(tm)
        if o.short is not None:
            families = [t.family for t in trajs]
            for fam in set(families):
                idx = [i for i, f in enumerate(families) if f == fam and gaps[i] is not None]
                if idx:
                    self.budget.observe(fam, sum(float(gaps[i].sum()) for i in idx)
                                        / max(sum(trajs[i].num_policy_tokens for i in idx), 1))
            s.m["budget_mean"] = sum(budgets) / len(budgets)
            s.m["teacher_tokens_per_trajectory"] = s.m["teacher_tokens"] / max(len(self.teachers) * len(trajs), 1)
        if o.mopd.success_history and self.teachers:
            _update_history(self.state["history"], self.names, s.w, trajs)

    def _advantages(self, s: OPDStep) -> None:
        """The per-token advantages: the sequence terms, the environment and the distillation advantage."""
        o, trajs = self.o, s.trajs
        env_adv = self.estimator(s.rewards, normalize_std=True).reshape(-1)
        x = TermInputs(_masks(trajs), rewards=s.rewards)
        if o.reward_weighted is not None:
            x.reward_weighted_coef, x.reward_weighted_temperature = o.reward_weighted.coef, o.reward_weighted.temperature
        if o.rlsd is not None:
            x.rlsd_weights = _rlsd_weights(trajs, s.rewards.view(-1), o.rlsd, seed=self.ws.cfg.seed * 31 + s.step)
            x.rlsd_coef = o.rlsd.coef
            s.m["rlsd_distilled"] = float((x.rlsd_weights > 0).sum())
            if o.rlsd.target == "topk" and bool((x.rlsd_weights > 0).any()):
                # the start-of-step snapshot's targets, stored before any update
                s.rlsd_targets = _rlsd_snapshot_targets(self.model, self.ws.tokenizer, trajs, x.rlsd_weights, o.rlsd)
        extra = sequence_advantage(self.sequence_terms, x, len(trajs))
        s.token_adv = token_advantages(x.masks, env_adv, o.reward_coef, extra, s.kl if o.loss == "sampled" else None,
                                       o.kl_coef)

    def _update(self, s: OPDStep) -> None:
        """The selected loss terms, in order; their metrics into ``s.m``."""
        u = Updates()
        for name in self.loss_terms:
            LOSS_TERMS[name](self, s, u)
        s.m.update(reduce_updates(u.pg, PG_METRICS))
        s.m.update({k: v for k, v in u.distill.items() if k in ("distill_loss", "divergence_max")})
        if u.distill and not u.pg:
            s.m["grad_norm"] = u.distill.get("grad_norm", 0.0)
        s.m.update(u.other)

    def extra_state(self) -> dict[str, Any]:
        st = self.state
        return {**{k: v for k, v in st.items() if k != "history"}, "history": {k: list(v) for k, v in st["history"].items()},
                "budget": self.budget.state_dict() if self.budget else None}

    def restore(self, st: dict[str, Any]) -> None:
        for k in ("policy", "rollout_tokens", "teacher_tokens"):
            self.state[k] = st.get(k, 0)
        self.state["history"].update({k: tuple(v) for k, v in st.get("history", {}).items()})
        if self.budget is not None and st.get("budget"):
            self.budget.load_state_dict(st["budget"])


@dataclass
class Updates:
    """What a step's loss terms did: the policy-gradient updates' metrics, the last distillation
    update's metrics (a later distillation term replaces an earlier one's), and any other metrics."""

    pg: list = field(default_factory=list)
    distill: dict = field(default_factory=dict)
    other: dict = field(default_factory=dict)


def _pg_loss(run: OPDRun, s: OPDStep, u: Updates) -> None:
    """The clipped policy gradient on the token advantages, ``epochs`` passes (loss sampled; else one)."""
    o = run.o
    for e in range(o.epochs if o.loss == "sampled" else 1):
        u.pg += pg_update(run.learner, s.trajs, s.token_adv, o.updates_per_step, s.step * 7 + 3 + 101 * e, run.state,
                          skip_zero=True, eps_low=o.eps_low, eps_high=o.eps_high, agg=o.loss_agg,
                          sync=run.ws.rollout.sync)


def _topk_loss(run: OPDRun, s: OPDStep, u: Updates) -> None:
    """A top-k divergence to each trajectory's most-weighted teacher (``loss: topk``)."""
    u.distill, n_up = _topk_update(run.learner, s.topk_rows, s.trajs, s.w, s.kl, run.o, seed=s.step)
    run.state["policy"] += n_up


def _rlsd_topk_loss(run: OPDRun, s: OPDStep, u: Updates) -> None:
    """RLSD's forward KL to the start-of-step snapshot's top-k on the verified trajectories."""
    if s.rlsd_targets is not None:
        u.distill = _rlsd_topk_update(run.learner, s.rlsd_targets, run.o.topk_tail)
        run.state["policy"] += 1


def _sequence_fallback_loss(run: OPDRun, s: OPDStep, u: Updates) -> None:
    """The cross-tokenizer teachers' own verified episodes as one SFT update."""
    u.other.update(_sequence_fallback(run.ws, run.learner, run.cross, s.chosen, s.step, run.state))


LOSS_TERMS = {"pg": _pg_loss, "topk": _topk_loss, "rlsd_topk": _rlsd_topk_loss, "sequence_fallback": _sequence_fallback_loss}


# ------------------------------------------------------------- helpers -----
@torch.no_grad()
def _student_entropy(learner: Learner, trajs: list[Trajectory]) -> list[torch.Tensor]:
    from mentorrl.models.batch import collate, forward_logprobs

    out = []
    mbs = learner.cfg.micro_batch_size
    device = next(learner.model.parameters()).device
    for lo in range(0, len(trajs), mbs):
        chunk = trajs[lo: lo + mbs]
        _, ent = forward_logprobs(learner.model, collate(chunk, learner.pad_id).to(device), learner.temperature,
                                  with_entropy=True)
        out += [ent[b, : len(t.token_ids)].cpu() for b, t in enumerate(chunk)]
    return out


def _step_weight_tensors(learner, trajs, kl, rewards, sw) -> list[torch.Tensor | None]:
    """MOPD's failure-aware token weights of every trajectory that has a distillation advantage."""
    ent = _student_entropy(learner, trajs)
    out: list[torch.Tensor | None] = []
    for i, t in enumerate(trajs):
        if kl[i] is None:
            out.append(None)
            continue
        out.append(step_weights(torch.tensor(t.loss_mask)[None], tool_error_tokens(t)[None],
                                torch.tensor([float(rewards[i]) < sw.low_reward]), ent[i][None],
                                sw.tool_error_boost, sw.low_reward_boost, sw.entropy_threshold, sw.entropy_boost)[0])
    return out


def _masks(trajs) -> list[torch.Tensor]:
    return [torch.tensor(t.loss_mask, dtype=torch.float32) for t in trajs]


def _center(trajs, kl) -> list[torch.Tensor | None]:
    """The ``center`` term (:func:`mentorrl.algos.opd_terms.center_term`)."""
    return center_term(kl)[0]


def _short_select(trajs, kl, gaps, short) -> tuple[list[torch.Tensor | None], float]:
    """The ``short`` term (:func:`mentorrl.algos.opd_terms.short_term`): the kept advantages and the share kept."""
    x = TermInputs(_masks(trajs), gaps=gaps, short_threshold=short.threshold, short_top_frac=short.top_frac)
    out, m = short_term(kl, x)
    return out, m["distilled_token_share"]


def _update_history(history, names, w, trajs) -> None:
    for b, t in enumerate(trajs):
        if w.shape[1] == 0 or float(w[b].sum()) == 0:
            continue
        top = names[int(w[b].argmax())]
        s, n = history[top]
        history[top] = (s + int(bool(t.reward and t.reward.success)), n + 1)


def _rlsd_weights(trajs, rewards, r, seed: int) -> torch.Tensor:
    passed = torch.tensor([bool(t.reward and t.reward.success) for t in trajs])
    explore = torch.tensor(exploration_split(len(trajs), r.exploration_share, seed))
    lengths = torch.tensor([float(t.num_policy_tokens) for t in trajs])
    return distill_weights(rewards, lengths, passed & ~explore, r.reward_temperature, r.length_power)


def _topk_update(learner, topk_rows, trajs, w, kl, o, seed: int) -> tuple[dict[str, float], int]:
    """Top-k divergence to the most-weighted teacher of each trajectory that gave a top-k: the top-k its
    scoring pass stored (``topk_rows[m][b]``), then ``epochs`` passes of ``updates_per_step`` minibatches. Returns the mean
    metrics and the number of optimizer steps."""
    items = []
    for b, t in enumerate(trajs):
        ms = [m for m in range(len(topk_rows)) if w[b, m] > 0 and topk_rows[m].get(b) is not None]
        if not ms:
            continue
        m = max(ms, key=lambda j: float(w[b, j]))
        sig = topk_rows[m][b]
        weight = torch.tensor(t.loss_mask, dtype=torch.float32) * o.kl_coef
        if sig.topk_mask is not None:  # a cross-tokenizer teacher: only its one-to-one chunks have a top-k
            weight = weight * sig.topk_mask.float()
        if o.distill_until == "first_error":
            weight = weight * until_first_error(t)
        if o.short is not None and kl[b] is not None:
            weight = weight * (kl[b] != 0).float()
        if float(weight.sum()) > 0:
            items.append((t, sig.topk_ids, sig.topk_logprobs, weight))
    ups = []
    for epoch in range(o.epochs):
        for idx in minibatches(list(range(len(items))), o.updates_per_step, seed=seed * 31 + epoch):
            chosen = [items[i] for i in idx]
            ups.append(learner.distill_step([c[0] for c in chosen], [c[1] for c in chosen], [c[2] for c in chosen],
                                            kind=o.divergence, beta=o.beta, token_weights=[c[3] for c in chosen],
                                            tail=o.topk_tail))
    return reduce_updates(ups, ("distill_loss", "divergence_max", "grad_norm")), len(ups)


def _rlsd_snapshot_targets(model, tokenizer, trajs, sd_w, r) -> list[tuple[Trajectory, Any, Any, torch.Tensor]]:
    """RLSD's soft targets: the top-k of a frozen copy of the student as it was when the step's
    rollouts were made (called before any update of the step), at ``r.teacher_temperature``, on the
    verified trajectories, with their distillation weights."""
    snapshot = HFTeacher(copy.deepcopy(model), tokenizer, "self-snapshot", r.teacher_temperature)
    out = []
    for i in range(len(trajs)):
        if sd_w[i] > 0:
            sig = snapshot.score(trajs[i], top_k=r.top_k)
            out.append((trajs[i], sig.topk_ids, sig.topk_logprobs,
                        torch.full((len(trajs[i].token_ids),), float(sd_w[i]) * r.coef)))
    return out


def _rlsd_topk_update(learner, targets, tail: bool) -> dict[str, float]:
    """L_SD: forward KL from the stored snapshot targets, one update."""
    return learner.distill_step([x[0] for x in targets], [x[1] for x in targets], [x[2] for x in targets],
                                kind="forward", token_weights=[x[3] for x in targets], tail=tail)


def _sequence_fallback(ws, learner, cross, tasks, step, state) -> dict[str, float]:
    """Each cross-tokenizer teacher plays the step's tasks itself; its verified episodes, re-tokenised
    by the student, are one SFT update."""
    targets = []
    generated = 0
    for t in cross:
        env = ws.make_env()
        try:
            contract = contract_for_env(t.tokenizer, env, ws.cfg.sampling, ws.cfg.limits, ws.cfg.prompt)
        finally:
            env.close()
        own = ws.rollout.with_contract(contract).run(t.model, tasks, seed=ws.cfg.seed * 4_409 + step,
                                                     batch_size=len(tasks))
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
        state["policy"] += 1
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
            teachers[name] = {"weight": float(w[b, m]), "aligned": s is not None,
                              "chunks": s.num_chunks if s is not None else 0,
                              "teacher_chunk_logprob_mean": float(s.teacher_lp.mean()) if s is not None and s.num_chunks else None,
                              "teacher_tokens": s.teacher_tokens if s is not None else 0}
        k = kl[b]
        rows.append({"trajectory_id": t.id, "task_id": t.task_id, "family": t.family,
                     "reward": t.reward.total if t.reward else None, "success": bool(t.reward and t.reward.success),
                     "teachers": teachers,
                     "distill_advantage_mean": float(k[torch.tensor(t.loss_mask, dtype=torch.bool)].mean()) if k is not None and t.num_policy_tokens else None,
                     "distilled_tokens": int((k != 0).sum()) if k is not None else 0,
                     "token_budget": t.sampling.get("max_total_tokens")})
    with open(run_dir / "opd" / f"signals-step-{step + 1:06d}.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


__all__ = ["LOSS_TERMS", "build_teacher", "heldout_check", "load_teacher", "loss_term_names", "opd_stage",
           "sequence_term_names", "token_term_names", "weights_fingerprint"]
