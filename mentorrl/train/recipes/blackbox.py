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

The stage is :class:`BlackBoxStage` on the one training loop (:mod:`mentorrl.train.loop`):
its rollout hook also turns the student's trajectories into chat episodes, and the recipe plugs in
as the score source: a :class:`BlackBoxRecipe` registered by name (:func:`blackbox_recipe`,
:data:`RECIPES`) whose ``score`` asks the teacher and builds the batch and whose ``advantages`` /
``update`` train on it. The teacher opens with the stage and closes with it.

Whatever the teacher fails to answer (timeouts, malformed JSON, a wrong count of scores) is
counted and the sample left out; a step with nothing to learn from logs that and moves on. The
client's counters are logged every step as ``teacher_<counter>`` (cumulative).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Iterator

import torch

from mentorrl.algos.advantages import get_advantage_estimator, group_reward_stats, sanitize_group_rewards
from mentorrl.algos.preference import after_shared_prefix, dpo_loss, ipo_loss, orpo_loss, soft_label_loss
from mentorrl.chat import action_key, action_of, assistant_message, message_text, trajectory_messages
from mentorrl.clients.openai_api import STAT_KEYS, TeacherClient
from mentorrl.config import BlackBoxConfig, BlackBoxTeacherConfig
from mentorrl.config.registry import Registry
from mentorrl.contract import render_observation_content
from mentorrl.opd.remote_teacher import ActingTeacher, BlackBoxTeacher, PromptedTeacher, StudentEpisode
from mentorrl.opd.teacher import Capability, require
from mentorrl.rollout.episode import Episode, text_turn_player
from mentorrl.rollout.kvcache import cache_kwarg, make_cache
from mentorrl.rollout.sampling import sample_tokens
from mentorrl.train.loop import Stage, StepBatch, StepData, StepSeeds, run_on_loop
from mentorrl.train.stage_helpers import PG_METRICS, pg_update, reduce_updates
from mentorrl.train.workspace import Workspace, frozen_copy, heldout_check
from mentorrl.trajectory import Segment, Trajectory

PG_KEYS = (*PG_METRICS, "skipped_update")


# ------------------------------------------------------------------ teacher ------
def checkpoint_identity(path: Path) -> str:
    """A served checkpoint's name in response-cache keys: its resolved path and each file's name,
    size and modification time (cheap for any size of model; rewriting a file changes it)."""
    path = Path(path).resolve()
    files = sorted(
        (f.relative_to(path).as_posix(), f.stat().st_size, f.stat().st_mtime_ns) for f in path.rglob("*") if f.is_file()
    )
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
            from mentorrl.train.teachers import build_teacher, checkpoint_dir

            path = (
                checkpoint_dir("blackbox teacher", t.serve.path)
                if t.serve.path
                else build_teacher(ws, t.serve, student)
            )
            if not (path / "config.json").exists():
                raise FileNotFoundError(f"blackbox teacher: {path} is not a Hugging Face checkpoint directory")
            n = torch.get_num_threads() if ws.cfg.threads == "auto" else ws.cfg.threads  # auto: as the workspace set
            threads = ["--threads", str(n)] if n else []  # the run's CPU budget, not more
            dist = ws.cfg.distributed
            if dist.backend == "ray" and dist.teacher_workers > 0:  # on a Ray actor, with a fresh bearer token
                from mentorrl.distributed.ray_serve import serve_on_actor

                url, token_env = stack.enter_context(serve_on_actor(dist, path, ["--threads", "1"]))
            else:
                url, token_env = stack.enter_context(serve_subprocess(path, extra_args=threads)), None
            client_cfg = client_cfg.model_copy(
                update={"base_url": url, "api_key_env": token_env, "cache_namespace": checkpoint_identity(path)}
            )
        client = TeacherClient(client_cfg, seed=seed)
        stack.callback(client.close)
        if t.mode == "acting":
            yield ActingTeacher(
                client,
                samples=t.samples,
                temperature=t.temperature,
                threshold=t.threshold,
                act_temperature=t.act_temperature,
                max_tokens=t.max_tokens,
                seed=seed,
            )
        else:
            yield PromptedTeacher(
                client,
                threshold=t.threshold,
                act_temperature=t.act_temperature,
                max_tokens=max(t.max_tokens, 256),
                seed=seed,
            )


