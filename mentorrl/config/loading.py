"""Loading a run config: YAML in (bounded, with ``extends`` and ``key.sub=value`` overrides), plugins
loaded, validated by the current run-config model, every failure a :class:`ConfigError` naming the file
or the dotted field.

Every field has a default, so an empty file is a valid config (the demo recipe). Unknown or ill-typed
fields fail loudly with the dotted path of the field, as do non-finite numbers (inf, nan) and booleans
given where a number is expected, anywhere in the config. Input is untrusted: files and documents are
bounded in bytes, nodes (YAML aliases followed) and depth.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from mentorrl.config.base import ConfigError
from mentorrl.config.plugins import load_plugins
from mentorrl.config.run import RunConfig, run_config_model

# Bounds on untrusted config input. A real recipe is a few hundred nodes and a few KB.
MAX_CONFIG_BYTES = 1 << 20  # per file
MAX_CONFIG_NODES = 20_000  # per document, with YAML aliases followed (an anchor bomb expands exponentially)
MAX_CONFIG_DEPTH = 32  # nesting levels
MAX_CONFIG_CHARS = 4 * MAX_CONFIG_BYTES  # characters of keys and strings per document, aliases expanded
MAX_EXTENDS = 16  # files in one `extends` chain
MAX_CONFIG_INT = 2**63 - 1  # every int field fits in 64 bits (seeds reach torch and numpy)

Loc = tuple[Any, ...]


def _dotted(loc: Loc) -> str:
    return ".".join(str(p) for p in loc) or "(top level)"


def _shown(text: str, limit: int = 80) -> str:
    """``text`` printable whatever it holds (a lone surrogate as an escape), cut at ``limit``."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _origin(loc: Loc, origins: dict[tuple[str, ...], str]) -> str | None:
    """The ``--set`` that set (a section holding, or a field inside) the problem's location; the last wins."""
    path = tuple(str(p) for p in loc)
    hit = None
    for key, label in origins.items():
        n = min(len(key), len(path))
        if n and key[:n] == path[:n]:
            hit = label
    return hit


def _format_problems(problems: dict[Loc, str], source: str, origins: dict[tuple[str, ...], str] | None = None) -> str:
    origins = origins or {}
    found = {loc: _origin(loc, origins) for loc in problems}
    lines = [
        f"  {_shown(_dotted(loc), 200)}: {msg}" + (f" (from {found[loc]})" if found[loc] else "")
        for loc, msg in problems.items()
    ]
    if found and all(found.values()):
        labels = ", ".join(dict.fromkeys(v for v in found.values() if v))
        head = f"invalid override {labels} (applied over {source}):"
    else:
        head = f"invalid config {source}:"
    return "\n".join([head, *lines])


def _field_of(loc: Loc) -> str:
    """The dotted field of a location inside a parsed document (mapping keys; list positions dropped)."""
    keys = [str(p)[:40] for p in loc if not isinstance(p, int)]
    return (".".join(keys[:6]) + (".…" if len(keys) > 6 else "")) or "(top level)"


def check_bounded(
    value: Any,
    what: str,
    max_nodes: int = MAX_CONFIG_NODES,
    max_depth: int = MAX_CONFIG_DEPTH,
    max_chars: int = MAX_CONFIG_CHARS,
) -> None:
    """Refuse a parsed document with more than ``max_nodes`` nodes, ``max_depth`` levels or
    ``max_chars`` characters of keys and strings; the message names the field the excess is in.

    Nodes and characters are counted as if every YAML alias were expanded (shared and even cyclic
    references count each time they are reached: a string anchored once and aliased thousands of
    times is as large as its copies would be once validated), and the walk stops at the first excess,
    so its cost is bounded by ``max_nodes`` whatever the document."""
    stack: list[tuple[Any, int, Loc]] = [(value, 0, ())]
    nodes = chars = 0
    while stack:
        v, depth, loc = stack.pop()
        nodes += 1
        if nodes > max_nodes:
            raise ConfigError(
                f"{what}: {_field_of(loc)} is too large: more than {max_nodes} YAML nodes once aliases are expanded"
            )
        if depth > max_depth:
            raise ConfigError(f"{what}: {_field_of(loc)} is too deep: more than {max_depth} levels of nesting")
        if isinstance(v, (str, bytes)):
            chars += len(v)
            if chars > max_chars:
                raise ConfigError(
                    f"{what}: {_field_of(loc)} is too large: more than {max_chars} characters of text once "
                    "aliases are expanded"
                )
        elif isinstance(v, dict):
            for k, x in v.items():
                stack.append((k, depth + 1, loc))
                stack.append((x, depth + 1, (*loc, k if isinstance(k, (str, int)) else str(k)[:40])))
        elif isinstance(v, (list, tuple, set, frozenset)):
            stack.extend((x, depth + 1, (*loc, i)) for i, x in enumerate(v))


