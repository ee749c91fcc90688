"""Start-up cost of the code sandbox: a program that does nothing (``pass``), timed end to end.

Compared, interleaved (so a busy machine slows each alike):

* ``unshare``: the earlier hand-written launcher's chain: setpriv (as root), ``unshare --user --mount
  --net --pid --ipc --uts --fork --kill-child --mount-proc``, a launcher interpreter, then the
  program's interpreter (two interpreter starts; the launcher's mount work is left out, so this is a
  lower bound of its cost);
* ``bwrap``: the chain the sandbox runs now, without the per-run cgroup: setpriv, bubblewrap with the
  allow-listed root and the seccomp filter, one interpreter;
* ``run_sandboxed``: the whole call, the per-run cgroup (created, joined, removed) included.

Usage: ``python bench/sandbox_startup.py [--runs 30] [--json out.json]``. Needs a machine where the
sandbox works (``check_sandbox()``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    sb.check_sandbox()
    ws = Path(tempfile.mkdtemp(prefix="bench-", dir=sb.sandbox_root()))
    if os.getuid() == 0:
        os.chown(ws, sb.NOBODY, sb.NOBODY)
    ws_fd = os.open(ws, os.O_RDONLY | os.O_DIRECTORY)
    times: dict[str, list[float]] = {"unshare": [], "bwrap": [], "run_sandboxed": []}
    try:
        for _ in range(a.runs):
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
    out = {
        k: {"median_ms": round(statistics.median(v) * 1e3, 1), "min_ms": round(min(v) * 1e3, 1), "runs": len(v)}
        for k, v in times.items()
    }
    out["loadavg"] = open("/proc/loadavg").read().split()[:3]
    print(json.dumps(out, indent=2))
    if a.json:
        a.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
