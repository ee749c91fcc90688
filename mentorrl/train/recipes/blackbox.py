"""Black-box on-policy distillation (``recipe: [sft, blackbox]``): the student rolls out, an
API-only teacher (no log-probs) judges or corrects what it actually did, and one of six recipes
turns that into an update.

One step:

1. Roll out ``tasks_per_step x samples_per_task`` episodes with the student.
2. Send them to the teacher as chat messages (:class:`~mentorrl.opd.remote_teacher.StudentEpisode`).
3. Build the recipe's batch:

   ========================  =======================  ==============================================
   recipe                    the teacher gives        the student learns by
   ========================  =======================  ==============================================
   ``correction``            critique + its actions   SFT on the teacher's continuation from the
                                                      first wrong step, after the student's prefix
   ``ranking``               candidate scores         DPO / IPO / ORPO on (best, worst) pairs
   ``score``                 rubric scores            GRPO on the verifier's reward fused with them
   ``critique``              step scores              GRPO with each turn's advantage shifted by
                                                      its standardised step score
   ``soft_labels``           candidate scores         cross-entropy from softmax(scores / T) to the
                                                      student's softmax over its sequence log-probs
   ``actions``               action scores            the same at single states, over candidate
                                                      next actions (student samples + teacher's)
   ========================  =======================  ==============================================

Whatever the teacher fails to answer (timeouts, malformed JSON, a wrong count of scores) is
counted and the sample left out; a step with nothing to learn from logs that and moves on. The
client's counters are logged every step as ``teacher_<counter>`` (cumulative).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from mentorrl.algos.advantages import get_advantage_estimator, group_reward_stats, sanitize_group_rewards
from mentorrl.algos.preference import after_shared_prefix, dpo_loss, ipo_loss, orpo_loss, soft_label_loss
from mentorrl.chat import action_key, action_of, assistant_message, message_text, trajectory_messages
from mentorrl.config import BlackBoxConfig, BlackBoxTeacherConfig
from mentorrl.contract import render_observation_content
from mentorrl.clients.openai_api import STAT_KEYS, TeacherClient
from mentorrl.opd.remote_teacher import ActingTeacher, BlackBoxTeacher, PromptedTeacher, StudentEpisode
from mentorrl.opd.teacher import Capability, require
from mentorrl.rollout.episode import Episode, text_turn_player
from mentorrl.train.learner import Learner
from mentorrl.rollout.kvcache import cache_kwarg, make_cache
from mentorrl.rollout.sampling import sample_tokens
from mentorrl.train.loop import collect_group, pg_update, pick_tasks, reduce_updates, rollout_metrics, train_pool
from mentorrl.train.registry import register_stage
from mentorrl.train.stage_runner import run_stage
from mentorrl.train.workspace import Workspace, frozen_copy, heldout_check
from mentorrl.trajectory import Segment, Trajectory

NEEDS = {"correction": [Capability.STEP_CRITIQUE, Capability.SAMPLING], "ranking": [Capability.RANKING],
         "score": [Capability.SCORING], "critique": [Capability.STEP_CRITIQUE],
         "soft_labels": [Capability.RANKING], "actions": [Capability.ACTION_RANKING, Capability.SAMPLING]}
PG_KEYS = ("pg_loss", "clip_frac", "entropy", "grad_norm", "skipped_update", "approx_kl", "logprob_abs_gap",
           "policy_lag_mean", "policy_lag_max")


# ------------------------------------------------------------------ teacher ------
def checkpoint_identity(path: Path) -> str:
    """A served checkpoint's name in response-cache keys: its resolved path and each file's name,
    size and modification time (cheap for any size of model; rewriting a file changes it)."""
    path = Path(path).resolve()
    files = sorted((f.relative_to(path).as_posix(), f.stat().st_size, f.stat().st_mtime_ns)
                   for f in path.rglob("*") if f.is_file())
    return "served:" + hashlib.sha256(json.dumps([str(path), files]).encode()).hexdigest()[:16]


@contextlib.contextmanager
def open_teacher(ws: Workspace, t: BlackBoxTeacherConfig, student=None, seed: int = 0) -> Iterator[BlackBoxTeacher]:
    """The configured black-box teacher. With ``serve`` set, the checkpoint (given, or built once
    like an OPD teacher) runs as a ``mentorrl serve`` subprocess on 127.0.0.1 for the duration and
    is reached only through HTTP; under ``distributed: {backend: ray, teacher_workers: >= 1}`` that
    subprocess runs on a Ray actor (:mod:`mentorrl.distributed.ray_serve`), behind a fresh bearer token."""
    with contextlib.ExitStack() as stack:
        client_cfg = t.client
        if t.serve is not None:
            from mentorrl.serve import serve_subprocess
            from mentorrl.train.teachers import build_teacher

            path = Path(t.serve.path) if t.serve.path else build_teacher(ws, t.serve, student)
            if not (path / "config.json").exists():
                raise FileNotFoundError(f"blackbox teacher: {path} is not a Hugging Face checkpoint directory")
            threads = ["--threads", str(ws.cfg.threads)] if ws.cfg.threads else []  # the run's CPU budget, not more
            dist = ws.cfg.distributed
            if dist.backend == "ray" and dist.teacher_workers > 0:  # on a Ray actor, with a fresh bearer token
                from mentorrl.distributed.ray_serve import serve_on_actor

                url, token_env = stack.enter_context(serve_on_actor(dist, path, ["--threads", "1"]))
            else:
                url, token_env = stack.enter_context(serve_subprocess(path, extra_args=threads)), None
            client_cfg = client_cfg.model_copy(update={"base_url": url, "api_key_env": token_env,
                                                       "cache_namespace": checkpoint_identity(path)})
        client = TeacherClient(client_cfg, seed=seed)
        stack.callback(client.close)
        if t.mode == "acting":
            yield ActingTeacher(client, samples=t.samples, temperature=t.temperature, threshold=t.threshold,
                                act_temperature=t.act_temperature, max_tokens=t.max_tokens, seed=seed)
        else:
            yield PromptedTeacher(client, threshold=t.threshold, act_temperature=t.act_temperature,
                                  max_tokens=max(t.max_tokens, 256), seed=seed)


def student_episodes(ws: Workspace, tasks, trajs: list[Trajectory]) -> list[StudentEpisode]:
    system = ws.contract.system_text()
    return [StudentEpisode(task, traj, trajectory_messages(traj, ws.tokenizer, system, task.prompt))
            for task, traj in zip(tasks, trajs)]


# --------------------------------------------------------------- correction ------
def corrected_trajectory(ws: Workspace, ep: StudentEpisode, first_wrong: int, teacher: BlackBoxTeacher
                         ) -> Trajectory | None:
    """The student's first ``first_wrong`` turns replayed as they were (context, loss mask 0), then
    the teacher acting from that state until the episode ends (its turns: loss mask 1). None when
    the teacher stopped answering."""
    contract, traj = ws.contract, ep.traj
    env = ws.make_env()
    try:
        e = Episode(contract, env, ep.task, policy_version=traj.policy_version, weights=ws.cfg.reward, source="teacher")
        e.start()
        turns = [s for s in traj.segments if s.role == "policy"]
        for seg in turns[:first_wrong]:
            action = e.add_policy_turn(traj.token_ids[seg.start:seg.end], traj.logprobs[seg.start:seg.end], stopped=True)
            if action is None or e.add_observation(e.run_tool(action)) is None:
                return None  # the prefix ended the episode: nothing left to correct
        msgs = list(ep.messages[:ep.turn_indices[first_wrong]])
        play = text_turn_player(e)
        while not e.done:
            reply = teacher.act(msgs)
            if not reply:
                return None
            text = message_text(reply[0])
            msgs.append(assistant_message(text))
            result = play(text)
            if result is None:
                break
            msgs.append({"role": "tool", "content": render_observation_content(result.ok, result.content, result.error)})
        fixed = e.finish()
    finally:
        env.close()
    n_ctx = turns[first_wrong].start if first_wrong < len(turns) else len(fixed.token_ids)
    mask = [m if i >= n_ctx else 0 for i, m in enumerate(fixed.loss_mask)]
    return fixed.model_copy(update={"loss_mask": mask}) if any(mask) else None


def teacher_map(teacher: BlackBoxTeacher, fn, items: list) -> list:
    """``[fn(x) for x in items]`` with up to the client's ``max_concurrency`` calls in flight (a hosted
    teacher answers in seconds; asking one state at a time would make a step wait on every call)."""
    workers = getattr(getattr(teacher.client, "config", None), "max_concurrency", 1)
    if workers <= 1 or len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(fn, items))


def _correct(ws, teacher, ep: StudentEpisode, o: BlackBoxConfig) -> tuple[str, Trajectory | None]:
    """One episode's correction and what became of it: ok, teacher_skips, no_error_found or rejected_corrections."""
    c = teacher.critique(ep)
    if c is None:
        return "teacher_skips", None
    if c.first_wrong is None:
        return "no_error_found", None
    fixed = corrected_trajectory(ws, ep, c.first_wrong, teacher)
    if fixed is None:
        return "teacher_skips", None
    if o.correction.require_success and not fixed.reward.success:
        return "rejected_corrections", None
    return "ok", fixed


