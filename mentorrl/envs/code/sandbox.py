"""The sandbox every program of the ``code`` environment runs in.

Each execution is one process chain::

    [sh: join this run's cgroups]                     (when the machine delegates cgroups)
      [setpriv --reuid nobody]                          (only when the host runs as root)
        bwrap --unshare-all --disable-userns --die-with-parent --new-session --seccomp FD
              --tmpfs / --ro-bind <interpreter, its libraries, its standard library> --bind-fd WS /ws
          python -I -S -B -X pycache_prefix=/.pycache -c PRELUDE PROGRAM   (the untrusted code)

* **A root built from an allow-list**: a fresh read-only tmpfs holding only the interpreter, the
  shared libraries it and its extension modules load, its standard library (any ``site-packages``
  inside it covered by an empty read-only tmpfs), ``/proc`` and a minimal ``/dev``, and the
  workspace at ``/ws`` (bound from a descriptor the host opened, so no path is resolved at run
  time; ``read_only`` subdirectories, the tests, bound read-only). No ``/work``, no
  site-packages (so no ``mentorrl``), no ``/tmp``, no ``/home``, no ``/sys``, no shell.
* **Code shown is code run**: ``-B`` and an empty read-only ``pycache_prefix`` (no bytecode is read
  from or written to ``__pycache__``); ``-I`` keeps the workspace off the front of ``sys.path``; every
  directory outside the interpreter's own is searched for ``.py`` source only (the prelude's path
  hook), so an extension module, bytecode or zip planted there never runs instead of a ``.py``.
* **Namespaces**: no network (a fresh network namespace), PID, IPC, UTS, mount, user and cgroup
  namespaces; ``--disable-userns`` forbids nested user namespaces.
* **seccomp** (:mod:`.seccomp`): no ``unshare`` / ``setns`` / namespace ``clone`` flags, no mounts,
  no ``keyctl``, no ``io_uring``, no ``ptrace`` / ``process_vm_*``, no ``bpf``, no ``memfd_create`` /
  ``execveat``; sockets of the ``AF_UNIX`` family only (an allow-list).
* **Per-sandbox limits** (:mod:`.cgroups`): one cgroup per run with the memory (shared memory and
  tmpfs pages count), the process count and the CPU time (polled, the run killed past ``cpu_s``,
  and ``cpu.max`` at one core) of the whole sandbox; per-process rlimits on top (CPU, address
  space, processes, file size, open files, no core dumps); a wall-time limit; stdout and stderr
  capped at ``max_output_bytes`` each.
* **Not root on the host**: when the host runs as root the chain drops to ``nobody`` (setpriv).

:func:`check_sandbox` probes the machine once per process. No bubblewrap, or a probe that
fails or escapes: :class:`SandboxUnavailable`. A machine without one of the :data:`WEAKER`
protections (``cgroup``, ``workspace_quota``, ``seccomp``) makes it raise too, unless the caller
opts out of that protection by name (``allow_weaker``, or ``MENTORRL_CODE_ALLOW_WEAKER``): the
sandbox never runs silently weaker.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import seccomp
from .cgroups import CgroupLayout, RunCgroup, cgroup_support

NOBODY = 65534
WEAKER = ("cgroup", "workspace_quota", "seccomp")  # protections a user may opt out of, by name
SANDBOX_WS = "/ws"
PYCACHE = "/.pycache"  # an empty read-only directory: the interpreter's only bytecode cache


class SandboxUnavailable(RuntimeError):
    """No working isolation on this machine: the code environment refuses to run programs."""


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 2
    wall_s: float = 4.0
    memory_mb: int = 512  # the whole sandbox (cgroup) and each process (address space)
    max_processes: int = 32
    max_output_bytes: int = 16_384
    max_file_bytes: int = 1 << 20
    max_open_files: int = 64
    workspace_mb: int = 16  # the episode's tmpfs holds the workspace and the verifier's copy of it
    workspace_files: int = 512


@dataclass
class RunResult:
    """How a sandboxed program ended: ``status`` is ok | exit | cpu | wall | output | signal | memory."""

    status: str
    exit_code: int | None
    stdout: str
    stderr: str
    duration_s: float
    notes: list[str] = field(default_factory=list)  # what the sandbox stopped, in words

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# Runs first in the sandboxed interpreter: the per-process limits, then the program as __main__.
# Every directory outside the interpreter's own (the workspace, /dev/shm, anything added to sys.path) is
# searched for source only: an extension module, bytecode or zip there never runs instead of a .py.
PRELUDE = r"""
import resource as _r, sys as _s, os as _o, importlib.machinery as _m
for _k, _v in {limits}:
    _r.setrlimit(_k, _v)
