"""The code sandbox against a hostile workspace: the host-side code never follows a workspace path,
the sandbox's root is an allow-list, limits hold for the whole sandbox, a machine without a
protection refuses to start unless the user opts out by name, and every denial of service ends as
a clean failure with nothing left behind."""

from __future__ import annotations

import os
import stat
import threading
import time
from pathlib import Path

import pytest

from mentorrl.envs.code import attacks, fsafe
from mentorrl.envs.code import env as code_env
from mentorrl.envs.code import sandbox as sb
from mentorrl.envs.code.attacks import hardcoded_solution, universal_solution


def _py(env, code):
    return env.step("run_python", {"code": code})


# ------------------------------------------------------------------ the allow-listed root ----
def test_the_sandbox_sees_only_the_workspace_the_interpreter_and_its_stdlib(env_task):
    env, _ = env_task
    probe = (
        "import os, sys\n"
        "print([p for p in ('/work', '/tmp', '/home', '/root', '/sys', '/sys/class/net', '/etc/passwd', '/bin/sh')"
        " if os.path.exists(p)])\n"
        "print([p for p in sys.path if 'packages' in p])\n"
        "try:\n    import mentorrl\n    print('mentorrl importable')\nexcept ImportError:\n    print('no mentorrl')\n"
    )
    r = _py(env, probe)
    assert r.ok, r.error
    assert r.content["stdout"].split("\n")[:3] == ["[]", "[]", "no mentorrl"]
    for layout_path in sb.python_layout().binds:
        assert "site-packages" not in layout_path and "dist-packages" not in layout_path
        assert not layout_path.startswith(("/work", "/tmp", "/home"))


def test_universal_solution_cannot_find_the_reference_solutions(env_task):
    env, tasks = env_task
    env.step("write_file", {"path": "solution.py", "content": universal_solution(tasks[0])})
    v = env.verify("done")
    assert not v.success and v.details["hidden_passed"] < v.details["hidden_total"]


def test_stale_bytecode_is_never_run(env_task):
    env, tasks = env_task
    gen = attacks.stale_bytecode(tasks[0])
    r = _py(env, next(gen).arguments["code"])
    assert r.ok, r.error
    assert "NotImplementedError" in env.step("read_file", {"path": "solution.py"}).content["content"]
    v = env.verify("done")
    assert not v.success and v.details["hidden_passed"] == 0, v
    r = env.step("run_tests", {})  # the visible tests run the stub too
    assert r.ok and r.content["passed"] == 0


def test_a_workspace_module_cannot_shadow_the_standard_library(env_task):
    env, tasks = env_task
    env.step("write_file", {"path": "typing.py", "content": "import sys\nprint('SHADOW-RAN', file=sys.stderr)\n"})
    env.step("write_file", {"path": "solution.py", "content": tasks[0].reference["solution"]})
    res, _ = env._run_hidden(tasks[0])
    assert res is not None and "SHADOW-RAN" not in res.stderr and "SHADOW-RAN" not in res.stdout
    v = env.verify("done")
    assert not v.success and any("shadows the standard library: typing" in x for x in v.violations)


# ------------------------------------------------------ the host never follows a workspace path ----
def test_host_side_code_has_no_path_walk_and_no_chown():
    import inspect

    for mod in (code_env, fsafe):
        src = inspect.getsource(mod)
        for banned in ("os.walk(", "os.chown(", "shutil.copytree", "shutil.rmtree", ".is_symlink()", "realpath"):
            assert banned not in src, (mod.__name__, banned)