def correction_update(ws, learner, teacher, eps, o: BlackBoxConfig) -> dict[str, float]:
    todo = [ep for ep in eps if not (o.correction.only_failed and ep.traj.reward.success)]
    done = teacher_map(teacher, lambda ep: _correct(ws, teacher, ep, o), todo)
    m = {"critiqued": float(len(todo)), "no_error_found": 0.0, "rejected_corrections": 0.0, "teacher_skips": 0.0}
    for what, _ in done:
        if what != "ok":
            m[what] += 1
    targets = [fixed for what, fixed in done if what == "ok"]
    m["batch_size"] = float(len(targets))
    if targets:
        m.update(learner.sft_step(targets, agg=o.loss_agg))
    return m


# ----------------------------------------------------------- ranking -> DPO ------
def verifier_vetoes(chosen: Trajectory, rejected: Trajectory) -> bool:
    """The verifier overrules a teacher's preference when the chosen trajectory broke a hard
    constraint, or failed where the rejected one succeeded."""
    return bool(chosen.reward.violations) or (rejected.reward.success and not chosen.reward.success)


def preference_pairs(groups: list[list[Trajectory]], scores: list[list[float] | None], min_margin: float,
                     veto: bool = True, which: str = "best_worst"
                     ) -> tuple[list[tuple[Trajectory, Trajectory, list[int], list[int]]], dict[str, float]]:
    """(chosen, rejected, chosen mask, rejected mask) from each group's teacher scores: its best and
    worst candidates (``which="best_worst"``) or every pair (``"all"``) whose scores differ by at
    least ``min_margin``, masked after their shared prefix; with ``veto``, none the verifier
    overrules (:func:`verifier_vetoes`). ``ties`` counts groups (or pairs) too close to call."""
    pairs, m = [], {"ties": 0.0, "teacher_skips": 0.0, "vetoed": 0.0}
    for group, s in zip(groups, scores):
        if s is None:
            m["teacher_skips"] += 1
            continue
        if which == "all":
            cands = [(i, j) for i in range(len(s)) for j in range(len(s)) if s[i] - s[j] >= max(min_margin, 1e-9)]
        else:
            best, worst = max(range(len(s)), key=s.__getitem__), min(range(len(s)), key=s.__getitem__)
            cands = [(best, worst)] if s[best] - s[worst] >= max(min_margin, 1e-9) else []
        if not cands:
            m["ties"] += 1
        for i, j in cands:
            c, r = group[i], group[j]
            if veto and verifier_vetoes(c, r):
                m["vetoed"] += 1
                continue
            try:
                cm, rm = after_shared_prefix(c.token_ids, r.token_ids, c.loss_mask, r.loss_mask)
            except ValueError:
                m["ties"] += 1
                continue
            if not any(cm) or not any(rm):  # one is a prefix of the other: nothing of its own to compare
                m["ties"] += 1
                continue
            pairs.append((c, r, cm, rm))
    return pairs, m


