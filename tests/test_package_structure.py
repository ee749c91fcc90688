"""Structure rules for the whole package: no function in mentorrl/ over 80 lines, and no module
importing another mentorrl module's private (``_underscore``) names."""

from __future__ import annotations

import ast
from pathlib import Path

import mentorrl

PACKAGE = Path(mentorrl.__file__).parent
MAX_LINES = 80


def long_functions(root: Path, limit: int = MAX_LINES) -> list[str]:
    """``path:line name (n lines)`` of every function (nested ones too) under ``root`` longer than ``limit``."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({n} lines)")
    return out


def private_imports(root: Path, package: str = "mentorrl") -> list[str]:
    """``path:line module.name`` of every ``from <package>... import _name`` (or relative ``from . import
    _name``) under ``root``: a private name (one underscore, not a dunder) taken from another module."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            module = node.module or ""
            if node.level == 0 and module != package and not module.startswith(package + "."):
                continue
            where = f"{path.relative_to(root.parent)}:{node.lineno}"
            out += [
                f"{where} {'.' * node.level}{module}.{a.name}"
                for a in node.names
                if a.name.startswith("_") and not a.name.startswith("__")
            ]
    return out


def test_no_function_in_the_package_is_over_80_lines():
    assert long_functions(PACKAGE) == []


def test_no_module_imports_another_modules_private_names():
    assert private_imports(PACKAGE) == []


def test_the_length_check_sees_a_long_function(tmp_path):
    (tmp_path / "m.py").write_text("def f():\n" + "    x = 1\n" * 85 + "\n\ndef g():\n    return 1\n")
    assert long_functions(tmp_path) == [f"{tmp_path.name}/m.py:1 f (86 lines)"]


def test_the_private_import_check_sees_absolute_relative_and_nested_imports(tmp_path):
    (tmp_path / "m.py").write_text(
        "from mentorrl.a import public, _private\n"
        "from .b import _rel\n"
        "from mentorrl import __version__\n"  # a dunder is not private
        "from os.path import _get_sep\n"  # another package's names are not this rule's business
        "from mentorrlx import _other\n"
        "def f():\n"
        "    from mentorrl.c.d import _inner\n"
    )
    name = tmp_path.name
    assert private_imports(tmp_path) == [
        f"{name}/m.py:1 mentorrl.a._private",
        f"{name}/m.py:2 .b._rel",
        f"{name}/m.py:7 mentorrl.c.d._inner",
    ]