def text_problems(raw: Any, loc: Loc = ()) -> dict[Loc, str]:
    """Every key or string of a parsed document that is not text: a lone surrogate (``"\\udcff"`` in
    YAML, a file name decoded with ``surrogateescape``) cannot be written to a file or printed as UTF-8.
    ``raw`` must be bounded (:func:`check_bounded`)."""
    out: dict[Loc, str] = {}
    if isinstance(raw, str):
        try:
            raw.encode("utf-8")
        except UnicodeEncodeError as e:
            out[loc] = (
                f"holds a lone surrogate (U+{ord(raw[e.start]):04X}) at character {e.start}: not text "
                "that can be written as UTF-8 (a path must be valid Unicode)"
            )
    elif isinstance(raw, dict):
        for k, v in raw.items():
            key = k if isinstance(k, (str, int)) else str(k)
            out.update(text_problems(k, (*loc, key)) if isinstance(k, str) else {})
            out.update(text_problems(v, (*loc, key)))
    elif isinstance(raw, (list, tuple)):
        for i, v in enumerate(raw):
            out.update(text_problems(v, (*loc, i)))
    return out


def parse_yaml(text: str, what: str) -> Any:
    """``yaml.safe_load`` of untrusted text: any failure, or a document over the bounds, is a ConfigError."""
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} is not valid YAML: {e}") from None
    except RecursionError:
        raise ConfigError(f"{what} is too deep: nesting exhausted the YAML parser") from None
    check_bounded(loaded, what)
    return loaded


def _deep_set(d: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    if not all(keys):
        raise ConfigError("empty field name; write key.sub=value")
    for k in keys[:-1]:
        child = d.setdefault(k, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{_shown(k)} is not a section")
        d[k] = d = dict(child)  # a copy: a YAML alias may share this mapping with another field
    d[keys[-1]] = value


PACKAGED_CONFIG_DIR = Path(__file__).parent.parent / "configs"


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _read_text(path: Path) -> str:
    """A config file's text: UTF-8, at most MAX_CONFIG_BYTES; every failure names the file."""
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"config {path} is a directory, not a YAML file") from None
    except (OSError, ValueError) as e:  # permissions, a name too long, an embedded NUL ...
        raise ConfigError(f"config {path} cannot be read: {getattr(e, 'strerror', None) or e}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config {path} is too large: over {MAX_CONFIG_BYTES} bytes")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config {path} is not UTF-8 text (byte {e.start}: 0x{raw[e.start]:02x})") from None


def _parent_path(path: Path, parent: Any) -> Path:
    """Where ``extends: parent`` of ``path`` points: next to ``path``, else a packaged config."""
    if not isinstance(parent, str) or not parent.strip():
        raise ConfigError(f"config {path}: extends must be a file name, got {parent!r}")
    base = path.parent / parent
    try:
        if "\x00" in parent:
            raise ValueError("embedded null byte")
        if not base.exists() and (PACKAGED_CONFIG_DIR / parent).is_file():
            base = PACKAGED_CONFIG_DIR / parent
        if base.is_dir():
            raise ConfigError(f"config {path}: extends {parent} is a directory, not a YAML file")
        return base.resolve()
    except (OSError, ValueError, RuntimeError) as e:  # a name too long, a NUL, a symlink loop ...
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"config {path}: extends {parent!r} is not a usable file name ({e})") from None


