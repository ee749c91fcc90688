"""The sandbox every program of the ``code`` environment runs in.

Each execution is a separate process chain::

    [setpriv --reuid nobody (only when the host runs as root)]
      unshare --user --map-root-user --mount --net --pid --ipc --uts --fork --kill-child --mount-proc
        python -I -S -B -c LAUNCHER      (namespace root: sets up the mounts, then drops every capability)
          python -I -S -B -c PROGRAM     (the untrusted code, with resource limits)

* **No network**: a fresh network namespace has only a loopback device that is down.
* **Read-only view outside the workspace**: the launcher remounts every mount read-only, covers the
  sandbox root (the directory holding every environment's workspace and verifier files) with an
  empty read-only tmpfs, and binds only this run's workspace back, read-write, at
  ``<root>/ws``; ``read_only`` paths inside the workspace (the tests) are bound read-only. Other
  tasks' workspaces and every verifier's hidden tests are therefore not in the sandbox's view.
* **No capabilities**: before running the program the launcher drops the capability bounding set,
  locks ``SECBIT_NOROOT`` (uid 0 in the namespace gains nothing at exec) and sets
  ``no_new_privs``, so the program cannot undo the read-only remounts.
* **Not root on the host**: when the host runs as root the chain starts as ``nobody`` (setpriv),
  so files are accessed, and processes counted, as an unprivileged user.
* **Limits**: CPU time (RLIMIT_CPU), memory (RLIMIT_AS), processes (RLIMIT_NPROC, counted in the
  sandbox's own user namespace), file size (RLIMIT_FSIZE), open files, no core dumps; a wall-time
  limit kills the whole process group (and with it the PID namespace); stdout and stderr are
  capped at ``max_output_bytes`` each (the process is killed when it writes more).

:func:`check_sandbox` probes the mechanism once per process and raises :class:`SandboxUnavailable`
with the reason when it does not work (no ``unshare``, user namespaces disabled, a mount refused):
the environment then refuses to start instead of running code unjailed.
"""

from __future__ import annotations

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

NOBODY = 65534


class SandboxUnavailable(RuntimeError):
    """No working isolation on this machine: the code environment refuses to run programs."""


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 2
    wall_s: float = 4.0
    memory_mb: int = 512
    max_processes: int = 32
    max_output_bytes: int = 16_384
    max_file_bytes: int = 1 << 20
    max_open_files: int = 64


@dataclass
class RunResult:
    """How a sandboxed program ended: ``status`` is ok | exit | cpu | wall | output | signal."""

    status: str
    exit_code: int | None
    stdout: str
    stderr: str
    duration_s: float
    notes: list[str] = field(default_factory=list)  # what the sandbox stopped, in words

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# Runs as root of the new user namespace (pid 1 of the new PID namespace). argv[1]: JSON config.
LAUNCHER = r"""
import ctypes, json, os, resource, sys
cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
MS_NOATIME, MS_NODIRATIME, MS_REC, MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1024, 2048, 16384, 1 << 18, 1 << 21, 1 << 24
FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
         "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME, "strictatime": MS_STRICTATIME}

def die(msg):
    os.write(2, ("mentorrl-sandbox-setup-failed: " + msg + "\n").encode())
    os._exit(125)

def mount(src, dst, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    if libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), dst)

def unescape(p):
    return p.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")

try:
    ws, root = cfg["workspace"], cfg["root"]
    wsfd = os.open(ws, os.O_PATH | os.O_DIRECTORY)
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    seen, kept = set(), {}
    for line in reversed(open("/proc/self/mountinfo").read().splitlines()):
        parts = line.split()
        mp, opts = unescape(parts[4]), parts[5].split(",")
        if mp in seen:
            continue
        seen.add(mp)
        flags = MS_BIND | MS_REMOUNT | MS_RDONLY
        for o in opts:
            flags |= FLAGS.get(o, 0)
        kept[mp] = flags & ~(MS_REMOUNT | MS_RDONLY | MS_BIND)
        try:
            mount(None, mp, None, flags)
        except OSError as e:
            if mp == "/" or e.errno not in (13, 2):  # EACCES / ENOENT: unreachable from here anyway
                die(f"read-only remount of {mp}: {e}")
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
    target = os.path.join(root, "ws")
    os.mkdir(target)
    mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    mount(f"/proc/self/fd/{wsfd}", target, None, MS_BIND | MS_REC)
    # a bind keeps its source mount's (now read-only) flags: make this one writable again
    home = max((m for m in kept if ws == m or ws.startswith(m.rstrip("/") + "/")), key=len)
    mount(None, target, None, MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV | kept[home])
    os.close(wsfd)
    for rel in cfg["read_only"]:
        p = os.path.join(target, rel)
        if os.path.isdir(p) and not os.path.islink(p):
            mount(p, p, None, MS_BIND)
            mount(None, p, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(target)
    # no way back: no capabilities after exec, even as uid 0 of this namespace
    PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT = 24, 28, 38, 47
    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break
    libc.prctl(PR_CAP_AMBIENT, 4, 0, 0, 0)
    if libc.prctl(PR_SET_SECUREBITS, 0x01 | 0x02 | 0x04 | 0x08 | 0x40 | 0x80, 0, 0, 0) != 0:
        die("securebits: " + os.strerror(ctypes.get_errno()))
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        die("no_new_privs: " + os.strerror(ctypes.get_errno()))
    lim = cfg["limits"]
    for res, val in ((resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1)),
                     (resource.RLIMIT_AS, (lim["memory_mb"] << 20,) * 2),
                     (resource.RLIMIT_NPROC, (lim["max_processes"],) * 2),
                     (resource.RLIMIT_FSIZE, (lim["max_file_bytes"],) * 2),
                     (resource.RLIMIT_NOFILE, (lim["max_open_files"],) * 2),
                     (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(res, val)
except Exception as e:
    die(f"{type(e).__name__}: {e}")
env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": target, "TMPDIR": target, "LANG": "C.UTF-8",
       "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}
os.execve(sys.executable, [sys.executable, "-I", "-S", "-B", "-c", cfg["program"], *cfg["args"]], env)
"""

