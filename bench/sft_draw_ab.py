"""SFT's held-out success under two ways of drawing its batches, on the same code and seed.

``old``: ``random.Random(seed * 1_000_003 + step + offset)`` (the formula before ``StepSeeds``);
``new``: ``StepSeeds(seed, "sft", step).rng(purpose)`` (what the SFT stage does now). Each arm runs the
demo's SFT stage (100 steps from the shipped base) and evaluates it on ``eval.num_tasks`` held-out tasks.

    python bench/sft_draw_ab.py old 0 OUT/old0                 # the old formula, seed 0
    python bench/sft_draw_ab.py old 0 OUT/old0b --offset 500   # the same formula, another offset
    python bench/sft_draw_ab.py new 0 OUT/new0 --purpose batch-alt
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from mentorrl.cli_common import load_run_config
from mentorrl.models.build import load_policy
from mentorrl.train.loop import RLLoop
from mentorrl.train.models_init import base_model_dir
from mentorrl.train.recipes import sft as sft_mod
from mentorrl.train.workspace import evaluate, open_workspace


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["old", "new"])
    p.add_argument("seed", type=int)
    p.add_argument("out")
    p.add_argument("--offset", type=int, default=0, help="old: added to the formula's seed")
    p.add_argument("--purpose", default="batch", help="new: the StepSeeds purpose")
    p.add_argument("--n", type=int, default=500, help="held-out tasks")
    a = p.parse_args()
    cfg = load_run_config(None, [f"seed={a.seed}", f"eval.num_tasks={a.n}"], a.out, "demo.yaml")
    torch.set_num_threads(1)

    def rollout(self, b):
        rng = (
            random.Random(self.ws.cfg.seed * 1_000_003 + b.step + a.offset)
            if a.mode == "old"
            else b.seeds.rng(a.purpose)
        )
        k = min(self.cfg.batch_size, len(self.demos))
        b.trajs = [self.demos[i] for i in rng.sample(range(len(self.demos)), k)]

    sft_mod.SFTStage.rollout = rollout
    ws = open_workspace(cfg, show_progress=False)
    tok, model = load_policy(base_model_dir(ws))
    ws.bind_tokenizer(tok)
    RLLoop(sft_mod.SFTStage(ws, model)).run()
    r = evaluate(ws, model, "sft")
    print(
        json.dumps(
            {
                "mode": a.mode,
                "seed": a.seed,
                "offset": a.offset,
                "purpose": a.purpose,
                "success": r["success"],
                "n": r["n"],
            }
        )
    )


if __name__ == "__main__":
    main()
