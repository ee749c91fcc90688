"""One control group per sandboxed run: memory (shared memory and tmpfs pages included), processes
and CPU are limited for the whole sandbox, not per process.

cgroup v2 (a delegated subtree: this process's own cgroup, or ``MENTORRL_CODE_CGROUP``) sets
``memory.max`` / ``memory.swap.max``, ``pids.max`` and ``cpu.max``; cgroup v1 (the hybrid layout
many container hosts still have) sets ``memory.limit_in_bytes`` / ``memory.memsw.limit_in_bytes``,
``pids.max`` and ``cpu.cfs_quota_us`` in one group per hierarchy, with ``cpuacct.usage`` for the
CPU time. :func:`cgroup_support` says which (or why none); :class:`RunCgroup` creates the groups,
reports the CPU time and the OOM kills of the run, kills everything in them and removes them.
"""

from __future__ import annotations

import functools
import os
import signal
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

V1_CONTROLLERS = ("memory", "pids", "cpu", "cpuacct")
V2_CONTROLLERS = ("memory", "pids", "cpu")
CPU_PERIOD_US = 100_000


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, fs type, super options) of every cgroup mount."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fstype, _src, sopts = (right.split() + ["", ""])[:3]
        if fstype in ("cgroup", "cgroup2"):
            out.append((left.split()[4].replace("\\040", " "), fstype, set(sopts.split(","))))
    return out


def _own_paths() -> dict[str, str]:
    """controller (or "" for v2) -> this process's cgroup path."""
    out = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, ctrls, path = line.split(":", 2)
        for c in ctrls.split(",") if ctrls else [""]:
            out[c] = path
    return out


def _parents_v1() -> dict[str, Path] | str:
    own, mounts = _own_paths(), _mounts()
    parents = {}
    for c in V1_CONTROLLERS:
        mp = next((m for m, t, o in mounts if t == "cgroup" and c in o), None)
        if mp is None or c not in own:
            return f"cgroup v1: no {c} hierarchy"
        parents[c] = Path(mp) / own[c].lstrip("/")
    return parents


def _parent_v2() -> Path | str:
    env = os.environ.get("MENTORRL_CODE_CGROUP")
    if env:
        return Path(env)
    mp = next((m for m, t, _ in _mounts() if t == "cgroup2"), None)
    if mp is None or "" not in _own_paths():
        return "no cgroup v2 mount"
    return Path(mp) / _own_paths()[""].lstrip("/")


def _v2_ready(parent: Path) -> str:
    """Empty when ``parent`` can hold limited child groups; else why not."""
    try:
        avail = set((parent / "cgroup.controllers").read_text().split())
    except OSError as e:
        return f"cgroup v2: {e}"
    missing = [c for c in V2_CONTROLLERS if c not in avail]
    if missing:
        return f"cgroup v2: controllers {', '.join(missing)} not delegated to {parent}"
    enabled = set((parent / "cgroup.subtree_control").read_text().split())
    if not set(V2_CONTROLLERS) <= enabled:
        try:
            (parent / "cgroup.subtree_control").write_text(" ".join("+" + c for c in V2_CONTROLLERS))
        except OSError as e:
            return f"cgroup v2: cannot enable {', '.join(V2_CONTROLLERS)} under {parent} ({e.strerror})"
    return ""


@dataclass(frozen=True)
class CgroupLayout:
    version: int  # 1 or 2
    parents: dict[str, Path]  # controller -> parent directory (v2: "" -> the one parent)


@functools.cache
def cgroup_support() -> CgroupLayout | str:
    """The layout to create per-run groups in, or a string saying why there is none (probed once)."""
    return _probe()


def _probe() -> CgroupLayout | str:
    parent = _parent_v2()
    why = _v2_ready(parent) if isinstance(parent, Path) else parent
    layout: CgroupLayout | str = CgroupLayout(2, {"": parent}) if not why else why
    if isinstance(layout, str):
        v1 = _parents_v1()
        if isinstance(v1, str):
            return f"{why}; {v1}"
        layout = CgroupLayout(1, v1)
    try:  # can we really create, limit and remove a group?
        cg = RunCgroup.create(layout, memory_bytes=64 << 20, pids=8, cpu_fraction=1.0)
        cg.remove()
    except OSError as e:
        return f"cgroup v{layout.version}: cannot create a limited group ({e})"
    return layout


