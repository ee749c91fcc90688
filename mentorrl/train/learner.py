"""The learner: optimiser, micro-batched gradient accumulation, and the two update kinds.

The algorithm itself lives in ``mentorrl.algos`` (pure functions); the learner only
feeds it tensors built from trajectories and applies the gradient.

Data parallel (``dp=``, a :class:`~mentorrl.train.distributed.DataParallel`): every rank is given
the whole batch, runs forward/backward on its contiguous share only, and DDP all-reduces the
gradients once per optimizer step; micro-batches are weighted by their share of the global batch
so the result is the single-process full-batch gradient (see :mod:`mentorrl.train.distributed`).
Under ``fsdp2`` the same weighting holds; the optimizer steps a sharded copy whose weights are
gathered back into the policy after each step (:mod:`mentorrl.train.fsdp`).
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Callable, Sequence

import torch

from mentorrl.algos.logprobs import masked_mean
from mentorrl.algos.losses import clipped_value_loss, get_policy_loss, sft_loss, weighted_nll
from mentorrl.config import OptimConfig
from mentorrl.models.batch import TokenBatch, collate, forward_logprobs
from mentorrl.models.device import autocast, grad_scaler, module_placement, resolve_dtype
from mentorrl.train.consistency import logprob_gap_metrics
from mentorrl.train.memory import OffloadedAdamW, enable_gradient_checkpointing, micro_batch_slices, offload_applies
from mentorrl.trajectory import Trajectory


def make_optimizer(model, cfg: OptimConfig):
    """AdamW over the parameters that train (``requires_grad``: with LoRA adapters, only theirs; state in CPU
    memory with ``cfg.offload_optimizer`` on a GPU model, :class:`~mentorrl.train.memory.OffloadedAdamW`) and its
    warm-up schedule."""
    params = [p for p in model.parameters() if p.requires_grad]
    adamw = OffloadedAdamW if cfg.offload_optimizer and offload_applies(model) else torch.optim.AdamW
    opt = adamw(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    warm = max(cfg.warmup_steps, 0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
    return opt, sched


def _share(mb: TokenBatch, total_tokens: float, total_seqs: int, agg: str) -> float:
    """Weight of one micro-batch so the accumulated loss equals the full-batch aggregate.

    ``"sum"``: the loss function already divides by a batch-wide total, so every micro-batch counts 1."""
    if agg == "sum":
        return 1.0
    if agg == "token-mean":
        return float(mb.loss_mask.sum()) / max(total_tokens, 1.0)
    return mb.input_ids.shape[0] / total_seqs


def pad_token_values(rows: Sequence[torch.Tensor], T: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Right-pad per-trajectory tensors ``[T_b, ...]`` to ``[B, T, ...]`` with zeros, like :func:`collate`."""
    out = torch.zeros(len(rows), T, *rows[0].shape[1:], dtype=dtype)
    for b, r in enumerate(rows):
        out[b, : r.shape[0]] = r.to(dtype)
    return out


