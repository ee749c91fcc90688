"""The code environment's sandbox: each abuse gets a clear error observation and the host is untouched."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from mentorrl.envs.code import sandbox as sb
from mentorrl.envs.code.sandbox import SandboxUnavailable, check_sandbox

try:
    check_sandbox()
    REASON = ""
except SandboxUnavailable as e:  # pragma: no cover - depends on the machine
    REASON = str(e)  # the tests below then fail on CodeEnv()/check_sandbox() with this reason
# Never skipped: on a machine without isolation these tests fail (the environment refuses to start there).


def test_infinite_loop_is_stopped_by_the_cpu_limit(env_task):
    env, _ = env_task
    r = env.step("run_python", {"code": "while True:\n    pass"})
    # on idle cores the 2 s CPU limit ends it; on busy ones (a loaded CI machine) the 4 s wall limit can come first
    assert not r.ok and r.error_kind == "timeout" and ("CPU-time limit" in r.error or "wall-time limit" in r.error)
    # the CPU limit itself, with a wall limit far away
    res = sb.run_sandboxed(env.workspace, "while True:\n    pass", limits=sb.Limits(cpu_s=1, wall_s=120.0))
    assert res.status == "cpu", res


def test_sleeping_program_is_stopped_by_the_wall_limit(env_task):
    env, _ = env_task
    r = env.step("run_python", {"code": "import time\ntime.sleep(60)"})
    assert not r.ok and r.error_kind == "timeout" and "wall-time limit" in r.error


def test_fork_bomb_hits_the_process_limit(env_task):
    env, _ = env_task
    before = len(os.listdir("/proc"))
    r = env.step("run_python", {"code": "import os\nwhile True:\n    os.fork()"})
    assert not r.ok and "process limit" in r.error
    assert len(os.listdir("/proc")) < before + 20  # the PID namespace died with its init: nothing left over


def test_huge_allocation_hits_the_memory_limit(env_task):
    env, _ = env_task
    r = env.step("run_python", {"code": "x = bytearray(8 << 30)"})
    assert not r.ok and "memory limit" in r.error


def test_rm_rf_leaves_the_host_untouched(env_task, tmp_path):
    """The canary lives outside the workspace: it is not even in the sandbox's view, and what is
    (the interpreter and its standard library) is read-only."""
    env, _ = env_task
    canary = Path("/var/tmp") / f"mentorrl-canary-{os.getpid()}"
    canary.write_text("alive")
    os.chmod(canary, 0o666)
    try:
        r = env.step("run_python", {"code": f"import os\nprint(os.path.exists({str(canary)!r}))"})
        assert r.ok and r.content["stdout"].strip() == "False"
        r = env.step("run_python", {"code": "import os, json\nos.remove(json.__file__)"})
        assert not r.ok and "write refused" in r.error and "Read-only file system" in r.error
        assert canary.read_text() == "alive"
        assert any("outside the workspace" in v for v in env.verify("done").violations)
    finally:
        canary.unlink(missing_ok=True)


def test_no_network(env_task):
    env, _ = env_task
    with socket.socket() as srv:  # a listener on the host's loopback: unreachable from the sandbox
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        for target in (f"('127.0.0.1', {port})", "('1.1.1.1', 80)"):
            r = env.step("run_python", {"code": f"import socket\nsocket.create_connection({target}, timeout=2)"})
            assert not r.ok and ("no network" in r.error or "refused" in r.error.lower()), r.error


def test_other_tasks_hidden_tests_are_out_of_view():
    from mentorrl.envs import get_env

    entry = get_env("code")
    a, b = entry.make_env(), entry.make_env()
    ta, tb = entry.make_tasks().tasks("train", 2, 0)
    try:
        a.reset(ta)
        b.reset(tb)
        secret = b.verifier_dir / "hidden_tests.json"
        assert secret.exists()
        for path in (secret, a.verifier_dir / "hidden_tests.json", b.workspace / "solution.py"):
            r = a.step("run_python", {"code": f"print(open({str(path)!r}).read())"})
            assert not r.ok and "No such file" in r.error
        r = a.step("run_python", {"code": f"import os\nprint(os.path.exists({str(a.root)!r}))"})
        assert r.ok and r.content["stdout"].strip() == "False"  # the sandbox root is not in the view
        r = a.step("read_file", {"path": str(secret)})
        assert not r.ok and r.error_kind == "policy"
    finally:
        a.close()
        b.close()


def test_output_is_capped_and_no_capability_is_left(env_task):
    env, _ = env_task
    r = env.step("run_python", {"code": "print('x' * 10**6)"})
    assert not r.ok and "output limit" in r.error
    r = env.step("run_python", {"code": "print([l for l in open('/proc/self/status') if l.startswith('CapEff')][0])"})
    assert r.ok and r.content["stdout"].split()[-1] == "0000000000000000"
    r = env.step(
        "run_python",
        {"code": "import ctypes\nprint(ctypes.CDLL(None).mount(b'none', b'/', None, 32 | 1 << 5, None))"},
    )
    assert r.ok and r.content["stdout"].strip() == "-1"


def test_symlink_in_the_workspace_cannot_lead_write_file_outside(env_task):
    env, _ = env_task
    r = env.step("run_python", {"code": "import os\nos.symlink('/etc', 'etc')"})
    assert r.ok
    r = env.step("write_file", {"path": "etc/evil", "content": "x"})
    assert not r.ok and r.error_kind == "policy" and not Path("/etc/evil").exists()


def test_fails_closed_without_isolation(monkeypatch):
    monkeypatch.setattr(sb, "_probe_error", lambda: "code sandbox: no `bwrap` binary found")
    from mentorrl.envs.code import CodeEnv

    with pytest.raises(SandboxUnavailable, match="bwrap"):
        CodeEnv()


def test_setup_failure_is_reported_not_run_unjailed(monkeypatch, tmp_path):
    monkeypatch.setattr(sb, "_bwrap", lambda: None)
    root = tmp_path / "root"
    (root / "ws").mkdir(parents=True)
    with pytest.raises(SandboxUnavailable, match="bwrap"):
        sb.run_sandboxed(root / "ws", "print(1)", root=root)
