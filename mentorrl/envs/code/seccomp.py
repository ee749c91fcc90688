"""The sandbox's seccomp filter, as a classic BPF program built by hand (no library needed).

Denied with ``EPERM``: new namespaces (``unshare``, ``setns``, ``clone`` with a namespace flag),
mounts (``mount``, ``umount2``, ``pivot_root``, the new mount API), ``keyctl`` / ``add_key`` /
``request_key``, ``io_uring_*``, ``ptrace``, ``bpf``, ``perf_event_open``, ``userfaultfd``,
``kexec_load``, ``open_by_handle_at``; ``clone3`` gets ``ENOSYS`` (its flags are out of the
filter's reach, and the C library then falls back to ``clone``). A foreign architecture (the
32-bit or x32 ABI on x86_64) kills the process. :func:`bpf_program` returns the filter in the
layout ``bwrap --seccomp FD`` reads (an array of ``struct sock_filter``); ``None`` on an
architecture without a table here (the sandbox then reports seccomp as missing).
"""

from __future__ import annotations

import errno
import platform
import struct

# BPF opcodes
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_JSET_K = 0x45
_RET_K = 0x06
_RET_KILL_PROCESS = 0x80000000
_RET_ERRNO = 0x00050000
_RET_ALLOW = 0x7FFF0000
# offsets in struct seccomp_data
_NR, _ARCH, _ARG0 = 0, 4, 16
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWTIME
CLONE_NS_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x80

# name -> number, per architecture (from the kernel's syscall tables)
SYSCALLS = {
    "x86_64": {
        "audit_arch": 0xC000003E,
        "ptrace": 101,
        "pivot_root": 155,
        "mount": 165,
        "umount2": 166,
        "kexec_load": 246,
        "add_key": 248,
        "request_key": 249,
        "keyctl": 250,
        "unshare": 272,
        "perf_event_open": 298,
        "open_by_handle_at": 304,
        "setns": 308,
        "kexec_file_load": 320,
        "bpf": 321,
        "userfaultfd": 323,
        "io_uring_setup": 425,
        "io_uring_enter": 426,
        "io_uring_register": 427,
        "open_tree": 428,
        "move_mount": 429,
        "fsopen": 430,
        "fsconfig": 431,
        "fsmount": 432,
        "fspick": 433,
        "mount_setattr": 442,
        "clone": 56,
        "clone3": 435,
    },
    "aarch64": {
        "audit_arch": 0xC00000B7,
        "ptrace": 117,
        "pivot_root": 41,
        "mount": 40,
        "umount2": 39,
        "kexec_load": 104,
        "add_key": 217,
        "request_key": 218,
        "keyctl": 219,
        "unshare": 97,
        "perf_event_open": 241,
        "open_by_handle_at": 265,
        "setns": 268,
        "kexec_file_load": 294,
        "bpf": 280,
        "userfaultfd": 282,
        "io_uring_setup": 425,
        "io_uring_enter": 426,
        "io_uring_register": 427,
        "open_tree": 428,
        "move_mount": 429,
        "fsopen": 430,
        "fsconfig": 431,
        "fsmount": 432,
        "fspick": 433,
        "mount_setattr": 442,
        "clone": 220,
        "clone3": 435,
    },
}
DENIED = tuple(n for n in SYSCALLS["x86_64"] if n not in ("audit_arch", "clone", "clone3"))
_ALIASES = {"amd64": "x86_64", "arm64": "aarch64"}


def machine() -> str:
    m = platform.machine().lower()
    return _ALIASES.get(m, m)


def _ins(code: int, k: int, jt: int = 0, jf: int = 0) -> tuple[int, int, int, int]:
    return (code, jt, jf, k)


def bpf_program(arch: str | None = None) -> bytes | None:
    """The filter as packed ``struct sock_filter`` records, or None for an unknown architecture."""
    table = SYSCALLS.get(arch or machine())
    if table is None:
        return None
    denied = [table[n] for n in DENIED]
    # layout: arch check, [x32 check], one jeq per denied call, clone3, clone + its flags, then the returns
    head = [_ins(_LD_W_ABS, _ARCH), _ins(_JEQ_K, table["audit_arch"], 1, 0), _ins(_RET_K, _RET_KILL_PROCESS)]
    body = [_ins(_LD_W_ABS, _NR)]
    x32 = (arch or machine()) == "x86_64"
    n_checks = len(denied) + (1 if x32 else 0)
    # after the checks: [jeq clone3] [jeq clone] [ld arg0] [jset] [ret allow] [ret eperm] [ret enosys]
    tail_len = 4  # clone3, clone, ld arg0, jset
    for i in range(n_checks):
        to_eperm = (n_checks - i - 1) + tail_len + 1  # skip the rest of the checks, the tail and ret allow
        if x32 and i == 0:
            body.append(_ins(_JGE_K, 0x40000000, to_eperm, 0))  # the x32 ABI sets this bit in nr
        else:
            body.append(_ins(_JEQ_K, denied[i - (1 if x32 else 0)], to_eperm, 0))
    body += [
        _ins(_JEQ_K, table["clone3"], 5, 0),  # -> ret ENOSYS
        _ins(_JEQ_K, table["clone"], 0, 2),  # not clone -> ret allow
        _ins(_LD_W_ABS, _ARG0),  # clone's flags (the low 32 bits of its first argument)
        _ins(_JSET_K, CLONE_NS_FLAGS, 1, 0),  # a namespace flag -> ret EPERM
        _ins(_RET_K, _RET_ALLOW),
        _ins(_RET_K, _RET_ERRNO | errno.EPERM),
        _ins(_RET_K, _RET_ERRNO | errno.ENOSYS),
    ]
    return b"".join(struct.pack("=HBBI", *ins) for ins in head + body)


__all__ = ["bpf_program", "machine", "DENIED", "SYSCALLS", "CLONE_NS_FLAGS"]
