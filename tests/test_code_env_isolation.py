"""The code sandbox, round 2 (issue 56): the four findings of the second security test, each shown
closed by a test that fails on the code before the fix.

1. A run's output is hostile: a result line of 15,000 ``[`` cannot crash ``verify``, and no error in
   ``verify`` escapes it (a failed verdict with a reason instead).
2. Socket families: only ``AF_UNIX`` sockets can be created (``AF_VSOCK``, ``AF_INET``, ``AF_NETLINK``,
   ``AF_PACKET`` ... are refused by the seccomp filter).
3. Only source is importable from the workspace: an extension module, bytecode or a ``.pth`` file
   planted beside ``helper.py`` never runs instead of it, in ``run_python``, ``run_tests`` or ``verify``.
4. The hidden inputs cannot leave through ``Verdict.details``, and anonymous memory cannot be executed
   (``memfd_create`` and ``execveat`` are refused).

These tests need bubblewrap; they skip when it is missing (elsewhere the environment refuses to start).
"""

from __future__ import annotations

import json
import shutil

import pytest

from mentorrl.envs.code import env as code_env
from mentorrl.envs.code import fsafe, seccomp

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed")


def _py(env, code):
    return env.step("run_python", {"code": code})


def _write(env, path, content):
    r = env.step("write_file", {"path": path, "content": content})
    assert r.ok, r.error


# ------------------------------------------------------------- 1. hostile run output ----
BOMB = "MENTORRL-RESULTS " + "[" * 15_000

# the attack: the result marker and 15,000 '[' on every descriptor the solution can reach
RECURSION_BOMB = f"""import os
for fd in range(1, 64):
    try:
        os.write(fd, {(BOMB + chr(10)).encode()!r})
    except OSError:
        pass
os._exit(0)
"""


def test_a_recursion_bomb_in_the_output_is_a_failed_verdict_never_an_exception(env_task):
    env, _ = env_task
    _write(env, "solution.py", RECURSION_BOMB)
    v = env.verify("done")  # raised RecursionError before the fix
    assert not v.success and v.details["hidden_passed"] == 0


@pytest.mark.parametrize(
    "stdout",
    [
        BOMB,
        BOMB + "]" * 15_000,
        "MENTORRL-RESULTS " + '{"a":' * 5_000 + "1" + "}" * 5_000,
        "MENTORRL-RESULTS " + "[" * 10 + "1" + "]" * 10 + "x" * 200_000,
        "MENTORRL-RESULTS \ud800",
    ],
)
def test_the_result_parser_is_bounded_in_size_and_depth(stdout):
    assert code_env._results(stdout) is None  # never RecursionError, never a huge parse


def test_the_result_parser_reads_honest_results():
    ok = [{"ok": [[1, 2], {"k": "v [ ] { }"}]}, {"error": "ValueError"}]
    assert code_env._results("noise\nMENTORRL-RESULTS " + json.dumps(ok) + "\n") == ok
    assert code_env.json_depth('["[[[", {"a": [1]}]') == 3  # brackets inside strings do not count


def test_any_error_in_verify_is_a_failed_verdict_with_a_reason(env_task, monkeypatch):
    env, tasks = env_task
    _write(env, "solution.py", tasks[0].reference["solution"])

    def boom(*a, **k):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(code_env, "_verdict", boom)  # past the sandbox run: comparing the results
    v = env.verify("done")
    assert not v.success and "RecursionError" in v.details["error"]