_probe: tuple[bool, str] | None = None


def _unshare() -> str | None:
    return shutil.which("unshare") or ("/usr/bin/unshare" if os.path.exists("/usr/bin/unshare") else None)


def sandbox_root() -> Path:
    """The directory under which every workspace and verifier directory lives (hidden in the sandbox)."""
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


def _command(cfg: dict) -> list[str]:
    unshare = _unshare()
    if unshare is None:
        raise SandboxUnavailable("code sandbox: no `unshare` binary (util-linux) found")
    cmd = [
        unshare,
        "--user",
        "--map-root-user",
        "--mount",
        "--net",
        "--pid",
        "--ipc",
        "--uts",
        "--fork",
        "--kill-child",
        "--mount-proc",
        sandbox_python(),
        "-I",
        "-S",
        "-B",
        "-c",
        LAUNCHER,
        json.dumps(cfg),
    ]
    if os.getuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            raise SandboxUnavailable(
                "code sandbox: running as root but `setpriv` (util-linux) is missing, "
                "so the sandbox cannot drop to an unprivileged user"
            )
        cmd = [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *cmd]
    return cmd


def run_sandboxed(
    workspace: Path,
    program: str,
    args: list[str] | None = None,
    *,
    limits: Limits | None = None,
    stdin: str = "",
    read_only: tuple[str, ...] = ("tests",),
    root: Path | None = None,
) -> RunResult:
    """Run ``python -c program args...`` in the sandbox with ``workspace`` as its (only writable) directory."""
    limits = limits or Limits()
    root = Path(root or sandbox_root())
    workspace = Path(workspace).resolve()
    if root.resolve() not in workspace.parents:
        raise ValueError(f"workspace {workspace} is not under the sandbox root {root}")
    cfg = {
        "workspace": str(workspace),
        "root": str(root.resolve()),
        "read_only": list(read_only),
        "program": program,
        "args": list(args or []),
        "limits": limits.__dict__,
    }
    cmd = _command(cfg)
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            close_fds=True,
            cwd="/",
            env={"PATH": os.defpath},
        )
    except OSError as e:
        raise SandboxUnavailable(f"code sandbox: cannot start {cmd[0]}: {e}") from e
    out, err, why, cpu = _collect(proc, stdin.encode(), limits)
    duration = time.monotonic() - t0
    rc = proc.returncode
    stdout = out.decode("utf-8", "replace")
    stderr = err.decode("utf-8", "replace")
    if "mentorrl-sandbox-setup-failed:" in stderr:
        raise SandboxUnavailable("code sandbox: " + stderr.split("mentorrl-sandbox-setup-failed:", 1)[1].strip())
    notes: list[str] = []
    if why == "wall":
        status = "wall"
        notes.append(f"killed: wall-time limit of {limits.wall_s:g} s exceeded")
        stderr = stderr.replace("unshare: sigprocmask unblock failed: Invalid argument\n", "")
    elif why == "output":
        status = "output"
        notes.append(f"killed: output limit of {limits.max_output_bytes} bytes exceeded")
    elif rc != 0 and cpu >= limits.cpu_s - 0.05:
        status = "cpu"
        notes.append(f"killed: CPU-time limit of {limits.cpu_s} s exceeded")
        stderr = stderr.replace("unshare: sigprocmask unblock failed: Invalid argument\n", "")
    elif rc == 0:
        status = "ok"
    elif rc is not None and (rc < 0 or rc > 128):
        status = "signal"
        notes.append(f"killed by signal {abs(rc) if rc < 0 else rc - 128}")
    else:
        status = "exit"
    notes += _explain(stdout + stderr, limits)
    return RunResult(status, rc, stdout, stderr, duration, notes)


