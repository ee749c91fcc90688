"""Checkpoint checksums: ``checksums.sha256`` (``sha256sum`` format, one line per file) over every file
directly in a checkpoint directory, written last and verified before anything in it is loaded.

Two rules (docs/architecture.md, "Checkpoints"):

* a directory the run wrote and loads again (a stage checkpoint, sharded or not, a stage's final
  weights, an evolve version, RFT's best weights, a cached teacher) must carry its manifest:
  :func:`require_manifest` refuses one without it, naming it and how to vouch for it;
* a model directory from elsewhere (``model.path``, a teacher's or critic's ``path``, the checkpoint
  of ``mentorrl eval`` / ``serve``) is verified when it carries a manifest (:func:`verify_manifest`);
  one without (a Hugging Face download) loads as it is.

Verification also refuses a tensor file (weights, optimizer state, shards) that the manifest does not
list: a file added or renamed after the manifest was written is as unverified as a changed one.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

MANIFEST = "checksums.sha256"
_MANIFEST_LINE = re.compile(r"^([0-9a-f]{64}) [ *]([^/\\]+)$")
TENSOR_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".distcp", ".metadata")


class CorruptCheckpointError(ValueError):
    """A checkpoint file that fails its checksum or does not load. The message names the file."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path = path


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(directory: Path) -> Path:
    """Write ``checksums.sha256`` over every file directly in ``directory`` (fsynced, the last write)."""
    directory = Path(directory)
    lines = [f"{sha256_file(p)}  {p.name}\n" for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST]
    out = directory / MANIFEST
    with open(out, "w", encoding="utf-8") as f:
        f.write("".join(lines))
        f.flush()
        os.fsync(f.fileno())
    return out


def _listed(manifest: Path) -> dict[str, str]:
    try:
        text = manifest.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(manifest, f"unreadable checksum manifest ({e})") from e
    listed: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        m = _MANIFEST_LINE.match(line)
        if m is None:
            raise CorruptCheckpointError(manifest, f"line {n} is not '<sha256>  <file>'")
        listed[m.group(2)] = m.group(1)
    return listed


def verify_manifest(directory: Path, required: tuple[str, ...] = ()) -> bool:
    """Check ``directory`` against its ``checksums.sha256``: every listed file exists and matches, and
    every tensor file in it is listed.

    Returns False when there is no manifest (see :func:`require_manifest`); raises
    :class:`CorruptCheckpointError` naming the first bad file (or the manifest itself)."""
    directory = Path(directory)
    manifest = directory / MANIFEST
    if not manifest.exists():
        return False
    listed = _listed(manifest)
    for name in required:
        if name not in listed:
            raise CorruptCheckpointError(manifest, f"does not list {name}")
    for p in sorted(directory.iterdir()):
        if p.is_file() and p.name not in listed and p.name.endswith(TENSOR_SUFFIXES):
            raise CorruptCheckpointError(p, "not listed in the checksum manifest (added after it was written)")
    for name, want in listed.items():
        f = directory / name
        if not f.is_file():
            raise CorruptCheckpointError(f, "missing (listed in the checksum manifest)")
        got = sha256_file(f)
        if got != want:
            raise CorruptCheckpointError(
                f, f"sha256 {got[:16]}... does not match the manifest's {want[:16]}... (the file changed or is damaged)"
            )
    return True


def require_manifest(directory: Path, required: tuple[str, ...] = ()) -> None:
    """:func:`verify_manifest`, and a directory without a manifest is refused too: nothing in it could
    be checked (a flipped bit in its weights would load silently)."""
    directory = Path(directory)
    if not verify_manifest(directory, required):
        raise CorruptCheckpointError(
            directory / MANIFEST,
            "missing: the checkpoint has no checksums, so damage to it cannot be detected (a checkpoint "
            "written before checksums, or its manifest removed); if you trust its files, vouch for them with "
            f"`python -c \"from mentorrl.core.checksums import write_manifest; write_manifest('{directory}')\"`",
        )


__all__ = [
    "MANIFEST",
    "TENSOR_SUFFIXES",
    "CorruptCheckpointError",
    "require_manifest",
    "sha256_file",
    "verify_manifest",
    "write_manifest",
]