# ------------------------------------------------------------------ 2. socket families ----
SOCKETS = """import ctypes, socket
libc = ctypes.CDLL(None, use_errno=True)
for name in ("AF_INET", "AF_INET6", "AF_NETLINK", "AF_PACKET", "AF_VSOCK", "AF_BLUETOOTH", "AF_ALG"):
    fam = getattr(socket, name, None) or {"AF_VSOCK": 40, "AF_ALG": 38, "AF_BLUETOOTH": 31}[name]
    try:
        socket.socket(fam, socket.SOCK_STREAM if name in ("AF_INET", "AF_INET6", "AF_VSOCK") else socket.SOCK_RAW).close()
        print(name, "OPEN")
    except OSError as e:
        print(name, "refused", e.errno)
    fd = libc.syscall(SYS_SOCKET, fam, 1, 0)  # native code is under the same filter
    print(name + "-native", "OPEN" if fd >= 0 else "refused", ctypes.get_errno())
a = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
b, c = socket.socketpair()
b.sendall(b"x")
print("AF_UNIX", "works" if c.recv(1) == b"x" else "broken")
try:
    socket.socketpair(socket.AF_INET)
    print("socketpair-AF_INET OPEN")
except OSError as e:
    print("socketpair-AF_INET refused", e.errno)
"""


@pytest.mark.parametrize("arch", sorted(seccomp.SYSCALLS))
def test_the_filter_assembles_for_every_architecture(arch):
    prog = seccomp.bpf_program(arch)
    assert prog and len(prog) % 8 == 0 and len(prog) // 8 < 256
    assert {"socket", "socketpair", "memfd_create", "execveat"} <= set(seccomp.SYSCALLS[arch])
    assert "memfd_create" in seccomp.DENIED and "execveat" in seccomp.DENIED and seccomp.SOCKET_FAMILIES == (1,)


def test_only_unix_sockets_can_be_created(env_task):
    env, _ = env_task
    r = _py(env, SOCKETS.replace("SYS_SOCKET", str(seccomp.SYSCALLS[seccomp.machine()]["socket"])))
    assert r.ok, r.error
    lines = [ln.split() for ln in r.content["stdout"].strip().splitlines()]
    assert ["AF_UNIX", "works"] in lines
    refused = [ln for ln in lines if ln[0] != "AF_UNIX"]
    assert len(refused) == 15 and all(ln[1] == "refused" for ln in refused), lines
    assert all(ln[2] == "97" for ln in refused), lines  # EAFNOSUPPORT: the filter, not the kernel's choice


# ---------------------------------------------------------------- 3. only source runs ----
PLANT = {
    # an extension module (any shared object) named for helper: the import system prefers it to helper.py
    "extension": "import glob, shutil, sys, importlib.machinery as m\n"
    "d = [p for p in sys.path if p.endswith('lib-dynload')][0]\n"
    "shutil.copy(sorted(glob.glob(d + '/*.so'))[0], 'helper' + m.EXTENSION_SUFFIXES[0])\n",
    "abi3": "import glob, shutil, sys\n"
    "d = [p for p in sys.path if p.endswith('lib-dynload')][0]\n"
    "shutil.copy(sorted(glob.glob(d + '/*.so'))[0], 'helper.abi3.so')\n",
    "plain-so": "import glob, shutil, sys\n"
    "d = [p for p in sys.path if p.endswith('lib-dynload')][0]\n"
    "shutil.copy(sorted(glob.glob(d + '/*.so'))[0], 'helper.so')\n",
    # a package directory whose __init__ is an extension module: a package wins over helper.py
    "package": "import glob, os, shutil, sys, importlib.machinery as m\n"
    "d = [p for p in sys.path if p.endswith('lib-dynload')][0]\n"
    "os.mkdir('helper')\n"
    "shutil.copy(sorted(glob.glob(d + '/*.so'))[0], 'helper/__init__' + m.EXTENSION_SUFFIXES[0])\n",
    # bytecode beside the source, and in a cache
    "bytecode": "import os, py_compile\n"
    "open('b.py', 'w').write('WHO = \"bytecode\"')\n"
    "py_compile.compile('b.py', cfile='helper.pyc')\n"
    "os.makedirs('__pycache__', exist_ok=True)\n"
    "import sys\n"
    "py_compile.compile('b.py', cfile='__pycache__/helper.%s.pyc' % sys.implementation.cache_tag)\n"
    "os.remove('b.py')\n",
    # site hooks (the sandbox runs without site, so these must never matter)
    "pth": "open('zz.pth', 'w').write('import sys; sys.modules[\"helper\"] = type(sys)(\"helper\")\\n')\n"
    "open('helper.egg-link', 'w').write('/ws\\n')\n",
}


