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

Every step logs the student rollout tokens so far (the budget OPD is compared on), the
teacher tokens read, the reverse-KL estimate, alignment failures and the distilled share;
``opd/signals-step-N.jsonl`` keeps, for the sampled trajectories, each teacher's signal and
weight so a routing decision can be audited.
"""

from __future__ import annotations

import copy
import json
import random
import time
from pathlib import Path
from typing import Any

import torch

from mentorrl.algos.advantages import get_advantage_estimator, group_reward_stats, sanitize_group_rewards
from mentorrl.algos.distill import select_large_gap
from mentorrl.config import OptimConfig, TeacherConfig
from mentorrl.contract import contract_for_env
from mentorrl.models.build import load_policy
from mentorrl.opd.advantage import (
    GapBudget,
    group_reward_weights,
    kl_advantages,
    teacher_weights,
    tool_error_tokens,
    until_first_error,
)
from mentorrl.opd.align import AlignmentError
from mentorrl.opd.mopd import step_weights
from mentorrl.opd.rlsd import distill_weights, exploration_split
from mentorrl.opd.retokenize import retokenize
from mentorrl.opd.signals import ChunkSignal, CrossTokenizerTeacher, same_tokenizer_signal
from mentorrl.opd.teacher import Capability, HFTeacher, TeacherSignal, require, tokenizer_fingerprint
from mentorrl.rollout.runner import rollout_tasks
from mentorrl.train.consistency import policy_lag
from mentorrl.train.learner import Learner
from mentorrl.train.stages import (
    TRAIN_POOL_SEED_OFFSET,
    Workspace,
    _minibatches,
    _reduce_updates,
    _require_consistent,
    heldout_check,
    rollout_metrics,
    run_stage,
)
from mentorrl.trajectory import Trajectory, write_jsonl



# ------------------------------------------------------------ teachers -----
TEACHER_RECIPE_FIELDS = ("seed", "train_split", "env", "sampling", "limits", "prompt", "reward", "model", "sft")


def teacher_build_config(cfg, t: TeacherConfig):
    """The run config that builds teacher ``t``: this run's environment, contract and seed, the
    teacher's own model size (and tokenizer when ``build.vocab_size`` is set), and a longer SFT
    on more expert demonstrations than the student's -- the demo's ``sft`` stage with other numbers."""
    from mentorrl.config import SFTConfig

    b = t.build
    spec = (b.spec or cfg.model.spec).model_copy(update={"vocab_size": b.vocab_size or cfg.model.spec.vocab_size})
    sft = SFTConfig(num_demos=b.num_demos, steps=b.sft_steps, batch_size=b.batch_size,
                    optim=OptimConfig(lr=b.lr, warmup_steps=5))
    keep = {k: getattr(cfg, k) for k in ("seed", "train_split", "threads", "env", "sampling", "limits", "prompt",
                                         "reward")}
    return type(cfg)(recipe=["sft"], model=cfg.model.model_copy(update={"path": None, "spec": spec}), sft=sft,
                     **keep)


def weights_fingerprint(model) -> str:
    """A hash of a model's weights (names, shapes, dtypes and values): the cache key of a teacher
    built from it."""
    import hashlib

    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        t = p.detach().cpu().contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())  # reshape: 0-dim tensors (a logit scale) too
    return h.hexdigest()


def teacher_dir(cfg, t: TeacherConfig, student_weights: str | None = None) -> Path:
    """Where teacher ``t`` is built: one directory per build recipe under ``opd.teachers_dir`` (shared by
    every run that asks for the same teacher), or under the run directory when that is null. A teacher
    built from the student (``build.init: student``) is keyed by the student's weights as well."""
    import hashlib

    sub = teacher_build_config(cfg, t).model_dump(mode="json", include=set(TEACHER_RECIPE_FIELDS))
    if t.build.init == "student":
        if student_weights is None:
            raise ValueError(f"teacher {t.name!r} is built from the student (build.init student): its directory "
                             "depends on the student's weights")
        sub = {**sub, "init": "student", "student_weights": student_weights}
    key = hashlib.sha256(json.dumps(sub, sort_keys=True).encode()).hexdigest()[:10]
    root = Path(cfg.opd.teachers_dir) if cfg.opd.teachers_dir else Path(cfg.run_dir) / "teachers"
    return root / f"{t.name}-{key}"