_std = tuple(_o.path.realpath(_p) + "/" for _p in _s.path)
def _source_only(path, _std=_std, _hooks=tuple(_s.path_hooks), _m=_m, _o=_o):
    real = _o.path.realpath(path or ".")
    if (real + "/").startswith(_std):  # the interpreter's own directories keep their usual finders
        for _h in _hooks:
            try:
                return _h(path)
            except ImportError:
                pass
        raise ImportError(path)
    if not _o.path.isdir(real):  # no zip archive, outside the interpreter's own
        raise ImportError("only directories of Python source are searched here")
    return _m.FileFinder(path or ".", (_m.SourceFileLoader, _m.SOURCE_SUFFIXES))
_s.path_hooks[:] = [_source_only]
_s.path_importer_cache.clear()
_s.argv[0] = "-c"
_c = compile(_s.argv.pop(1), "<string>", "exec")
del _r, _s, _o, _m, _k, _v, _std, _source_only
exec(_c)
"""


def _prelude(limits: Limits) -> str:
    import resource as r

    pairs = [
        (r.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1)),
        (r.RLIMIT_AS, (limits.memory_mb << 20,) * 2),
        (r.RLIMIT_NPROC, (limits.max_processes,) * 2),
        (r.RLIMIT_FSIZE, (limits.max_file_bytes,) * 2),
        (r.RLIMIT_NOFILE, (limits.max_open_files,) * 2),
        (r.RLIMIT_CORE, (0, 0)),
    ]
    return PRELUDE.format(limits=repr(pairs))


# -------------------------------------------------------------- the allow-listed root ----
def sandbox_root() -> Path:
    """The directory under which every episode directory lives (none of it is in a sandbox's view)."""
    base = Path(os.environ.get("MENTORRL_CODE_SANDBOX_ROOT") or Path("/tmp") / f"mentorrl-code-{os.getuid()}")
    base.mkdir(mode=0o711, parents=True, exist_ok=True)
    os.chmod(base, 0o711)
    return base


def _world_runnable(path: str) -> bool:
    """Can any user run ``path`` (o+x on the file and on every directory above it)?"""
    real = Path(os.path.realpath(path))
    try:
        return all(os.stat(p).st_mode & 0o001 for p in [real, *real.parents])
    except OSError:
        return False


def sandbox_python() -> str:
    """The interpreter the sandbox runs: this one when the sandbox user may run it, else a system python3."""
    env = os.environ.get("MENTORRL_CODE_SANDBOX_PYTHON")
    if env:
        return env
    if os.getuid() != 0 or _world_runnable(sys.executable):
        return sys.executable
    for cand in ("/usr/bin/python3", "/usr/local/bin/python3", shutil.which("python3") or ""):
        if cand and _world_runnable(cand):
            return cand
    raise SandboxUnavailable(
        f"code sandbox: no python3 that the unprivileged sandbox user ({NOBODY}) may run "
        f"({sys.executable} is not world-executable); set MENTORRL_CODE_SANDBOX_PYTHON"
    )


LAYOUT_PROBE = r"""
import glob, json, os, sys, sysconfig
dyn = [p for p in sys.path if p.endswith("lib-dynload")]
print(json.dumps({"exe": os.path.realpath(sys.executable), "path": [p for p in sys.path if os.path.isdir(p)],
                  "ext": [f for d in dyn for f in glob.glob(os.path.join(d, "*.so"))],
                  "site": sorted({sysconfig.get_path("purelib"), sysconfig.get_path("platlib")})}))
"""


@dataclass(frozen=True)
class PythonLayout:
    exe: str  # the interpreter binary (real path)
    binds: tuple[str, ...]  # read-only binds: the binary, its libraries, the standard library
    masks: tuple[str, ...]  # site-packages directories inside those binds: covered by an empty tmpfs


def python_layout(python: str | None = None) -> PythonLayout:
    """What the sandbox must show for ``python`` to run with its standard library (probed once)."""
    return _probe_layout(python or sandbox_python())


@functools.cache  # once per interpreter and process (a failed probe raises, and is tried again next time)
def _probe_layout(python: str) -> PythonLayout:
    try:
        info = json.loads(
            subprocess.run([python, "-I", "-S", "-c", LAYOUT_PROBE], capture_output=True, check=True).stdout
        )
    except (OSError, subprocess.CalledProcessError, ValueError) as e:
        raise SandboxUnavailable(f"code sandbox: cannot inspect the interpreter {python}: {e}") from e
    libs = _shared_libraries([info["exe"], *info["ext"]])
    binds = {info["exe"], *libs, *info["path"]}
    if os.path.exists("/etc/ld.so.cache"):
        binds.add("/etc/ld.so.cache")
    masks = []
    for d in info["path"]:
        for cand in (os.path.join(d, "site-packages"), os.path.join(d, "dist-packages"), *info["site"]):
            if os.path.isdir(cand) and (cand + "/").startswith(d + "/") and cand not in masks:
                masks.append(cand)
    return PythonLayout(info["exe"], tuple(sorted(binds)), tuple(masks))


def _shared_libraries(files: list[str]) -> set[str]:
    """Every shared library ``files`` load (as ``ldd`` resolves them), the dynamic loader included."""
    ldd = shutil.which("ldd") or "/usr/bin/ldd"
    try:
        out = subprocess.run([ldd, *files], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SandboxUnavailable(f"code sandbox: `ldd` is needed to list the interpreter's libraries: {e}") from e
    libs = set()
    for line in out.splitlines():
        parts = line.split()
        path = (
            parts[2] if "=>" in parts and len(parts) > 3 else (parts[0] if parts and parts[0].startswith("/") else "")
        )
        if path.startswith("/") and os.path.exists(path):
            libs.add(path)
    return libs


def _bwrap() -> str | None:
    return shutil.which("bwrap") or ("/usr/bin/bwrap" if os.path.exists("/usr/bin/bwrap") else None)


@dataclass(frozen=True)
class Mounts:
    """The descriptors bound into the sandbox: the workspace, and its read-only subdirectories."""

    workspace_fd: int
    read_only_fds: tuple[tuple[int, str], ...] = ()  # (fd, path relative to the workspace)
    writable: bool = True


def bwrap_args(layout: PythonLayout, mounts: Mounts, seccomp_fd: int | None) -> list[str]:
    """bubblewrap's options for a root of ``layout`` plus the workspace (fds are inherited)."""
    b = _bwrap()
    if b is None:
        raise SandboxUnavailable("code sandbox: no `bwrap` binary (Debian package bubblewrap) found")
    args = [b, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session"]
    args += ["--hostname", "sandbox", "--clearenv", "--tmpfs", "/"]
    for p in layout.binds:
        args += ["--ro-bind", p, p]
    for m in layout.masks:
        args += ["--tmpfs", m, "--remount-ro", m]
    args += ["--proc", "/proc", "--dev", "/dev", "--dir", PYCACHE]
    args += ["--bind-fd" if mounts.writable else "--ro-bind-fd", str(mounts.workspace_fd), SANDBOX_WS]
    for fd, rel in mounts.read_only_fds:
        args += ["--ro-bind-fd", str(fd), f"{SANDBOX_WS}/{rel}"]
    args += ["--remount-ro", "/", "--chdir", SANDBOX_WS]
    env = {"PATH": os.path.dirname(layout.exe), "HOME": SANDBOX_WS, "TMPDIR": SANDBOX_WS, "LANG": "C.UTF-8"}
    for k, v in env.items():
        args += ["--setenv", k, v]
    if seccomp_fd is not None:
        args += ["--seccomp", str(seccomp_fd)]
    return args


# ------------------------------------------------------------------- what is available ----
@dataclass(frozen=True)
class Support:
    """What this machine provides: ``missing`` maps each absent protection of :data:`WEAKER` to why."""

    cgroup: CgroupLayout | None
    workspace_quota: bool
    seccomp: bool
    missing: dict[str, str]


def allow_weaker_from_env() -> tuple[str, ...]:
    raw = os.environ.get("MENTORRL_CODE_ALLOW_WEAKER", "")
    return tuple(x.strip() for x in raw.split(",") if x.strip())


@functools.cache
def machine_support() -> Support:
    """The protections this machine provides (probed once per process)."""
    missing = {}
    cg = cgroup_support()
    if isinstance(cg, str):
        missing["cgroup"] = cg
    quota = tmpfs_quota_problem()
    if quota:
        missing["workspace_quota"] = quota
    if seccomp.bpf_program() is None:
        missing["seccomp"] = f"no seccomp syscall table for {seccomp.machine()}"
    return Support(None if isinstance(cg, str) else cg, not quota, "seccomp" not in missing, missing)


def check_sandbox(allow_weaker: tuple[str, ...] | list[str] | None = None) -> Support:
    """Raise :class:`SandboxUnavailable` when the sandbox does not work here, or lacks a protection the
    caller did not opt out of by name (``allow_weaker``; default: ``MENTORRL_CODE_ALLOW_WEAKER``)."""
    allow = tuple(allow_weaker_from_env() if allow_weaker is None else allow_weaker)
    unknown = [a for a in allow if a not in WEAKER]
    if unknown:
        raise ValueError(f"allow_weaker: unknown protection(s) {unknown}; known: {', '.join(WEAKER)}")
    sup = machine_support()
    refused = {k: v for k, v in sup.missing.items() if k not in allow}
    if refused:
        raise SandboxUnavailable(
            "code sandbox: this machine cannot provide "
            + "; ".join(f"{k} ({v})" for k, v in refused.items())
            + f". Opt out explicitly to run weaker: allow_weaker=[{', '.join(map(repr, refused))}] "
            f"(or MENTORRL_CODE_ALLOW_WEAKER={','.join(refused)})"
        )
    error = _probe_error()
    if error:
        raise SandboxUnavailable(error)
    return sup


@functools.cache
def _probe_error() -> str:
    """Why the probe program could not run confined here ("" when it did); run once per process."""
    return _run_probe()


# ---------------------------------------------------------------------- the tmpfs quota ----
_libc = ctypes.CDLL(None, use_errno=True)
MS_NOSUID, MS_NODEV, MNT_DETACH = 2, 4, 2


def mount_tmpfs(path: Path, size_bytes: int, inodes: int, mode: int = 0o711) -> None:
    """Mount a size- and inode-limited tmpfs on ``path`` (needs root)."""
    data = f"size={size_bytes},nr_inodes={inodes},mode={mode:o}".encode()
    if _libc.mount(b"tmpfs", str(path).encode(), b"tmpfs", MS_NOSUID | MS_NODEV, data) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), str(path))


def unmount(path: Path) -> None:
    if _libc.umount2(str(path).encode(), MNT_DETACH) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), str(path))