@pytest.mark.parametrize("kind", list(PLANT))
def test_only_the_source_shown_is_imported(env_task, kind):
    env, tasks = env_task
    task = tasks[0]
    _write(env, "helper.py", 'WHO = "source"\n' + task.reference["solution"])
    _write(env, "solution.py", "from helper import *  # noqa\n")
    r = _py(env, PLANT[kind])
    assert r.ok, r.error
    r = _py(env, "import os, sys\nsys.path.append(os.getcwd())\nimport helper\nprint(helper.WHO)")
    assert r.ok and r.content["stdout"].strip() == "source", r
    r = env.step("run_tests", {})
    assert r.ok and r.content["passed"] == r.content["total"], r
    v = env.verify("done")
    assert v.success, v


def test_the_verifier_copy_holds_no_extension_bytecode_or_site_hook(tmp_path):
    import importlib.machinery as m

    src, dst = tmp_path / "src", tmp_path / "dst"
    (src / "pkg" / "__pycache__").mkdir(parents=True)
    dst.mkdir()
    keep = ["a.py", "data.txt", "pkg/__init__.py", "pkg/b.py", "notes.json"]
    drop = [f"x{s}" for s in m.all_suffixes() if s not in m.SOURCE_SUFFIXES]
    drop += ["y.so", "z.pyd", "w.pth", "v.egg-link", "pkg/c.abi3.so", "pkg/__pycache__/b.cpython-311.pyc"]
    for rel in keep + drop:
        (src / rel).write_text("x")
    s, d = fsafe.os.open(src, fsafe.DIR_FLAGS), fsafe.os.open(dst, fsafe.DIR_FLAGS)
    try:
        rep = fsafe.copy_tree(s, d, fsafe.CopyCaps())
    finally:
        fsafe.os.close(s)
        fsafe.os.close(d)
    copied = sorted(str(p.relative_to(dst)) for p in dst.rglob("*") if p.is_file())
    assert copied == sorted(keep), (copied, rep.skipped)


def test_write_file_refuses_a_file_that_could_shadow_source(env_task):
    env, _ = env_task
    for name in ("helper.so", "helper.cpython-311-x86_64-linux-gnu.so", "helper.pyc", "x.pth", "pkg/m.pyd"):
        r = env.step("write_file", {"path": name, "content": "x"})
        assert not r.ok and r.error_kind == "policy", (name, r)


# --------------------------------------------------------- 4. hidden inputs, memfd exec ----
# at import, look everywhere the runner could have left the hidden inputs, and send what is found
# out through the import error (which the verdict reports)
EXFILTRATE = r"""import gc, os, sys
NEEDLES = __NEEDLES__
found = []
main = sys.modules.get("__main__")
for name in ("spec", "cases"):
    found.append(repr(getattr(main, name, ""))[:2000])
for o in gc.get_objects():
    if isinstance(o, dict) and ("cases" in o or "case" in o):
        found.append(repr(o)[:2000])
try:
    found.append(sys.stdin.read()[:2000])
except Exception:
    pass
for path in ("/proc/%d/fd/0" % os.getppid(), "/proc/1/fd/0", "/proc/%d/environ" % os.getppid(),
             "/proc/%d/cmdline" % os.getppid()):
    try:
        found.append(open(path, "rb").read(2000).decode("latin-1"))
    except OSError:
        pass
try:
    mem = open("/proc/%d/mem" % os.getppid(), "rb")
    for line in open("/proc/%d/maps" % os.getppid()).read().splitlines():
        f = line.split()
        if f[1].startswith("rw"):
            lo, hi = (int(x, 16) for x in f[0].split("-"))
            try:
                mem.seek(lo)
                found.append(mem.read(min(hi - lo, 64 << 20)).decode("latin-1"))
            except (OSError, ValueError, OverflowError):
                pass
except (OSError, ValueError):
    pass
found = [n for n in NEEDLES for f in found if n in f]
raise ImportError("FOUND " + "|".join(sorted(set(found))) if found else "nothing found")
"""


