"""The sandbox's seccomp filter, as a classic BPF program built by hand (no library needed).

Denied with ``EPERM``: new namespaces (``unshare``, ``setns``, ``clone`` with a namespace flag),
mounts (``mount``, ``umount2``, ``pivot_root``, the new mount API), ``keyctl`` / ``add_key`` /
``request_key``, ``io_uring_*``, ``ptrace``, ``process_vm_readv`` / ``process_vm_writev``, ``bpf``,
``perf_event_open``, ``userfaultfd``, ``kexec_load``, ``open_by_handle_at``, and running anonymous
memory (``memfd_create``, ``execveat``: no ``fexecve``); ``clone3`` gets ``ENOSYS`` (its flags are out
of the filter's reach, and the C library then falls back to ``clone``). Sockets come from an
allow-list of families: ``socket`` and ``socketpair`` for any family but ``AF_UNIX`` get
``EAFNOSUPPORT`` (so ``AF_VSOCK``, ``AF_NETLINK``, ``AF_PACKET``, ``AF_INET`` ... never reach the
kernel's socket code). A foreign architecture (the 32-bit ABI on x86_64) kills the process; an x32
call gets ``EPERM``. :func:`bpf_program` returns the filter in the layout ``bwrap --seccomp FD``
reads (an array of ``struct sock_filter``); ``None`` on an architecture without a table here (the
sandbox then reports seccomp as missing).
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
_NR, _ARCH, _ARG0 = 0, 4, 16  # _ARG0: the low 32 bits of the first argument (little-endian)
AF_UNIX = 1
SOCKET_FAMILIES = (AF_UNIX,)  # the only socket families a sandboxed program may create
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
        "process_vm_readv": 310,
        "process_vm_writev": 311,
        "memfd_create": 319,
        "execveat": 322,
        "clone": 56,
        "clone3": 435,
        "socket": 41,
        "socketpair": 53,
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
        "process_vm_readv": 270,
        "process_vm_writev": 271,
        "memfd_create": 279,
        "execveat": 281,
        "clone": 220,
        "clone3": 435,
        "socket": 198,
        "socketpair": 199,
    },
}
_CHECKED = ("audit_arch", "clone", "clone3", "socket", "socketpair")  # not denied outright: see bpf_program
DENIED = tuple(n for n in SYSCALLS["x86_64"] if n not in _CHECKED)
_ALIASES = {"amd64": "x86_64", "arm64": "aarch64"}


def machine() -> str:
    m = platform.machine().lower()
    return _ALIASES.get(m, m)


def _assemble(prog: list[tuple]) -> bytes:
    """Pack ``prog``: instructions ``(code, k, jt, jf)`` whose jump targets are label names, and
    ``("label", name)`` markers; a jump's offset is counted from the next instruction."""
    labels, n = {}, 0
    for ins in prog:
        if ins[0] == "label":
            labels[ins[1]] = n
        else:
            n += 1
    out, i = [], 0
    for ins in prog:
        if ins[0] == "label":
            continue
        code, k, jt, jf = ins
        offs = [labels[t] - i - 1 if isinstance(t, str) else t for t in (jt, jf)]
        if not all(0 <= o < 256 for o in offs):
            raise ValueError(f"seccomp: jump out of range at instruction {i}")
        out.append(struct.pack("=HBBI", code, offs[0], offs[1], k))
        i += 1
    return b"".join(out)


def bpf_program(arch: str | None = None) -> bytes | None:
    """The filter as packed ``struct sock_filter`` records, or None for an unknown architecture."""
    arch = arch or machine()
    table = SYSCALLS.get(arch)
    if table is None:
        return None
    prog: list[tuple] = [
        (_LD_W_ABS, _ARCH, 0, 0),
        (_JEQ_K, table["audit_arch"], 1, 0),
        (_RET_K, _RET_KILL_PROCESS, 0, 0),  # a foreign ABI
        (_LD_W_ABS, _NR, 0, 0),
    ]
    if arch == "x86_64":
        prog.append((_JGE_K, 0x40000000, "eperm", 0))  # the x32 ABI sets this bit in nr
    prog += [(_JEQ_K, table[n], "eperm", 0) for n in DENIED]
    prog += [
        (_JEQ_K, table["clone3"], "enosys", 0),
        (_JEQ_K, table["socket"], "family", 0),
        (_JEQ_K, table["socketpair"], "family", 0),
        (_JEQ_K, table["clone"], "clone", "allow"),
        ("label", "clone"),
        (_LD_W_ABS, _ARG0, 0, 0),  # clone's flags
        (_JSET_K, CLONE_NS_FLAGS, "eperm", "allow"),
        ("label", "family"),
        (_LD_W_ABS, _ARG0, 0, 0),  # the socket's family: an allow-list
        *[(_JEQ_K, fam, "allow", 0) for fam in SOCKET_FAMILIES],
        (_RET_K, _RET_ERRNO | errno.EAFNOSUPPORT, 0, 0),
        ("label", "allow"),
        (_RET_K, _RET_ALLOW, 0, 0),
        ("label", "eperm"),
        (_RET_K, _RET_ERRNO | errno.EPERM, 0, 0),
        ("label", "enosys"),
        (_RET_K, _RET_ERRNO | errno.ENOSYS, 0, 0),
    ]
    return _assemble(prog)


__all__ = ["bpf_program", "machine", "DENIED", "SYSCALLS", "CLONE_NS_FLAGS", "SOCKET_FAMILIES"]
