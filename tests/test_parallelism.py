"""``threads: auto`` (mentorrl/train/parallelism.py): processes x threads from a documented table of
(cores, device, recipe, overlap, ranks), printed at start and written to the run directory."""

from __future__ import annotations

import json

import pytest
import torch

from mentorrl.config import load_config
from mentorrl.train.parallelism import Parallelism, choose_parallelism
from mentorrl.train.workspace import auto_parallelism, open_workspace

RL = ("sft", "grpo")

# cores, device, recipe, overlap, ranks -> threads, rollout workers, learner ranks
TABLE = [
    (1, "cpu", RL, False, 1, 1, 1, 1),
    (2, "cpu", RL, False, 1, 2, 2, 1),  # today's demo: one process, both cores
    (2, "cpu", RL, True, 1, 1, 1, 1),  # overlap on 2 cores: rollout 1 + learner 1
    (2, "cpu", ("sft",), False, 1, 2, 2, 1),
    (2, "cpu", RL, False, 2, 1, 2, 2),  # torchrun 2 ranks x 1 thread
    (4, "cpu", RL, False, 1, 4, 4, 2),  # ranks advised on more cores
    (64, "cpu", RL, False, 1, 64, 64, 8),
    (64, "cpu", ("sft",), False, 1, 64, 64, 1),  # no rollouts: nothing to split over processes
    (64, "cpu", RL, True, 1, 32, 32, 1),
    (64, "cpu", RL, False, 8, 8, 64, 8),
    (16, "cuda", RL, False, 1, 4, 16, 1),
    (2, "cuda", RL, True, 1, 2, 1, 1),
    (3, "cpu", RL, True, 1, 1, 1, 1),
]


@pytest.mark.parametrize("cores,device,recipe,overlap,ranks,threads,workers,learner_ranks", TABLE)
def test_the_table(cores, device, recipe, overlap, ranks, threads, workers, learner_ranks):
    p = choose_parallelism(cores, device, recipe, overlap, ranks)
    assert (p.threads, p.rollout_workers, p.learner_ranks) == (threads, workers, learner_ranks)
    assert p.reason and str(p.threads) in p.line()
    assert p.threads * max(p.learner_ranks if ranks > 1 else 1, 1) <= max(cores, 1)  # never more threads than cores
    assert choose_parallelism(cores, device, recipe, overlap, ranks) == p  # pure


def test_auto_is_applied_printed_and_written_to_the_run_directory(tmp_path, capsys):
    before = torch.get_num_threads()
    try:
        cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", "threads=auto", "grpo.overlap=one_step"])
        ws = open_workspace(cfg, show_progress=False)
        written = json.loads((ws.run_dir / "parallelism.json").read_text())
        plan = Parallelism(**written["run"])
        assert plan.threads == torch.get_num_threads() == plan.cores  # the run's: SFT keeps every core
        assert "parallelism (threads: auto)" in capsys.readouterr().out
    finally:
        torch.set_num_threads(before)


def test_auto_sets_the_ray_rollout_workers_unless_the_config_did():
    cfg = load_config(None, ["threads=auto", "distributed.backend=ray"])
    plan = auto_parallelism(cfg)
    assert cfg.distributed.rollout_workers == plan.rollout_workers
    cfg = load_config(None, ["threads=auto", "distributed.backend=ray", "distributed.rollout_workers=5"])
    auto_parallelism(cfg)
    assert cfg.distributed.rollout_workers == 5
    assert auto_parallelism(load_config(None, ["threads=2"])) is None
