"""Base checkpoints shipped inside the package, found by the hash of the build config that made them.

Building the demo's pretrained base takes far longer than the demo itself on two CPU cores, so
the package carries the result (a few MB of safetensors) under ``mentorrl/models/bases/<name>/``,
next to the ``mentorrl_build.json`` that ``mentorrl init-model`` wrote when it built it: the exact
command, the build config and its hash, the corpus and the loss curve, and the digest of the files.

:func:`find_shipped_base` is a cache lookup, nothing more: a recipe that would build a base with a
config whose hash equals a shipped base's recorded hash gets a copy of that base instead of a
rebuild. Any other config (another size, seed, prompt format or pretraining budget) builds from
scratch through the same code. A shipped directory whose files no longer match its recorded digest
is skipped with a warning naming it, and the base is rebuilt.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

from mentorrl.models.build import dir_digest

SHIPPED_ROOT = Path(__file__).parent / "bases"
BUILD_RECORD = "mentorrl_build.json"


def _record(path: Path) -> dict[str, Any] | None:
    try:
        rec = json.loads((path / BUILD_RECORD).read_text())
    except (OSError, ValueError) as e:
        warnings.warn(f"shipped base {path}: unreadable {BUILD_RECORD} ({e}); ignored", stacklevel=3)
        return None
    return rec if isinstance(rec, dict) else None


def shipped_bases(root: Path = SHIPPED_ROOT) -> list[tuple[Path, dict[str, Any]]]:
    """(directory, build record) of every shipped base under ``root``, sorted by name."""
    if not root.is_dir():
        return []
    out = []
    for d in sorted(p for p in root.iterdir() if (p / BUILD_RECORD).is_file()):
        rec = _record(d)
        if rec is not None:
            out.append((d, rec))
    return out


def find_shipped_base(config_hash: str, root: Path = SHIPPED_ROOT) -> Path | None:
    """The shipped base built from the config with this hash, if its files are intact."""
    for d, rec in shipped_bases(root):
        if rec.get("config_hash") != config_hash:
            continue
        if dir_digest(d) != rec.get("digest"):
            warnings.warn(
                f"shipped base {d}: files do not match the digest in its {BUILD_RECORD}; ignored, the base is rebuilt",
                stacklevel=2,
            )
            continue
        return d
    return None


def install_shipped_base(src: Path, out_dir: Path) -> Path:
    """Copy a shipped base into ``out_dir``; its build record notes where it came from."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file():
            shutil.copy2(f, out_dir / f.name)
    rec = json.loads((src / BUILD_RECORD).read_text())
    rec["source"] = {"shipped": src.name}
    (out_dir / BUILD_RECORD).write_text(json.dumps(rec, indent=2))
    return out_dir
