"""Held-out success along SFT from a given base: where does the copy phase change happen?

SFT on the demo's demonstrations (the demo recipe's settings, overridable with ``--set``), from
the base checkpoint ``--base``; at each step in ``--at`` the policy is evaluated on ``--n``
held-out tasks (temperature from the config, the eval seed 12345) and saved to
``OUT/sft-STEP``. One JSON line per checkpoint: SFT loss, training seconds, success with its 95%
Wilson interval, tool success.

    python bench/sft_curve.py --base runs/base --out runs/sft-curve --at 100,200,300,450,600
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from mentorrl.cli_common import load_run_config
from mentorrl.eval.metrics import summarize
from mentorrl.models.build import load_policy
from mentorrl.rollout.runner import expert_demonstrations, rollout_tasks
from mentorrl.train.learner import Learner
from mentorrl.train.loop import StepSeeds
from mentorrl.train.workspace import open_workspace


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", required=True, help="base checkpoint directory")
    p.add_argument("--out", required=True)
    p.add_argument("--at", default="100,200,300,450,600", help="SFT steps to evaluate at")
    p.add_argument("--n", type=int, default=200, help="held-out tasks per evaluation")
    p.add_argument("--set", action="append", default=[], help="config override (repeatable)")
    a = p.parse_args()
    at = sorted({int(x) for x in a.at.split(",")})
    cfg = load_run_config(None, a.set, a.out, "demo.yaml")
    torch.set_num_threads(cfg.threads or int(os.environ.get("OMP_NUM_THREADS", "1")))
    ws = open_workspace(cfg, show_progress=False)
    tok, model = load_policy(a.base)
    ws.bind_tokenizer(tok)
    demos = expert_demonstrations(
        ws.contract,
        ws.make_env,
        ws.env_entry.make_expert(),
        ws.train_tasks(cfg.sft.num_demos, cfg.seed),
        weights=cfg.reward,
    )
    heldout = ws.tasks(cfg.eval.split, a.n, cfg.eval.seed)
    learner = Learner(model, cfg.sft.optim, ws.contract.pad_token_id, ws.contract.sampling.temperature)
    train_s = 0.0
    for step in range(at[-1]):
        rng = StepSeeds(cfg.seed, "sft", step).rng("batch")  # the SFT stage's own batch order
        batch = [demos[i] for i in rng.sample(range(len(demos)), min(cfg.sft.batch_size, len(demos)))]
        t0 = time.perf_counter()
        m = learner.sft_step(batch, agg=cfg.sft.loss_agg)
        train_s += time.perf_counter() - t0
        if step + 1 in at:
            t1 = time.perf_counter()
            s = summarize(
                rollout_tasks(
                    model,
                    ws.contract,
                    ws.make_env,
                    heldout,
                    seed=cfg.eval.seed,
                    batch_size=cfg.eval.batch_size,
                    weights=cfg.reward,
                )
            )
            model.save_pretrained(f"{a.out}/sft-{step + 1}")
            tok.save_pretrained(f"{a.out}/sft-{step + 1}")
            print(
                json.dumps(
                    {
                        "step": step + 1,
                        "loss": round(m["loss"], 4),
                        "train_s": round(train_s, 1),
                        "eval_s": round(time.perf_counter() - t1, 1),
                        "n": s["n"],
                        "success": s["success"],
                        "ci95": [round(x, 3) for x in s["success_ci95"]],
                        "tool_success": round(s["tool_success"], 3),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
