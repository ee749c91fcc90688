"""The docs: the README stays short and keeps the two set-up commands, every relative link in
README.md and docs/ resolves, and the mkdocs-material site builds with no warning (strict)."""

from __future__ import annotations

import re
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

DEMO_COMMAND = ("python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e . "
                "&& mentorrl demo")
TEST_COMMAND = ("python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && "
                "pip install -e \".[test]\" && python -m pytest -q -n 2")

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def _markdown_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def _relative_links(path: Path) -> list[str]:
    text = _FENCE.sub("", path.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)  # links inside inline code are not links
    return [t for t in _LINK.findall(text) if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def test_readme_is_at_most_12_kb():
    assert len(README.read_bytes()) <= 12 * 1024, f"README.md is {len(README.read_bytes())} bytes: move content to docs/"


def test_readme_keeps_the_two_set_up_commands():
    text = README.read_text()
    assert "## Set-up: the two commands" in text
    assert f"```bash\n{DEMO_COMMAND}\n```" in text
    assert f"```bash\n{TEST_COMMAND}\n```" in text
    # .ci/run runs the README's test command: the two must agree
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install -q -e ".[test]"' in ci and "python -m pytest -q -n 2" in ci


def test_every_relative_link_resolves():
    broken = []
    for md in _markdown_files():
        for target in _relative_links(md):
            file_part = target.split("#", 1)[0]
            if file_part and not (md.parent / file_part).exists():
                broken.append(f"{md.relative_to(ROOT)}: {target}")
    assert not broken, "broken relative links:\n" + "\n".join(broken)


def test_the_link_checker_sees_links():
    """Guard the guard: the pattern finds the README's links into the docs."""
    links = _relative_links(README)
    assert "docs/results.md" in links and "docs/reference/configuration.md" in links


def test_mkdocs_build_is_strict_and_clean(tmp_path):
    import importlib.util

    missing = [m for m in ("mkdocs", "material") if importlib.util.find_spec(m) is None]
    assert not missing, "mkdocs-material is missing: pip install -e '.[test]'"
    assert "mkdocs-material" in (ROOT / "pyproject.toml").read_text(), "the [test] extra must install mkdocs-material"
    res = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "WARNING" not in out, out
    assert (tmp_path / "site" / "reference" / "configuration" / "index.html").exists()