@dataclass
class RunCgroup:
    layout: CgroupLayout
    dirs: dict[str, Path] = field(default_factory=dict)

    @classmethod
    def create(cls, layout: CgroupLayout, *, memory_bytes: int, pids: int, cpu_fraction: float) -> "RunCgroup":
        name = f"mentorrl-code-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        cg = cls(layout)
        try:
            for c, parent in layout.parents.items():
                d = parent / name
                d.mkdir()
                cg.dirs[c] = d
            quota = max(1000, int(CPU_PERIOD_US * cpu_fraction))
            if layout.version == 2:
                d = cg.dirs[""]
                _write(d / "memory.max", memory_bytes)
                _write(d / "memory.swap.max", 0, optional=True)
                _write(d / "pids.max", pids)
                _write(d / "cpu.max", f"{quota} {CPU_PERIOD_US}")
            else:
                _write(cg.dirs["memory"] / "memory.limit_in_bytes", memory_bytes)
                _write(cg.dirs["memory"] / "memory.memsw.limit_in_bytes", memory_bytes, optional=True)
                _write(cg.dirs["pids"] / "pids.max", pids)
                _write(cg.dirs["cpu"] / "cpu.cfs_period_us", CPU_PERIOD_US)
                _write(cg.dirs["cpu"] / "cpu.cfs_quota_us", quota)
        except OSError:
            cg.remove()
            raise
        return cg

    def procs_files(self) -> list[str]:
        """The files a process writes its pid to, to join every group of this run."""
        return [str(d / "cgroup.procs") for d in self.dirs.values()]

    def cpu_seconds(self) -> float:
        try:
            if self.layout.version == 2:
                for line in (self.dirs[""] / "cpu.stat").read_text().splitlines():
                    if line.startswith("usage_usec "):
                        return int(line.split()[1]) / 1e6
                return 0.0
            return int((self.dirs["cpuacct"] / "cpuacct.usage").read_text()) / 1e9
        except (OSError, ValueError):
            return 0.0

    def oom_killed(self) -> bool:
        try:
            if self.layout.version == 2:
                text = (self.dirs[""] / "memory.events").read_text()
                return any(ln.split()[0] in ("oom_kill", "oom") and int(ln.split()[1]) > 0 for ln in text.splitlines())
            text = (self.dirs["memory"] / "memory.oom_control").read_text()
            kills = [ln.split()[1] for ln in text.splitlines() if ln.startswith("oom_kill ")]
            return bool(kills and int(kills[0]) > 0) or int((self.dirs["memory"] / "memory.failcnt").read_text()) > 0
        except (OSError, ValueError, IndexError):
            return False

    def pids(self) -> set[int]:
        out: set[int] = set()
        for d in self.dirs.values():
            try:
                out |= {int(p) for p in (d / "cgroup.procs").read_text().split()}
            except (OSError, ValueError):
                pass
        return out

    def kill(self) -> None:
        """SIGKILL every process of the run (cgroup.kill on v2; one by one on v1, until none is left)."""
        if self.layout.version == 2:
            try:
                _write(self.dirs[""] / "cgroup.kill", 1)
                return
            except OSError:
                pass
        for _ in range(50):
            left = self.pids()
            if not left:
                return
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.01)

    def remove(self) -> None:
        """Kill what is left and remove the groups (retrying while the kernel finishes the exits)."""
        if not self.dirs:
            return
        self.kill()
        deadline = time.monotonic() + 2.0
        for c, d in list(self.dirs.items()):
            while True:
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        break
                    self.kill()
                    time.sleep(0.01)
            self.dirs.pop(c, None)


def _write(path: Path, value: object, optional: bool = False) -> None:
    try:
        path.write_text(str(value))
    except FileNotFoundError:
        if not optional:
            raise


__all__ = ["CgroupLayout", "RunCgroup", "cgroup_support"]