def _collect(proc: subprocess.Popen, data: bytes, limits: Limits) -> tuple[bytes, bytes, str | None, float]:
    """Feed stdin, read both pipes up to the cap, enforce the wall time; returns (stdout, stderr, why killed,
    CPU seconds)."""
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    sel = selectors.DefaultSelector()
    for f in bufs:
        sel.register(f, selectors.EVENT_READ)
    try:
        proc.stdin.write(data)
        proc.stdin.close()
    except (BrokenPipeError, OSError):
        pass
    deadline = time.monotonic() + limits.wall_s + 1.0  # + start-up of the launcher chain
    why = None
    while sel.get_map():
        left = deadline - time.monotonic()
        if left <= 0:
            why = "wall"
            break
        for key, _ in sel.select(timeout=min(left, 0.5)):
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
            break
    if why:
        _kill(proc)
    status, cpu = _reap(proc, deadline)
    if status is None:
        why = why or "wall"
        _kill(proc)
        status, cpu = _reap(proc, None)
    sel.close()
    for f in bufs:
        f.close()
    return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), why, cpu


def _reap(proc: subprocess.Popen, deadline: float | None) -> tuple[int | None, float]:
    """Wait for the chain (until ``deadline``; None: for ever); its exit code and the CPU seconds of it and
    every descendant it waited for (the sandboxed program included)."""
    while True:
        pid, status, ru = os.wait4(proc.pid, 0 if deadline is None else os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, ru.ru_utime + ru.ru_stime
        if time.monotonic() >= deadline:
            return None, 0.0
        time.sleep(0.01)


def _kill(proc: subprocess.Popen) -> None:
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
    ("Read-only file system", "write refused: the sandbox can write only inside its workspace (tests are read-only)"),
    ("File too large", "file-size limit of {max_file_bytes} bytes reached"),
)


def _explain(text: str, limits: Limits) -> list[str]:
    return list(dict.fromkeys(msg.format(**limits.__dict__) for needle, msg in _EXPLAIN if needle in text))


def check_sandbox() -> None:
    """Raise :class:`SandboxUnavailable` when the sandbox does not work here (probed once per process)."""
    global _probe
    if _probe is None:
        _probe = _run_probe()
    ok, why = _probe
    if not ok:
        raise SandboxUnavailable(why)


PROBE = r"""
import os, socket
open("probe.txt", "w").write("ok")
try:
    open("/etc/mentorrl-sandbox-probe", "w")
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


def _run_probe() -> tuple[bool, str]:
    import tempfile

    try:
        root = sandbox_root()
        ws = Path(tempfile.mkdtemp(prefix="probe-", dir=root))
        if os.getuid() == 0:
            os.chown(ws, NOBODY, NOBODY)
        try:
            res = run_sandboxed(ws, PROBE, limits=Limits(wall_s=10), read_only=())
            wrote = (ws / "probe.txt").exists()
        finally:
            shutil.rmtree(ws, ignore_errors=True)
    except (SandboxUnavailable, OSError) as e:
        return False, str(e)
    if res.exit_code != 0 or not wrote:
        return False, (
            f"code sandbox: the probe program failed (exit {res.exit_code}): "
            f"{(res.stderr or res.stdout).strip()[-400:]}"
        )
    lines = res.stdout.split()
    if "WRITABLE-OUTSIDE" in lines or "NETWORK" in lines or (lines and lines[-1] != "0000000000000000"):
        return False, f"code sandbox: the probe escaped its limits: {res.stdout.strip()}"
    return True, ""


__all__ = [
    "Limits",
    "RunResult",
    "SandboxUnavailable",
    "check_sandbox",
    "run_sandboxed",
    "sandbox_root",
    "LAUNCHER",
    "NOBODY",
]