def test_every_host_open_in_the_workspace_is_nofollow(env_task, monkeypatch):
    """Record every os.open the host makes during an episode: each relative one has O_NOFOLLOW, and every
    ownership change is an fchown on a descriptor."""
    env, tasks = env_task
    calls, chowns = [], []
    real_open = os.open

    def spy_open(path, flags, *a, **k):
        calls.append((path, flags, k.get("dir_fd")))
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", spy_open)
    monkeypatch.setattr(os, "chown", lambda *a, **k: chowns.append(a))
    monkeypatch.setattr(os, "lchown", lambda *a, **k: chowns.append(a))
    env.reset(tasks[1])
    _py(env, "import os\nos.symlink('/etc/passwd', 'p')\nos.mkdir('d')\nos.symlink('/etc', 'd/e')")
    for path, content in (("solution.py", tasks[1].reference["solution"]), ("d/new.py", "x = 1"), ("p", "x")):
        env.step("write_file", {"path": path, "content": content})
    for path in ("solution.py", "p", "d/e/passwd"):
        env.step("read_file", {"path": path})
    env.verify("done")
    env.close()
    relative = [(p, f) for p, f, d in calls if d is not None]
    assert relative and all(f & os.O_NOFOLLOW for _, f in relative), [p for p, f in relative if not f & os.O_NOFOLLOW]
    assert not chowns


def test_a_symlink_swap_loop_never_hands_over_or_leaks_a_root_only_file(env_task):
    """A loop swapping a regular file and a symlink to a root-only 0600 file runs in the workspace while
    the host writes, reads, verifies and cleans up: the file never changes owner and is never read."""
    env, tasks = env_task
    secret = Path("/var/tmp") / f"mentorrl-secret-{os.getpid()}"
    secret.write_text("TOP-SECRET")
    os.chmod(secret, 0o600)
    before = secret.stat()
    ws = env.workspace
    stop = threading.Event()

    def swap():
        while not stop.is_set():
            for name in ("x.txt", "solution.py", "tests2"):
                p = ws / name
                try:
                    if p.is_symlink() or not p.exists():
                        p.unlink(missing_ok=True)
                        p.write_text("plain")
                    else:
                        p.unlink()
                        p.symlink_to(secret)
                except OSError:
                    pass

    t = threading.Thread(target=swap, daemon=True)
    t.start()
    try:
        seen = []
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            for name in ("x.txt", "solution.py"):
                env.step("write_file", {"path": name, "content": "def f(): pass\n"})
                r = env.step("read_file", {"path": name})
                seen.append(r.content["content"] if r.ok else "")
        env.verify("done")
    finally:
        stop.set()
        t.join()
        env.close()
    after = secret.stat()
    try:
        assert (after.st_uid, after.st_gid, stat.S_IMODE(after.st_mode)) == (
            before.st_uid,
            before.st_gid,
            0o600,
        )
        assert secret.read_text() == "TOP-SECRET"  # never written through the link either
        assert not any("TOP-SECRET" in s for s in seen)
    finally:
        secret.unlink()


# ------------------------------------------------------------- denial of service, no leak ----
def _threads() -> set[str]:
    return {t.name for t in threading.enumerate() if not t.daemon}


def _no_new_threads(before: set[str], wait_s: float = 10.0) -> bool:
    """No non-daemon thread outlives the episode (a thread that is finishing on a loaded machine gets ``wait_s``)."""
    deadline = time.monotonic() + wait_s
    while not _threads() <= before and time.monotonic() < deadline:
        time.sleep(0.05)
    return _threads() <= before


def test_fifo_and_socket_fail_cleanly(env_task):
    env, tasks = env_task
    threads = _threads()
    r = _py(env, attacks.SPECIAL_FILES)
    assert r.ok, r.error
    t0 = time.monotonic()
    w = env.step("write_file", {"path": "notes.txt", "content": "x"})
    rd = env.step("read_file", {"path": "fifo.py"})
    rs = env.step("read_file", {"path": "sock"})
    assert time.monotonic() - t0 < 10.0  # a FIFO would block for good; 10 s leaves room for a loaded machine
    assert not w.ok and w.error_kind == "policy" and not rd.ok and rd.error_kind == "policy" and not rs.ok
    env.step("write_file", {"path": "solution.py", "content": tasks[0].reference["solution"]})
    v = env.verify("done")  # the copy leaves the FIFOs and the socket out
    assert v.details["hidden_passed"] == v.details["hidden_total"]
    assert any("special file" in x for x in v.violations)
    d = env._dir
    env.close()
    assert not d.exists() and _no_new_threads(threads)


