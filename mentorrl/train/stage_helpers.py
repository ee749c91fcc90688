"""The parts the stages' hooks share (the loop itself is :mod:`mentorrl.train.loop`).

- the rollout: :func:`collect_group` rolls each task out ``group_size`` times with the current policy, times
  it and refuses data the policy did not produce under the run's contract
  (:func:`require_consistent`);
- the policy-gradient minibatch update: :func:`minibatches` deals the step's trajectories into
  shuffled minibatches, :func:`pg_update` runs one clipped (or GRPO / masked-IS) update per
  minibatch (the learner counts the policy versions), and :func:`reduce_updates` turns the updates' metrics into
  one value per metric for ``metrics.jsonl``;
- off-policy guidance: :func:`relabel_behaviour` gives demonstrations the current policy's
  behaviour log-probs, :func:`guide_failed_groups` finds the scripted expert's verified
  demonstration for each group in which no rollout succeeded (``grpo.guide``), and
  :func:`guided_advantages` scores it as one more member of that group;
- the step's rewards and rollout metrics (:func:`group_rewards`, :func:`outcome_rewards`,
  :func:`rollout_metrics`), the high-reward-failure debugger and the held-out gap check
  (:class:`RewardGapWatch`, an RL stage's monitor of it).

Every seed comes from the caller (:class:`~mentorrl.train.loop.StepSeeds`), so a resumed stage
redoes a step exactly.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch

from mentorrl.algos.advantages import group_reward_stats, sanitize_group_rewards
from mentorrl.eval.metrics import summarize
from mentorrl.models.batch import collate, forward_logprobs
from mentorrl.models.device import autocast, resolve_dtype
from mentorrl.rollout.backends import backend_of
from mentorrl.train.audit import GapMonitor, flag_high_reward_failures
from mentorrl.train.consistency import batch_checks, policy_lag
from mentorrl.train.parallelism import cpu_clock, cpu_cores
from mentorrl.train.workspace import Workspace, heldout_check
from mentorrl.trajectory import Trajectory, write_jsonl

FINISH_REASONS = ("answer", "max_turns", "max_tokens", "length")
# What every policy-gradient update reports besides its loss (reduced over a step's updates by reduce_updates);
# each stage's list is its loss's own metrics plus these.
UPDATE_HEALTH = (
    "entropy",
    "grad_norm",
    "approx_kl",
    "logprob_abs_gap",
    "train_rollout_kl",
    "policy_lag_mean",
    "policy_lag_max",
)
PG_METRICS = ("pg_loss", "clip_frac", *UPDATE_HEALTH)


# ------------------------------------------------------------ rollouts -----
class Collected(NamedTuple):
    """One step's rollouts, in task order (each task ``group_size`` times), and what they cost."""

    trajs: list[Trajectory]
    rollout_s: float
    rollout_cpu_s: float


def collect_group(
    ws: Workspace,
    model,
    chosen: list,
    group_size: int,
    policy_version: int,
    seed: int,
    where: str | None,
    token_budgets: list[int] | None = None,
    shard: bool = False,
) -> Collected:
    """Roll every task of ``chosen`` out ``group_size`` times (task by task, seeds from ``seed``);
    with ``where``, raise unless the batch passes the consistency checks (:func:`require_consistent`).
    ``shard``: split the rollouts over the data-parallel ranks (:func:`rollout_shared`)."""
    grouped = [t for t in chosen for _ in range(group_size)]
    extra = {"token_budgets": token_budgets} if token_budgets is not None else {}
    t0, c0 = time.perf_counter(), cpu_clock()
    if shard:
        trajs = rollout_shared(ws, model, grouped, policy_version, seed)
    else:
        trajs = ws.rollout.run(
            model, grouped, policy_version=policy_version, seed=seed, batch_size=len(grouped), **extra
        )
    collected = Collected(trajs, time.perf_counter() - t0, cpu_clock() - c0)
    if where is not None:
        require_consistent(ws, trajs, policy_version, where)
    return collected


