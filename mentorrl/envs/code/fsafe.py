"""Host-side file operations on a workspace that hostile code has had its hands on.

The workspace is never walked or changed through paths: every operation starts from a directory
file descriptor and opens each component relative to it with ``O_NOFOLLOW`` (a symlink anywhere
fails the operation; it is never followed), files are opened ``O_NONBLOCK`` (a FIFO cannot block
the host) and checked with ``fstat`` after the open (only regular files are read or written), and
ownership changes go through ``fchown`` on the open descriptor. Walks are iterative (no
recursion, so 1,500 nested directories are no problem) and bounded: :func:`copy_tree` caps depth,
entries and bytes and copies regular files and directories only, and no file that could run instead of
source (:func:`shadows_source`: extension modules, bytecode, ``.pth``); :func:`remove_tree` removes any
tree with a constant number of open descriptors, climbing back with ``..`` checked against the
device and inode it came from.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass, field

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
CHUNK = 1 << 16


class UnsafePath(OSError):
    """A path that leaves the workspace, goes through a symlink, or names something not a regular file."""


def split_rel(path: str) -> list[str]:
    """The components of a workspace-relative path; UnsafePath for an absolute path or one with ``..``."""
    if not path or path.startswith("/") or "\x00" in path:
        raise UnsafePath(f"{path!r} is not a path inside the workspace")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise UnsafePath(f"{path!r} is not a path inside the workspace")
    return parts


def open_dir(root_fd: int, parts: list[str], *, create: bool = False, owner: tuple[int, int] | None = None) -> int:
    """A descriptor of the directory ``root_fd/parts...``, each component opened ``O_NOFOLLOW``
    (``create``: make the missing ones, handed to ``owner`` by ``fchown``)."""
    fd = os.dup(root_fd)
    try:
        for name in parts:
            try:
                nfd = os.open(name, DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                os.mkdir(name, 0o755, dir_fd=fd)
                nfd = os.open(name, DIR_FLAGS, dir_fd=fd)
                if owner is not None:
                    os.fchown(nfd, *owner)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise UnsafePath(f"{name!r} is a symlink or not a directory") from e
                raise
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def _regular(fd: int, what: str) -> os.stat_result:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePath(f"{what} is not a regular file")
    return st


def read_file(root_fd: int, path: str, limit: int) -> bytes:
    """At most ``limit`` bytes of the regular file ``path`` (no symlink followed, no FIFO waited on)."""
    *dirs, name = split_rel(path)
    dfd = open_dir(root_fd, dirs)
    try:
        try:
            fd = os.open(name, os.O_RDONLY | FILE_FLAGS, dir_fd=dfd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise UnsafePath(f"{path!r} is a symlink") from e
            raise
    finally:
        os.close(dfd)
    try:
        _regular(fd, repr(path))
        out = bytearray()
        while len(out) < limit:
            chunk = os.read(fd, min(CHUNK, limit - len(out)))
            if not chunk:
                break
            out += chunk
        return bytes(out)
    finally:
        os.close(fd)


def write_file(root_fd: int, path: str, data: bytes, owner: tuple[int, int] | None = None) -> None:
    """Replace the contents of the regular file ``path`` (created if missing, with its directories)."""
    *dirs, name = split_rel(path)
    dfd = open_dir(root_fd, dirs, create=True, owner=owner)
    try:
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | FILE_FLAGS, 0o644, dir_fd=dfd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise UnsafePath(f"{path!r} is a symlink") from e
            if e.errno in (errno.ENXIO, errno.EISDIR, errno.ETXTBSY):
                raise UnsafePath(f"{path!r} is not a regular file") from e
            raise
    finally:
        os.close(dfd)
    try:
        st = _regular(fd, repr(path))
        if st.st_nlink > 1:
            raise UnsafePath(f"{path!r} has other hard links")
        os.ftruncate(fd, 0)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if owner is not None:
            os.fchown(fd, *owner)
    finally:
        os.close(fd)


def entry_stat(root_fd: int, path: str) -> os.stat_result | None:
    """lstat of ``path`` below ``root_fd`` (symlinks not followed); None when missing."""
    *dirs, name = split_rel(path)
    try:
        dfd = open_dir(root_fd, dirs)
    except (FileNotFoundError, UnsafePath):
        return None
    try:
        return os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    finally:
        os.close(dfd)


def _not_source_suffixes() -> tuple[str, ...]:
    """Name endings of files the import system (or ``site``) runs instead of, or beside, source: extension
    modules of any platform, bytecode, ``.pth`` and ``.egg-link`` files, and every importable suffix of
    this interpreter other than ``.py``."""
    import importlib.machinery as m

    fixed = (".so", ".pyd", ".dll", ".dylib", ".pyc", ".pyo", ".pth", ".egg-link")
    ours = tuple(x for x in m.all_suffixes() if x not in m.SOURCE_SUFFIXES)
    return tuple(dict.fromkeys(fixed + ours))


NOT_SOURCE_SUFFIXES = _not_source_suffixes()
CACHE_DIRS = frozenset({"__pycache__"})


def shadows_source(name: str) -> bool:
    """Could a file or directory called ``name`` run as code instead of (or beside) the ``.py`` shown?"""
    return name in CACHE_DIRS or name.lower().endswith(NOT_SOURCE_SUFFIXES)


@dataclass
class CopyCaps:
    max_depth: int = 16
    max_entries: int = 512
    max_bytes: int = 16 << 20
    skip_dirs: frozenset[str] = CACHE_DIRS
    skip_suffixes: tuple[str, ...] = NOT_SOURCE_SUFFIXES  # only source is copied: nothing that shadows a .py


@dataclass
class CopyReport:
    entries: int = 0
    bytes: int = 0
    skipped: list[str] = field(default_factory=list)  # what was left out, and why


class CopyLimit(OSError):
    """The tree is deeper, larger or has more entries than the copy allows."""


def copy_tree(src_fd: int, dst_fd: int, caps: CopyCaps) -> CopyReport:
    """Copy the regular files and directories below ``src_fd`` into ``dst_fd`` (iterative, bounded).
    Symlinks, FIFOs, sockets and devices are left out (and named in the report); CopyLimit when a cap
    is passed."""
    rep = CopyReport()
    stack = [(os.dup(src_fd), os.dup(dst_fd), "", 0)]
    try:
        while stack:
            s, d, prefix, depth = stack.pop()
            try:
                _copy_dir(s, d, prefix, depth, caps, rep, stack)
            finally:
                os.close(s)
                os.close(d)
    finally:
        for s, d, _, _ in stack:
            os.close(s)
            os.close(d)
    return rep


def _copy_dir(s: int, d: int, prefix: str, depth: int, caps: CopyCaps, rep: CopyReport, stack: list) -> None:
    with os.scandir(s) as it:
        entries = sorted((e.name for e in it))
    for name in entries:
        rel = prefix + name
        rep.entries += 1
        if rep.entries > caps.max_entries:
            raise CopyLimit(f"more than {caps.max_entries} files and directories")
        st = os.stat(name, dir_fd=s, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            if name in caps.skip_dirs:
                rep.skipped.append(f"{rel}/ (bytecode cache)")
                continue
            if depth + 1 > caps.max_depth:
                raise CopyLimit(f"directories nested deeper than {caps.max_depth}")
            os.mkdir(name, 0o755, dir_fd=d)
            stack.append((os.open(name, DIR_FLAGS, dir_fd=s), os.open(name, DIR_FLAGS, dir_fd=d), rel + "/", depth + 1))
        elif stat.S_ISREG(st.st_mode):
            if name.lower().endswith(caps.skip_suffixes):
                rep.skipped.append(f"{rel} (not source: extension module, bytecode or site hook)")
                continue
            _copy_file(s, d, name, caps, rep)
        else:
            rep.skipped.append(f"{rel} ({_kind(st.st_mode)})")


def _copy_file(s: int, d: int, name: str, caps: CopyCaps, rep: CopyReport) -> None:
    fd = os.open(name, os.O_RDONLY | FILE_FLAGS, dir_fd=s)
    try:
        st = _regular(fd, repr(name))
        if rep.bytes + st.st_size > caps.max_bytes:  # logical size: a sparse file counts in full
            raise CopyLimit(f"more than {caps.max_bytes} bytes of files")
        out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | FILE_FLAGS, 0o644, dir_fd=d)
        try:
            left = st.st_size
            while left > 0:
                chunk = os.read(fd, min(CHUNK, left))
                if not chunk:
                    break
                left -= len(chunk)
                view = memoryview(chunk)
                while view:
                    view = view[os.write(out, view) :]
            rep.bytes += st.st_size - left
        finally:
            os.close(out)
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    for test, word in ((stat.S_ISLNK, "symlink"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return word
    return "device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "special file"


def remove_tree(parent_fd: int, name: str) -> None:
    """Remove ``parent_fd/name`` and everything below it, whatever its depth or contents, holding at
    most three descriptors; a symlink is removed, never followed. Missing: nothing to do."""
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=parent_fd)
        return
    fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    path: list[tuple[str, int, int]] = []  # (name in parent, parent's st_dev, parent's st_ino) per level
    try:
        while True:
            child = _first_subdir_after_unlinking_files(fd)
            if child is not None:
                here = os.fstat(fd)
                nfd = os.open(child, DIR_FLAGS, dir_fd=fd)
                path.append((child, here.st_dev, here.st_ino))
                os.close(fd)
                fd = nfd
                continue
            if not path:
                break
            child, dev, ino = path.pop()
            up = os.open("..", DIR_FLAGS, dir_fd=fd)
            ust = os.fstat(up)
            os.close(fd)
            fd = up
            if (ust.st_dev, ust.st_ino) != (dev, ino):
                raise OSError(f"directory moved while it was being removed (at {child!r})")
            os.rmdir(child, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent_fd)


def _first_subdir_after_unlinking_files(fd: int) -> str | None:
    with os.scandir(fd) as it:
        for e in it:
            if e.is_dir(follow_symlinks=False):
                return e.name
            try:
                os.unlink(e.name, dir_fd=fd)
            except FileNotFoundError:
                pass
    return None


__all__ = [
    "UnsafePath",
    "CopyCaps",
    "CopyLimit",
    "CopyReport",
    "split_rel",
    "open_dir",
    "read_file",
    "write_file",
    "entry_stat",
    "copy_tree",
    "remove_tree",
    "shadows_source",
    "NOT_SOURCE_SUFFIXES",
]