def uses_preference(o: BlackBoxConfig) -> bool:
    """Whether the recipe trains on preference pairs (trajectory ranking, or action ranking with ``loss: preference``)."""
    return o.recipe == "ranking" or (o.recipe == "actions" and o.actions.loss == "preference")


def preference_update(learner, ref_model, pairs, o: BlackBoxConfig) -> dict[str, float]:
    p = o.preference
    trajs = [c for c, _, _, _ in pairs] + [r for _, r, _, _ in pairs]
    masks = [torch.tensor(cm) for _, _, cm, _ in pairs] + [torch.tensor(rm) for _, _, _, rm in pairs]
    n = len(pairs)
    if p.loss == "orpo":
        # ORPO (Hong et al.; TRL): each side's mean log-prob over its own whole completion, the same
        # token set on both sides -- not the chosen side whole and the rejected side after the shared prefix
        full = [torch.tensor(c.loss_mask) for c, _, _, _ in pairs] + [torch.tensor(r.loss_mask) for _, r, _, _ in pairs]

        def orpo(s):
            # s: mean log-probs; orpo_loss works on token tensors, so hand it [N, 1] "tokens" with mask 1
            one = torch.ones(n, 1)
            return orpo_loss(s[:n, None], one, s[n:, None], one, lam=p.lam)

        return learner.sequence_step(trajs, full, orpo, average=True)
    average = p.loss == "ipo" or p.average
    ref = learner.sequence_logprobs(trajs, masks, average, model=ref_model)
    if p.nll_coef > 0:  # the chosen side once more, whole, for its token-mean NLL (RPO)
        trajs = trajs + trajs[:n]
        masks = masks + [torch.tensor(c.loss_mask) for c, _, _, _ in pairs]
    n_tokens = torch.tensor([1.0 if average else float(sum(c.loss_mask)) for c, _, _, _ in pairs])

    def objective(s):
        if p.loss == "ipo":
            return ipo_loss(s[:n], s[n:2 * n], ref[:n], ref[n:], tau=p.tau)
        loss, m = dpo_loss(s[:n], s[n:2 * n], ref[:n], ref[n:], beta=p.beta, label_smoothing=p.label_smoothing)
        if p.nll_coef > 0:
            nll = (-s[2 * n:] / n_tokens).mean()
            loss = loss + p.nll_coef * nll
            m = {**m, "dpo_loss": m["loss"], "chosen_nll": nll.item(), "loss": loss.item()}
        return loss, m

    return learner.sequence_step(trajs, masks, objective, average=average)