def rollout_shared(ws: Workspace, model, tasks: list, policy_version: int, seed: int) -> list[Trajectory]:
    """One step's rollouts, in task order. Under data parallel each rank decodes its contiguous
    share (seeded by its offset in the batch) and all ranks gather every trajectory; under
    ``distributed.backend: ray`` the shares go to the Ray rollout actors the same way."""
    cfg = ws.cfg
    if cfg.distributed.backend == "ray":  # rollout actors (mentorrl.distributed.ray_workers, docs/ray.md)
        return ws.ray_rollouts(model).rollout(tasks, policy_version, seed)
    if ws.dp is None:
        return ws.rollout.run(model, tasks, policy_version=policy_version, seed=seed, batch_size=len(tasks))
    own = ws.dp.shard(len(tasks))
    mine = (
        ws.rollout.run(
            model,
            tasks[own.start : own.stop],
            policy_version=policy_version,
            seed=seed + own.start,
            batch_size=max(len(own), 1),
        )
        if len(own)
        else []
    )
    return [t for part in ws.dp.all_gather(mine) for t in part]


def require_consistent(ws: Workspace, trajs: list[Trajectory], current_version: int, where: str) -> None:
    """Never train on data the policy did not produce under this run's contract: raise on any failed check."""
    checks = batch_checks(
        trajs, current_version, ws.contract.env_name, ws.contract.env_version, ws.contract.fingerprint()
    )
    failed = [f"{c.name}: {c.detail}" for c in checks if not c.passed]
    if failed:
        raise RuntimeError(f"{where}: train/rollout consistency check failed: " + "; ".join(failed))


# ------------------------------------------------------------ guidance -----
@torch.no_grad()
def relabel_behaviour(
    model,
    trajs: list[Trajectory],
    pad_id: int,
    temperature: float,
    policy_version: int | None = None,
    precision: str | None = None,
) -> list[Trajectory]:
    """Copies of ``trajs`` whose behaviour log-probs are the current policy's (for off-policy
    demonstrations): the importance ratio is 1 at the update, so a demonstration's share of the
    policy-gradient loss is its advantage times the maximum-likelihood gradient. With
    ``policy_version`` the copies are stamped with it (the version whose log-probs they carry).
    ``precision``: the learner's compute dtype (``model.dtype``), so the ratio is 1 under its autocast too."""
    if not trajs:
        return []
    device = next(model.parameters()).device
    with autocast(device, resolve_dtype(precision)):
        lp = forward_logprobs(model, collate(trajs, pad_id).to(device), temperature)[0].float().cpu()
    extra = {} if policy_version is None else {"policy_version": policy_version}
    return [
        t.model_copy(
            update={
                "logprobs": [float(x) if m else 0.0 for x, m in zip(lp[b, : len(t.token_ids)].tolist(), t.loss_mask)],
                **extra,
            }
        )
        for b, t in enumerate(trajs)
    ]


def guide_failed_groups(
    ws: Workspace, model, tasks: list, trajs: list[Trajectory], expert: Any, policy_version: int, pad_id: int
) -> list[tuple[int, Trajectory]]:
    """Expert guidance for GRPO (mixed-policy groups, after LUFFY, Yan et al. 2025): for every group
    where no rollout succeeded, the scripted expert's demonstration of that task, if the verifier
    accepts it, as ``(group index, demonstration)``. Such a group otherwise carries no signal
    towards success: every member failed, so group-relative advantages only rank failures. The
    demonstration joins its group (:func:`guided_advantages`); the policy's rollouts all stay, so a
    harmful failure (a violation) keeps its more negative advantage. It is relabelled with the
    current policy's log-probs and version (:func:`relabel_behaviour`). Groups with a success, and
    tasks the expert cannot solve, get nothing."""
    size = len(trajs) // max(len(tasks), 1)
    failed = [
        i
        for i in range(len(tasks))
        if not any(t.reward is not None and t.reward.success for t in trajs[i * size : (i + 1) * size])
    ]
    if not failed:
        return []
    demos = ws.rollout.demonstrations(expert, [tasks[i] for i in failed])
    by_task = {d.task_id: d for d in demos}
    pairs = [(i, by_task[tasks[i].id]) for i in failed if tasks[i].id in by_task]
    relabelled = relabel_behaviour(
        model, [d for _, d in pairs], pad_id, ws.contract.sampling.temperature, policy_version, ws.cfg.model.dtype
    )
    return [(i, d) for (i, _), d in zip(pairs, relabelled)]


