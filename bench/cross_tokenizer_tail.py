"""How much of a cross-tokenizer teacher's next-token mass the student cannot spell.

Cross-tokenizer top-k OPD (``opd_cross.yaml``) gives a target at every policy token whose chunk is one
token on both sides: the teacher's top-k next tokens among those the student can spell, and a tail bin
for the rest. Mass the teacher puts on tokens the student cannot spell (its merges) lands in the tail
bin. This rolls out ``--tasks`` train tasks with the student, scores them with the teacher through the
same alignment the OPD stage uses, and prints the share of policy tokens with a target and the
teacher's mass on unspellable tokens at those positions.

    python bench/cross_tokenizer_tail.py STUDENT_CKPT TEACHER_CKPT
"""

from __future__ import annotations

import argparse
import os
import warnings

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
warnings.filterwarnings("ignore")

import torch  # noqa: E402

from mentorrl.cli_common import quiet_transformers  # noqa: E402
from mentorrl.config import load_config  # noqa: E402
from mentorrl.models.build import load_policy  # noqa: E402
from mentorrl.opd.signals import CrossTokenizerTeacher  # noqa: E402
from mentorrl.rollout.runner import rollout_tasks  # noqa: E402
from mentorrl.train.workspace import open_workspace  # noqa: E402

DEMO = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mentorrl", "configs", "demo.yaml")


def unspellable_mass(teacher: CrossTokenizerTeacher, traj) -> tuple[int, list[float]]:
    """(policy tokens, the teacher's mass on student-unspellable tokens at each position with a top-k target)."""
    teacher_ids, chunk_of, bounds = teacher.alignment(traj)
    with torch.no_grad():
        lp = torch.log_softmax(teacher.model(input_ids=torch.tensor([teacher_ids])).logits[0, :-1].float(), -1)
    sizes = torch.bincount(chunk_of[chunk_of >= 0], minlength=len(bounds))
    unspellable = teacher.to_student < 0
    policy, masses = 0, []
    for t, c in enumerate(chunk_of.tolist()):
        if not traj.loss_mask[t]:
            continue
        policy += 1
        if c >= 0 and sizes[c] == 1 and bounds[c][1] - bounds[c][0] == 1:
            masses.append(float(lp[bounds[c][0] - 1].exp()[unspellable].sum()))
    return policy, masses


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("student", help="student checkpoint (rolls out)")
    ap.add_argument("teacher", help="teacher checkpoint with its own tokenizer")
    ap.add_argument("--tasks", type=int, default=48)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--run-dir", default="runs/cross-tokenizer-tail")
    args = ap.parse_args(argv)
    quiet_transformers()
    torch.set_num_threads(1)
    ws = open_workspace(load_config(DEMO, [f"run_dir={args.run_dir}", "audit.preflight=false"]), show_progress=False)
    stok, student = load_policy(args.student)
    ws.bind_tokenizer(stok)
    ttok, tmodel = load_policy(args.teacher)
    teacher = CrossTokenizerTeacher(tmodel, ttok, stok)
    trajs = rollout_tasks(student, ws.contract, ws.make_env, ws.tasks("train", args.tasks, args.seed), seed=args.seed)
    total, masses = 0, []
    for tr in trajs:
        n, m = unspellable_mass(teacher, tr)
        total += n
        masses += m
    t = torch.tensor(masses)
    big = int((t > 0.1).sum())
    print(f"policy tokens {total}; with a top-k target {len(masses)} ({100 * len(masses) / max(total, 1):.1f}%)")
    print(
        f"teacher mass on tokens the student cannot spell, at those positions: mean {float(t.mean()):.4f}, "
        f"p90 {float(t.quantile(0.9)):.4f}, p99 {float(t.quantile(0.99)):.4f}, max {float(t.max()):.3f}; "
        f"above 0.1 at {big} positions ({100 * big / max(len(masses), 1):.2f}%)"
    )


if __name__ == "__main__":
    main()
