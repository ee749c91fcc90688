"""Issue 18's structure rules for mentorrl/train: short functions, registered stages, one loop."""

from __future__ import annotations

import ast
from pathlib import Path

import mentorrl

TRAIN = Path(mentorrl.__file__).parent / "train"
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


def test_no_function_in_train_is_over_80_lines():
    assert long_functions(TRAIN) == []


def test_the_length_check_sees_a_long_function(tmp_path):
    (tmp_path / "m.py").write_text("def f():\n" + "    x = 1\n" * 85 + "\n\ndef g():\n    return 1\n")
    assert long_functions(tmp_path) == [f"{tmp_path.name}/m.py:1 f (86 lines)"]


def test_no_stage_imports_another_modules_private_names():
    """No module under mentorrl/train imports an _underscore name from another mentorrl.train module."""
    bad = []
    for path in sorted(TRAIN.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mentorrl.train"):
                bad += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert bad == []


def test_nothing_in_train_imports_the_compatibility_modules():
    """mentorrl.train.stages / mentorrl.train.opd only re-export moved names for outside callers."""
    bad = []
    for path in sorted(TRAIN.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in ("mentorrl.train.stages", "mentorrl.train.opd"):
                bad.append(f"{path.relative_to(TRAIN)}: {node.module}")
    assert bad == []