# ------------------------------------------------------------- score reward ------
def fused_rewards(trajs: list[Trajectory], teacher_scores: list[float | None], coef: float) -> tuple[torch.Tensor, int]:
    """``(1 - coef) * verifier + coef * teacher`` per trajectory. The verifier is authoritative: a
    trajectory that broke a hard constraint, or one the teacher did not score, keeps the
    verifier's reward. Returns the rewards and how many were fused."""
    out, fused = [], 0
    for t, s in zip(trajs, teacher_scores):
        if s is None or t.reward.violations:
            out.append(t.reward.total)
        else:
            out.append((1 - coef) * t.reward.total + coef * s)
            fused += 1
    return torch.tensor(out, dtype=torch.float32), fused


def step_advantages(trajs: list[Trajectory], outcome_adv: torch.Tensor, step_scores: list[list[float] | None],
                    coef: float) -> list[torch.Tensor]:
    """Per-token advantages: the trajectory's outcome advantage on every policy token, plus
    ``coef`` times its turn's step score standardised over every scored turn of the batch."""
    flat = torch.tensor([s for sc in step_scores if sc for s in sc], dtype=torch.float32)
    mu, sd = (float(flat.mean()), float(flat.std(unbiased=False))) if flat.numel() else (0.0, 0.0)
    out = []
    for t, a, sc in zip(trajs, outcome_adv.tolist(), step_scores):
        adv = torch.tensor(t.loss_mask, dtype=torch.float32) * a
        if sc and sd > 1e-6:
            for seg, s in zip([g for g in t.segments if g.role == "policy"], sc):
                adv[seg.start:seg.end] += coef * (s - mu) / sd
        out.append(adv * torch.tensor(t.loss_mask, dtype=torch.float32))
    return out