def guided_advantages(
    estimator: Any, rewards: torch.Tensor, guided: list[tuple[int, float]], **kw: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages of the ``[tasks, G]`` policy rollouts (flattened, row-major) and of each guided
    group's demonstration (``guided``: (group index, its reward)). A guided group's ``G + 1`` rewards
    go through ``estimator`` together, as one group; the others exactly as without guidance."""
    adv = estimator(rewards, **kw).clone()
    extra = []
    for i, r in guided:
        row = estimator(torch.cat([rewards[i], torch.tensor([r], dtype=rewards.dtype)]).view(1, -1), **kw).view(-1)
        adv[i] = row[:-1]
        extra.append(row[-1])
    return adv.reshape(-1), (torch.stack(extra) if extra else torch.zeros(0, dtype=adv.dtype))


# ------------------------------------------------------------- rewards -----
def group_rewards(raw: torch.Tensor, audit) -> tuple[torch.Tensor, dict[str, float], dict[str, float]]:
    """``[tasks, G]`` rewards sanitised with the audit's bounds and outlier rule, the clip counters,
    and the group statistics as ``reward_*`` metrics."""
    rewards, clipped = sanitize_group_rewards(raw, audit.reward_low, audit.reward_high, audit.outlier_z)
    return rewards, clipped, {f"reward_{k}": v for k, v in group_reward_stats(rewards).items()}


def outcome_rewards(trajs: list[Trajectory], audit) -> tuple[torch.Tensor, dict[str, float]]:
    """Each trajectory's total reward, sanitised (non-finite / out-of-range clipped) without group statistics: ``[B]``."""
    raw = torch.tensor([t.reward.total for t in trajs], dtype=torch.float32).view(-1, 1)
    rewards, clipped = sanitize_group_rewards(raw, audit.reward_low, audit.reward_high, None)
    return rewards.view(-1), clipped


def rollout_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    """What one step's rollouts did, for ``metrics.jsonl``: success, tool calls per trajectory
    (well-formed ones, whatever the tool answered), the malformed-call rate (turns with unparsable
    tool-call tags, over all call attempts), the share of each finish reason (``finish_answer``,
    ``finish_max_turns``: turn limit, ``finish_max_tokens``: context budget, ``finish_length``:
    a turn cut at ``max_new_tokens``), turns and policy tokens; and the seconds the episodes' tool
    calls (``rollout_tool_s``) and verifications (``rollout_verify_s``) took, summed over episodes:
    they run beside the decoding, so their sum over the step's wall time bounds the share of it the
    environment (a sandbox) can hold."""
    s = summarize(trajs)
    n = len(trajs)
    calls = [c for t in trajs for c in t.tool_calls]
    malformed = sum(c.error_kind == "malformed" for c in calls)
    out = {
        "task_success": s["success"],
        "tool_success": s["tool_success"],
        "mean_turns": s["mean_turns"],
        "violation_rate": s["violation_rate"],
        "mean_policy_tokens": s["mean_policy_tokens"],
        "rollout_tokens": float(sum(t.num_policy_tokens for t in trajs)),  # policy tokens the student generated
        "tool_calls_per_traj": (len(calls) - malformed) / n if n else 0.0,
        "malformed_call_rate": malformed / len(calls) if calls else 0.0,
        "rollout_backend": backend_of(
            trajs
        ),  # a tag: the engine that sampled them (hf, vllm), for the consistency metrics
    }
    out.update({f"finish_{r}": (sum(t.finish_reason == r for t in trajs) / n if n else 0.0) for r in FINISH_REASONS})
    for key in ("tool_s", "verify_s"):
        out[f"rollout_{key}"] = float(sum(t.timings.get(key, 0.0) for t in trajs))
    return out


def rollout_cost(trajs: list[Trajectory], rollout_s: float, rollout_cpu_s: float) -> dict[str, float]:
    """A step's rollout metrics (:func:`rollout_metrics`) with how many were rolled out, their wall and CPU seconds
    and the share of the machine's cores the rollout kept busy."""
    return {
        **rollout_metrics(trajs),
        "rollouts": float(len(trajs)),
        "rollout_s": rollout_s,
        "rollout_cpu_s": rollout_cpu_s,
        "rollout_cpu_util": rollout_cpu_s / max(rollout_s, 1e-9) / cpu_cores(),
    }


def reward_debugger(trajs: list[Trajectory], threshold: float, path: Path) -> dict[str, float]:
    """Flag high-reward failures; write them for review (a redone step overwrites its file)."""
    flagged = flag_high_reward_failures(trajs, threshold)
    if flagged:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_jsonl(path, flagged)
    return {"reward_flagged": float(len(flagged)), "reward_flagged_share": len(flagged) / len(trajs) if trajs else 0.0}


def score_outcomes(ws, stage: str, step: int, trajs: list[Trajectory]) -> tuple[torch.Tensor, dict[str, float]]:
    """The outcome-reward ``score`` of a critic-based stage (PPO, SAO): each trajectory's sanitised total reward
    (``[B]``), and the step's metrics -- reward mean / std, the share clipped, and the reward debugger's flags
    (written to ``RUN_DIR/audit/flagged-<stage>-step-N.jsonl``)."""
    audit = ws.cfg.audit
    rewards, clipped = outcome_rewards(trajs, audit)
    metrics = {
        "reward_mean": rewards.mean().item(),
        "reward_std": rewards.std().item() if len(trajs) > 1 else 0.0,
        "reward_clipped": clipped["clipped"],
    }
    flagged = ws.run_dir / "audit" / f"flagged-{stage}-step-{step + 1:06d}.jsonl"
    return rewards, {**metrics, **reward_debugger(trajs, audit.flag_reward, flagged)}


def gap_check(ws: Workspace, monitor: GapMonitor, step: int, success: float) -> dict[str, float]:
    """Held-out ``success`` now (:func:`heldout_check`), fed to the reward-success gap monitor."""
    warning = monitor.observe_eval(step, success)
    if warning:
        ws.console.print(f"[bold red]warning:[/bold red] {warning['message']}")
    return {"heldout_success": success, "gap_warning": 1.0 if warning else 0.0}


# ------------------------------------------------------------- updates -----
class RewardGapWatch:
    """The reward-success gap monitor of an RL stage: each step's mean reward, and every
    ``audit.eval_every`` steps a held-out check (all ranks keep the same monitor; it is checkpointed)."""

    def __init__(self, ws: Workspace, model):
        a = ws.cfg.audit
        self.ws, self.model = ws, model
        self.monitor = GapMonitor(a.reward_window, a.reward_rise, a.success_rise)

    def observe(self, step: int, reward_mean: float) -> dict[str, float]:
        """Feed step ``step``'s (0-based) mean reward; the held-out check's metrics when it is due."""
        ws, audit = self.ws, self.ws.cfg.audit
        self.monitor.observe_reward(step + 1, reward_mean)
        if not (audit.eval_every and (step + 1) % audit.eval_every == 0):
            return {}
        success = heldout_check(ws, self.model, audit.eval_tasks)  # every rank takes part
        out, state = ws.on_main(lambda: (gap_check(ws, self.monitor, step + 1, success), self.monitor.state_dict()))
        self.monitor.load_state_dict(state)
        return out

    def state_dict(self) -> dict[str, Any]:
        return self.monitor.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.monitor.load_state_dict(state or {})


def minibatches(items: list[int], k: int, seed: int) -> list[list[int]]:
    """``items`` shuffled with ``seed`` and dealt round-robin into ``min(k, len(items))`` minibatches."""
    return [[i for unit in mb for i in unit] for mb in deal([[i] for i in items], k, seed)]


def deal(units: list[list[int]], k: int, seed: int) -> list[list[list[int]]]:
    """``units`` (lists of items that stay together, e.g. a GRPO group) shuffled with ``seed`` and
    dealt round-robin into ``min(k, len(units))`` minibatches."""
    perm = torch.randperm(len(units), generator=torch.Generator().manual_seed(seed)).tolist()
    order = [units[i] for i in perm]
    k = min(k, len(order))
    return [order[i::k] for i in range(k)]


def length_order(idx: list[int], trajs: list[Trajectory], world_size: int = 1) -> list[int]:
    """``idx`` reordered so that micro-batches (consecutive runs) hold trajectories of similar length:
    less right-padding in the learner's forward and backward. With ``world_size`` data-parallel
    ranks, each rank's contiguous share gets every ``world_size``-th trajectory of the sorted order,
    so the shares stay alike in length. An update's loss is a weighted sum over trajectories, so the
    order changes it only by float rounding."""
    s = sorted(idx, key=lambda i: len(trajs[i].token_ids))
    return s if world_size <= 1 else [i for r in range(world_size) for i in s[r::world_size]]


def prefix_order(idx: list[int], trajs: list[Trajectory]) -> list[int]:
    """``idx`` in lexicographic order of the trajectories' tokens, so a micro-batch (a consecutive
    run, and a data-parallel rank's contiguous share) holds whole groups whose shared prompt and
    common first turns the learner's prefix packing runs once (:func:`mentorrl.models.batch.prefix_pack`)."""
    return sorted(idx, key=lambda i: trajs[i].token_ids)


def update_order(learner, idx: list[int], trajs: list[Trajectory]) -> list[int]:
    """The order a minibatch is micro-batched in: by shared prefix when the learner packs prefixes,
    else by length."""
    if learner.packs_prefixes:
        return prefix_order(idx, trajs)
    return length_order(idx, trajs, learner.dp.world_size if learner.dp is not None else 1)


def reduce_updates(updates: list[dict[str, float]], keys: tuple[str, ...]) -> dict[str, float]:
    """One value per metric over a step's optimizer updates: the max for ``*_max`` keys, else the mean (0 if none)."""
    out = {}
    for key in keys:
        vals = [m[key] for m in updates if key in m]
        out[key] = (max(vals) if key.endswith("_max") else sum(vals) / len(vals)) if vals else 0.0
    return out


def pg_update(
    learner,
    trajs: list[Trajectory],
    adv,
    k: int,
    seed: int,
    *,
    items: list[int] | None = None,
    groups: list[list[int]] | None = None,
    kind: str = "clipped",
    skip_zero: bool = False,
    drop_zero: bool = False,
    nll_weights: torch.Tensor | None = None,
    sync: Callable[[Any, int], None] | None = None,
    **loss: Any,
) -> list[dict[str, float]]:
    """One pass of policy-gradient updates: ``items`` (default: every trajectory) dealt into ``k``
    minibatches with ``seed``, one optimizer step per minibatch; each update's metrics with the
    minibatch's policy lag behind the learner's policy version (which the learner advances).
    ``groups`` (instead of ``items``): lists of trajectories dealt together, so a minibatch holds
    whole GRPO groups (as verl deals prompts): their advantages balance within it, and the learner
    runs each group's shared prompt and common turns once, not once per minibatch it was split over.

    ``adv``: per-trajectory token advantages (a list of 1-D tensors), or one advantage per trajectory (a
    tensor: GRPO's sequence level, where ``kind`` is any registered policy loss, ``grpo.loss``). ``skip_zero`` skips a minibatch whose advantages are all 0.
    ``drop_zero`` (only without a KL term: then a zero-advantage trajectory's loss is exactly 0) does
    not forward a minibatch's zero-advantage trajectories but keeps them in its loss denominator,
    so each update equals the one over the whole minibatch (dropping them from the denominator too
    would scale the step up by up to ``group_size`` when few groups carry signal). A minibatch
    with no signal at all is skipped.
    ``nll_weights`` (sequence-level ``adv`` only; [len(trajs)] or None): an SFT term per trajectory
    (:meth:`Learner.policy_step`); a trajectory with a non-zero weight is forwarded whatever its advantage.
    ``loss`` goes to the learner's step (``eps_low``, ``eps_high``, ``agg``, ``ref_model``, ``kl_coef``)."""
    per_sequence = isinstance(adv, torch.Tensor)
    if nll_weights is not None and not per_sequence:
        raise ValueError("pg_update: nll_weights needs one advantage per trajectory (a tensor)")
    if groups is not None and items is not None:
        raise ValueError("pg_update: give items or groups, not both")
    units = groups if groups is not None else [[i] for i in (range(len(trajs)) if items is None else items)]
    units = [u for u in units if u]
    ups: list[dict[str, float]] = []
    for idx in [[i for u in mb for i in u] for mb in deal(units, k, seed)] if units else []:
        live = [i for i in idx if adv[i].abs().sum() > 0 or (nll_weights is not None and nll_weights[i] != 0)]
        if (skip_zero or drop_zero) and not live:
            continue
        norm = None
        if drop_zero and len(live) < len(idx):
            norm = (float(sum(trajs[i].num_policy_tokens for i in idx)), len(idx))
            idx = live
        idx = update_order(learner, idx, trajs)
        batch = [trajs[i] for i in idx]
        lag_from = learner.version
        if per_sequence:
            nll = nll_weights[idx] if nll_weights is not None else None
            m = learner.policy_step(batch, adv[idx], kind, norm=norm, nll_weights=nll, **loss)
        else:
            m = learner.token_policy_step(batch, [adv[i] for i in idx], kind, norm=norm, **loss)
        ups.append({**m, **policy_lag(batch, lag_from)})
    if ups and sync is not None:  # outside the loop (which syncs after every update hook)
        sync(learner.model, learner.version)  # a rollout engine of its own (vLLM) gets the new weights
    return ups