def _read_yaml(path: Path, seen: tuple[Path, ...]) -> dict[str, Any]:
    """A config file's mapping; ``extends: FILE`` (relative to this file, else a packaged config
    such as ``demo.yaml``) is loaded first and this file's keys are merged over it."""
    loaded = parse_yaml(_read_text(path), f"config {path}")
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"config {path} must be a mapping at the top level")
    data = loaded or {}
    parent = data.pop("extends", None)
    if parent is None:
        return data
    base = _parent_path(path, parent)
    if base in seen or base == path.resolve():
        raise ConfigError(f"config {path}: extends {parent} makes a cycle")
    if len(seen) + 1 >= MAX_EXTENDS:
        raise ConfigError(f"config {path}: extends chain longer than {MAX_EXTENDS} files")
    merged = _merge(_read_yaml(base, (*seen, path.resolve())), data)
    check_bounded(merged, f"config {path} (merged over {parent})")
    return merged


_MISSING = object()


def _child(raw: Any, key: Any) -> Any:
    if isinstance(raw, dict):
        return raw.get(key, _MISSING)
    if isinstance(raw, (list, tuple)) and isinstance(key, int) and key < len(raw):
        return raw[key]
    return _MISSING


def _members(tp: Any) -> list[Any]:
    if get_origin(tp) in (Union, UnionType):
        return [a for a in get_args(tp) if a is not type(None)]
    return [tp]


def _child_type(tp: Any, key: Any) -> Any:
    """The annotation of item ``key`` inside a value annotated ``tp`` (None: unknown)."""
    for m in _members(tp):
        if isinstance(m, type) and issubclass(m, BaseModel):
            info = m.model_fields.get(key) if isinstance(key, str) else None
            return info.annotation if info is not None else None
        origin, args = get_origin(m), get_args(m)
        if origin is dict and len(args) == 2:
            return args[1]
        if origin is list and args:
            return args[0]
        if origin is tuple and args:
            if len(args) == 2 and args[1] is Ellipsis:
                return args[0]
            return args[key] if isinstance(key, int) and 0 <= key < len(args) else None
    return None


def _is_number(tp: Any) -> bool:
    members = _members(tp)
    return bool(members) and all(m in (int, float) for m in members)


def raw_number_problems(raw: Any, tp: Any = None, loc: Loc = ()) -> dict[Loc, str]:
    """The one numeric check of the input, before pydantic sees it: every field annotated as a number
    (int or float, in any section, dict, list or tuple) must get a finite number, not a boolean.

    Pydantic alone accepts ``inf``, ``nan``, ``1e999`` and YAML's ``.inf`` for a float and reads
    ``steps: true`` as 1. ``raw`` must be bounded (see :func:`check_bounded`)."""
    tp = run_config_model() if tp is None and not loc else tp
    if tp is None:
        return {}
    out: dict[Loc, str] = {}
    if isinstance(raw, dict):
        for k, v in raw.items():
            out.update(raw_number_problems(v, _child_type(tp, k), (*loc, k)))
    elif isinstance(raw, (list, tuple)):
        for i, v in enumerate(raw):
            out.update(raw_number_problems(v, _child_type(tp, i), (*loc, i)))
    elif _is_number(tp):
        if isinstance(raw, bool):
            out[loc] = f"expected a number, got the boolean {str(raw).lower()}"
        elif isinstance(raw, int) and all(m is int for m in _members(tp)):
            if not -MAX_CONFIG_INT <= raw <= MAX_CONFIG_INT:
                out[loc] = f"integer out of range: |value| must be at most 2**63 - 1, got {str(raw)[:40]}..."
        elif isinstance(raw, (int, float, str)):
            try:
                finite = math.isfinite(float(raw))
            except OverflowError:  # an int beyond float range
                finite = False
            except ValueError:  # not a number at all: pydantic says so
                finite = True
            if not finite:
                out[loc] = f"must be a finite number, got {str(raw)[:40]}"
    return out


def number_problems(value: Any, raw: Any = _MISSING, loc: Loc = ()) -> dict[Loc, str]:
    """The same rule on the validated config (a safety net for types :func:`raw_number_problems`
    cannot resolve): every float is finite, and no number was given as a boolean. ``raw`` is the
    input the value was validated from, walked alongside."""
    out: dict[Loc, str] = {}
    if isinstance(value, BaseModel):
        for name in type(value).model_fields:
            out.update(number_problems(getattr(value, name), _child(raw, name), (*loc, name)))
    elif isinstance(value, dict):
        for k, v in value.items():
            out.update(number_problems(v, _child(raw, k), (*loc, k)))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            out.update(number_problems(v, _child(raw, i), (*loc, i)))
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(raw, bool):
            out[loc] = f"expected a number, got the boolean {str(raw).lower()}"
        elif isinstance(value, float) and not math.isfinite(value):
            out[loc] = f"must be a finite number, got {value}"
    return out