class Learner:
    def __init__(
        self,
        model,
        optim: OptimConfig,
        pad_id: int,
        temperature: float = 1.0,
        dp=None,
        version_per_update: bool = True,
        precision: str | torch.dtype | None = None,
    ):
        """``precision``: the compute dtype (``model.dtype``: float32, bfloat16, float16; None: float32).
        Below float32 the learner trains in mixed precision: ``model``'s weights and the optimizer state
        stay as they are (fp32), forward and backward run under ``torch.autocast``, and float16 on a GPU
        scales the loss (``torch.amp.GradScaler``)."""
        self.model = model
        # The policy version: the number of weight versions the rollout may have sampled from. With
        # ``version_per_update`` every optimizer step is a new version; otherwise the owner calls
        # :meth:`publish` when its weights go to the rollout (SAO's sync every k steps).
        self.version = 0
        self.version_per_update = version_per_update
        self.cfg = optim
        self.pad_id = pad_id
        self.temperature = temperature if temperature > 0 else 1.0
        self.compute_dtype = resolve_dtype(precision)
        self.scaler = grad_scaler(module_placement(model).device, self.compute_dtype)
        # why optim.gradient_checkpointing is not in effect (None: it is, or was not asked for)
        self.checkpointing_problem = enable_gradient_checkpointing(model) if optim.gradient_checkpointing else None
        self.dp = dp if dp is not None and dp.world_size > 1 else None
        self._ddp = self.dp.wrap(model) if self.dp is not None else None
        # fsdp2: the optimizer steps a sharded training copy, and ``model`` is given its weights after each step
        self.sharded = self._ddp if getattr(self._ddp, "sharded", False) else None
        self.optimizer, self.scheduler = make_optimizer(self.trained, optim)

    @property
    def trained(self) -> torch.nn.Module:
        """The module whose parameters the optimizer steps: the policy, or under ``fsdp2`` its sharded
        training copy (:class:`~mentorrl.train.fsdp.ShardedModule`)."""
        return self.sharded.module if self.sharded is not None else self.model

    @property
    def pack_mode(self) -> bool | str:
        """The ``pack`` argument of the learner's forwards (:func:`mentorrl.models.batch.selected_states`):
        False, "dense" (a dense tree mask only), or True (block-sparse where the model supports it)."""
        if not self.cfg.pack_prefixes:
            return False
        return True if self.cfg.tree_attention else "dense"

    @property
    def packs_prefixes(self) -> bool:
        """Whether this learner's forwards pack shared prefixes (config on and a model that takes a
        tree mask; a model whose packed forward then disagrees with its padded one still falls back)."""
        from mentorrl.models.batch import packable

        return bool(self.cfg.pack_prefixes) and packable(self.model)

    # ---- generic accumulation --------------------------------------------
    def _forward_with(self, model, mb: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """What ``loss_fn`` receives per micro-batch: (per-token outputs, per-token entropy), both [B, T]."""
        return forward_logprobs(model, mb, self.temperature, with_entropy=True, pack=self.pack_mode)

    def _forward(self, mb: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return self._forward_with(self.model, mb)

    def autocast(self):
        """The context of this learner's forwards: autocast in its compute dtype (nothing for float32)."""
        return autocast(module_placement(self.model).device, self.compute_dtype)

    def _backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def _optimizer_step(self) -> float:
        """Clip the accumulated gradients and step (skipping a non-finite update); the gradient norm."""
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self.sharded is not None:  # DTensor gradients: the norm is reduced over the ranks
            gn = self.sharded.clip_grad_norm_(self.cfg.max_grad_norm)
        else:
            gn = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm))
        if math.isfinite(gn):
            self.optimizer.step()
        else:  # skip a poisoned update rather than corrupt the weights
            self.optimizer.zero_grad(set_to_none=True)
        if self.scaler is not None:
            self.scaler.update()
        if self.sharded is not None:
            self.sharded.publish(self.model)  # the rollout, evaluation and final weights read the full policy
        return gn

    def micro_batches(self, trajs: Sequence[Trajectory], lo: int, hi: int) -> list[slice]:
        """Rows ``[lo, hi)`` of ``trajs`` as micro-batches (``optim.micro_batch_tokens`` or ``micro_batch_size``)."""
        return micro_batch_slices([len(t.token_ids) for t in trajs], lo, hi, self.cfg)

    def _run(self, fn: Callable, *args):
        """``fn(model, *args)``, through DDP when data-parallel (which arms the gradient all-reduce)."""
        return self._ddp(fn, *args) if self._ddp is not None else fn(self.model, *args)

    def _sync(self, last: bool):
        """DDP's ``no_sync`` for all but a rank's last micro-batch: one all-reduce per optimizer step."""
        return self._ddp.no_sync() if self._ddp is not None and not last else nullcontext()

    def _lockstep(self, slices: list[slice]) -> list[slice | None]:
        """The micro-batches this rank runs: its own, then (None) zero-weight ones up to one at least
        and, under ``fsdp2``, up to the busiest rank's count (every rank all-gathers each layer in
        every forward, so all run as many)."""
        n = self.dp.max_over_ranks(len(slices)) if self.sharded is not None else len(slices)
        return [*slices, *[None] * (max(n, 1) - len(slices))]

    def _own_slices(self, trajs: Sequence[Trajectory]) -> list[slice]:
        """This rank's micro-batches, as slices of the *global* batch (so per-trajectory inputs
        such as advantages are indexed the same way on every rank)."""
        own = self.dp.shard(len(trajs)) if self.dp is not None else range(len(trajs))
        return self.micro_batches(trajs, own.start, own.stop)

    def reduce_across_ranks(
        self, sums: dict[str, float], maxes: dict[str, float] | None = None
    ) -> tuple[dict[str, float], dict[str, float]]:
        """Per-rank partial sums summed (and maxima maxed) over ranks; unchanged in one process."""
        maxes = maxes or {}
        if self.dp is None:
            return sums, maxes
        s_out: dict[str, float] = {}
        m_out: dict[str, float] = {}
        for s, m in self.dp.all_gather((sums, maxes)):
            for k, v in s.items():
                s_out[k] = s_out.get(k, 0.0) + v
            for k, v in m.items():
                m_out[k] = max(m_out.get(k, v), v)
        return s_out, m_out

    def _accumulate(
        self,
        trajs: Sequence[Trajectory],
        agg: str,
        loss_fn: Callable[[TokenBatch, torch.Tensor, torch.Tensor, slice], tuple[torch.Tensor, dict]],
        forward: Callable[[torch.nn.Module, TokenBatch, slice], tuple[torch.Tensor, torch.Tensor]] | None = None,
        norm: tuple[float, int] | None = None,
    ) -> dict[str, float]:
        """Run ``loss_fn`` per micro-batch, weighting each so the sum is the full-batch loss; one optimiser step.

        ``loss_fn`` returns ``(loss, metrics)``, or ``(loss, metrics, extra)`` where ``extra`` is a term
        already normalised over the whole batch (added as it is, not weighted by the micro-batch's share).

        ``norm = (policy tokens, sequences)`` of the batch the aggregate is taken over, when ``trajs``
        is part of it: trajectories left out because their loss is exactly zero (zero advantage, no
        KL term) still count in the token-mean / seq-mean denominator, so the update is the
        full batch's update, not a larger one (default: ``trajs`` themselves).

        ``forward(model, mb, sl)`` replaces the default forward. Data-parallel: only this rank's
        share is run; each loss is scaled by the world size because DDP averages the ranks'
        gradients, and the metrics' per-rank partial sums are summed over ranks."""
        self.trained.train()
        device = next(self.model.parameters()).device
        total_tokens, total_seqs = (
            (float(sum(t.num_policy_tokens for t in trajs)), len(trajs)) if norm is None else norm
        )
        metrics: dict[str, float] = {}
        scale = float(self.dp.world_size) if self.dp is not None else 1.0
        fwd = forward if forward is not None else (lambda model, mb, sl: self._forward_with(model, mb))
        self.optimizer.zero_grad(set_to_none=True)
        ent_sum, tok_sum = 0.0, 0.0
        runs = self._lockstep(self._own_slices(trajs))
        for i, sl in enumerate(runs):
            idle = sl is None  # a rank with no (more) share still joins the step's collectives, with zeros
            sl = slice(0, 1) if idle else sl
            with self._sync(last=i == len(runs) - 1):
                mb = collate(trajs[sl], self.pad_id).to(device)
                with self.autocast():
                    logprobs, entropy = self._run(fwd, mb, sl)
                logprobs, entropy = logprobs.float(), entropy.float()
                if idle:
                    self._backward(logprobs.sum() * 0.0)
                    continue
                loss, m, *extra = loss_fn(mb, logprobs, entropy, sl)
                w = _share(mb, total_tokens, total_seqs, agg)
                self._backward((loss * w + (extra[0] if extra else 0.0)) * scale)
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0.0) + w * float(v)
            n = float(mb.loss_mask.sum())
            ent_sum += float(masked_mean(entropy, mb.loss_mask)) * n
            tok_sum += n
        if self.dp is not None:
            metrics, _ = self.reduce_across_ranks({**metrics, "__ent": ent_sum, "__tok": tok_sum})
            ent_sum, tok_sum = metrics.pop("__ent"), metrics.pop("__tok")
        gn = self._optimizer_step()
        self.scheduler.step()
        self.trained.eval()
        if self.version_per_update:
            self.version += 1
        metrics.update(
            grad_norm=gn,
            entropy=ent_sum / max(tok_sum, 1.0),
            lr=self.scheduler.get_last_lr()[0],
            skipped_update=float(not math.isfinite(gn)),
        )
        return metrics

    # ---- update kinds -------------------------------------------------------
    def sft_step(self, trajs: Sequence[Trajectory], agg: str = "token-mean") -> dict[str, float]:
        def fn(mb, logprobs, entropy, sl):
            return sft_loss(logprobs, mb.loss_mask, agg=agg)

        return self._accumulate(trajs, agg, fn)

    def policy_step(
        self,
        trajs: Sequence[Trajectory],
        advantages: torch.Tensor,
        loss_name: str = "grpo",
        ref_model=None,
        norm: tuple[float, int] | None = None,
        nll_weights: torch.Tensor | None = None,
        **loss_kwargs,
    ) -> dict[str, float]:
        """One clipped policy-gradient update; ``advantages`` is [len(trajs)] (sequence level).
        ``norm``: see :meth:`_accumulate` (the batch ``trajs`` were taken from).
        ``nll_weights`` ([len(trajs)], or None): adds ``sum_i w_i * NLL_i`` to the loss, ``NLL_i`` the
        summed negative log-likelihood of trajectory i's policy tokens, whatever its advantage (an SFT
        term on chosen trajectories, e.g. the expert's demonstrations of ``grpo.guide_sft``)."""
        agg = loss_kwargs.get("agg", "token-mean")
        loss = get_policy_loss(loss_name)

        def fn(mb, logprobs, entropy, sl):
            adv = advantages[sl].to(logprobs.device)
            ref = None
            if ref_model is not None:
                with torch.no_grad():
                    ref, _ = forward_logprobs(ref_model, mb, self.temperature, pack=self.pack_mode)
            kw = dict(loss_kwargs)
            if ref is not None:
                kw["ref_logprobs"] = ref
            value, m = loss(logprobs, mb.old_logprobs, adv, mb.loss_mask, **kw)
            m = {**m, **logprob_gap_metrics(mb.old_logprobs, logprobs, mb.loss_mask)}
            if nll_weights is None:
                return value, m
            nll = weighted_nll(logprobs, mb.loss_mask, nll_weights[sl].to(logprobs.device))
            return value, m, nll

        return self._accumulate(trajs, agg, fn, norm=norm)

    def token_policy_step(
        self,
        trajs: Sequence[Trajectory],
        token_advantages: Sequence[torch.Tensor],
        loss_name: str = "clipped",
        norm: tuple[float, int] | None = None,
        **loss_kwargs,
    ) -> dict[str, float]:
        """One policy-gradient update with per-token advantages (PPO / SAO): one 1-D tensor per
        trajectory, aligned to its ``token_ids`` (0 off the policy tokens). ``norm``: see :meth:`_accumulate`."""
        agg = loss_kwargs.get("agg", "token-mean")
        loss = get_policy_loss(loss_name)

        def fn(mb, logprobs, entropy, sl):
            adv = pad_token_values(token_advantages[sl], mb.input_ids.shape[1]).to(logprobs.device)
            value, m = loss(logprobs, mb.old_logprobs, adv, mb.loss_mask, **loss_kwargs)
            return value, {**m, **logprob_gap_metrics(mb.old_logprobs, logprobs, mb.loss_mask)}

        return self._accumulate(trajs, agg, fn, norm=norm)

    def distill_step(
        self,
        trajs: Sequence[Trajectory],
        topk_ids: Sequence[torch.Tensor],
        topk_logprobs: Sequence[torch.Tensor],
        kind: str = "reverse",
        beta: float = 0.5,
        token_weights: Sequence[torch.Tensor] | None = None,
        tail: bool = False,
    ) -> dict[str, float]:
        """One top-k distillation update (white-box OPD on the student's own trajectories).

        Per trajectory, ``topk_ids`` / ``topk_logprobs`` are the teacher's ``[T, k]`` top-k at every
        position (e.g. :class:`~mentorrl.opd.teacher.TeacherSignal`). At each policy token the
        student's distribution over those k tokens and the teacher's, both renormalised there,
        are compared with ``kind`` (reverse / forward KL, JSD(beta)); the loss is their mean over
        policy tokens, weighted by ``token_weights`` when given (e.g. ShortOPD selections or
        MOPD step weights), exactly over the whole batch whatever the micro-batching. ``tail``:
        compare k + 1 bins (the top-k and the rest of the mass, :func:`~mentorrl.algos.distill.with_tail`)
        instead of renormalising over the k tokens."""
        from mentorrl.algos.distill import divergence_of, renormalise, with_tail

        support = with_tail if tail else renormalise
        from mentorrl.models.batch import forward_selected_logprobs

        weights = [torch.tensor(t.loss_mask, dtype=torch.float32) for t in trajs]
        if token_weights is not None:
            weights = [m * w for m, w in zip(weights, token_weights)]
        total = float(sum(w.sum() for w in weights))
        if total <= 0:
            raise ValueError("distill_step: no policy token has a positive weight")
        device = next(self.model.parameters()).device
        seen: dict[str, float] = {"max": 0.0, "sum": 0.0}

        def forward(model, mb, sl):
            ids = pad_token_values(topk_ids[sl], mb.input_ids.shape[1], dtype=torch.long).to(device)
            return forward_selected_logprobs(model, mb, ids, self.temperature, pack=self.pack_mode), torch.zeros_like(
                mb.loss_mask, dtype=torch.float32
            )

        def fn(mb, student_k, _entropy, sl):
            T = mb.input_ids.shape[1]
            teacher_k = pad_token_values(topk_logprobs[sl], T).to(student_k.device)
            div = divergence_of(support(student_k), support(teacher_k), kind, beta)
            w = pad_token_values(weights[sl], T).to(div.device) * (mb.loss_mask != 0)
            d = div.detach()[w > 0]
            seen["max"] = max(seen["max"], d.max().item() if d.numel() else 0.0)
            seen["sum"] += (d * w[w > 0]).sum().item()
            return (div * w).sum() / total, {}

        m = self._accumulate(trajs, "sum", fn, forward=forward)
        m.pop("entropy", None)
        (sums, maxes) = self.reduce_across_ranks({"sum": seen["sum"]}, {"max": seen["max"]})
        seen.update(sum=sums["sum"], max=maxes["max"])
        m.update(distill_loss=seen["sum"] / total, divergence_max=seen["max"], distilled_token_weight=total)
        return m

    @torch.no_grad()
    def sequence_logprobs(
        self, trajs: Sequence[Trajectory], masks: Sequence[torch.Tensor], average: bool = False, model=None
    ) -> torch.Tensor:
        """``[N]``: each trajectory's summed (``average``: mean) token log-prob over its mask, under
        ``model`` (default: the policy; e.g. a frozen reference), micro-batched, without gradient."""
        from mentorrl.algos.preference import sequence_logprobs

        model = model if model is not None else self.model
        device = next(model.parameters()).device
        out = []
        for sl in self.micro_batches(trajs, 0, len(trajs)):
            mb = collate(trajs[sl], self.pad_id).to(device)
            with self.autocast():
                lp, _ = forward_logprobs(model, mb, self.temperature, pack=self.pack_mode)
            lp = lp.float()
            out.append(sequence_logprobs(lp, pad_token_values(masks[sl], mb.input_ids.shape[1]).to(device), average))
        return torch.cat(out).float().cpu()

    def sequence_step(
        self,
        trajs: Sequence[Trajectory],
        masks: Sequence[torch.Tensor],
        objective: Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, float]]],
        average: bool = False,
    ) -> dict[str, float]:
        """One update on a loss of *sequence* log-probs that couples trajectories (DPO pairs,
        candidate soft labels): ``objective(s) -> (loss, metrics)`` with ``s[i]`` the masked
        sum (mean) of trajectory ``i``'s token log-probs.

        Exact at any micro-batch size: a first pass computes ``s`` without gradient and
        ``g = dloss/ds``; the second backpropagates ``sum_i g_i s_i`` micro-batch by micro-batch,
        whose gradient equals the loss's. ``masks`` select the tokens (within the policy tokens)."""
        from mentorrl.algos.preference import sequence_logprobs

        masks = [m.float() * torch.tensor(t.loss_mask, dtype=torch.float32) for m, t in zip(masks, trajs)]
        s = self.sequence_logprobs(trajs, masks, average).requires_grad_(True)
        loss, metrics = objective(s)
        (g,) = torch.autograd.grad(loss, s)
        if not bool(torch.isfinite(g).all()):
            raise FloatingPointError("sequence_step: the objective's gradient is not finite")

        def fn(mb, logprobs, entropy, sl):
            m = pad_token_values(masks[sl], mb.input_ids.shape[1]).to(logprobs.device)
            return (g[sl].to(logprobs.device) * sequence_logprobs(logprobs, m, average)).sum(), {}

        out = self._accumulate(trajs, "sum", fn)
        out.update({k: float(v) for k, v in metrics.items()}, loss=float(loss.detach()))
        return out

    def publish(self) -> int:
        """A new policy version (for a learner whose versions are not its optimizer steps)."""
        self.version += 1
        return self.version

    def state_dict(self) -> dict:
        """Optimizer, scheduler, version (and the fp16 gradient scaler); under ``fsdp2`` the optimizer state is
        not here but in the checkpoint's shards (:func:`mentorrl.train.fsdp.save_shards`), and ``sharded`` says so."""
        out: dict = {"scheduler": self.scheduler.state_dict(), "version": self.version}
        if self.scaler is not None:
            out["grad_scaler"] = self.scaler.state_dict()
        if self.sharded is None:
            return {"optimizer": self.optimizer.state_dict(), **out}
        return {**out, "sharded": True}

    def load_state_dict(self, state: dict) -> None:
        if bool(state.get("sharded")) != (self.sharded is not None):
            was, now = ("fsdp2", "this learner") if state.get("sharded") else ("ddp or one process", "fsdp2")
            raise ValueError(
                f"the checkpoint's optimizer state was written by a {was} learner and cannot resume {now}; "
                "resume with the distributed.strategy (and torchrun launch) that wrote it"
            )
        if self.sharded is None:
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.version = int(state.get("version", 0))
        if self.scaler is not None and "grad_scaler" in state:
            self.scaler.load_state_dict(state["grad_scaler"])


