"""Seeded task generator for the ``code`` environment.

A task is one problem variant (:mod:`.problems`) with its integer parameter, 3 visible test cases
(written into the workspace's ``tests/test_visible.py``) and 8 hidden ones (the variant's edge cases
plus random cases; disjoint from the visible ones), all drawn from ``random.Random`` seeded by the
task's episode seed. Splits use disjoint episode-seed ranges, like ``orders``: ``train``,
``heldout`` (training-time evaluation) and ``hidden`` (evaluation only, never trained on).
"""

from __future__ import annotations

import json
import random

from mentorrl.envs.base import Task

from .problems import FAMILIES, VARIANTS, expected, problem

SEED_BASE = {"train": 0, "heldout": 1 << 40, "hidden": 2 << 40}
N_VISIBLE, N_HIDDEN = 3, 8


def _key(case: dict) -> str:
    return json.dumps(case, sort_keys=True)


def build_task(split: str, seed: int, index: int, ep_seed: int, family: str) -> Task:
    rng = random.Random(ep_seed)
    variant = rng.choice(VARIANTS[family])
    param = rng.randrange(1000)
    prob = problem(family, variant, param)
    seen: set[str] = set()
    visible: list[dict] = []
    while len(visible) < N_VISIBLE:
        case = prob.gen(rng)
        if _key(case) not in seen and all(_key(case) != _key(e) for e in prob.edge):
            seen.add(_key(case))
            visible.append(case)
    hidden = [e for e in prob.edge]
    seen |= {_key(e) for e in hidden}
    tries = 0
    while len(hidden) < N_HIDDEN and tries < 200:
        tries += 1
        case = prob.gen(rng)
        if _key(case) not in seen:
            seen.add(_key(case))
            hidden.append(case)
    prompt = (
        f"Implement {prob.signature} in solution.py. {prob.doc} "
        "Visible tests are in tests/test_visible.py (run_tests runs them); hidden tests check other inputs."
    )
    return Task(
        id=f"code-{split}-{seed}-{index:05d}",
        family=family,
        split=split,
        prompt=prompt,
        seed=ep_seed,
        reference={
            "variant": variant,
            "param": param,
            "kind": prob.kind,
            "entry": prob.entry,
            "visible": [{"case": c, "expected": e} for c, e in zip(visible, expected(prob, visible))],
            "hidden": [{"case": c, "expected": e} for c, e in zip(hidden, expected(prob, hidden))],
            "solution": prob.source,
        },
    )


class CodeTasks:
    """``tasks(split, n, seed)``: a deterministic list of tasks; splits use disjoint episode seeds."""

    SEED_BASE = SEED_BASE
    families = FAMILIES  # the task families it draws (a family filter such as sft.families is checked against it)

    def tasks(self, split: str = "train", n: int = 200, seed: int = 0) -> list[Task]:
        if split not in SEED_BASE:
            raise ValueError(f"split must be one of {', '.join(SEED_BASE)}, not {split!r}")
        rng = random.Random(f"code/{split}/{seed}")
        out, used = [], set()
        for i in range(n):
            family = FAMILIES[i % len(FAMILIES)] if i < len(FAMILIES) else rng.choice(FAMILIES)
            ep_seed = SEED_BASE[split] + rng.getrandbits(39)
            while ep_seed in used:
                ep_seed = SEED_BASE[split] + rng.getrandbits(39)
            used.add(ep_seed)
            out.append(build_task(split, seed, i, ep_seed, family))
        return out


__all__ = ["CodeTasks", "SEED_BASE", "N_VISIBLE", "N_HIDDEN", "build_task"]
