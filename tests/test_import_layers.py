"""The import contracts in pyproject.toml (`[tool.importlinter]`) hold, and a broken one fails the check.

Layers point one way (cli -> train -> opd/flywheel/integrity/serve -> eval -> models -> rollout ->
rewards -> envs -> core), only the command line imports ``mentorrl.cli`` / ``mentorrl.cli_common``,
``mentorrl.config`` imports no runtime module, and sibling modules import no cycle.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("importlinter")


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [sys.executable, "-c", code, "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )


def test_the_import_contracts_hold():
    res = lint_imports(ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 broken" in res.stdout


@pytest.mark.parametrize(
    "module, line, contract",
    [
        ("mentorrl/envs/_probe.py", "import mentorrl.train.workspace", "Layers point one way"),
        ("mentorrl/rewards/_probe.py", "from mentorrl.cli_common import err", "Nothing outside the command line"),
        ("mentorrl/config/_probe.py", "import mentorrl.core.splits", "Layers point one way"),
    ],
)
def test_an_upward_import_breaks_a_contract(tmp_path, module, line, contract):
    shutil.copytree(ROOT / "mentorrl", tmp_path / "mentorrl", ignore=shutil.ignore_patterns("__pycache__", "bases"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / module).write_text(f'"""An upward import the contracts must catch."""\n\n{line}\n')
    res = lint_imports(tmp_path)
    assert res.returncode != 0, res.stdout
    broken = res.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken, res.stdout


def test_config_imports_no_runtime_module(tmp_path):
    """The config contract itself: a validator importing eval at module level breaks it."""
    shutil.copytree(ROOT / "mentorrl", tmp_path / "mentorrl", ignore=shutil.ignore_patterns("__pycache__", "bases"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    cfg = tmp_path / "mentorrl" / "config" / "loading.py"
    cfg.write_text(cfg.read_text().replace("import yaml\n", "import yaml\n\nimport mentorrl.eval.sets  # noqa\n", 1))
    res = lint_imports(tmp_path)
    assert res.returncode != 0
    assert "The config is schema only" in res.stdout.split("Broken contracts", 1)[-1], res.stdout