def test_deep_directories_fail_verify_cleanly_and_are_removed(env_task):
    env, tasks = env_task
    r = _py(env, attacks.DEEP_DIRS)
    assert r.ok, r.error
    env.step("write_file", {"path": "solution.py", "content": tasks[0].reference["solution"]})
    v = env.verify("done")
    assert not v.success and any("not copyable" in x for x in v.violations), v
    d = env._dir
    env.close()
    assert not d.exists()


def test_sparse_files_cannot_blow_up_the_verifier_copy(env_task):
    env, tasks = env_task
    r = _py(env, attacks.SPARSE)
    assert r.ok, r.error
    t0 = time.monotonic()
    v = env.verify("done")
    assert time.monotonic() - t0 < 10
    assert not v.success and any("not copyable" in x for x in v.violations), v


def test_remove_tree_handles_any_depth_and_special_files(tmp_path):
    """Without the episode tmpfs (a machine opted out of it), removal is still complete."""
    import socket

    top = tmp_path / "episode"
    top.mkdir()
    fd = os.open(top, os.O_RDONLY)
    try:
        for _ in range(1500):
            os.mkdir("d", dir_fd=fd)
            nfd = os.open("d", os.O_RDONLY, dir_fd=fd)
            os.mkfifo("fifo", dir_fd=nfd) if _ % 300 == 0 else None
            os.close(fd)
            fd = nfd
    finally:
        os.close(fd)
    os.mkfifo(top / "f")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(top / "s"))
    with open(top / "sparse", "wb") as f:
        f.truncate(1 << 30)
    os.symlink("/etc", top / "etc")
    root = os.open(tmp_path, os.O_RDONLY)
    try:
        fsafe.remove_tree(root, "episode")
    finally:
        os.close(root)
    assert not top.exists() and Path("/etc/passwd").exists()


