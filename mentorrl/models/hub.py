"""Where a checkpoint named in the config lives: a local directory, or a Hugging Face hub id
(``org/name``) already in the local hub cache.

A checkpoint field (``model.path``, a teacher's path) is passed to ``from_pretrained`` as written.
mentorrl never downloads: :func:`checkpoint_problem` checks, before a run writes anything, that a hub
id resolves offline (its ``config.json`` is in the cache ``huggingface_hub`` uses, ``HF_HUB_CACHE`` or
``HF_HOME/hub``), and says how to fix it when it does not."""

from __future__ import annotations

import re
from pathlib import Path

# A hub repo id: ``name`` or ``org/name``; letters, digits, ``-``, ``_``, ``.`` (as the hub allows).
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/)?[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")


def looks_like_hub_id(path: str) -> bool:
    """Whether ``path`` reads as a hub id (``org/name``) rather than a filesystem path: not an existing
    path, no leading ``.``/``/``/``~``, at most one ``/``."""
    p = str(path)
    return not Path(p).exists() and not p.startswith((".", "/", "~")) and bool(_HUB_ID.match(p))


def hub_cache_dir() -> str:
    """The hub cache ``from_pretrained`` reads (``HF_HUB_CACHE``, else ``HF_HOME/hub``)."""
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def cached_hub_checkpoint(repo_id: str) -> Path | None:
    """The cached snapshot directory of hub id ``repo_id`` (its ``refs/main`` revision) holding a
    ``config.json``, or None when the cache has none. Never touches the network."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, "config.json", cache_dir=hub_cache_dir())
    return Path(found).parent if isinstance(found, str) else None


def checkpoint_problem(field: str, path: str) -> str | None:
    """Why the checkpoint ``path`` of config field ``field`` cannot be loaded without a download, or
    None when it can: a directory must hold a ``config.json``; a hub id must be in the local cache."""
    p = Path(path)
    if p.is_dir():
        return (
            None
            if (p / "config.json").is_file()
            else f"{field} {path} is not a Hugging Face checkpoint directory (no config.json)"
        )
    if not looks_like_hub_id(path):
        return f"{field} {path} is not a Hugging Face checkpoint directory (no such directory)"
    if cached_hub_checkpoint(path) is not None:
        return None
    return (
        f"{field} {path!r} is neither a local directory nor a hub id in the local Hugging Face cache "
        f"({hub_cache_dir()}); mentorrl does not download models. Fetch it where there is network access "
        f"(`huggingface-cli download {path}`) and point HF_HOME or HF_HUB_CACHE at that cache, or set "
        f"{field} to the checkpoint's directory"
    )


__all__ = ["cached_hub_checkpoint", "checkpoint_problem", "hub_cache_dir", "looks_like_hub_id"]