def build_teacher(ws: Workspace, t: TeacherConfig, student=None) -> Path:
    """The stronger local teacher, built once (resumable: the SFT stage checkpoints like any other).

    ``build.init: scratch`` trains a fresh tiny model; ``student`` trains on from a copy of
    ``student`` (the policy as it enters the stage), so the teacher is the student trained longer."""
    from mentorrl.train.pipeline import build_tiny_model
    from mentorrl.train.stages import open_workspace, sft_stage

    from_student = t.build.init == "student"
    if from_student and student is None:
        raise ValueError(f"teacher {t.name!r} has build.init student but no student model was given")
    out = teacher_dir(ws.cfg, t, weights_fingerprint(student) if from_student else None)
    final = out / "sft" / "final"
    if (final / "DONE").exists():  # built before (same recipe); load_teacher still checks the tokenizer
        return final
    if not from_student and ws.cfg.model.path is not None and t.build.vocab_size is None:
        raise ValueError(f"teacher {t.name!r}: the student is a checkpoint ({ws.cfg.model.path}) and no teacher of "
                         f"this build recipe is cached at {out}; give the teacher a path, a build.vocab_size for "
                         "a tiny teacher with its own tokenizer, or build.init student")
    sub = teacher_build_config(ws.cfg, t).model_copy(update={"run_dir": str(out)})
    origin = "the student's weights" if from_student else f"a fresh model (vocab {sub.model.spec.vocab_size})"
    ws.console.print(f"building teacher {t.name!r} into {out}: {sub.sft.steps} SFT steps on {sub.sft.num_demos} "
                     f"demonstrations from {origin}")
    tws = open_workspace(sub, show_progress=ws.show_progress)
    tws.console = ws.console
    if from_student:
        tok, model = ws.tokenizer, copy.deepcopy(student)
    else:
        base = build_tiny_model(tws.env_entry, out / "base_model", sub.model.spec, sub.model.tokenizer_corpus_tasks,
                                sub.seed, sub.prompt)
        tok, model = load_policy(base)
    tws.bind_tokenizer(tok)
    return sft_stage(tws, model, resume=True)


def load_teacher(ws: Workspace, t: TeacherConfig, student=None):
    """An :class:`HFTeacher` when the checkpoint shares the student's tokenizer, else a
    :class:`CrossTokenizerTeacher` (``student``: the policy a ``build.init: student`` teacher starts from)."""
    path = Path(t.path) if t.path else build_teacher(ws, t, student)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"teacher {t.name!r}: {path} is not a Hugging Face checkpoint directory")
    tok, model = load_policy(path)
    if tokenizer_fingerprint(tok) == tokenizer_fingerprint(ws.tokenizer):
        return HFTeacher(model, tok, t.name, t.temperature)
    return CrossTokenizerTeacher(model, tok, ws.tokenizer, t.name, t.temperature, t.special_tokens)


def _signal(teacher, traj: Trajectory, top_k: int | None) -> tuple[ChunkSignal, TeacherSignal | None]:
    """The teacher's one forward pass over ``traj``: its chunk signal, and its top-k when asked for."""
    if isinstance(teacher, HFTeacher):
        scored = teacher.score(traj, top_k=top_k)
        return same_tokenizer_signal(teacher, traj, scored), (scored if top_k is not None else None)
    if top_k is None:
        return teacher.score(traj), None
    return teacher.score(traj, top_k=top_k)  # top-k on the chunks that are one token on both sides


def needed_capabilities(cfg) -> list[Capability]:
    o = cfg.opd
    if o.loss == "topk":
        return [Capability.TOPK_LOGPROBS]
    return [Capability.TOKEN_LOGPROBS]


