"""Which tokens of a held-out demonstration can a checkpoint not predict? Teacher-forced loss by class.

For each checkpoint, the scripted expert's verified demonstrations of ``--n`` held-out tasks are
scored token by token (the policy's own tokens only, as SFT trains them); the mean loss in nats is
reported per token class:

* ``digit``: digits (ids, sums, counts -- copied from the user or an observation);
* ``street_town``: the first word of a street or a town (copied from the user's new address);
* ``product``: product-name words;
* ``other``: everything else (tool names, JSON, answer words).

A class whose loss stays near ``log(#choices)`` after SFT is being guessed, not copied: the
demo's SFT policy copied digits (0.1 nats) and guessed streets and towns (~2-4 nats), which is
why ``update_address`` stayed near 0% through GRPO (bench/results/pretrain_sweep.md).

    python bench/copy_loss.py CKPT [CKPT ...] --n 150
"""

from __future__ import annotations

import argparse
import json

import torch

from mentorrl.cli_common import load_run_config
from mentorrl.envs.orders.world import CITIES, PRODUCT_NAMES, STREETS
from mentorrl.models.batch import collate, forward_logprobs
from mentorrl.models.build import load_policy
from mentorrl.rollout.runner import expert_demonstrations
from mentorrl.train.workspace import open_workspace


def first_word_ids(tok, phrases: list[str]) -> set[int]:
    """Ids of the first token of each phrase's words, as they follow a space."""
    return {tok.convert_tokens_to_ids(tok.tokenize(" " + w)[0]) for p in phrases for w in p.split()[:1]}


def classify(tok, street_town: set[int], product: set[int]):
    def cls(tid: int) -> str:
        if tok.decode([tid]).strip().isdigit():
            return "digit"
        if tid in street_town:
            return "street_town"
        return "product" if tid in product else "other"

    return cls


def token_losses(model, demos, cls, pad_id: int) -> dict[str, list[float]]:
    """Negative log-likelihood of each policy token, grouped by ``cls(token id)``: the learner's own
    forward (:func:`forward_logprobs`), so the figures are the SFT loss's terms."""
    out: dict[str, list[float]] = {}
    for d in demos:
        with torch.no_grad():
            lp, _ = forward_logprobs(model, collate([d], pad_id))
        for t, keep in enumerate(d.loss_mask):
            if keep:
                out.setdefault(cls(d.token_ids[t]), []).append(-float(lp[0, t]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkpoints", nargs="+")
    p.add_argument("--n", type=int, default=150, help="held-out tasks (their expert demonstrations)")
    p.add_argument("--seed", type=int, default=777, help="held-out task draw")
    p.add_argument("--set", action="append", default=["threads=1"], help="config override (repeatable)")
    a = p.parse_args()
    cfg = load_run_config(None, a.set, "runs/copy-loss", "demo.yaml")
    torch.set_num_threads(cfg.threads or 1)
    for path in a.checkpoints:
        tok, model = load_policy(path)
        model.eval()
        ws = open_workspace(cfg, show_progress=False)
        ws.bind_tokenizer(tok)
        demos = expert_demonstrations(
            ws.contract, ws.make_env, ws.env_entry.make_expert(), ws.tasks("heldout", a.n, a.seed), weights=cfg.reward
        )
        cls = classify(tok, first_word_ids(tok, STREETS + CITIES), first_word_ids(tok, PRODUCT_NAMES))
        losses = token_losses(model, demos, cls, ws.contract.pad_token_id)
        print(
            json.dumps(
                {
                    "checkpoint": path,
                    "demos": len(demos),
                    **{
                        k: {"mean_nats": round(sum(v) / len(v), 3), "tokens": len(v)} for k, v in sorted(losses.items())
                    },
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