def tmpfs_quota_problem() -> str:
    """Empty when a size-limited tmpfs can be mounted for each episode; else why not."""
    if os.getuid() != 0:
        return "not root: cannot mount a size-limited tmpfs for each workspace"
    import tempfile

    try:
        d = Path(tempfile.mkdtemp(prefix="quota-probe-", dir=sandbox_root()))
    except OSError as e:
        return f"cannot create a directory under the sandbox root: {e}"
    try:
        mount_tmpfs(d, 1 << 20, 64)
        unmount(d)
        return ""
    except OSError as e:
        return f"cannot mount a tmpfs: {e}"
    finally:
        os.rmdir(d)


# ------------------------------------------------------------------------------ running ----
def run_sandboxed(
    workspace: Path | int,
    program: str,
    args: list[str] | None = None,
    *,
    limits: Limits | None = None,
    stdin: str = "",
    read_only: tuple[str, ...] = ("tests",),
    root: Path | None = None,
    writable: bool = True,
    allow_weaker: tuple[str, ...] | None = None,
) -> RunResult:
    """Run ``python -c program args...`` in the sandbox with ``workspace`` (a path under the sandbox root,
    or an open directory descriptor) as its only writable directory, ``/ws``."""
    sup = check_sandbox(allow_weaker)
    limits = limits or Limits()
    ws_fd, ro = _open_mounts(workspace, read_only, root)
    try:
        return _run(program, list(args or []), limits, stdin, Mounts(ws_fd, tuple(ro), writable), sup)
    finally:
        for fd in [ws_fd, *(fd for fd, _ in ro)]:
            os.close(fd)


