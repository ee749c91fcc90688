"""Load a run's report.html in a real headless browser (Chromium through Playwright) and check it.

    python bench/check_report_html.py                      # a tiny real run (about a minute on CPU), then check
    python bench/check_report_html.py --run-dir runs/demo  # check an existing run's report.html

Checks: the page loads from a file:// URL with no console error, no page error and no request
other than the page itself (it is self-contained); every chart (``svg.chart``) is laid out with a
non-zero size; every curve (``polyline``) has a non-zero drawn length; the sections (evaluation,
curves, reward breakdown, failure mix, review queue) are there. Saves a full-page screenshot
(``--screenshot``, default ``RUN_DIR/report_html.png``) and prints a JSON summary; exits 1 on a failed check.

Needs ``pip install playwright`` and a Chromium: ``--chromium PATH`` (default: ``chromium`` on PATH,
e.g. Debian's ``apt-get install chromium``), else Playwright's own (``playwright install chromium``).
CI has no browser, so this is a bench script; tests/test_report_html.py checks the page's structure.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SECTIONS = ("evaluation", "curves", "reward", "failures", "review")

TINY = [
    "threads=1",
    "model.spec.hidden_size=64",
    "model.spec.intermediate_size=128",
    "model.spec.num_layers=2",
    "model.spec.num_heads=2",
    "model.spec.num_kv_heads=1",
    "model.spec.vocab_size=600",
    "model.tokenizer_corpus_tasks=60",
    "model.pretrain.steps=0",
    "sft.steps=6",
    "sft.num_demos=16",
    "sft.batch_size=4",
    "grpo.steps=5",
    "grpo.tasks_per_step=2",
    "grpo.samples_per_task=2",
    "grpo.checkpoint_every=2",
    "eval.num_tasks=8",
    "sampling.max_new_tokens=24",
    "limits.max_turns=3",
    "limits.max_total_tokens=512",
    "prompt.tool_descriptions=false",
]


def tiny_run(run_dir: Path) -> None:
    """SFT -> GRPO of the tiny model, evaluated, as ``mentorrl train`` writes it (report.html included)."""
    cmd = [
        sys.executable,
        "-m",
        "mentorrl.cli",
        "train",
        str(REPO / "mentorrl" / "configs" / "demo.yaml"),
        "--set",
        f"run_dir={run_dir}",
    ]
    for o in TINY:
        cmd += ["--set", o]
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)


def check(page_path: Path, screenshot: Path, chromium: str | None) -> dict:
    from playwright.sync_api import sync_playwright

    url = page_path.resolve().as_uri()
    console, page_errors, requests = [], [], []
    with sync_playwright() as p:
        kw = {"executable_path": chromium} if chromium else {}
        browser = p.chromium.launch(headless=True, args=["--no-sandbox"], **kw)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            page.on("console", lambda m: console.append({"type": m.type, "text": m.text}))
            page.on("pageerror", lambda e: page_errors.append(str(e)))
            page.on("request", lambda r: requests.append(r.url))
            page.goto(url, wait_until="load")
            charts = page.evaluate("""() => [...document.querySelectorAll('svg.chart')].map(s => {
                const r = s.getBoundingClientRect();
                const lines = [...s.querySelectorAll('polyline')].map(l => l.getTotalLength());
                return {label: s.getAttribute('aria-label'), width: r.width, height: r.height,
                        polylines: lines.length, min_length: lines.length ? Math.min(...lines) : null,
                        bars: s.querySelectorAll('rect.bar').length};
            })""")
            sections = page.evaluate(f"() => {list(SECTIONS)!r}.filter(id => document.getElementById(id))")
            review_rows = page.evaluate("() => document.querySelectorAll('#review ~ table tr').length")
            version = browser.version
            screenshot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(screenshot), full_page=True)
        finally:
            browser.close()
    problems = []
    errors = [c for c in console if c["type"] in ("error", "warning")]
    if errors:
        problems.append(f"console errors/warnings: {errors}")
    if page_errors:
        problems.append(f"page errors: {page_errors}")
    others = [u for u in requests if u != url]
    if others:
        problems.append(f"the page fetched {others} (it must be self-contained)")
    if not charts:
        problems.append("no chart")
    for c in charts:
        if not (c["width"] > 0 and c["height"] > 0):
            problems.append(f"chart {c['label']!r} is not laid out ({c['width']}x{c['height']})")
        if c["polylines"] and not c["min_length"] > 0:
            problems.append(f"chart {c['label']!r} has a curve of zero length")
        if not c["polylines"] and not c["bars"]:
            problems.append(f"chart {c['label']!r} draws nothing")
    missing = [s for s in SECTIONS if s not in sections]
    if missing:
        problems.append(f"missing sections {missing}")
    return {
        "page": str(page_path),
        "browser": f"Chromium {version}",
        "charts": len(charts),
        "curves": sum(c["polylines"] for c in charts),
        "bars": sum(c["bars"] for c in charts),
        "review_rows": review_rows,
        "console_messages": len(console),
        "requests": len(requests),
        "screenshot": str(screenshot),
        "problems": problems,
        "ok": not problems,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", type=Path, help="a run directory with report.html (default: a tiny run now)")
    ap.add_argument("--screenshot", type=Path, help="where to save the screenshot (default RUN_DIR/report_html.png)")
    ap.add_argument(
        "--chromium",
        default=shutil.which("chromium") or shutil.which("chromium-browser"),
        help="Chromium executable (default: chromium on PATH, else Playwright's own)",
    )
    args = ap.parse_args(argv)
    run_dir = args.run_dir
    if run_dir is None:
        run_dir = Path(tempfile.mkdtemp(prefix="report-html-")) / "run"
        tiny_run(run_dir)
    page = run_dir / "report.html"
    if not page.exists():
        print(f"{page} does not exist (a run from before report.html: rebuild its report)", file=sys.stderr)
        return 1
    result = check(page, args.screenshot or run_dir / "report_html.png", args.chromium)
    print(json.dumps(result, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