def plugins_of(data: Any) -> list[str]:
    """The ``plugins`` a parsed config names (what is not a list of strings is left to validation)."""
    plugins = data.get("plugins") if isinstance(data, dict) else None
    return [m for m in plugins if isinstance(m, str)] if isinstance(plugins, list) else []


def _problems(data: Any, source: str) -> tuple[RunConfig | None, dict[Loc, str]]:
    """The validated config (None when it does not validate) and every problem, by location."""
    check_bounded(data, f"config {source}")
    load_plugins(plugins_of(data))
    model = run_config_model()
    problems = text_problems(data)
    for loc, msg in raw_number_problems(data, model).items():
        problems.setdefault(loc, msg)
    cfg = None
    try:
        cfg = model.model_validate(data)
    except ValidationError as e:
        found = list(problems)
        for err in e.errors():
            loc = tuple(err["loc"])
            if not any(f[: len(loc)] == loc for f in found):  # not a consequence of a problem already reported
                problems.setdefault(loc, err["msg"])
    else:
        for loc, msg in number_problems(cfg, data).items():
            problems.setdefault(loc, msg)
    return cfg, problems


def validate_config(
    data: Any, source: str = "(defaults)", origins: dict[tuple[str, ...], str] | None = None
) -> RunConfig:
    """A RunConfig from parsed data, or a ConfigError listing every bad field by dotted path (and the
    ``--set`` override it came from, given ``origins``: field path -> override). The plugins it names
    (and the installed entry points) are loaded first, so their stages' sections validate."""
    cfg, problems = _problems(data, source)
    if problems or cfg is None:
        raise ConfigError(_format_problems(problems, source, origins))
    return cfg


def _apply_override(data: dict[str, Any], ov: str) -> tuple[str, ...]:
    """Apply one ``key.sub=value`` override; returns its field path. Failures name the override."""
    label = f"--set {_shown(ov)}"
    if "=" not in ov:
        raise ConfigError(f"{label}: an override must look like key.sub=value")
    key, raw = ov.split("=", 1)
    key = key.strip()
    for what, text in (("field name", key), ("value", raw)):
        for msg in text_problems(text).values():
            raise ConfigError(f"{label}: the {what} {msg}")
    try:
        _deep_set(data, key, parse_yaml(raw, f"{label}: the value of {_shown(key)}"))
    except ConfigError as e:
        msg = str(e)
        raise ConfigError(msg if msg.startswith(label) else f"{label}: {msg}") from None
    return tuple(key.split("."))


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, plugins: list[str] | None = None
) -> RunConfig:
    """Load YAML (or defaults), apply ``key.sub=value`` overrides, add ``plugins`` (modules, e.g. from
    ``mentorrl train --plugin``) to the config's own, load them, validate.

    Raises ConfigError (naming the file or field, and the ``--set`` override that caused it) for
    anything else than a valid config."""
    data: dict[str, Any] = {}
    source = "(defaults)"
    if path is not None:
        source = str(path)
        data = _read_yaml(Path(path), seen=())
    origins: dict[tuple[str, ...], str] = {}
    for ov in overrides or []:
        origins[_apply_override(data, ov)] = f"--set {_shown(ov)}"
    if plugins:
        listed = data.get("plugins") if isinstance(data.get("plugins"), list) else []
        data["plugins"] = [*listed, *(m for m in plugins if m not in listed)]
    return validate_config(data, source, origins)


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


__all__ = [
    "MAX_CONFIG_BYTES",
    "MAX_CONFIG_CHARS",
    "MAX_CONFIG_DEPTH",
    "MAX_CONFIG_INT",
    "MAX_CONFIG_NODES",
    "MAX_EXTENDS",
    "PACKAGED_CONFIG_DIR",
    "ConfigError",
    "check_bounded",
    "dump_config",
    "load_config",
    "number_problems",
    "parse_yaml",
    "plugins_of",
    "raw_number_problems",
    "text_problems",
    "validate_config",
]
