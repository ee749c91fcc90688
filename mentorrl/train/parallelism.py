"""``threads: auto``: processes x threads for this machine, from a documented table (docs/scaling.md,
"Parallelism chosen for the machine"), not a constant.

:func:`choose_parallelism` is a pure function of the machine (cores, device) and the run (its recipe,
whether a stage overlaps its rollout with its update, the ranks a torchrun launch started). The workspace
applies the run's ``threads`` (torch intra-op threads of this process) and ``rollout_workers`` (Ray rollout
actors under ``distributed.backend: ray``, unless set); an overlapped stage (``grpo.overlap: one_step``)
applies its own ``threads`` while it runs (:func:`mentorrl.train.overlap.stage_threads`), so SFT keeps every
core. Each choice is printed with its reason and written to ``RUN_DIR/parallelism.json`` (``run``, and the
stage's name). ``learner_ranks`` is advice (the line says which ``torchrun`` command would use the cores
better); ``--ranks`` on ``mentorrl demo`` / ``train`` launches them (:func:`auto_ranks`, :func:`torchrun_command`).

The rows, from the measurements in docs/scaling.md ("CPU threads on two cores", 2 idle cores):

- a torchrun launch of R ranks: ``cores // R`` threads each (the ranks share the cores);
- a GPU learner: the model runs on the GPU; host threads feed it (collation, sampling's Python, tool
  calls): ``min(cores, 4)``;
- CPU, GRPO with ``overlap: one_step``: the rollout ahead and the learner run at once, so each gets half
  the cores (``cores // 2``; on 2 cores, 1 + 1);
- CPU otherwise: one process with every core (a second torch thread made the SFT step 1.47x and the GRPO
  step 1.11x faster on 2 cores); with rollout stages on more than 2 cores the line advises learner ranks
  (``cores // 2``, at most 8, 2 threads each): decoding a small model is one small product after
  another that threads do not split but processes do (2 ranks x 1 thread: 1.60x one 2-thread process).

Ray rollout actors take one CPU each: every core while the synchronous learner waits for the rollout,
half of them beside an overlapped learner.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

try:
    import resource
except ImportError:  # not a Unix
    resource = None  # type: ignore[assignment]

ROLLOUT_STAGES = frozenset({"grpo", "ppo", "sao", "opd", "rft", "evolve", "blackbox", "external"})
GPU_HOST_THREADS = 4
MAX_ADVISED_RANKS = 8


@dataclass(frozen=True)
class Parallelism:
    """What ``threads: auto`` chose, and why."""

    cores: int
    device: str  # "cpu" or "cuda"
    threads: int  # torch intra-op threads of this process
    rollout_workers: int  # Ray rollout actors (distributed.backend: ray), one CPU each
    learner_ranks: int  # data-parallel ranks: the launch's, or the ones advised for this machine
    reason: str

    def line(self) -> str:
        return (
            f"parallelism (threads: auto): {self.threads} torch thread(s) per process on {self.cores} "
            f"{self.device} core(s), {self.rollout_workers} Ray rollout worker(s), {self.learner_ranks} learner "
            f"rank(s) -- {self.reason}"
        )


def choose_parallelism(
    cores: int, device: str, recipe: tuple[str, ...] | list[str], overlap: bool = False, ranks: int = 1
) -> Parallelism:
    """The table of the module doc: a pure function of the machine and the run."""
    cores, ranks = max(1, int(cores)), max(1, int(ranks))
    gpu = device.startswith("cuda")
    kind = "cuda" if gpu else "cpu"
    rollouts = bool(ROLLOUT_STAGES & set(recipe))
    workers = max(1, cores // 2) if overlap else cores
    if ranks > 1:
        t = max(1, cores // ranks)
        return Parallelism(cores, kind, t, workers, ranks, f"a torchrun launch of {ranks} ranks shares {cores} cores")
    if gpu:
        t = min(cores, GPU_HOST_THREADS)
        return Parallelism(cores, kind, t, workers, 1, f"the GPU runs the model; {t} host thread(s) feed it")
    if overlap:
        t = max(1, cores // 2)
        why = f"grpo.overlap: one_step runs the rollout ahead and the learner at once: {t} thread(s) each"
        return Parallelism(cores, kind, t, workers, 1, why)
    if rollouts and cores > 2:
        advised = min(cores // 2, MAX_ADVISED_RANKS)
        why = (
            f"one process, every core; rollouts split over processes, not threads: launch "
            f"`torchrun --nproc-per-node {advised} -m mentorrl.cli train CONFIG --set threads=auto` for {advised} "
            "learner ranks"
        )
        return Parallelism(cores, kind, cores, workers, advised, why)
    return Parallelism(cores, kind, cores, workers, 1, "one process, every core (the measured fastest one process)")


def auto_ranks(
    cores: int, device: str, recipe: tuple[str, ...] | list[str], supported: tuple[str, ...]
) -> tuple[int, str]:
    """``(ranks, why)`` for ``--ranks auto``: data-parallel ranks this machine and recipe are run fastest
    with. On CPU with at least 2 cores and every stage of the recipe in ``supported`` (the stages whose
    learner runs data-parallel): ``cores // 2`` ranks, at least 2 and at most :data:`MAX_ADVISED_RANKS` (2
    ranks x 1 thread made the demo's GRPO step 1.60x one 2-thread process, docs/scaling.md); else 1."""
    if device.startswith("cuda"):
        return 1, "a GPU learner: one rank per GPU is a torchrun launch of your own"
    missing = [s for s in dict.fromkeys(recipe) if s not in supported]
    if missing:
        return 1, f"{', '.join(missing)} cannot run data-parallel"
    if cores < 2:
        return 1, "one core"
    n = min(max(cores // 2, 2), MAX_ADVISED_RANKS)
    return n, f"{n} data-parallel ranks on {cores} CPU cores (rollouts split over processes, not threads)"


def torchrun_command(ranks: int, cli_args: list[str], python: str) -> list[str]:
    """The command that runs ``mentorrl CLI_ARGS`` as ``ranks`` data-parallel ranks on this machine, each
    choosing its threads (``threads=auto``: the cores shared out between the ranks)."""
    return [
        python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={int(ranks)}",
        "-m",
        "mentorrl.cli",
        *cli_args,
        "--set",
        "threads=auto",
    ]


def cpu_clock() -> float:
    """CPU seconds of this process (every thread) and of its child processes that have ended (their own
    children included, once waited for): a step's tool calls and verifications run in sandboxed child
    processes (the code environment), whose CPU a process clock alone would leave out of ``cpu_s`` and
    ``cpu_util``. The difference of two readings is what ran in between (a child counts when it is reaped)."""
    own = time.process_time()
    if resource is None:  # no getrusage (not a Unix)
        return own
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own + ru.ru_utime + ru.ru_stime


def cpu_cores() -> int:
    """Cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def write_parallelism(run_dir: Path, plan: Parallelism, scope: str = "run") -> Path:
    """``RUN_DIR/parallelism.json``: per scope (``run``: the workspace's; a stage's name: what that stage
    chose for itself, e.g. an overlapped GRPO), the choice, its inputs and its reason."""
    path = Path(run_dir) / "parallelism.json"
    try:
        held = json.loads(path.read_text()) if path.exists() else {}
    except ValueError:  # a torn file from a killed run: rewritten
        held = {}
    path.write_text(json.dumps({**held, scope: asdict(plan)}, indent=2) + "\n")
    return path