def _open_mounts(workspace: Path | int, read_only: tuple[str, ...], root: Path | None) -> tuple[int, list]:
    """The workspace's fd and (fd, name) of its read_only subdirectories that exist, none through a symlink."""
    from .fsafe import DIR_FLAGS

    if isinstance(workspace, int):
        ws_fd = os.dup(workspace)
    else:
        root = Path(root or sandbox_root()).resolve()
        ws = Path(workspace).resolve()
        if root not in ws.parents:
            raise ValueError(f"workspace {ws} is not under the sandbox root {root}")
        ws_fd = os.open(ws, DIR_FLAGS)
    ro = []
    for rel in read_only:
        try:
            ro.append((os.open(rel, DIR_FLAGS, dir_fd=ws_fd), rel))
        except OSError:
            pass  # missing or a symlink: nothing to protect there (the verifier flags a replaced tests dir)
    return ws_fd, ro


def _command(mounts: Mounts, seccomp_fd: int | None, cg: RunCgroup | None, limits: Limits, program: str, args):
    layout = python_layout()
    cmd = bwrap_args(layout, mounts, seccomp_fd)
    cmd += ["--", layout.exe, "-I", "-S", "-B", "-X", f"pycache_prefix={PYCACHE}", "-c", _prelude(limits)]
    cmd += [program, *args]
    if os.getuid() == 0:
        setpriv = shutil.which("setpriv") or "/usr/bin/setpriv"
        if not os.path.exists(setpriv):
            raise SandboxUnavailable("code sandbox: running as root but `setpriv` (util-linux) is missing")
        cmd = [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *cmd]
    if cg is not None:  # join every group of the run before anything runs
        joins = "".join(f'echo $$ > "${i + 1}" && ' for i in range(len(cg.procs_files())))
        n = len(cg.procs_files())
        cmd = ["/bin/sh", "-c", f'{joins}shift {n} && exec "$@"', "sh", *cg.procs_files(), *cmd]
    return cmd


