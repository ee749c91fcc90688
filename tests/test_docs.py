"""The docs: the README stays short and keeps the two set-up commands, every relative link in
README.md and docs/ resolves, and the mkdocs-material site builds with no warning (strict)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

DEMO_COMMAND = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e . && mentorrl demo"
)
TEST_COMMAND = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && "
    'pip install -e ".[test]" && python -m pytest -q -n 2'
)

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def _markdown_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def _relative_links(path: Path) -> list[str]:
    text = _FENCE.sub("", path.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)  # links inside inline code are not links
    return [t for t in _LINK.findall(text) if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def test_readme_is_at_most_12_kb():
    assert len(README.read_bytes()) <= 12 * 1024, (
        f"README.md is {len(README.read_bytes())} bytes: move content to docs/"
    )


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
    res = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert "WARNING" not in out, out
    assert (tmp_path / "site" / "reference" / "configuration" / "index.html").exists()


# --- the results page and the changelog -------------------------------------------------------------------

RESULTS = ROOT / "docs" / "results.md"
CHANGELOG = ROOT / "docs" / "changelog.md"
_RAW_REF = re.compile(r"bench/results/[A-Za-z0-9_.*/-]*[A-Za-z0-9_*/]")
_HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")
_FIGURE = re.compile(r"\d+(?:\.\d+)?\s?%|\d(?:\.\d+)?×")
_ISSUE_REF = re.compile(r"\bissues?\b|(?<![\w/])#\d+\b", re.I)


def _results_sections() -> list[tuple[str, str]]:
    """(heading, body) for every ## / ### section of the results page, the preamble left out."""
    parts = re.split(r"^(#{2,3} .*)$", RESULTS.read_text(), flags=re.M)
    return list(zip(parts[1::2], parts[2::2]))


def test_results_page_is_under_25_kb():
    size = len(RESULTS.read_bytes())
    assert size < 25 * 1024, f"docs/results.md is {size} bytes: superseded runs belong in bench/results/archive/"


def test_every_raw_result_the_results_page_names_exists():
    refs = sorted(set(_RAW_REF.findall(RESULTS.read_text())))
    assert len(refs) >= 10, refs  # guard the guard: the page names its raw files this way
    missing = [r for r in refs if not (list(ROOT.glob(r)) if "*" in r else (ROOT / r).exists())]
    assert not missing, f"docs/results.md names raw files that do not exist: {missing}"


def test_every_figure_on_the_results_page_has_a_command_and_a_raw_file():
    inline_command = re.compile(r"`(?:python bench/|mentorrl )[^`]+`")
    lacking = []
    for heading, body in _results_sections():
        if not _FIGURE.search(body):
            continue
        has_command = "```bash" in body or bool(inline_command.search(body))
        has_raw = bool(_RAW_REF.search(body))
        if not (has_command and has_raw):
            lacking.append(f"{heading} (command: {has_command}, raw file: {has_raw})")
    assert not lacking, "sections with figures but no command or raw file:\n" + "\n".join(lacking)


def test_results_page_cites_commits_only_as_what_a_figure_was_measured_at():
    text = RESULTS.read_text()
    assert not _ISSUE_REF.search(text), _ISSUE_REF.search(text)
    stray = [line for line in text.splitlines() if _HASH.search(line) and not line.startswith("- Measured at:")]
    assert not stray, "commit hashes outside a 'Measured at' line:\n" + "\n".join(stray)
    assert text.count("- Measured at:") >= 8


def test_readme_links_to_the_results_instead_of_repeating_them():
    text = README.read_text()
    figures = [m for m in re.findall(r"\d+(?:\.\d+)?%", text) if m != "95%"]
    assert not figures, f"README repeats measured figures {figures}: link docs/results.md instead"
    assert len(re.findall(r"\bminutes\b", text)) == 2  # the demo's time and the tests' time, once each


def test_changelog_is_per_release_with_added_changed_fixed_only():
    text = CHANGELOG.read_text()
    releases = re.findall(r"^## (.*)$", text, flags=re.M)
    assert releases[0] == "[Unreleased]", releases
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), flags=re.M).group(1)
    assert f"[{version}]" in releases[1], (version, releases)
    for heading in releases[1:]:
        assert re.fullmatch(r"\[\d+\.\d+\.\d+\] - \d{4}-\d{2}-\d{2}", heading), heading
    for block in re.split(r"^## .*$", text, flags=re.M)[1:]:
        kinds = re.findall(r"^### (.*)$", block, flags=re.M)
        assert kinds == ["Added", "Changed", "Fixed"], kinds
    assert not _ISSUE_REF.search(text), _ISSUE_REF.search(text)
    assert len(text.encode()) < 12 * 1024, "the changelog is a user-facing summary, not a work log"
