"""Where a checkpoint named in the config lives: a local directory, a Hugging Face hub id (``org/name``)
already in the local hub cache, or a GGUF source (a ``.gguf`` file, or the short name of an installed
package that ships one: :mod:`mentorrl.models.gguf`).

A directory or hub id (``model.path``, a teacher's path) is passed to ``from_pretrained`` as written; a
GGUF source is converted once into a checkpoint directory (:func:`mentorrl.models.gguf.resolve_model_path`).
mentorrl never downloads: :func:`checkpoint_problem` checks, before a run writes anything, that a hub
id resolves offline (its ``config.json`` is in the cache ``huggingface_hub`` uses, ``HF_HUB_CACHE`` or
``HF_HOME/hub``) and that a GGUF source is present, and says how to fix it when it is not."""

from __future__ import annotations

import re
from pathlib import Path

from mentorrl.models.gguf import gguf_problem, is_gguf_source

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
    None when it can: a directory must hold a ``config.json``; a GGUF source must be present (the file, or
    the package that ships it) and readable; a hub id must be in the local cache."""
    p = Path(path)
    if is_gguf_source(path):
        return gguf_problem(field, path)
    if p.is_dir():
        return (
            None
            if (p / "config.json").is_file()
            else f"{field} {path} is not a Hugging Face checkpoint directory (no config.json)"
        )
    if p.is_file():
        return f"{field} {path} is a file, neither a Hugging Face checkpoint directory nor a GGUF file"
    if not looks_like_hub_id(path):
        return f"{field} {path} is not a Hugging Face checkpoint directory (no such directory)"
    if cached_hub_checkpoint(path) is not None:
        return None
    return (
        f"{field} {path!r} is neither a local directory nor a hub id in the local Hugging Face cache "
        f"({hub_cache_dir()}); mentorrl does not download models. Fetch it where there is network access "
        f"(`hf download {path}`) and point HF_HOME or HF_HUB_CACHE at that cache, or set "
        f"{field} to the checkpoint's directory or a .gguf file"
    )


__all__ = ["cached_hub_checkpoint", "checkpoint_problem", "hub_cache_dir", "looks_like_hub_id"]