def _run(program: str, args: list[str], limits: Limits, stdin: str, mounts: Mounts, sup: Support) -> RunResult:
    cg = None
    seccomp_fd = None
    try:
        if sup.cgroup is not None:
            cg = RunCgroup.create(
                sup.cgroup,
                memory_bytes=limits.memory_mb << 20,
                pids=limits.max_processes + 4,
                cpu_fraction=1.0,
            )
        if sup.seccomp:
            seccomp_fd = os.memfd_create("mentorrl-seccomp", 0)
            os.write(seccomp_fd, seccomp.bpf_program())
            os.lseek(seccomp_fd, 0, os.SEEK_SET)
        cmd = _command(mounts, seccomp_fd, cg, limits, program, args)
        fds = [mounts.workspace_fd, *(fd for fd, _ in mounts.read_only_fds)]
        if seccomp_fd is not None:
            fds.append(seccomp_fd)
        return _execute(cmd, fds, stdin, limits, cg)
    finally:
        if cg is not None:
            cg.remove()
        if seccomp_fd is not None:
            os.close(seccomp_fd)


def _execute(cmd: list[str], fds: list[int], stdin: str, limits: Limits, cg: RunCgroup | None) -> RunResult:
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            close_fds=True,
            pass_fds=fds,
            cwd="/",
            env={"PATH": os.defpath},
        )
    except OSError as e:
        raise SandboxUnavailable(f"code sandbox: cannot start {cmd[0]}: {e}") from e
    out, err, why, cpu = _collect(proc, stdin.encode(), limits, cg)
    duration = time.monotonic() - t0
    rc = proc.returncode
    stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
    if rc == 1 and stderr.startswith("bwrap:"):
        raise SandboxUnavailable("code sandbox: " + stderr.strip()[:400])
    oom = cg is not None and cg.oom_killed()
    status, notes = _status(why, rc, cpu, oom, limits)
    notes += _explain(stdout + stderr, limits)
    return RunResult(status, rc, stdout, stderr, duration, list(dict.fromkeys(notes)))