# --------------------------------------------------------------- stage -----
def opd_stage(ws: Workspace, model, resume: bool = False) -> Path:
    cfg, o, audit = ws.cfg, ws.cfg.opd, ws.cfg.audit
    pool = ws.train_tasks(max(o.tasks_per_step * max(o.steps, 1), 64), cfg.seed + TRAIN_POOL_SEED_OFFSET)
    learner = Learner(model, o.optim, ws.contract.pad_token_id, ws.contract.sampling.temperature)
    estimator = get_advantage_estimator("grpo")
    teachers = [load_teacher(ws, t, model) for t in o.teachers if t.kind == "hf"]
    for t in teachers:
        require(t, needed_capabilities(cfg), f"opd (loss {o.loss})")
    cross = [t for t in teachers if isinstance(t, CrossTokenizerTeacher)]
    if cross and o.cross_tokenizer == "sequence":
        for t in cross:
            require(t, [Capability.SAMPLING], "opd (cross_tokenizer sequence)")
    names = [t.name for t in teachers]
    shared = [isinstance(t, HFTeacher) for t in teachers]
    state: dict[str, Any] = {"policy": 0, "rollout_tokens": 0, "teacher_tokens": 0,
                             "history": {n: (0, 0) for n in names}}
    budget = None
    if o.short is not None:
        budget = GapBudget(o.short.min_budget, o.short.max_budget or cfg.limits.max_total_tokens, o.short.full_gap,
                           o.short.ema)
    stage_dir = ws.run_dir / "opd"

    def step_fn(step: int) -> dict[str, float]:
        rng = random.Random(cfg.seed * 1_000_003 + 17 * step + 11)
        chosen = rng.sample(pool, min(o.tasks_per_step, len(pool)))
        grouped = [t for t in chosen for _ in range(o.samples_per_task)]
        budgets = [budget.budget(t.family) for t in grouped] if budget is not None else None
        t0 = time.perf_counter()
        trajs = rollout_tasks(model, ws.contract, ws.make_env, grouped, policy_version=state["policy"],
                              seed=cfg.seed * 6_151 + step, batch_size=len(grouped), weights=cfg.reward,
                              token_budgets=budgets)
        t_roll = time.perf_counter() - t0
        _require_consistent(ws, trajs, state["policy"], f"OPD step {step + 1}")
        state["rollout_tokens"] += sum(t.num_policy_tokens for t in trajs)
        raw = torch.tensor([t.reward.total for t in trajs], dtype=torch.float32).view(len(chosen), o.samples_per_task)
        rewards, clipped = sanitize_group_rewards(raw, audit.reward_low, audit.reward_high, audit.outlier_z)
        m: dict[str, float] = {f"reward_{k}": v for k, v in group_reward_stats(rewards).items()}
        m.update(rollout_metrics(trajs), rollouts=float(len(trajs)), rollout_s=t_roll)

        # ---- teacher signals (one forward per trajectory and teacher) ----
        t1 = time.perf_counter()
        signals: list[list[ChunkSignal | None]] = []
        topk_rows: list[dict[int, TeacherSignal | None]] = [{} for _ in teachers]  # loss topk: the same pass's top-k
        failures = 0
        seq_mode = o.cross_tokenizer == "sequence"
        for teacher in teachers:
            row: list[ChunkSignal | None] = []
            for traj in trajs:
                if seq_mode and isinstance(teacher, CrossTokenizerTeacher):
                    row.append(None)
                    continue
                try:
                    sig, scored = _signal(teacher, traj, o.top_k if o.loss == "topk" else None)
                    row.append(sig)
                    topk_rows[len(signals)][len(row) - 1] = scored
                except AlignmentError:
                    failures += 1
                    row.append(None)
            signals.append(row)
        teacher_tokens = sum(s.teacher_tokens for row in signals for s in row if s is not None)
        state["teacher_tokens"] += teacher_tokens
        families = [t.family for t in trajs]
        w = teacher_weights(families, names, signals, o.mopd.routes, o.mopd.confidence_temperature,
                            state["history"] if o.mopd.success_history else None) if teachers else torch.zeros(len(trajs), 0)
        kl = kl_advantages(trajs, signals, w, shared) if teachers else [None] * len(trajs)
        m.update(teacher_s=time.perf_counter() - t1, teacher_tokens=float(teacher_tokens),
                 alignment_failures=float(failures))
        partial = [(int(sig.topk_mask.sum()), trajs[b].num_policy_tokens) for row in topk_rows
                   for b, sig in row.items() if sig is not None and sig.topk_mask is not None]
        if partial:  # cross-tokenizer top-k: the share of policy tokens with a target
            m["topk_coverage"] = sum(c for c, _ in partial) / max(sum(n for _, n in partial), 1)

        # ---- token weights: MOPD failure-aware steps, ShortOPD selection ----
        policy_tokens = sum(t.num_policy_tokens for t in trajs)
        m["opd_reverse_kl"] = -sum(float(k.sum()) for k in kl if k is not None) / max(policy_tokens, 1)
        if o.distill_until == "first_error":
            kl = [k * until_first_error(t) if k is not None else None for k, t in zip(kl, trajs)]
        gaps = [k.abs() if k is not None else None for k in kl]
        if o.mopd.step_weights is not None and teachers:
            kl = _apply_step_weights(learner, trajs, kl, rewards.view(-1), o.mopd.step_weights)
        if o.loss == "sampled" and o.center:
            kl = _center(trajs, kl)
        if o.short is not None:
            kl, share = _short_select(trajs, kl, gaps, o.short)
            m["distilled_token_share"] = share
            for fam in set(families):
                idx = [i for i, f in enumerate(families) if f == fam and gaps[i] is not None]
                if idx:
                    budget.observe(fam, sum(float(gaps[i].sum()) for i in idx) / max(sum(trajs[i].num_policy_tokens for i in idx), 1))
            m["budget_mean"] = sum(budgets) / len(budgets)
            m["teacher_tokens_per_trajectory"] = teacher_tokens / max(len(teachers) * len(trajs), 1)
        if o.mopd.success_history and teachers:
            _update_history(state["history"], names, w, trajs)

        # ---- per-token advantages ----
        env_adv = estimator(rewards, normalize_std=True).reshape(-1)
        extra = torch.zeros(len(trajs))
        if o.reward_weighted is not None:
            extra += o.reward_weighted.coef * group_reward_weights(rewards, o.reward_weighted.temperature).reshape(-1)
        sd_w, rlsd_targets = None, None
        if o.rlsd is not None:
            sd_w = _rlsd_weights(trajs, rewards.view(-1), o.rlsd, seed=cfg.seed * 31 + step)
            m["rlsd_distilled"] = float((sd_w > 0).sum())
            if o.rlsd.target == "selected":
                extra += o.rlsd.coef * sd_w.float()
            elif bool((sd_w > 0).any()):  # the start-of-step snapshot's targets, stored before any update
                rlsd_targets = _rlsd_snapshot_targets(model, ws.tokenizer, trajs, sd_w, o.rlsd)
        rl_coef = o.reward_coef
        token_adv = []
        for i, t in enumerate(trajs):
            mask = torch.tensor(t.loss_mask, dtype=torch.float32)
            a = (rl_coef * float(env_adv[i]) + float(extra[i])) * mask
            if kl[i] is not None and o.loss == "sampled":
                a = a + o.kl_coef * kl[i]
            token_adv.append(a)

        # ---- updates ----
        t2 = time.perf_counter()
        ups: list[dict[str, float]] = []
        every = list(range(len(trajs)))
        if o.loss == "sampled" or rl_coef > 0 or o.reward_weighted is not None or (o.rlsd and o.rlsd.target == "selected"):
            passes = o.epochs if o.loss == "sampled" else 1
            for idx in [b for e in range(passes) for b in _minibatches(every, o.updates_per_step, seed=step * 7 + 3 + 101 * e)]:
                if not any(token_adv[i].abs().sum() > 0 for i in idx):
                    continue
                batch = [trajs[i] for i in idx]
                ups.append({**learner.token_policy_step(batch, [token_adv[i] for i in idx], "clipped",
                                                        eps_low=o.eps_low, eps_high=o.eps_high, agg=o.loss_agg),
                            **policy_lag(batch, state["policy"])})
                state["policy"] += 1
        dm: dict[str, float] = {}
        if o.loss == "topk" and teachers:
            dm, n_up = _topk_update(learner, topk_rows, trajs, w, kl, o, seed=step)
            state["policy"] += n_up
        if rlsd_targets is not None:
            dm = _rlsd_topk_update(learner, rlsd_targets, o.topk_tail)
            state["policy"] += 1
        m.update(_reduce_updates(ups, ("pg_loss", "clip_frac", "entropy", "grad_norm", "approx_kl", "logprob_abs_gap",
                                       "train_rollout_kl", "policy_lag_mean", "policy_lag_max")))
        m.update({k: v for k, v in dm.items() if k in ("distill_loss", "divergence_max")})
        if dm and not ups:
            m["grad_norm"] = dm.get("grad_norm", 0.0)

        # ---- the sequence-level fallback: the cross-tokenizer teachers' own verified episodes ----
        if seq_mode and cross:
            m.update(_sequence_fallback(ws, learner, cross, chosen, step, state))

        m.update(update_s=time.perf_counter() - t2, policy_version=float(state["policy"]),
                 rollout_tokens_total=float(state["rollout_tokens"]),
                 teacher_tokens_total=float(state["teacher_tokens"]), reward_clipped=clipped["clipped"])
        if o.eval_every and (step + 1) % o.eval_every == 0:
            m["heldout_success"] = heldout_check(ws, model, o.eval_tasks)
        if o.sample_trajectories:
            _write_samples(ws.run_dir, step, trajs[: o.sample_trajectories], signals, names, w, kl)
        return m

    def extra_state() -> dict[str, Any]:
        return {**{k: v for k, v in state.items() if k != "history"}, "history": {k: list(v) for k, v in state["history"].items()},
                "budget": budget.state_dict() if budget else None}

    def restore(st: dict[str, Any]) -> None:
        for k in ("policy", "rollout_tokens", "teacher_tokens"):
            state[k] = st.get(k, 0)
        state["history"].update({k: tuple(v) for k, v in st.get("history", {}).items()})
        if budget is not None and st.get("budget"):
            budget.load_state_dict(st["budget"])

    stage_dir.mkdir(parents=True, exist_ok=True)
    return run_stage(ws, "opd", model, learner, o.steps, step_fn, o.checkpoint_every, resume,
                     extra_state=extra_state, restore_extra=restore)


