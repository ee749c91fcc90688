"""Seconds per SFT step of the demo model on this machine, for the CPU levers issue 17 asks about.

Arms (each a separate process, so thread settings take effect): torch threads (``--threads``),
micro-batch size with length-sorted batches (``--set sft.optim.micro_batch_size=8 --sort``) and,
with ``--compile``, ``torch.compile`` of the model. The demo's base and demonstrations; the first
two steps are warm-up and not timed. Prints one JSON line.

    OMP_WAIT_POLICY=PASSIVE python bench/sft_step_time.py --threads 1
    OMP_WAIT_POLICY=PASSIVE python bench/sft_step_time.py --threads 2
    OMP_WAIT_POLICY=PASSIVE python bench/sft_step_time.py --threads 2 --sort --set sft.optim.micro_batch_size=8
    OMP_WAIT_POLICY=PASSIVE python bench/sft_step_time.py --threads 2 --compile
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time

import torch

from mentorrl.cli_common import load_run_config
from mentorrl.models.build import load_policy
from mentorrl.rollout.runner import expert_demonstrations
from mentorrl.train.learner import Learner
from mentorrl.train.models_init import base_model_dir
from mentorrl.train.workspace import open_workspace


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=10, help="timed steps (after 2 warm-up steps)")
    p.add_argument("--sort", action="store_true", help="sort each batch by length (less padding per micro-batch)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--set", action="append", default=[])
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_run_config(None, a.set + [f"threads={a.threads}"], tmp, "demo.yaml")
        ws = open_workspace(cfg, show_progress=False)
        tok, model = load_policy(base_model_dir(ws))
        ws.bind_tokenizer(tok)
        demos = expert_demonstrations(
            ws.contract, ws.make_env, ws.env_entry.make_expert(), ws.train_tasks(256, cfg.seed), weights=cfg.reward
        )
        if a.compile:
            model = torch.compile(model)
        learner = Learner(model, cfg.sft.optim, ws.contract.pad_token_id, 1.0)
        times = []
        for step in range(a.steps + 2):
            rng = random.Random(step)
            batch = [demos[i] for i in rng.sample(range(len(demos)), cfg.sft.batch_size)]
            if a.sort:
                batch.sort(key=lambda d: len(d.token_ids))
            t0 = time.perf_counter()
            learner.sft_step(batch, agg=cfg.sft.loss_agg)
            times.append(time.perf_counter() - t0)
        timed = sorted(times[2:])
        print(
            json.dumps(
                {
                    "threads": a.threads,
                    "sort": a.sort,
                    "compile": a.compile,
                    "overrides": a.set,
                    "batch_size": cfg.sft.batch_size,
                    "median_s_per_step": round(timed[len(timed) // 2], 3),
                    "min_s": round(timed[0], 3),
                    "max_s": round(timed[-1], 3),
                }
            )
        )


if __name__ == "__main__":
    main()
