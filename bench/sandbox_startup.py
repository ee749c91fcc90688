"""Start-up cost of the code sandbox: a program that does nothing (``pass``), timed end to end.

Compared, interleaved (so a busy machine slows each alike):

* ``unshare``: the earlier hand-written launcher's chain: setpriv (as root), ``unshare --user --mount
  --net --pid --ipc --uts --fork --kill-child --mount-proc``, a launcher interpreter, then the
  program's interpreter (two interpreter starts; the launcher's mount work is left out, so this is a
  lower bound of its cost);
* ``bwrap``: the chain the sandbox runs now, without the per-run cgroup: setpriv, bubblewrap with the
  allow-listed root and the seccomp filter, one interpreter;
* ``run_sandboxed``: the whole call, the per-run cgroup (created, joined, removed) included.

Two optional measurements on top (neither runs by default):

* ``--workers 1 2 4``: how the cost scales with concurrent workers. For each worker count W, ``--runs``
  ``run_sandboxed("pass")`` calls spread over a thread pool of W workers, each worker thread on its own
  workspace; the worker counts interleaved over ``--rounds`` rounds. Under ``"workers"``: per W the
  calls per second (calls over the summed batch wall time), the per-call median and minimum latency,
  the calls and the wall seconds; with ``cpu_count`` and the load average before the batches.
* ``--verify N``: the code environment's own per-episode path on N held-out tasks: reset, write the
  task's reference solution with ``write_file``, then ``run_tests`` and ``verify`` timed (median and
  minimum milliseconds of each, under ``"verify"``); every run must pass.

Usage: ``python bench/sandbox_startup.py [--runs 30] [--workers 1 2 4] [--rounds 3] [--verify 8]
[--json out.json]``. Needs a machine where the sandbox works (``check_sandbox()``).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mentorrl.envs.code import sandbox as sb
from mentorrl.envs.code import seccomp

EXEC_LAUNCHER = "import os, sys; os.execv(sys.executable, [sys.executable, '-I', '-S', '-B', '-c', 'pass'])"


def _setpriv() -> list[str]:
    if os.getuid() != 0:
        return []
    return [
        shutil.which("setpriv") or "/usr/bin/setpriv",
        f"--reuid={sb.NOBODY}",
        f"--regid={sb.NOBODY}",
        "--clear-groups",
    ]


def unshare_chain(python: str) -> list[str]:
    flags = ["--user", "--map-root-user", "--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child"]
    return [
        *_setpriv(),
        shutil.which("unshare") or "/usr/bin/unshare",
        *flags,
        "--mount-proc",
        python,
        "-I",
        "-S",
        "-B",
    ] + [
        "-c",
        EXEC_LAUNCHER,
    ]


def bwrap_chain(ws_fd: int, seccomp_fd: int) -> list[str]:
    layout = sb.python_layout()
    args = sb.bwrap_args(layout, sb.Mounts(ws_fd), seccomp_fd)
    return [*_setpriv(), *args, "--", layout.exe, "-I", "-S", "-B", "-c", "pass"]


def _time(cmd: list[str], fds: tuple[int, ...] = ()) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, pass_fds=fds, stdout=subprocess.DEVNULL, cwd="/")
    return time.perf_counter() - t0


def _workspace() -> Path:
    """A workspace under the sandbox root, owned by the sandbox user when the host runs as root."""
    ws = Path(tempfile.mkdtemp(prefix="bench-", dir=sb.sandbox_root()))
    if os.getuid() == 0:
        os.chown(ws, sb.NOBODY, sb.NOBODY)
    return ws


def _summary(v: list[float]) -> dict:
    return {"median_ms": round(statistics.median(v) * 1e3, 1), "min_ms": round(min(v) * 1e3, 1), "runs": len(v)}


def compare(runs: int) -> dict[str, list[float]]:
    """Seconds per run of the three chains, interleaved."""
    ws = _workspace()
    ws_fd = os.open(ws, os.O_RDONLY | os.O_DIRECTORY)
    times: dict[str, list[float]] = {"unshare": [], "bwrap": [], "run_sandboxed": []}
    try:
        for _ in range(runs):
            times["unshare"].append(_time(unshare_chain(sb.python_layout().exe)))
            sfd = os.memfd_create("seccomp", 0)
            os.write(sfd, seccomp.bpf_program() or b"")
            os.lseek(sfd, 0, os.SEEK_SET)
            try:
                times["bwrap"].append(_time(bwrap_chain(ws_fd, sfd), (ws_fd, sfd)))
            finally:
                os.close(sfd)
            t0 = time.perf_counter()
            assert sb.run_sandboxed(ws, "pass", read_only=()).ok
            times["run_sandboxed"].append(time.perf_counter() - t0)
    finally:
        os.close(ws_fd)
        shutil.rmtree(ws, ignore_errors=True)
    return times


def _batch(workspaces: list[Path], calls: int) -> tuple[float, list[float]]:
    """``calls`` sandboxed ``pass`` runs over one pool of ``len(workspaces)`` threads, each thread on its own
    workspace: the batch's wall seconds and each call's seconds."""
    free: queue.SimpleQueue[Path] = queue.SimpleQueue()
    for ws in workspaces:
        free.put(ws)
    mine = threading.local()

    def claim() -> None:  # the pool's initializer: one workspace per worker thread, for the thread's life
        mine.ws = free.get_nowait()

    def one(_: int) -> float:
        t0 = time.perf_counter()
        res = sb.run_sandboxed(mine.ws, "pass", read_only=())
        dt = time.perf_counter() - t0
        assert res.ok, (res.status, res.stderr[-300:])
        return dt

    with ThreadPoolExecutor(len(workspaces), initializer=claim) as pool:
        t0 = time.perf_counter()
        lat = list(pool.map(one, range(calls)))
        wall = time.perf_counter() - t0
    return wall, lat


def scaling(workers: list[int], runs: int, rounds: int = 3) -> dict[str, dict]:
    """Per worker count: calls per second and per-call latency of ``runs`` calls, the worker counts
    interleaved over ``rounds`` rounds (so a busy machine slows each alike)."""
    rounds = max(1, min(rounds, runs))
    per_round = [runs // rounds + (r < runs % rounds) for r in range(rounds)]
    spaces = {w: [_workspace() for _ in range(w)] for w in workers}
    wall = {w: 0.0 for w in workers}
    lat: dict[int, list[float]] = {w: [] for w in workers}
    try:
        for r, calls in enumerate(per_round):
            order = workers if r % 2 == 0 else workers[::-1]  # alternate who goes first
            for w in order:
                s, v = _batch(spaces[w], calls)
                wall[w] += s
                lat[w] += v
    finally:
        for ws in (ws for v in spaces.values() for ws in v):
            shutil.rmtree(ws, ignore_errors=True)
    return {
        str(w): {"calls_per_s": round(len(lat[w]) / wall[w], 2), **_summary(lat[w]), "wall_s": round(wall[w], 3)}
        for w in workers
    }


def verify_path(n: int) -> dict[str, dict]:
    """The per-episode path of the code environment on ``n`` held-out tasks: ``run_tests`` and ``verify`` of
    the task's reference solution (written with ``write_file``), each timed; every run must pass."""
    from mentorrl.envs import get_env

    entry = get_env("code")
    env = entry.make_env()
    times: dict[str, list[float]] = {"run_tests": [], "verify": []}
    try:
        for task in entry.make_tasks().tasks("heldout", n, 0):
            env.reset(task)
            wrote = env.step("write_file", {"path": "solution.py", "content": task.reference["solution"]})
            assert wrote.ok, wrote.error
            t0 = time.perf_counter()
            r = env.step("run_tests", {})
            times["run_tests"].append(time.perf_counter() - t0)
            assert r.ok and r.content["passed"] == r.content["total"], (task.id, r.error or r.content)
            t0 = time.perf_counter()
            verdict = env.verify("done")
            times["verify"].append(time.perf_counter() - t0)
            assert verdict.success and not verdict.violations, (task.id, verdict)
    finally:
        env.close()
    return {k: _summary(v) for k, v in times.items()}


def _loadavg() -> list[str]:
    with open("/proc/loadavg") as f:
        return f.read().split()[:3]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--workers", type=int, nargs="+", default=None, help="worker counts to compare, e.g. 1 2 4")
    ap.add_argument("--rounds", type=int, default=3, help="rounds the worker counts are interleaved over")
    ap.add_argument("--verify", type=int, default=0, metavar="N", help="time run_tests and verify on N tasks")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    sb.check_sandbox()
    out: dict = {k: _summary(v) for k, v in compare(a.runs).items()}
    if a.workers:
        out["cpu_count"] = os.cpu_count()
        out["loadavg_before_workers"] = _loadavg()
        out["workers"] = scaling(a.workers, a.runs, a.rounds)
    if a.verify:
        out["verify"] = verify_path(a.verify)
    out["loadavg"] = _loadavg()
    print(json.dumps(out, indent=2))
    if a.json:
        a.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