# ------------------------------------------------------------- helpers -----
@torch.no_grad()
def _student_entropy(learner: Learner, trajs: list[Trajectory]) -> list[torch.Tensor]:
    from mentorrl.train.batch import collate, forward_logprobs

    out = []
    mbs = learner.cfg.micro_batch_size
    device = next(learner.model.parameters()).device
    for lo in range(0, len(trajs), mbs):
        chunk = trajs[lo: lo + mbs]
        _, ent = forward_logprobs(learner.model, collate(chunk, learner.pad_id).to(device), learner.temperature,
                                  with_entropy=True)
        out += [ent[b, : len(t.token_ids)].cpu() for b, t in enumerate(chunk)]
    return out


def _apply_step_weights(learner, trajs, kl, rewards, sw) -> list[torch.Tensor | None]:
    ent = _student_entropy(learner, trajs)
    out = []
    for i, t in enumerate(trajs):
        if kl[i] is None:
            out.append(None)
            continue
        w = step_weights(torch.tensor(t.loss_mask)[None], tool_error_tokens(t)[None],
                         torch.tensor([float(rewards[i]) < sw.low_reward]), ent[i][None],
                         sw.tool_error_boost, sw.low_reward_boost, sw.entropy_threshold, sw.entropy_boost)[0]
        out.append(kl[i] * w.float())
    return out


