"""Logs a cluster can read (issue 40, item 5): with stdout not a terminal, a stage prints plain
progress lines as it goes (stage, step/total, reward, success, tokens/s, elapsed, ETA), at least
every ``logging.log_every_steps`` steps and after any step ending ``logging.log_every_s`` seconds
after the last line; a terminal keeps its rich bar."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from mentorrl.config import load_config
from mentorrl.train.progress import StepLines, progress_line, stage_progress

LINE = re.compile(
    r"^\[(?P<stage>[\w-]+)\] step (?P<step>\d+)/(?P<total>\d+) reward=(?P<reward>-|-?\d+\.\d{3}) "
    r"success=(?P<success>-|\d\.\d{3}) tok/s=(?P<toks>-|\d+) elapsed=(?P<elapsed>\d+:\d\d:\d\d) "
    r"eta=(?P<eta>-|\d+:\d\d:\d\d)$"
)


@given(
    every_steps=st.integers(1, 8),
    every_s=st.floats(0.5, 60),
    durations=st.lists(st.floats(0, 90, allow_nan=False), min_size=1, max_size=60),
    start=st.integers(0, 5),
)
@settings(max_examples=300, deadline=None)
def test_lines_come_exactly_when_due(every_steps, every_s, durations, start):
    """With a fake clock: the first step and the last get a line; a line comes after every
    ``every_steps`` steps at most, and after any step ending ``every_s`` or more after the last
    line; no other step gets one."""
    total = start + len(durations)
    now, clock = [0.0], lambda: now[0]
    lines: list[str] = []
    sl = StepLines("grpo", total, lines.append, every_steps=every_steps, every_s=every_s, clock=clock)
    printed: list[tuple[int, float]] = []
    for i, d in enumerate(durations):
        now[0] += d
        step = start + i + 1
        n = len(lines)
        sl.update(step, {"reward_mean": 0.5, "task_success": 0.25, "rollout_tokens": 10.0})
        if len(lines) > n:
            printed.append((step, now[0]))
    steps = [s for s, _ in printed]
    assert steps[0] == start + 1 and steps[-1] == total
    assert all(b - a <= every_steps for a, b in zip(steps, steps[1:])), "a gap of more than every_steps steps"
    for (a, ta), (b, tb) in zip(printed, printed[1:]):
        # no line in between was due: fewer than every_steps steps and less than every_s seconds since a
        t = ta
        for j, d in enumerate(durations[a - start : b - start - 1]):
            t += d
            assert (a + j + 1) - a < every_steps and t - ta < every_s, "a due step got no line"
    assert len(lines) == len(printed) and all(LINE.match(x) for x in lines), lines


def test_line_fields():
    line = progress_line("sft", 5, 20, {"loss": 1.0, "train_tokens": 1.0}, elapsed=50.0, done=5, tokens=2500.0)
    m = LINE.match(line)
    assert m, line
    assert m["stage"] == "sft" and (m["step"], m["total"]) == ("5", "20")
    assert m["reward"] == "-" and m["success"] == "-"  # SFT logs neither
    assert m["toks"] == "50" and m["elapsed"] == "0:00:50" and m["eta"] == "0:02:30"
    line = progress_line("grpo", 3, 3, {"reward_mean": -0.25, "task_success": 1.0}, 3725.0, 3, None)
    m = LINE.match(line)
    assert m and (m["reward"], m["success"], m["toks"], m["eta"]) == ("-0.250", "1.000", "-", "0:00:00")
    assert m["elapsed"] == "1:02:05"


def _ws(terminal: bool):
    buf = io.StringIO()
    cfg = load_config(None, ["logging.log_every_steps=2"])
    return SimpleNamespace(
        cfg=cfg,
        show_progress=True,
        console=Console(file=buf, force_terminal=terminal, width=120),
        progress=lambda: __import__("rich.progress").progress.Progress(console=Console(file=buf, force_terminal=True)),
    ), buf


def test_a_terminal_keeps_its_bar_and_a_pipe_gets_lines():
    ws, buf = _ws(terminal=False)
    with stage_progress(ws, "grpo", 5, 0) as p:
        for s in range(1, 6):
            p.update(s, {"reward_mean": 0.1 * s})
    got = buf.getvalue().splitlines()
    assert [LINE.match(x)["step"] for x in got] == ["1", "3", "5"], got
    ws, buf = _ws(terminal=True)
    with stage_progress(ws, "grpo", 5, 0) as p:
        for s in range(1, 6):
            p.update(s, {"reward_mean": 0.1 * s})
    assert not any(LINE.match(x) for x in buf.getvalue().splitlines())


@pytest.mark.slow  # a tiny real run: SFT and GRPO, about a minute on a loaded CPU
def test_a_redirected_run_prints_per_step_lines(tmp_path):
    from test_resume import TINY_OVERRIDES

    cfg = load_config(
        None,
        [
            *TINY_OVERRIDES,
            f"run_dir={tmp_path / 'run'}",
            "audit.preflight=false",
            "eval.num_tasks=2",
            "logging.log_every_steps=1",
        ],
    )
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    env.update(OMP_NUM_THREADS="1", TERM="dumb")
    env.pop("FORCE_COLOR", None)
    out = tmp_path / "stdout.log"
    with out.open("wb") as f:  # stdout a file, as under nohup or a cluster scheduler
        proc = subprocess.run(
            [sys.executable, "-m", "mentorrl.cli", "train", str(path)],
            stdout=f,
            stderr=subprocess.PIPE,
            cwd=tmp_path,
            env=env,
            timeout=900,
        )
    text = out.read_text()
    assert proc.returncode == 0, proc.stderr.decode()[-3000:] + text[-2000:]
    lines = [m for m in map(LINE.match, text.splitlines()) if m]
    for stage, n in (("sft", cfg.sft.steps), ("grpo", cfg.grpo.steps)):
        got = [m for m in lines if m["stage"] == stage]
        assert [int(m["step"]) for m in got] == list(range(1, n + 1)), text
        assert all(int(m["total"]) == n for m in got)
        assert all(m["toks"] != "-" for m in got), "tokens/s missing"
    grpo = [m for m in lines if m["stage"] == "grpo"]
    assert all(m["reward"] != "-" and m["success"] != "-" for m in grpo)
    bars = [x for x in text.splitlines() if re.search(r"━.*\d+/\d+", x)]
    assert not bars, f"a rich bar was printed to a file: {bars}"
