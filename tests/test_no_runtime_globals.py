"""No module of mentorrl holds run-time state in a bare module global (docs/architecture.md, "Run-time state").

Read from the source with :mod:`ast`, for every module under ``mentorrl/``:

- no ``global`` statement (a module name rebound at run time);
- no module-level mutable container (a dict, list or set literal, comprehension, or a call of a container
  type) that a function of the module mutates (a mutating method, an item assignment or deletion),

except the entries of :data:`ALLOWED`, each with why it stays. What must live as long as the process is
owned by one explicit object instead (e.g. :data:`mentorrl.train.distributed.PROCESS_GROUP`,
:data:`mentorrl.train.trackers.OPEN_TRACKERS`, :mod:`mentorrl.config.process`); a memo of a pure function is a
``functools.cache``. The :class:`~mentorrl.config.registry.Registry` objects are not containers: they are
the deliberate extension point, filled at import or registration time.
"""

from __future__ import annotations

import ast
from pathlib import Path

import mentorrl

ROOT = Path(mentorrl.__file__).parent

# (path under mentorrl/, name) -> why it stays a module-level container
ALLOWED = {
    ("chat_templates/formats.py", "TOOL_FORMATS"): "registry: filled by register_tool_format at import/registration",
    ("eval/judge.py", "_JUDGES"): "registry: filled by register_judge at registration",
    ("train/loop.py", "LOOPS"): "registry: filled by register_loop (a decorator) at import",
    ("models/batch.py", "_PACK_VERIFIED"): "weak side table of a module object: its entry dies with the module",
    ("opd/align.py", "_SPELLERS"): "weak side table of a tokenizer object: its entry dies with the tokenizer",
    ("rollout/decoders.py", "_checked"): "weak side table of a model object: the slot-decoder check, per model",
    ("rollout/decoders.py", "_POOL"): "weak side table of a model object: its KV buffers, reused (overwritten)",
}

CONTAINER_CALLS = {
    "dict",
    "list",
    "set",
    "OrderedDict",
    "defaultdict",
    "Counter",
    "deque",
    "WeakKeyDictionary",
    "WeakValueDictionary",
    "WeakSet",
}
MUTATORS = {
    "append",
    "appendleft",
    "add",
    "clear",
    "discard",
    "extend",
    "extendleft",
    "insert",
    "move_to_end",
    "pop",
    "popitem",
    "popleft",
    "remove",
    "setdefault",
    "update",
}


def _is_container(value: ast.expr) -> bool:
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        f = value.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
        return name in CONTAINER_CALLS
    return False


def _module_level(body: list[ast.stmt]):
    """The statements run at import (into if / try / with blocks, not into functions or classes)."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
            for field in ("body", "orelse", "finalbody"):
                yield from _module_level(getattr(stmt, field, []))
            for handler in getattr(stmt, "handlers", []):
                yield from _module_level(handler.body)


def _containers(tree: ast.Module) -> set[str]:
    out = set()
    for stmt in _module_level(tree.body):
        if isinstance(stmt, ast.Assign) and _is_container(stmt.value):
            out |= {t.id for t in stmt.targets if isinstance(t, ast.Name)}
        elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None and _is_container(stmt.value):
            if isinstance(stmt.target, ast.Name):
                out.add(stmt.target.id)
    return out


def _local_names(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    args = fn.args
    names = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg] if a}
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def _mutated(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """Names ``fn`` mutates in place: ``x.append(...)``, ``x[k] = v``, ``x[k] += v``, ``del x[k]``."""
    out = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            if isinstance(node.func.value, ast.Name):
                out.add(node.func.value.id)
        targets = (
            node.targets
            if isinstance(node, (ast.Assign, ast.Delete))
            else [node.target]
            if isinstance(node, ast.AugAssign)
            else []
        )
        for t in targets:
            if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name):
                out.add(t.value.id)
    return out - _local_names(fn)


def runtime_globals(root: Path) -> dict[tuple[str, str], str]:
    """(path under ``root``, name) -> what makes it run-time state, for every module under ``root``."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(), filename=str(path))
        containers = _containers(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                for name in node.names:
                    found[(rel, name)] = f"line {node.lineno}: global {name}"
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for name in _mutated(node) & containers:
                    found.setdefault((rel, name), f"mutated in {node.name}() (line {node.lineno})")
    return found


def test_no_module_holds_runtime_state_in_a_global_but_the_allowed():
    found = runtime_globals(ROOT)
    unexpected = {k: v for k, v in found.items() if k not in ALLOWED}
    assert not unexpected, "module-level run-time state (own it by an object, or pass it down):\n" + "\n".join(
        f"  mentorrl/{path}: {name}: {why}" for (path, name), why in sorted(unexpected.items())
    )


def test_the_allow_list_is_tight():
    """Every allowed name is still there and still mutated: a fixed one leaves the list."""
    found = runtime_globals(ROOT)
    assert sorted(k for k in ALLOWED if k not in found) == []
    assert all(why.strip() for why in ALLOWED.values())


def test_the_check_sees_a_global_statement_and_a_mutated_container(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        "from collections import OrderedDict\n"
        "_current = None\n"
        "_open: dict = {}\n"
        "_seen = set()\n"
        "_lru = OrderedDict()\n"
        "CONSTANT = {'a': 1}\n"
        "def join(x):\n"
        "    global _current\n"
        "    _current = x\n"
        "def remember(key, value):\n"
        "    _open[key] = value\n"
        "    _seen.add(key)\n"
        "    _lru.move_to_end(key)\n"
        "def read(key, CONSTANT=CONSTANT):\n"
        "    CONSTANT[key] = 1  # a parameter: not the module's\n"
        "    return _open.get(key)\n"
    )
    found = runtime_globals(tmp_path)
    assert set(found) == {("pkg/m.py", "_current"), ("pkg/m.py", "_open"), ("pkg/m.py", "_seen"), ("pkg/m.py", "_lru")}