def _center(trajs, kl) -> list[torch.Tensor | None]:
    """Subtract the batch mean of the distillation advantage over the tokens it covers (a baseline).

    The sampled-token advantages ``log p_t - log p_s`` average to minus the reverse KL, so without
    a baseline nearly every sampled token is pushed down and its probability flows to tokens nobody
    sampled; the mean carries no information about which tokens to prefer."""
    vals = [k[k != 0] for k in kl if k is not None]
    if not vals or sum(v.numel() for v in vals) == 0:
        return kl
    mean = float(torch.cat(vals).mean())
    return [torch.where(k != 0, k - mean, k) if k is not None else None for k in kl]


def _short_select(trajs, kl, gaps, short) -> tuple[list[torch.Tensor | None], float]:
    """Keep the distillation advantage only on the selected large-gap tokens; the share kept."""
    have = [i for i in range(len(trajs)) if kl[i] is not None]
    if not have:
        return kl, 0.0
    T = max(len(trajs[i].token_ids) for i in have)
    gap = torch.zeros(len(have), T)
    mask = torch.zeros(len(have), T)
    for r, i in enumerate(have):
        gap[r, : len(trajs[i].token_ids)] = gaps[i]
        mask[r, : len(trajs[i].token_ids)] = torch.tensor(trajs[i].loss_mask, dtype=torch.float32)
    keep = select_large_gap(gap, mask, threshold=short.threshold, top_frac=short.top_frac)
    out = list(kl)
    for r, i in enumerate(have):
        out[i] = kl[i] * keep[r, : len(trajs[i].token_ids)].float()
    return out, float(keep.sum()) / max(float(mask.sum()), 1.0)


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
        for idx in _minibatches(list(range(len(items))), o.updates_per_step, seed=seed * 31 + epoch):
            chosen = [items[i] for i in idx]
            ups.append(learner.distill_step([c[0] for c in chosen], [c[1] for c in chosen], [c[2] for c in chosen],
                                            kind=o.divergence, beta=o.beta, token_weights=[c[3] for c in chosen],
                                            tail=o.topk_tail))
    return _reduce_updates(ups, ("distill_loss", "divergence_max", "grad_norm")), len(ups)


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
        own = rollout_tasks(t.model, contract, ws.make_env, tasks, seed=ws.cfg.seed * 4_409 + step,
                            batch_size=len(tasks), weights=ws.cfg.reward)
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


__all__ = ["build_teacher", "heldout_check", "load_teacher", "opd_stage", "weights_fingerprint"]