def policy_gradient_update(learner, trajs, token_adv, o: BlackBoxConfig, state, step: int,
                           sync: Callable[[Any, int], None] | None = None) -> dict[str, float]:
    """Clipped policy-gradient minibatches over the batch; trajectories with a zero advantage are
    not forwarded but keep their place in the loss denominator (:func:`~mentorrl.train.loop.pg_update`)."""
    ups = pg_update(learner, trajs, token_adv, o.updates_per_step, step * 7 + 3, state, drop_zero=True,
                    eps_low=o.eps_low, eps_high=o.eps_high, agg=o.loss_agg, sync=sync)
    live = sum(1 for a in token_adv if a.abs().sum() > 0)
    return {**reduce_updates(ups, PG_KEYS), "batch_size": float(live)}


# ---------------------------------------------------- soft labels and actions ------
def soft_label_update(learner, groups: list[tuple[list[Trajectory], list[torch.Tensor], list[float]]],
                      temperature: float, average: bool) -> dict[str, float]:
    """One update on candidate-level soft labels: per group (candidates, their masks, teacher
    scores), cross-entropy from softmax(scores / T) to the student's softmax over its own
    candidate log-probs; averaged over groups (groups may differ in size)."""
    trajs = [t for g, _, _ in groups for t in g]
    masks = [m for _, ms, _ in groups for m in ms]
    bounds, lo = [], 0
    for g, _, _ in groups:
        bounds.append((lo, lo + len(g)))
        lo += len(g)

    def objective(s):
        losses, kls, tops = [], [], []
        for (a, b), (_, _, sc) in zip(bounds, groups):
            loss, mm = soft_label_loss(s[a:b], torch.tensor(sc), temperature)
            losses.append(loss)
            kls.append(mm["soft_label_kl"])
            tops.append(mm["top_agreement"])
        return torch.stack(losses).mean(), {"soft_label_kl": sum(kls) / len(kls), "top_agreement": sum(tops) / len(tops)}

    return learner.sequence_step(trajs, masks, objective, average=average)


@torch.no_grad()
def sample_turns(model, contract, prefix: list[int], k: int, seed: int) -> list[list[int]]:
    """``k`` student samples of the next turn from ``prefix`` (each ending at its stop token, if reached),
    decoded by the rollout sampler (:func:`mentorrl.rollout.sampling.sample_tokens`) with the contract's
    temperature and top-p (top-k off), row ``j`` drawing its noise from a generator seeded ``seed + j``."""
    device = next(model.parameters()).device
    params = contract.sampling.model_copy(update={"top_k": 0})
    gens = [torch.Generator().manual_seed(seed + j) for j in range(k)]
    stops = set(contract.stop_token_ids)
    ids = torch.tensor([prefix] * k, device=device)
    cache = make_cache(model)
    out = model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache})
    rows: list[list[int]] = [[] for _ in range(k)]
    for _ in range(contract.sampling.max_new_tokens):
        tokens, _ = sample_tokens(out.logits[:, -1], params, gens)
        for row, tok in zip(rows, tokens.tolist()):
            if not (row and row[-1] in stops):
                row.append(tok)
        if all(row and row[-1] in stops for row in rows):
            break
        out = model(input_ids=tokens[:, None].to(device), use_cache=True, **{cache_kwarg(model): cache})
    return rows


def candidate_trajectory(traj: Trajectory, prefix_len: int, turn_ids: list[int]) -> Trajectory:
    """The trajectory's first ``prefix_len`` tokens (context) followed by one candidate turn (loss mask 1)."""
    ids = list(traj.token_ids[:prefix_len]) + list(turn_ids)
    segs = [s for s in traj.segments if s.end <= prefix_len] + [Segment(role="policy", start=prefix_len, end=len(ids))]
    return traj.model_copy(update={"token_ids": ids, "loss_mask": [0] * prefix_len + [1] * len(turn_ids),
                                   "logprobs": [0.0] * len(ids), "segments": segs})