def _needles(task) -> list[str]:
    """Distinctive pieces of the hidden inputs (lists of three or more numbers, as repr and JSON write
    them), none of which is in the visible cases or the prompt."""
    public = json.dumps(task.reference["visible"]) + task.prompt
    out = []

    def walk(x):
        if isinstance(x, list):
            if len(x) >= 3 and all(type(v) is int for v in x):
                out.append(", ".join(map(str, x)))
            for v in x:
                walk(v)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)

    for h in task.reference["hidden"]:
        walk(h["case"])
    return [n for n in out if n not in public]


def _exfiltrate(env, tasks):
    task = next(t for t in tasks if t.family == "lists")
    env.reset(task)
    needles = _needles(task)
    assert len(needles) >= 3
    _write(env, "solution.py", EXFILTRATE.replace("__NEEDLES__", repr(needles)))
    v = env.verify("done")
    assert not v.success
    shown = json.dumps(v.details) + json.dumps(v.violations)
    return [n for n in needles if n in shown], shown


def test_the_hidden_inputs_cannot_leave_through_the_verdict(env_task):
    env, tasks = env_task
    leaked, shown = _exfiltrate(env, tasks)
    assert not leaked and "nothing found" in shown, shown[:600]


def test_the_runner_being_undumpable_is_what_keeps_its_memory_unread(env_task, monkeypatch):
    """The control: the same attack against a runner that leaves itself dumpable reads the inputs out of
    its memory (where the kernel lets a process read its same-user parent's memory, as here)."""
    env, tasks = env_task
    prctl = "ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)"
    assert prctl in code_env.HIDDEN_RUNNER
    monkeypatch.setattr(code_env, "HIDDEN_RUNNER", code_env.HIDDEN_RUNNER.replace(prctl, "pass"))
    leaked, shown = _exfiltrate(env, tasks)
    if "nothing found" in shown:
        pytest.skip("this kernel keeps a process from reading its parent's memory anyway (Yama)")
    assert leaked, shown[:600]


def test_an_honest_solution_still_passes_every_family(env_task):
    env, _ = env_task
    from mentorrl.envs import get_env

    tasks = get_env("code").make_tasks().tasks("train", 24, 3)
    seen = set()
    for t in tasks:
        if t.family in seen:
            continue
        seen.add(t.family)
        env.reset(t)
        _write(env, "solution.py", t.reference["solution"])
        v = env.verify("done")
        assert v.success, (t.family, v)
    assert len(seen) >= 3


MEMFD_EXEC = """import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.syscall(MEMFD_CREATE, b"x", 0)
print("memfd_create", fd, ctypes.get_errno())
real = os.open("/proc/self/exe", os.O_RDONLY)
r = libc.syscall(EXECVEAT, real, b"", None, None, 0x1000)  # AT_EMPTY_PATH: fexecve
print("execveat", r, ctypes.get_errno())
try:
    os.execve(real, ["python", "-c", "print('EXECUTED')"], {})
except OSError as e:
    print("fexecve", -1, e.errno)
"""


def test_anonymous_memory_cannot_be_executed(env_task):
    env, _ = env_task
    nrs = seccomp.SYSCALLS[seccomp.machine()]
    code = MEMFD_EXEC.replace("MEMFD_CREATE", str(nrs["memfd_create"])).replace("EXECVEAT", str(nrs["execveat"]))
    r = _py(env, code)
    assert r.ok, r.error
    assert "EXECUTED" not in r.content["stdout"]
    lines = {ln.split()[0]: ln.split()[1:] for ln in r.content["stdout"].strip().splitlines()}
    assert lines["memfd_create"] == ["-1", "1"] and lines["execveat"] == ["-1", "1"], lines  # EPERM
    assert lines["fexecve"][0] == "-1", lines


def test_os_memfd_create_is_refused_in_the_sandbox(env_task):
    env, _ = env_task
    r = _py(
        env,
        "import os\ntry:\n    os.memfd_create('x')\n    print('CREATED')\nexcept OSError as e:\n    print('refused', e.errno)",
    )
    assert r.ok and r.content["stdout"].split() == ["refused", "1"], r
