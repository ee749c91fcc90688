"""The learner: optimiser, micro-batched gradient accumulation, and the two update kinds.

The algorithm itself lives in ``mentorrl.algos`` (pure functions); the learner only
feeds it tensors built from trajectories and applies the gradient.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from mentorrl.algos.losses import get_policy_loss, sft_loss
from mentorrl.algos.logprobs import masked_mean
from mentorrl.config import OptimConfig
from mentorrl.train.consistency import logprob_gap_metrics
from mentorrl.train.batch import TokenBatch, collate, forward_logprobs
from mentorrl.trajectory import Trajectory


def make_optimizer(model, cfg: OptimConfig):
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    warm = max(cfg.warmup_steps, 0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
    return opt, sched


def _share(mb: TokenBatch, total_tokens: float, total_seqs: int, agg: str) -> float:
    """Weight of one micro-batch so the accumulated loss equals the full-batch aggregate."""
    if agg == "token-mean":
        return float(mb.loss_mask.sum()) / max(total_tokens, 1.0)
    return mb.input_ids.shape[0] / total_seqs


class Learner:
    def __init__(self, model, optim: OptimConfig, pad_id: int, temperature: float = 1.0):
        self.model = model
        self.cfg = optim
        self.pad_id = pad_id
        self.temperature = temperature if temperature > 0 else 1.0
        self.optimizer, self.scheduler = make_optimizer(model, optim)

    # ---- generic accumulation --------------------------------------------
    def _accumulate(
        self,
        trajs: Sequence[Trajectory],
        agg: str,
        loss_fn: Callable[[TokenBatch, torch.Tensor, torch.Tensor, slice], tuple[torch.Tensor, dict]],
    ) -> dict[str, float]:
        """Run ``loss_fn`` per micro-batch, weighting each so the sum is the full-batch loss; one optimiser step."""
        self.model.train()
        device = next(self.model.parameters()).device
        total_tokens = float(sum(t.num_policy_tokens for t in trajs))
        metrics: dict[str, float] = {}
        mbs = self.cfg.micro_batch_size
        self.optimizer.zero_grad(set_to_none=True)
        ent_sum, tok_sum = 0.0, 0.0
        for lo in range(0, len(trajs), mbs):
            sl = slice(lo, min(lo + mbs, len(trajs)))
            mb = collate(trajs[sl], self.pad_id).to(device)
            logprobs, entropy = forward_logprobs(self.model, mb, self.temperature, with_entropy=True)
            loss, m = loss_fn(mb, logprobs, entropy, sl)
            w = _share(mb, total_tokens, len(trajs), agg)
            (loss * w).backward()
            for k, v in m.items():
                metrics[k] = metrics.get(k, 0.0) + w * float(v)
            n = float(mb.loss_mask.sum())
            ent_sum += float(masked_mean(entropy, mb.loss_mask)) * n
            tok_sum += n
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        gn = float(grad_norm)
        if math.isfinite(gn):
            self.optimizer.step()
        else:  # skip a poisoned update rather than corrupt the weights
            self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.model.eval()
        metrics.update(grad_norm=gn, entropy=ent_sum / max(tok_sum, 1.0), lr=self.scheduler.get_last_lr()[0],
                       skipped_update=float(not math.isfinite(gn)))
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
        **loss_kwargs,
    ) -> dict[str, float]:
        """One clipped policy-gradient update; ``advantages`` is [len(trajs)] (sequence level)."""
        agg = loss_kwargs.get("agg", "token-mean")
        loss = get_policy_loss(loss_name)

        def fn(mb, logprobs, entropy, sl):
            adv = advantages[sl].to(logprobs.device)
            ref = None
            if ref_model is not None:
                with torch.no_grad():
                    ref, _ = forward_logprobs(ref_model, mb, self.temperature)
            kw = dict(loss_kwargs)
            if ref is not None:
                kw["ref_logprobs"] = ref
            value, m = loss(logprobs, mb.old_logprobs, adv, mb.loss_mask, **kw)
            return value, {**m, **logprob_gap_metrics(mb.old_logprobs, logprobs, mb.loss_mask)}

        return self._accumulate(trajs, agg, fn)

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])


__all__ = ["Learner", "make_optimizer"]