def action_groups(ws: Workspace, model, teacher: BlackBoxTeacher, eps: list[StudentEpisode], o: BlackBoxConfig,
                  rng: random.Random, seed: int) -> tuple[list, dict[str, float]]:
    """Per sampled state: the distinct candidate next turns (student samples, the turn it took and,
    optionally, the teacher's), as candidate trajectories, with the teacher's scores."""
    a, contract = o.actions, ws.contract
    groups, m = [], {"states": 0.0, "teacher_skips": 0.0, "uninformative_states": 0.0, "candidates": 0.0}
    for e_i, ep in enumerate(eps):
        turns = [s for s in ep.traj.segments if s.role == "policy"]
        for ti in sorted(rng.sample(range(len(turns)), min(a.states_per_trajectory, len(turns)))):
            seg = turns[ti]
            state_msgs = ep.messages[:ep.turn_indices[ti]]
            cands = [ep.traj.token_ids[seg.start:seg.end]] + sample_turns(model, contract, ep.traj.token_ids[:seg.start],
                                                                          a.candidates, seed * 9973 + e_i * 31 + ti)
            if a.include_teacher_action:
                mine = teacher.act(state_msgs)
                if mine:
                    cands.append(contract.policy_turn_ids(message_text(mine[0])))
            seen, uniq, msgs = set(), [], []
            for c in cands:
                msg = assistant_message(contract.decode_turn(c))
                key = action_key(action_of(msg))
                if key not in seen:
                    seen.add(key)
                    uniq.append(c)
                    msgs.append(msg)
            m["states"] += 1
            if len(uniq) < 2:
                m["uninformative_states"] += 1
                continue
            scores = teacher.rank_actions(state_msgs, msgs)
            if scores is None:
                m["teacher_skips"] += 1
                continue
            if max(scores) - min(scores) < 1e-6:
                m["uninformative_states"] += 1
                continue
            trajs = [candidate_trajectory(ep.traj, seg.start, c) for c in uniq]
            groups.append((trajs, [torch.tensor(t.loss_mask) for t in trajs], scores))
            m["candidates"] += len(uniq)
    return groups, m


# -------------------------------------------------------------------- stage ------
@register_stage("blackbox", config="blackbox", title="Black-box on-policy distillation", label="BB-OPD", rl=True)
def blackbox_stage(ws: Workspace, model, resume: bool = False) -> Path:
    cfg, o = ws.cfg, ws.cfg.blackbox
    with open_teacher(ws, o.teacher, student=model, seed=cfg.seed) as teacher:
        require(teacher, NEEDS[o.recipe], f"blackbox ({o.recipe})")
        return _run(ws, model, teacher, resume)


@dataclass
class Step:
    """What a recipe's update sees at one step."""

    ws: Workspace
    model: Any
    learner: Learner
    teacher: BlackBoxTeacher
    eps: list[StudentEpisode]  # every student episode of the step, grouped task by task
    G: int  # episodes per task
    state: dict[str, Any]  # policy version, rollout tokens (checkpointed)
    step: int
    rng: random.Random
    ref_model: Any = None

    @property
    def o(self) -> BlackBoxConfig:
        return self.ws.cfg.blackbox

    @property
    def trajs(self) -> list[Trajectory]:
        return [e.traj for e in self.eps]

    @property
    def groups(self) -> list[list[StudentEpisode]]:
        return [self.eps[i:i + self.G] for i in range(0, len(self.eps), self.G)]


def _correction(s: Step) -> dict[str, float]:
    m = correction_update(s.ws, s.learner, s.teacher, s.eps, s.o)
    s.state["policy"] += int(m["batch_size"] > 0)
    return m


def ranking_scores(trajs: list[Trajectory], teacher_scores: list[float] | None, coef: float
                   ) -> list[float] | None:
    """A group's ranking: ``(1 - coef) * verifier + coef * teacher`` per candidate, fused as the score
    recipe fuses rewards (:func:`fused_rewards`: a hard-constraint violation keeps the verifier's
    reward). None when the teacher could not rank the group and its score is needed."""
    if coef == 0:
        return [t.reward.total for t in trajs]
    return None if teacher_scores is None else fused_rewards(trajs, teacher_scores, coef)[0].tolist()


