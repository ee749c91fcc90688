"""`ruff check` (the rule set in pyproject.toml: syntax errors, undefined names, unused imports and
variables, each function's complexity and statement count, import order) passes on the package, the
benches and the tests, and `ruff format --check` finds nothing to reformat there."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREES = ["mentorrl", "bench", "tests"]


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, *TREES], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_ruff_finds_nothing():
    proc = ruff("check", "--output-format", "concise")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_tree_is_formatted():
    proc = ruff("format", "--check")
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_rules_reach_the_package():
    """The size and import-order rules are on, and their limits are the ones measured for the package."""
    import tomllib

    lint = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]
    assert {"C901", "PLR0915", "I"} <= set(lint["select"])
    assert lint["mccabe"]["max-complexity"] == 15 and lint["pylint"]["max-statements"] == 50
    assert not any(path.startswith("mentorrl") for path in lint.get("per-file-ignores", {}))