def _status(why: str | None, rc: int | None, cpu: float, oom: bool, limits: Limits) -> tuple[str, list[str]]:
    if why == "wall":
        return "wall", [f"killed: wall-time limit of {limits.wall_s:g} s exceeded"]
    if why == "output":
        return "output", [f"killed: output limit of {limits.max_output_bytes} bytes exceeded"]
    sigxcpu = rc in (-signal.SIGXCPU, 128 + signal.SIGXCPU)  # a process passed its own RLIMIT_CPU
    if why == "cpu" or sigxcpu or (rc != 0 and cpu >= limits.cpu_s - 0.05):
        return "cpu", [f"killed: CPU-time limit of {limits.cpu_s} s exceeded (all processes of the sandbox)"]
    if oom and rc != 0:
        return "memory", [f"killed: memory limit of {limits.memory_mb} MiB reached (the whole sandbox)"]
    if rc == 0:
        return "ok", []
    if rc is not None and (rc < 0 or rc > 128):
        return "signal", [f"killed by signal {abs(rc) if rc < 0 else rc - 128}"]
    return "exit", []


def _collect(proc: subprocess.Popen, data: bytes, limits: Limits, cg: RunCgroup | None):
    """Feed stdin, read both pipes up to the cap, enforce the wall time and the sandbox's CPU time;
    returns (stdout, stderr, why killed, CPU seconds)."""
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    sel = selectors.DefaultSelector()
    for f in bufs:
        sel.register(f, selectors.EVENT_READ)
    try:
        proc.stdin.write(data)
        proc.stdin.close()
    except (BrokenPipeError, OSError):
        pass
    deadline = time.monotonic() + limits.wall_s + 1.0  # + start-up of the chain
    why = None
    while sel.get_map() and why is None:
        left = deadline - time.monotonic()
        if left <= 0:
            why = "wall"
            break
        if cg is not None and cg.cpu_seconds() > limits.cpu_s:
            why = "cpu"
            break
        for key, _ in sel.select(timeout=min(left, 0.05)):
            chunk = os.read(key.fd, 65536)
            if not chunk:
                sel.unregister(key.fileobj)
                continue
            buf = bufs[key.fileobj]
            buf.extend(chunk)
            if len(buf) > limits.max_output_bytes:
                del buf[limits.max_output_bytes :]
                why = "output"
    if why:
        _kill(proc, cg)
    status, cpu = _reap(proc, deadline, cg, limits)
    if status is None:
        why = why or "wall"
        _kill(proc, cg)
        status, cpu = _reap(proc, None, None, limits)
    if cg is not None:
        cpu = max(cpu, cg.cpu_seconds())
    sel.close()
    for f in bufs:
        f.close()
    return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), why, cpu