def _preference_step(s: Step, groups: list[list[Trajectory]], scores: list[list[float] | None], veto: bool
                     ) -> dict[str, float]:
    """Pairs from each group's scores (:func:`preference_pairs`) and ``updates_per_step`` passes of the preference loss."""
    p = s.o.preference
    pairs, m = preference_pairs(groups, scores, p.min_margin, veto, p.pairs)
    m["batch_size"] = float(len(pairs))
    if pairs:
        m.update(_passes(lambda: preference_update(s.learner, s.ref_model, pairs, s.o), s.o.updates_per_step, s.state))
    return m


def _ranking(s: Step) -> dict[str, float]:
    p, groups = s.o.preference, s.groups
    ranked = teacher_map(s.teacher, s.teacher.rank, groups) if p.teacher_coef > 0 else [None] * len(groups)
    trajs = [[e.traj for e in g] for g in groups]
    scores = [ranking_scores(g, t, p.teacher_coef) for g, t in zip(trajs, ranked)]
    return _preference_step(s, trajs, scores, p.verifier_veto)


def _group_advantages(s: Step, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a = s.ws.cfg.audit
    rewards, _ = sanitize_group_rewards(raw.view(-1, s.G), a.reward_low, a.reward_high, a.outlier_z)
    return rewards, get_advantage_estimator("grpo")(rewards, normalize_std=True).reshape(-1)


def _score(s: Step) -> dict[str, float]:
    trajs = s.trajs
    ts = teacher_map(s.teacher, s.teacher.score, s.eps)
    overall = [x.overall(s.o.score.weights) if x is not None else None for x in ts]
    raw, fused = fused_rewards(trajs, overall, s.o.score.teacher_coef)
    got = [x for x in overall if x is not None]
    rewards, adv = _group_advantages(s, raw)
    m = {"teacher_scored": float(fused), "teacher_skips": float(len(ts) - len(got)), "teacher_score_mean": _mean(got),
         "teacher_verifier_agreement": _agreement(trajs, ts),
         **{f"fused_reward_{k}": v for k, v in group_reward_stats(rewards).items()}}
    token_adv = [torch.tensor(t.loss_mask, dtype=torch.float32) * float(a) for t, a in zip(trajs, adv)]
    return {**m, **policy_gradient_update(s.learner, trajs, token_adv, s.o, s.state, s.step, s.ws.rollout.sync)}


def _critique(s: Step) -> dict[str, float]:
    trajs = s.trajs
    _, adv = _group_advantages(s, torch.tensor([t.reward.total for t in trajs], dtype=torch.float32))
    crit = teacher_map(s.teacher, s.teacher.critique, s.eps)
    sc = [c.scores if c is not None else None for c in crit]
    m = {"teacher_skips": float(sum(c is None for c in crit)), "step_score_mean": _mean([x for y in sc if y for x in y])}
    token_adv = step_advantages(trajs, adv, sc, s.o.critique.coef)
    return {**m, **policy_gradient_update(s.learner, trajs, token_adv, s.o, s.state, s.step, s.ws.rollout.sync)}


def _soft_labels(s: Step) -> dict[str, float]:
    scores = teacher_map(s.teacher, s.teacher.rank, s.groups)
    data = [([e.traj for e in g], [torch.tensor(e.traj.loss_mask) for e in g], sc)
            for g, sc in zip(s.groups, scores) if sc is not None and max(sc) - min(sc) > 1e-6]
    m = {"teacher_skips": float(sum(sc is None for sc in scores)), "batch_size": float(len(data))}
    if data:
        sl = s.o.soft_labels
        m.update(_passes(lambda: soft_label_update(s.learner, data, sl.temperature, sl.average), s.o.updates_per_step,
                         s.state))
    return m


def _actions(s: Step) -> dict[str, float]:
    data, m = action_groups(s.ws, s.model, s.teacher, s.eps, s.o, s.rng, seed=s.ws.cfg.seed + s.step)
    a = s.o.actions
    if a.loss == "preference":  # pairs of a state's actions; no veto: they share the episode's outcome
        # the states' counters (teacher_skips among them) over the pairs' (every ranked state was scored)
        return {**_preference_step(s, [t for t, _, _ in data], [sc for _, _, sc in data], veto=False), **m}
    m["batch_size"] = float(len(data))
    if data:
        m.update(_passes(lambda: soft_label_update(s.learner, data, a.temperature, a.average), s.o.updates_per_step,
                         s.state))
    return m


RECIPE_STEPS = {"correction": _correction, "ranking": _ranking, "score": _score, "critique": _critique,
                "soft_labels": _soft_labels, "actions": _actions}


def _run(ws: Workspace, model, teacher: BlackBoxTeacher, resume: bool) -> Path:
    cfg, o = ws.cfg, ws.cfg.blackbox
    pool = train_pool(ws, o.tasks_per_step, o.steps)
    learner = Learner(model, o.optim, ws.contract.pad_token_id, ws.contract.sampling.temperature)
    ref_model = None
    if uses_preference(o) and o.preference.loss != "orpo":  # DPO / IPO: the policy as the stage starts
        ref_model = frozen_copy(model)
    state: dict[str, Any] = {"policy": 0, "rollout_tokens": 0}
    G = o.samples_per_task

    def step_fn(step: int) -> dict[str, float]:
        rng, chosen = pick_tasks(pool, o.tasks_per_step, cfg.seed * 1_000_003 + 17 * step + 29)
        grp = collect_group(ws, model, chosen, G, state["policy"], cfg.seed * 4_241 + step, f"blackbox step {step + 1}")
        trajs, grouped = grp.trajs, grp.grouped
        state["rollout_tokens"] += grp.policy_tokens
        m: dict[str, float] = {**rollout_metrics(trajs), "rollouts": float(len(trajs)), "rollout_s": grp.rollout_s,
                               **{f"reward_{k}": v for k, v in group_reward_stats(grp.raw_rewards()).items()}}
        t1 = time.perf_counter()
        ctx = Step(ws, model, learner, teacher, student_episodes(ws, grouped, trajs), G, state, step, rng, ref_model)
        m.update(RECIPE_STEPS[o.recipe](ctx))
        m.update({f"teacher_{k}": float(teacher.client.stats[k]) for k in STAT_KEYS},
                 teacher_s=time.perf_counter() - t1, policy_version=float(state["policy"]),
                 rollout_tokens_total=float(state["rollout_tokens"]))
        if o.eval_every and (step + 1) % o.eval_every == 0:
            m["heldout_success"] = heldout_check(ws, model, o.eval_tasks)
        return m

    def extra_state() -> dict[str, Any]:
        return dict(state)

    def restore(st: dict[str, Any]) -> None:
        state.update({k: st.get(k, 0) for k in ("policy", "rollout_tokens")})

    return run_stage(ws, "blackbox", model, learner, o.steps, step_fn, o.checkpoint_every, resume,
                     extra_state=extra_state, restore_extra=restore)


def _passes(update, n: int, state: dict[str, Any]) -> dict[str, float]:
    """``n`` optimizer steps on one batch of a sequence-level loss (pairs, candidate groups: fixed
    data, like offline DPO epochs); the first step's metrics, with the last step's loss as ``loss_last``."""
    first = update()
    last = first
    for _ in range(n - 1):
        last = update()
    state["policy"] += n
    return {**first, "loss_last": last["loss"]}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _agreement(trajs: list[Trajectory], scores) -> float:
    """Share of scored trajectories where the teacher's task_success (>= 0.5) agrees with the verifier."""
    pairs = [(t.reward.success, s.dims.get("task_success", 0.0) >= 0.5) for t, s in zip(trajs, scores) if s is not None]
    return sum(a == b for a, b in pairs) / len(pairs) if pairs else 0.0


__all__ = ["NEEDS", "action_groups", "blackbox_stage", "corrected_trajectory", "fused_rewards", "open_teacher",
           "preference_pairs", "ranking_scores", "sample_turns", "soft_label_update", "step_advantages", "student_episodes"]
