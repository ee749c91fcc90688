"""The reference checkpoints of ``bench/methods_seeds.py``, built once by one command into a cache outside the checkout.

    python bench/methods_refs.py                 # seeds 0 1 2 and both specialists; prints the bench command
    python bench/methods_refs.py --dry-run       # the plan, its estimated time and the commands, nothing run

What it builds, each one ``mentorrl train`` run in ``CACHE/NAME`` (``report.json``: finished, never rebuilt; a run
stopped part-way continues with ``--resume``):

* ``seed-S`` for each seed: the demo recipe (``demo.yaml``: SFT, then GRPO with held-out checks every 10 steps on
  200 tasks), the students (``seed-S/sft/final``) and the GRPO baselines (``seed-S``) of every arm;
* ``spec-a`` / ``spec-b``: ``specialist.yaml`` on each half of the orders families (the MOPD arms' teachers).

The OPD arms' built teachers go to ``CACHE/teachers`` (``opd.teachers_dir``, keyed by their build recipe), so the
first arm that needs one builds it and every later arm, sitting or checkout on this machine reuses it. The black-box
arms' teacher is ``seed-0``'s GRPO checkpoint.

``CACHE`` is ``--cache``, else ``$MENTORRL_CACHE/methods-refs/KEY``, else ``~/.cache/mentorrl/methods-refs/KEY``,
where KEY is a digest of the configs' text and the overrides: another recipe gets other references. It ends by
printing the ``methods_seeds.py`` command with every path filled in, and writes ``CACHE/refs.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _arms import fingerprint  # noqa: E402
from methods_seeds import SPEC_A_FAMILIES, spec_split  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "mentorrl" / "configs"
MINUTES = {"seed": 8.0, "spec": 12.0}  # 2 idle cores: a demo run (ranks auto), a 1500-step specialist SFT


@dataclass(frozen=True)
class Ref:
    name: str
    config: str
    overrides: tuple[str, ...]
    minutes: float

    def command(self, cache: Path, resume: bool) -> list[str]:
        cmd = [sys.executable, "-m", "mentorrl.cli", "train", str(CONFIGS / self.config)]
        cmd += ["--run-dir", str(cache / self.name)]
        for ov in self.overrides:
            cmd += ["--set", ov]
        return cmd + (["--resume"] if resume else [])


def refs(seeds: list[int], extra: list[str]) -> list[Ref]:
    """Every reference, in build order: the seeds' demo runs, then the two specialists."""
    spec = spec_split(SPEC_A_FAMILIES)
    out = [Ref(f"seed-{s}", "demo.yaml", (f"seed={s}", "eval.final_splits=[]", *extra), MINUTES["seed"]) for s in seeds]
    for key in ("spec_a", "spec_b"):
        fams = ", ".join(spec[key])
        out.append(Ref(key.replace("_", "-"), "specialist.yaml", (f"sft.families=[{fams}]", *extra), MINUTES["spec"]))
    return out


def default_cache(todo: list[Ref]) -> Path:
    key = fingerprint(*(f"{r.name}:{(CONFIGS / r.config).read_text()}:{r.overrides}" for r in todo))
    base = (
        Path(os.environ["MENTORRL_CACHE"]) if os.environ.get("MENTORRL_CACHE") else Path.home() / ".cache" / "mentorrl"
    )
    return base / "methods-refs" / key


def finished(cache: Path, r: Ref) -> bool:
    return (cache / r.name / "report.json").exists()


def bench_command(cache: Path, seeds: list[int], extra: list[str]) -> str:
    """The ``methods_seeds.py`` command that uses these references."""
    args = [
        "python",
        "bench/methods_seeds.py",
        "--sft",
        str(cache / "seed-{seed}" / "sft" / "final"),
        "--grpo-run",
        str(cache / "seed-{seed}"),
        "--spec-a",
        str(cache / "spec-a" / "sft" / "final"),
        "--spec-b",
        str(cache / "spec-b" / "sft" / "final"),
        "--bb-teacher",
        str(cache / "seed-0" / "grpo" / "final"),
        "--seeds",
        *map(str, seeds),
        "--set",
        f"opd.teachers_dir={cache / 'teachers'}",
        *[x for ov in extra for x in ("--set", ov)],
        "--results",
        "bench/results/methods_arms.jsonl",
        "--methods",
    ]
    return shlex.join(args) + " METHOD ..."


def main(argv: list[str] | None = None, run=subprocess.run) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--cache", type=Path, default=None)
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="a config override for every run")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and the commands; run nothing")
    a = ap.parse_args(argv)
    todo = refs(a.seeds, a.overrides)
    cache = a.cache or default_cache(todo)
    pending = [r for r in todo if not finished(cache, r)]
    total = sum(r.minutes for r in pending)
    print(f"references in {cache}: {len(todo) - len(pending)} of {len(todo)} built; about {total:.0f} minutes to go")
    for r in pending:
        print(f"  {r.name} (~{r.minutes:.0f} min): {shlex.join(r.command(cache, (cache / r.name).exists()))}")
    if not a.dry_run:
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
        for r in pending:
            t0 = time.perf_counter()
            done = run(r.command(cache, (cache / r.name).exists()), env=env)
            if done.returncode != 0:
                raise SystemExit(f"{r.name}: exited {done.returncode}; rerun this command to continue from it")
            print(f"{r.name}: built in {time.perf_counter() - t0:.0f} s")
        (cache / "refs.json").write_text(
            json.dumps({"refs": [r.name for r in todo], "seeds": a.seeds, "overrides": a.overrides}, indent=2)
        )
    print("\n" + bench_command(cache, a.seeds, a.overrides))
    return cache


if __name__ == "__main__":
    main()