def _reap(proc: subprocess.Popen, deadline: float | None, cg: RunCgroup | None, limits: Limits):
    """Wait for the chain (until ``deadline``; None: for ever); its exit code and CPU seconds."""
    while True:
        pid, status, ru = os.wait4(proc.pid, 0 if deadline is None else os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, ru.ru_utime + ru.ru_stime
        if time.monotonic() >= deadline or (cg is not None and cg.cpu_seconds() > limits.cpu_s):
            return None, 0.0
        time.sleep(0.01)


def _kill(proc: subprocess.Popen, cg: RunCgroup | None) -> None:
    if cg is not None:
        cg.kill()
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the chain's group; the PID namespace dies with its init
    except (ProcessLookupError, PermissionError):
        pass


_EXPLAIN = (
    ("MemoryError", "memory limit of {memory_mb} MiB reached"),
    ("Cannot allocate memory", "memory limit of {memory_mb} MiB reached"),
    ("Resource temporarily unavailable", "process limit of {max_processes} reached (fork refused)"),
    ("Network is unreachable", "no network in the sandbox"),
    ("Temporary failure in name resolution", "no network in the sandbox"),
    ("Address family not supported", "no network in the sandbox: only AF_UNIX sockets can be created"),
    ("Read-only file system", "write refused: the sandbox can write only inside its workspace (tests are read-only)"),
    ("File too large", "file-size limit of {max_file_bytes} bytes reached"),
    ("No space left on device", "workspace size limit of {workspace_mb} MiB reached"),
    ("Operation not permitted", "a system call the sandbox forbids was refused"),
)


def _explain(text: str, limits: Limits) -> list[str]:
    return list(dict.fromkeys(msg.format(**limits.__dict__) for needle, msg in _EXPLAIN if needle in text))


PROBE = r"""
import os, socket
open("probe.txt", "w").write("ok")
for path in ("/etc/mentorrl-sandbox-probe", "/mentorrl-sandbox-probe"):
    try:
        open(path, "w")
        print("WRITABLE-OUTSIDE")
    except OSError:
        pass
try:
    socket.create_connection(("127.0.0.1", 9), timeout=0.5)
    print("NETWORK")
except OSError:
    pass
print([l for l in open("/proc/self/status") if l.startswith("CapEff")][0].split()[1])
"""


def _run_probe() -> str:
    """Empty when a probe program runs jailed; else why the sandbox does not work here."""
    import tempfile

    if _bwrap() is None:
        return "code sandbox: no `bwrap` binary found (install the bubblewrap package)"
    try:
        ws = Path(tempfile.mkdtemp(prefix="probe-", dir=sandbox_root()))
        try:
            if os.getuid() == 0:
                os.chown(ws, NOBODY, NOBODY)  # a fresh directory no sandboxed code has seen
            res = _probe_once(ws)
            wrote = (ws / "probe.txt").exists()
        finally:
            shutil.rmtree(ws, ignore_errors=True)
    except (SandboxUnavailable, OSError) as e:
        return str(e)
    if res.exit_code != 0 or not wrote:
        return f"code sandbox: the probe program failed (exit {res.exit_code}): {(res.stderr or res.stdout)[-400:]}"
    lines = res.stdout.split()
    if "WRITABLE-OUTSIDE" in lines or "NETWORK" in lines or (lines and lines[-1] != "0000000000000000"):
        return f"code sandbox: the probe escaped its limits: {res.stdout.strip()}"
    return ""


def _probe_once(ws: Path) -> RunResult:
    from .fsafe import DIR_FLAGS

    fd = os.open(ws, DIR_FLAGS)
    try:
        return _run(PROBE, [], Limits(wall_s=10), "", Mounts(fd), machine_support())
    finally:
        os.close(fd)


__all__ = [
    "Limits",
    "RunResult",
    "SandboxUnavailable",
    "Support",
    "check_sandbox",
    "machine_support",
    "run_sandboxed",
    "sandbox_root",
    "python_layout",
    "mount_tmpfs",
    "unmount",
    "NOBODY",
    "WEAKER",
    "SANDBOX_WS",
]