class CriticLearner(Learner):
    """Optimiser and micro-batched accumulation for a :class:`~mentorrl.models.value.ValueModel`."""

    def __init__(self, critic, optim: OptimConfig, pad_id: int, precision: str | torch.dtype | None = None):
        super().__init__(critic, optim, pad_id, precision=precision)

    def _forward_with(self, model, mb: TokenBatch) -> tuple[torch.Tensor, torch.Tensor]:
        from mentorrl.models.value import forward_values

        values = forward_values(model, mb)
        return values, torch.zeros_like(values)

    def value_step(
        self,
        trajs: Sequence[Trajectory],
        returns: Sequence[torch.Tensor],
        old_values: Sequence[torch.Tensor],
        clip: float | None = 0.2,
    ) -> dict[str, float]:
        """One critic update towards ``returns`` (per trajectory, aligned to tokens) with a clipped value loss."""

        def fn(mb, values, _entropy, sl):
            T = mb.input_ids.shape[1]
            ret = pad_token_values(returns[sl], T).to(values.device)
            old = pad_token_values(old_values[sl], T).to(values.device)
            return clipped_value_loss(values, old, ret, mb.loss_mask, clip=clip)

        m = self._accumulate(trajs, "token-mean", fn)
        m.pop("entropy", None)
        return m

    @torch.no_grad()
    def values(self, trajs: Sequence[Trajectory]) -> list[torch.Tensor]:
        """Current value estimates, one 1-D tensor per trajectory (aligned to its tokens)."""
        from mentorrl.models.value import forward_values

        self.model.eval()
        out: list[torch.Tensor] = []
        device = next(self.model.parameters()).device
        for sl in self.micro_batches(trajs, 0, len(trajs)):
            chunk = trajs[sl]
            with self.autocast():
                v = forward_values(self.model, collate(chunk, self.pad_id).to(device)).float().cpu()
            out += [v[b, : len(t.token_ids)] for b, t in enumerate(chunk)]
        return out


__all__ = ["CriticLearner", "Learner", "make_optimizer", "pad_token_values"]
