"""docs/architecture.md is checked against the code: every module, file, class and function it names exists.

What counts as a name (so prose and config keys are left alone):
- in the Layout block: a package directory (``  rollout/``) and every ``something.py`` it mentions;
- in backticks anywhere: a path (``rollout/decoders.py``, ``algos/``), ``file.py: name`` (the name defined in
  that file), a CamelCase identifier or ``Class.attr``, and ``function(...)``.
A name is found when the package (or bench/, tests/) holds the file, or the AST of the package defines it
(a class, a function or method, a module-level assignment, an attribute assigned on ``self``)."""

from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "mentorrl"
DOC = ROOT / "docs" / "architecture.md"
TREES = (PKG, ROOT / "bench", ROOT / "tests")
# names the doc uses for other projects' code (transformers, torch, verl) and the shared notes
EXTERNAL = {
    "AutoTokenizer",
    "apply_chat_template",
    "full_tensor",
    "set_requires_gradient_sync",
    "core_algos.py",
    "reference/",
    "mentorrl/",
}


@lru_cache(maxsize=1)
def _files() -> list[Path]:
    return [p for t in TREES for p in t.rglob("*") if "__pycache__" not in p.parts]


def _path_exists(token: str) -> bool:
    """``token`` (``a/b.py``, ``a/``, ``b.py``) names a file or directory in the package, bench/ or tests/."""
    token = token.removeprefix("mentorrl/").rstrip("/")
    return any(p.as_posix().endswith("/" + token) for p in _files())


def _defined(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Name):
                        names.add(sub.id)
                    elif isinstance(sub, ast.Attribute):
                        names.add(sub.attr)
    return names


@lru_cache(maxsize=None)
def _names_in(path: Path) -> frozenset[str]:
    return frozenset(_defined(ast.parse(path.read_text())))


@lru_cache(maxsize=1)
def _all_names() -> frozenset[str]:
    out: set[str] = set()
    for p in PKG.rglob("*.py"):
        out |= _names_in(p)
    return frozenset(out)


def _doc_problems(text: str) -> list[str]:
    problems: list[str] = []
    layout = re.search(r"## Layout[^\n]*\n+```\n(.*?)```", text, re.S)
    if layout:
        for m in re.finditer(r"^  ([a-z_]+)/", layout.group(1), re.M):
            if not (PKG / m.group(1)).is_dir():
                problems.append(f"layout: package directory {m.group(1)}/ does not exist")
        for m in re.finditer(r"\b([a-z_][a-z0-9_]*\.py)\b", layout.group(1)):
            if not _path_exists(m.group(1)):
                problems.append(f"layout: no file {m.group(1)}")
    names = _all_names()
    for tok in set(re.findall(r"`([^`\n]+)`", text)):
        tok = tok.strip()
        if tok in EXTERNAL or tok.split("(")[0] in EXTERNAL:
            continue
        file_and_name = re.fullmatch(r"([\w/]+\.py): (\w+)", tok)
        if file_and_name:
            path, name = file_and_name.groups()
            hits = [p for p in _files() if p.as_posix().endswith("/" + path.removeprefix("mentorrl/"))]
            if not hits:
                problems.append(f"`{tok}`: no file {path}")
            elif not any(name in _names_in(p) for p in hits):
                problems.append(f"`{tok}`: {path} defines no {name}")
        elif re.fullmatch(r"[\w/]+/|[\w/]+\.py", tok) and "/" in tok or re.fullmatch(r"\w+\.py", tok):
            if not _path_exists(tok):
                problems.append(f"`{tok}`: no such file or directory")
        elif re.fullmatch(r"[A-Z][a-z]+[A-Z]\w*|[A-Z][a-z]\w*(?:\.\w+)+", tok):  # CamelCase or Class.attr
            parts = tok.split(".")
            if any(p not in names for p in parts):
                problems.append(f"`{tok}`: not defined in the package")
        elif m := re.fullmatch(r"(?:\w+\.)*([a-z_]\w*)\(.*\)", tok):
            if m.group(1) not in names:
                problems.append(f"`{tok}`: no function {m.group(1)} in the package")
    return sorted(problems)


def test_architecture_doc_names_only_what_exists():
    problems = _doc_problems(DOC.read_text())
    assert not problems, "\n".join(problems)


def test_the_checker_catches_a_stale_name():
    """The cheapest fake of this check passes everything; these must all be flagged."""
    stale = (
        "## Layout\n\n```\nmentorrl/\n  buffer/        gone\n  rollout/   pick_tasks.py: x\n```\n"
        "`teachers/`, `rollout/nowhere.py`, `NoSuchClass`, `RolloutEngine.no_such_method`, `pick_tasks(ws)`, "
        "`rollout/engine.py: no_such_name`"
    )
    problems = _doc_problems(stale)
    for needle in ("buffer/", "pick_tasks.py", "`teachers/`", "nowhere.py", "NoSuchClass", "no_such_method",
                   "pick_tasks(ws)", "no_such_name"):  # fmt: skip
        assert any(needle in p for p in problems), (needle, problems)
    assert not _doc_problems("`RolloutEngine.run_stream`, `rollout/decoders.py`, `make_decoder(model)`")