def test_copy_tree_copies_only_regular_files_within_caps(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    (src / "pkg" / "__pycache__").mkdir(parents=True)
    dst.mkdir()
    (src / "solution.py").write_text("x = 1\n")
    (src / "pkg" / "__pycache__" / "m.cpython-311.pyc").write_bytes(b"\0")
    (src / "stale.pyc").write_bytes(b"\0")
    os.symlink("/etc/passwd", src / "link")
    os.mkfifo(src / "fifo")
    s, d = os.open(src, os.O_RDONLY), os.open(dst, os.O_RDONLY)
    try:
        rep = fsafe.copy_tree(s, d, fsafe.CopyCaps())
        assert sorted(p.relative_to(dst).as_posix() for p in dst.rglob("*")) == ["pkg", "solution.py"]
        assert any("symlink" in x for x in rep.skipped) and any("FIFO" in x for x in rep.skipped)
        with open(src / "big", "wb") as f:
            f.truncate(64 << 20)
        with pytest.raises(fsafe.CopyLimit):
            fsafe.copy_tree(s, os.open(tmp_path, os.O_RDONLY), fsafe.CopyCaps(max_bytes=1 << 20))
    finally:
        os.close(s)
        os.close(d)


# --------------------------------------------------------------------- per-sandbox limits ----
def test_shared_memory_and_fork_memory_are_limited_for_the_whole_sandbox(env_task):
    env, _ = env_task
    r = _py(env, attacks.SHM + "print('held all')")
    assert not r.ok and "memory limit" in r.error, r
    res = sb.run_sandboxed(env.workspace, attacks.FORK_MEMORY, limits=sb.Limits(wall_s=30.0), root=env.root)
    # each child may hold 400 MiB of address space (per-process limits alone let all 8 hold it at once);
    # the sandbox's cgroup holds 512 MiB in all, so the OOM killer stops them
    assert res.stdout.count("child-held") < 8, res


def test_cpu_time_is_limited_for_the_whole_sandbox(env_task):
    env, _ = env_task
    code = "import os\nfor _ in range(8):\n    if os.fork() == 0:\n        break\nwhile True:\n    pass"
    t0 = time.monotonic()
    res = sb.run_sandboxed(env.workspace, code, limits=sb.Limits(cpu_s=1, wall_s=60.0), root=env.root)
    assert res.status == "cpu", res
    assert time.monotonic() - t0 < 30  # 8 processes x 1 s each would be 8 CPU-seconds on a 1-core quota


def test_seccomp_denies_namespaces_mounts_keyctl_io_uring_and_ptrace(env_task):
    env, _ = env_task
    from mentorrl.envs.code.seccomp import SYSCALLS, machine

    nrs = {n: SYSCALLS[machine()][n] for n in ("unshare", "mount", "keyctl", "io_uring_setup", "ptrace", "setns")}
    code = (
        "import ctypes\nl = ctypes.CDLL(None, use_errno=True)\n"
        f"for name, nr in {sorted(nrs.items())!r}:\n"
        "    print(name, l.syscall(nr, 0, 0, 0, 0, 0), ctypes.get_errno())\n"
        f"print('clone_newuser', l.syscall({SYSCALLS[machine()]['clone']}, 0x10000000 | 17, 0, 0, 0, 0), ctypes.get_errno())\n"
    )
    r = _py(env, code)
    assert r.ok, r.error
    lines = [ln.split() for ln in r.content["stdout"].strip().splitlines()]
    assert len(lines) == len(nrs) + 1
    assert all(ret == "-1" and err == "1" for _, ret, err in lines), lines  # EPERM


# ------------------------------------------------- refusal on a weaker machine, and opt-out ----
def test_a_missing_protection_refuses_to_start_unless_opted_out_by_name(monkeypatch):
    from mentorrl.envs.code import CodeEnv

    real = sb.machine_support()
    weaker = sb.Support(None, real.workspace_quota, real.seccomp, {"cgroup": "no cgroup delegation (test)"})
    monkeypatch.setattr(sb, "machine_support", lambda: weaker)
    monkeypatch.delenv("MENTORRL_CODE_ALLOW_WEAKER", raising=False)
    with pytest.raises(sb.SandboxUnavailable, match="cgroup.*allow_weaker"):
        CodeEnv()
    with pytest.raises(sb.SandboxUnavailable, match="cgroup"):
        CodeEnv(allow_weaker=["seccomp"])  # opting out of something else does not count
    with pytest.raises(ValueError, match="unknown"):
        CodeEnv(allow_weaker=["everything"])
    env = CodeEnv(allow_weaker=["cgroup"])  # explicit: runs, without the cgroup
    try:
        from mentorrl.envs.code import CodeTasks

        env.reset(CodeTasks().tasks("train", 1, 0)[0])
        r = _py(env, "print(6 * 7)")
        assert r.ok and r.content["stdout"].strip() == "42"
    finally:
        env.close()
    monkeypatch.setenv("MENTORRL_CODE_ALLOW_WEAKER", "cgroup")
    CodeEnv().close()


def test_without_the_workspace_quota_opt_out_the_episode_is_a_plain_directory(monkeypatch):
    from mentorrl.envs.code import CodeEnv, CodeTasks

    real = sb.machine_support()
    weaker = sb.Support(real.cgroup, False, real.seccomp, {"workspace_quota": "test"})
    monkeypatch.setattr(sb, "machine_support", lambda: weaker)
    with pytest.raises(sb.SandboxUnavailable, match="workspace_quota"):
        CodeEnv()
    env = CodeEnv(allow_weaker=["workspace_quota"])
    task = CodeTasks().tasks("train", 1, 0)[0]
    env.reset(task)
    d = env._dir
    try:
        _py(env, attacks.DEEP_DIRS)
        env.step("write_file", {"path": "solution.py", "content": hardcoded_solution(task)})
        assert not env.verify("done").success
    finally:
        env.close()
    assert not d.exists()


def test_the_machine_support_is_reported():
    sup = sb.machine_support()
    assert set(sup.missing) <= set(sb.WEAKER)
    if os.getuid() == 0:
        assert sup.workspace_quota, sup.missing