def student_episodes(ws: Workspace, tasks, trajs: list[Trajectory]) -> list[StudentEpisode]:
    system = ws.contract.system_text()
    return [
        StudentEpisode(task, traj, trajectory_messages(traj, ws.tokenizer, system, task.prompt))
        for task, traj in zip(tasks, trajs)
    ]


# --------------------------------------------------------------- correction ------
def corrected_trajectory(
    ws: Workspace, ep: StudentEpisode, first_wrong: int, teacher: BlackBoxTeacher
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
            action = e.add_policy_turn(
                traj.token_ids[seg.start : seg.end], traj.logprobs[seg.start : seg.end], stopped=True
            )
            if action is None or e.add_observation(e.run_tool(action)) is None:
                return None  # the prefix ended the episode: nothing left to correct
        msgs = list(ep.messages[: ep.turn_indices[first_wrong]])
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
            msgs.append(
                {"role": "tool", "content": render_observation_content(result.ok, result.content, result.error)}
            )
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


def corrections(ws, teacher, eps, o: BlackBoxConfig) -> tuple[list[Trajectory], dict[str, float]]:
    """The step's corrected trajectories (:func:`corrected_trajectory`) and what became of the rest."""
    todo = [ep for ep in eps if not (o.correction.only_failed and ep.traj.reward.success)]
    done = teacher_map(teacher, lambda ep: _correct(ws, teacher, ep, o), todo)
    m = {"critiqued": float(len(todo)), "no_error_found": 0.0, "rejected_corrections": 0.0, "teacher_skips": 0.0}
    for what, _ in done:
        if what != "ok":
            m[what] += 1
    targets = [fixed for what, fixed in done if what == "ok"]
    m["batch_size"] = float(len(targets))
    return targets, m


# ----------------------------------------------------------- ranking -> DPO ------
def verifier_vetoes(chosen: Trajectory, rejected: Trajectory) -> bool:
    """The verifier overrules a teacher's preference when the chosen trajectory broke a hard
    constraint, or failed where the rejected one succeeded."""
    return bool(chosen.reward.violations) or (rejected.reward.success and not chosen.reward.success)


def preference_pairs(
    groups: list[list[Trajectory]],
    scores: list[list[float] | None],
    min_margin: float,
    veto: bool = True,
    which: str = "best_worst",
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
            return ipo_loss(s[:n], s[n : 2 * n], ref[:n], ref[n:], tau=p.tau)
        loss, m = dpo_loss(s[:n], s[n : 2 * n], ref[:n], ref[n:], beta=p.beta, label_smoothing=p.label_smoothing)
        if p.nll_coef > 0:
            nll = (-s[2 * n :] / n_tokens).mean()
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


def step_advantages(
    trajs: list[Trajectory], outcome_adv: torch.Tensor, step_scores: list[list[float] | None], coef: float
) -> list[torch.Tensor]:
    """Per-token advantages: the trajectory's outcome advantage on every policy token, plus
    ``coef`` times its turn's step score standardised over every scored turn of the batch."""
    flat = torch.tensor([s for sc in step_scores if sc for s in sc], dtype=torch.float32)
    mu, sd = (float(flat.mean()), float(flat.std(unbiased=False))) if flat.numel() else (0.0, 0.0)
    out = []
    for t, a, sc in zip(trajs, outcome_adv.tolist(), step_scores):
        adv = torch.tensor(t.loss_mask, dtype=torch.float32) * a
        if sc and sd > 1e-6:
            for seg, s in zip([g for g in t.segments if g.role == "policy"], sc):
                adv[seg.start : seg.end] += coef * (s - mu) / sd
        out.append(adv * torch.tensor(t.loss_mask, dtype=torch.float32))
    return out


def policy_gradient_update(learner, trajs, token_adv, o: BlackBoxConfig, seed: int) -> dict[str, float]:
    """Clipped policy-gradient minibatches over the batch (dealt with ``seed``); trajectories with a
    zero advantage are not forwarded but keep their place in the loss denominator
    (:func:`~mentorrl.train.stage_helpers.pg_update`)."""
    ups = pg_update(
        learner,
        trajs,
        token_adv,
        o.updates_per_step,
        seed,
        drop_zero=True,
        eps_low=o.eps_low,
        eps_high=o.eps_high,
        agg=o.loss_agg,
    )
    live = sum(1 for a in token_adv if a.abs().sum() > 0)
    return {**reduce_updates(ups, PG_KEYS), "batch_size": float(live)}


# ---------------------------------------------------- soft labels and actions ------
def soft_label_update(
    learner, groups: list[tuple[list[Trajectory], list[torch.Tensor], list[float]]], temperature: float, average: bool
) -> dict[str, float]:
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
        return torch.stack(losses).mean(), {
            "soft_label_kl": sum(kls) / len(kls),
            "top_agreement": sum(tops) / len(tops),
        }

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
    return traj.model_copy(
        update={
            "token_ids": ids,
            "loss_mask": [0] * prefix_len + [1] * len(turn_ids),
            "logprobs": [0.0] * len(ids),
            "segments": segs,
        }
    )


def action_groups(
    ws: Workspace, model, teacher: BlackBoxTeacher, eps: list[StudentEpisode], o: BlackBoxConfig, seeds: StepSeeds
) -> tuple[list, dict[str, float]]:
    """Per sampled state: the distinct candidate next turns (student samples, the turn it took and,
    optionally, the teacher's), as candidate trajectories, with the teacher's scores. The states are
    drawn with ``seeds.rng("states")``, the student's samples at episode ``e``'s turn ``t`` with
    ``seeds(f"turns-{e}-{t}")``."""
    rng = seeds.rng("states")
    a, contract = o.actions, ws.contract
    groups, m = [], {"states": 0.0, "teacher_skips": 0.0, "uninformative_states": 0.0, "candidates": 0.0}
    for e_i, ep in enumerate(eps):
        turns = [s for s in ep.traj.segments if s.role == "policy"]
        for ti in sorted(rng.sample(range(len(turns)), min(a.states_per_trajectory, len(turns)))):
            seg = turns[ti]
            state_msgs = ep.messages[: ep.turn_indices[ti]]
            cands = [ep.traj.token_ids[seg.start : seg.end]] + sample_turns(
                model, contract, ep.traj.token_ids[: seg.start], a.candidates, seeds(f"turns-{e_i}-{ti}")
            )
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


def ranking_scores(trajs: list[Trajectory], teacher_scores: list[float] | None, coef: float) -> list[float] | None:
    """A group's ranking: ``(1 - coef) * verifier + coef * teacher`` per candidate, fused as the score
    recipe fuses rewards (:func:`fused_rewards`: a hard-constraint violation keeps the verifier's
    reward). None when the teacher could not rank the group and its score is needed."""
    if coef == 0:
        return [t.reward.total for t in trajs]
    return None if teacher_scores is None else fused_rewards(trajs, teacher_scores, coef)[0].tolist()


def passes(update, n: int) -> dict[str, float]:
    """``n`` optimizer steps on one batch of a sequence-level loss (pairs, candidate groups: fixed
    data, like offline DPO epochs); the first step's metrics, with the last step's loss as ``loss_last``."""
    first = update()
    last = first
    for _ in range(n - 1):
        last = update()
    return {**first, "loss_last": last["loss"]}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _agreement(trajs: list[Trajectory], scores) -> float:
    """Share of scored trajectories where the teacher's task_success (>= 0.5) agrees with the verifier."""
    pairs = [(t.reward.success, s.dims.get("task_success", 0.0) >= 0.5) for t, s in zip(trajs, scores) if s is not None]
    return sum(a == b for a, b in pairs) / len(pairs) if pairs else 0.0


# ------------------------------------------------------------------ recipes ------
@dataclass(slots=True)
class BlackBoxStepData(StepData):
    """What the black-box hooks hand on within a step: the rollout's student episodes ``eps`` (one per
    trajectory, as chat messages for the teacher) and ``teacher_t0`` (when the score hook began asking
    the teacher); then what the recipe's score builds for its update: preference ``pairs`` (None when
    the recipe built none), candidate groups with soft labels ``soft``, corrected trajectories
    ``targets``, or the critique's per-turn ``step_scores``."""

    eps: list[StudentEpisode] = field(default_factory=list)
    teacher_t0: float = 0.0
    pairs: list | None = None
    soft: list[tuple] = field(default_factory=list)
    targets: list[Trajectory] = field(default_factory=list)
    step_scores: list[list[float] | None] = field(default_factory=list)


class BlackBoxRecipe:
    """One way to learn from the teacher, chosen by ``blackbox.recipe``: :meth:`score` asks the
    teacher about the step's student episodes (``b.data.eps``, task by task) and builds the
    batch, :meth:`advantages` and :meth:`update` train on it. ``needs``: the teacher capabilities
    it asks for (checked when the stage opens the teacher). Register one with :func:`blackbox_recipe`."""

    name: ClassVar[str]
    needs: ClassVar[tuple[Capability, ...]]

    def score(self, stage: "BlackBoxStage", b: StepBatch) -> None:
        raise NotImplementedError

    def advantages(self, stage: "BlackBoxStage", b: StepBatch) -> None:
        """Advantages into ``b.adv`` (default: none)."""

    def update(self, stage: "BlackBoxStage", b: StepBatch) -> None:
        raise NotImplementedError


RECIPES: Registry[type[BlackBoxRecipe]] = Registry("black-box recipe")


def blackbox_recipe(cls: type[BlackBoxRecipe] | None = None, *, replace: bool = False) -> Any:
    """Register a :class:`BlackBoxRecipe` under its ``name`` (a taken name is an error unless ``replace``);
    ``@blackbox_recipe`` or ``@blackbox_recipe(replace=True)``."""
    if cls is None:
        return lambda c: RECIPES.register(c.name, c, replace=replace)
    return RECIPES.register(cls.name, cls, replace=replace)


def episode_groups(b: StepBatch) -> list[list[StudentEpisode]]:
    """The step's student episodes, task by task."""
    eps, g = b.data.eps, b.group_size
    return [eps[i : i + g] for i in range(0, len(eps), g)]


class PairsRecipe(BlackBoxRecipe):
    """Trains on the preference pairs its :meth:`score` leaves in ``b.data.pairs``."""

    @staticmethod
    def make_pairs(
        stage: "BlackBoxStage",
        b: StepBatch,
        groups: list[list[Trajectory]],
        scores: list[list[float] | None],
        veto: bool,
    ) -> None:
        """Pairs from each group's scores (:func:`preference_pairs`), with their counters."""
        p = stage.cfg.preference
        pairs, m = preference_pairs(groups, scores, p.min_margin, veto, p.pairs)
        b.data.pairs = pairs
        b.metrics.update(m, batch_size=float(len(pairs)))

    def update(self, stage: "BlackBoxStage", b: StepBatch) -> None:
        """``updates_per_step`` passes of the preference loss over the pairs."""
        pairs, o = b.data.pairs, stage.cfg
        if pairs:
            b.metrics.update(
                passes(lambda: preference_update(stage.learner, stage.ref_model, pairs, o), o.updates_per_step)
            )


class SoftLabelRecipe(BlackBoxRecipe):
    """Trains on the candidate groups its :meth:`score` leaves in ``b.data.soft`` (soft labels)."""

    def soft_settings(self, stage: "BlackBoxStage") -> tuple[float, bool]:
        """(temperature, average) of the soft-label loss."""
        sl = stage.cfg.soft_labels
        return sl.temperature, sl.average

    def update(self, stage: "BlackBoxStage", b: StepBatch) -> None:
        data, o = b.data.soft, stage.cfg
        if data:
            temperature, average = self.soft_settings(stage)
            b.metrics.update(
                passes(lambda: soft_label_update(stage.learner, data, temperature, average), o.updates_per_step)
            )


class PolicyGradientRecipe(BlackBoxRecipe):
    """Trains on the token advantages in ``b.adv`` with clipped policy-gradient minibatches."""

    @staticmethod
    def group_rewards(stage: "BlackBoxStage", b: StepBatch, raw: torch.Tensor) -> None:
        """``b.rewards``: ``raw`` (one reward per trajectory) as ``[tasks, group_size]``, sanitised by the audit."""
        a = stage.ws.cfg.audit
        b.rewards, _ = sanitize_group_rewards(raw.view(-1, b.group_size), a.reward_low, a.reward_high, a.outlier_z)

    @staticmethod
    def outcome_advantages(b: StepBatch) -> torch.Tensor:
        """One group-relative (GRPO, std-normalised) advantage per trajectory from ``b.rewards``."""
        return get_advantage_estimator("grpo")(b.rewards, normalize_std=True).reshape(-1)

    def update(self, stage: "BlackBoxStage", b: StepBatch) -> None:
        b.metrics.update(policy_gradient_update(stage.learner, b.trajs, b.adv, stage.cfg, b.seeds("minibatches")))


@blackbox_recipe
class CorrectionRecipe(BlackBoxRecipe):
    """SFT on the teacher's continuation from the student's first wrong step."""

    name = "correction"
    needs = (Capability.STEP_CRITIQUE, Capability.SAMPLING)

    def score(self, stage: "BlackBoxStage", b: StepBatch) -> None:
        b.data.targets, m = corrections(stage.ws, stage.teacher, b.data.eps, stage.cfg)
        b.metrics.update(m)

    def update(self, stage: "BlackBoxStage", b: StepBatch) -> None:
        if b.data.targets:
            b.metrics.update(stage.learner.sft_step(b.data.targets, agg=stage.cfg.loss_agg))


@blackbox_recipe
class RankingRecipe(PairsRecipe):
    """DPO / IPO / ORPO on each task's best and worst candidates by the teacher's (fused) ranking."""

    name = "ranking"
    needs = (Capability.RANKING,)

    def score(self, stage: "BlackBoxStage", b: StepBatch) -> None:
        p, teacher, groups = stage.cfg.preference, stage.teacher, episode_groups(b)
        ranked = teacher_map(teacher, teacher.rank, groups) if p.teacher_coef > 0 else [None] * len(groups)
        trajs = [[e.traj for e in g] for g in groups]
        scores = [ranking_scores(g, t, p.teacher_coef) for g, t in zip(trajs, ranked)]
        self.make_pairs(stage, b, trajs, scores, p.verifier_veto)


@blackbox_recipe
class ScoreRecipe(PolicyGradientRecipe):
    """GRPO on the verifier's reward fused with the teacher's rubric score."""

    name = "score"
    needs = (Capability.SCORING,)

    def score(self, stage: "BlackBoxStage", b: StepBatch) -> None:
        o, teacher, trajs = stage.cfg, stage.teacher, b.trajs
        ts = teacher_map(teacher, teacher.score, b.data.eps)
        overall = [x.overall(o.score.weights) if x is not None else None for x in ts]
        raw, fused = fused_rewards(trajs, overall, o.score.teacher_coef)
        got = [x for x in overall if x is not None]
        self.group_rewards(stage, b, raw)
        b.metrics.update(
            {
                "teacher_scored": float(fused),
                "teacher_skips": float(len(ts) - len(got)),
                "teacher_score_mean": _mean(got),
                "teacher_verifier_agreement": _agreement(trajs, ts),
                **{f"fused_reward_{k}": v for k, v in group_reward_stats(b.rewards).items()},
            }
        )

    def advantages(self, stage: "BlackBoxStage", b: StepBatch) -> None:
        adv = self.outcome_advantages(b)
        b.adv = [torch.tensor(t.loss_mask, dtype=torch.float32) * float(a) for t, a in zip(b.trajs, adv)]


@blackbox_recipe
class CritiqueRecipe(PolicyGradientRecipe):
    """GRPO whose per-turn advantage adds the teacher's standardised step score."""

    name = "critique"
    needs = (Capability.STEP_CRITIQUE,)

    def score(self, stage: "BlackBoxStage", b: StepBatch) -> None:
        self.group_rewards(stage, b, b.raw_rewards().reshape(-1))
        crit = teacher_map(stage.teacher, stage.teacher.critique, b.data.eps)
        sc = b.data.step_scores = [c.scores if c is not None else None for c in crit]
        b.metrics.update(
            teacher_skips=float(sum(c is None for c in crit)), step_score_mean=_mean([x for y in sc if y for x in y])
        )

    def advantages(self, stage: "BlackBoxStage", b: StepBatch) -> None:
        b.adv = step_advantages(b.trajs, self.outcome_advantages(b), b.data.step_scores, stage.cfg.critique.coef)


@blackbox_recipe
class SoftLabelsRecipe(SoftLabelRecipe):
    """Cross-entropy from the teacher's softmax over a task's candidates to the student's."""

    name = "soft_labels"
    needs = (Capability.RANKING,)

    def score(self, stage: "BlackBoxStage", b: StepBatch) -> None:
        groups = episode_groups(b)
        scores = teacher_map(stage.teacher, stage.teacher.rank, groups)
        b.data.soft = [
            ([e.traj for e in g], [torch.tensor(e.traj.loss_mask) for e in g], sc)
            for g, sc in zip(groups, scores)
            if sc is not None and max(sc) - min(sc) > 1e-6
        ]
        b.metrics.update(teacher_skips=float(sum(sc is None for sc in scores)), batch_size=float(len(b.data.soft)))


@blackbox_recipe
class ActionsRecipe(SoftLabelRecipe, PairsRecipe):
    """The teacher ranks candidate next turns at single states: soft labels over them, or
    (``actions.loss: preference``) preference pairs of turns."""

    name = "actions"
    needs = (Capability.ACTION_RANKING, Capability.SAMPLING)

    def soft_settings(self, stage: "BlackBoxStage") -> tuple[float, bool]:
        a = stage.cfg.actions
        return a.temperature, a.average

    def score(self, stage: "BlackBoxStage", b: StepBatch) -> None:
        data, m = action_groups(stage.ws, stage.model, stage.teacher, b.data.eps, stage.cfg, b.seeds)
        if stage.cfg.actions.loss == "preference":  # pairs of a state's actions; no veto: they share the outcome
            self.make_pairs(stage, b, [t for t, _, _ in data], [sc for _, _, sc in data], veto=False)
        else:
            b.data.soft = data
            b.metrics["batch_size"] = float(len(data))
        b.metrics.update(m)  # the states' counters (teacher_skips among them) over the pairs'

    def update(self, stage: "BlackBoxStage", b: StepBatch) -> None:
        if b.data.pairs is not None:
            PairsRecipe.update(self, stage, b)
        else:
            SoftLabelRecipe.update(self, stage, b)


NEEDS = {name: list(r.needs) for name, r in RECIPES.items()}


# -------------------------------------------------------------------- stage ------
class BlackBoxStage(Stage):
    """Black-box on-policy distillation: the student rolls out, the teacher (opened with the stage,
    closed with it) is asked about the student's episodes in the score hook, and the recipe
    (:data:`RECIPES`, by ``blackbox.recipe``) turns its answers into an update."""

    name = "blackbox"
    step_data = BlackBoxStepData
    update_metrics = ()  # each recipe reports its own update's metrics

    def __init__(self, ws: Workspace, model):
        super().__init__(ws, model)
        o = self.cfg
        self.recipe = RECIPES[o.recipe]()
        self.ref_model = frozen_copy(model) if uses_preference(o) and o.preference.loss != "orpo" else None
        self.state: dict[str, Any] = {"rollout_tokens": 0}
        self.exit = contextlib.ExitStack()
        try:
            self.teacher = self.exit.enter_context(
                open_teacher(ws, o.teacher, student=model, seed=self.seeds("teacher"))
            )
            require(self.teacher, list(self.recipe.needs), f"blackbox ({o.recipe})")
        except BaseException:
            self.exit.close()
            raise

    def rollout(self, b: StepBatch) -> None:
        """The student's rollouts, and the same as chat-message episodes for the teacher (``b.data.eps``)."""
        self.collect(b, self.cfg.samples_per_task)
        self.state["rollout_tokens"] += b.policy_tokens
        b.data.eps = student_episodes(self.ws, [t for t in b.tasks for _ in range(b.group_size)], b.trajs)

    def score(self, b: StepBatch) -> None:
        """The verifier's reward statistics, then the recipe asks the teacher."""
        b.metrics.update({f"reward_{k}": v for k, v in group_reward_stats(b.raw_rewards()).items()})
        b.data.teacher_t0 = time.perf_counter()
        self.recipe.score(self, b)

    def advantages(self, b: StepBatch) -> None:
        self.recipe.advantages(self, b)

    def update(self, b: StepBatch) -> None:
        self.recipe.update(self, b)

    def after(self, b: StepBatch) -> None:
        """The client's counters (cumulative), the teacher-and-update time, and the held-out check when due."""
        o = self.cfg
        b.metrics.update(
            {f"teacher_{k}": float(self.teacher.client.stats[k]) for k in STAT_KEYS},
            teacher_s=time.perf_counter() - b.data.teacher_t0,
            rollout_tokens_total=float(self.state["rollout_tokens"]),
        )
        if o.eval_every and (b.step + 1) % o.eval_every == 0:
            b.metrics["heldout_success"] = heldout_check(self.ws, self.model, o.eval_tasks)

    def state_dict(self) -> dict[str, Any]:
        return dict(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state["rollout_tokens"] = state.get("rollout_tokens", 0)

    def close(self) -> None:
        self.exit.close()


blackbox_stage = run_on_loop(BlackBoxStage)
