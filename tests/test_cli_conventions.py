"""One CLI convention (issue 40, item 6): ``--run-dir`` on every command that writes a run, ``--out``
for every other output (the old positional form still works, with a note), ``mentorrl --version``,
a ``--set`` error naming the override, clear exit-2 errors for a lone surrogate and an alias bomb,
and a commands table in docs/getting-started.md that lists every registered command."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import click
import pytest
import typer
from cli_helpers import cli_output
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from mentorrl.cli import app
from mentorrl.config import ConfigError, config_reference, load_config

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()
COMMANDS = typer.main.get_command(app).commands  # name -> click command
WRITES_A_RUN = {"demo", "train", "diagnose"}
FIELDS = sorted({f.replace("[]", "") for f, _, _ in config_reference() if "[]" not in f})


def _exit_2(res, *needles: str) -> str:
    out = cli_output(res)
    assert res.exit_code == 2, out
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert "Traceback" not in out
    for n in needles:
        assert n in out, (n, out)
    return out


def _options(cmd) -> set[str]:
    return {o for p in cmd.params for o in getattr(p, "opts", [])}


# ------------------------------------------------------------ the table -----
def test_the_commands_table_lists_every_registered_command():
    text = (ROOT / "docs" / "getting-started.md").read_text()
    section = text[text.index("## Commands") :]
    section = section[: section.index("\n## ", 4)] if "\n## " in section[4:] else section
    listed = re.findall(r"^\| `mentorrl ([a-z][a-z-]*)", section, flags=re.M)
    assert len(listed) == len(set(listed)), f"a command is listed twice: {listed}"
    assert set(listed) == set(COMMANDS), (
        f"docs/getting-started.md's commands table: missing {sorted(set(COMMANDS) - set(listed))}, "
        f"not commands {sorted(set(listed) - set(COMMANDS))}"
    )


def test_version():
    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and res.output.strip() == f"mentorrl {version('mentorrl')}"
    proc = subprocess.run([sys.executable, "-m", "mentorrl.cli", "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == f"mentorrl {version('mentorrl')}", proc.stderr


# ---------------------------------------------------------- --run-dir, --out -----
def test_every_command_that_writes_a_run_takes_run_dir():
    for name in WRITES_A_RUN:
        assert "--run-dir" in _options(COMMANDS[name]), name
    for name, cmd in COMMANDS.items():  # a command that loads a run config and writes it is in the set
        if "--set" in _options(cmd) and name not in ("config", "init-model", "eval", "gate"):
            assert name in WRITES_A_RUN, f"{name} loads a run config: does it write a run? (--run-dir)"


def test_outputs_are_out_options():
    """No command takes its output as a (required) positional argument any more: every output is
    ``--out``; the deprecated positional form is optional and named ``old_out``."""
    for name, cmd in COMMANDS.items():
        args = [p for p in cmd.params if isinstance(p, click.Argument)]
        outs = [p.name for p in args if "out" in p.name]
        assert all(n == "old_out" for n in outs), (name, outs)
        if outs:
            assert "--out" in _options(cmd), name
            assert not next(p for p in args if p.name == "old_out").required, name
    for name in ("export", "import", "init-model", "transplant-vocab", "export-merged", "eval", "gate", "flywheel"):
        assert "--out" in _options(COMMANDS[name]), name


def test_the_positional_output_still_works_with_a_note(tmp_path):
    """init-model: --out and the old positional form write the same model; both at once exit 2."""
    common = ["--set", "threads=1", "--set", "model.spec.vocab_size=600", "--set", "model.tokenizer_corpus_tasks=60"]
    common += ["--set", "model.spec.hidden_size=32", "--set", "model.spec.intermediate_size=64"]
    common += ["--set", "model.spec.num_layers=1", "--set", "model.pretrain.steps=0", "--rebuild"]
    new = runner.invoke(app, ["init-model", "--out", str(tmp_path / "a"), *common])
    assert new.exit_code == 0, cli_output(new)
    assert "deprecated" not in cli_output(new)
    old = runner.invoke(app, ["init-model", str(tmp_path / "b"), *common])
    assert old.exit_code == 0, cli_output(old)
    assert "deprecated; write --out" in cli_output(old)
    for f in ("model.safetensors", "tokenizer.json"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
    _exit_2(runner.invoke(app, ["init-model", str(tmp_path / "c"), "--out", str(tmp_path / "d")]), "--out only")
    _exit_2(runner.invoke(app, ["init-model"]), "missing the output: --out")
    assert not (tmp_path / "c").exists() and not (tmp_path / "d").exists()
    _exit_2(runner.invoke(app, ["export", str(tmp_path)]), "export: missing the output: --out")


def test_train_run_dir_option(tmp_path):
    """``train --run-dir`` is the run directory (here a file: refused before anything, naming it)."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"run_dir: {tmp_path / 'elsewhere'}\n")
    run_file = tmp_path / "run"
    run_file.write_text("not a directory")
    _exit_2(runner.invoke(app, ["train", str(cfg), "--run-dir", str(run_file)]), "run_dir", str(run_file))
    assert run_file.read_text() == "not a directory" and not (tmp_path / "elsewhere").exists()


# ------------------------------------------------------------- --set errors -----
@given(field=st.sampled_from(FIELDS), typo=st.sampled_from(["z", "_x", "s"]), value=st.sampled_from(["10", "x"]))
@settings(max_examples=60, deadline=None)
def test_a_bad_set_names_the_override_and_the_field(field, typo, value):
    ov = f"{field}{typo}={value}"
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "mentorrl" / "configs" / "demo.yaml", [ov])
    msg = str(e.value)
    assert f"--set {ov}" in msg, msg
    assert f"{field}{typo}" in msg or field.rsplit(".", 1)[0] in msg, msg


def test_cli_set_typo_is_not_blamed_on_the_file():
    out = _exit_2(runner.invoke(app, ["config", "--set", "grpo.stepz=10"]), "--set grpo.stepz=10", "grpo.stepz")
    assert "invalid config" not in out.splitlines()[0]  # the first line blames the override


# --------------------------------------------------- fuzzer findings -----
def test_a_lone_surrogate_run_dir_exits_2_naming_the_field(tmp_path):
    argv_form = "\udcff".encode("utf-8", "surrogatepass").decode("utf-8", "surrogateescape")  # bash $'\udcff'
    for ov in (f"run_dir={argv_form}", 'run_dir="\\udcff"', "run_dir=\udcff"):
        _exit_2(runner.invoke(app, ["config", "--set", ov]), "run_dir", "surrogate")
    cfg = tmp_path / "s.yaml"
    cfg.write_text('run_dir: "\\udcff"\neval:\n  final_splits: ["\\ud800"]\n')
    _exit_2(runner.invoke(app, ["config", "--config", str(cfg)]), "run_dir", "eval.final_splits.0", "surrogate")
    _exit_2(runner.invoke(app, ["train", str(cfg), "--no-eval"]), "run_dir", "surrogate")
    _exit_2(runner.invoke(app, ["demo", "--run-dir", "\udcff"]), "run_dir", "surrogate")


def test_a_lone_surrogate_from_a_real_shell_exits_2(tmp_path):
    """The bytes bash passes for ``--set run_dir=$'\\udcff'``, through a real process."""
    arg = b"run_dir=\xed\xb3\xbf"
    proc = subprocess.run(
        [sys.executable.encode(), b"-m", b"mentorrl.cli", b"config", b"--set", arg], capture_output=True
    )
    assert proc.returncode == 2, proc.stderr.decode("utf-8", "replace")
    err = proc.stderr.decode("utf-8", "replace")
    assert "Traceback" not in err and "run_dir" in err and "--set run_dir=" in err


def _bomb(field: str, levels: int = 8, width: int = 9) -> str:
    """A billion-laughs document whose expansion sits in ``field`` (a list of lists ... of strings)."""
    lines = ["_l0: &l0 [" + ", ".join(["lol"] * width) + "]"]
    for lv in range(1, levels):
        lines.append(f"_l{lv}: &l{lv} [" + ", ".join([f"*l{lv - 1}"] * width) + "]")
    section, _, name = field.rpartition(".")
    body = f"{name}: *l{levels - 1}"
    return "\n".join(lines) + "\n" + (f"{section}:\n  {body}\n" if section else body + "\n")


@pytest.mark.parametrize("field", ["eval.final_splits", "logging.tags", "grpo.steps", "run_dir"])
def test_an_alias_bomb_in_a_known_field_exits_2_fast_naming_it(tmp_path, field):
    cfg = tmp_path / "bomb.yaml"
    cfg.write_text(_bomb(field))
    t0 = time.perf_counter()
    out = _exit_2(runner.invoke(app, ["config", "--config", str(cfg)]), field, "too large")
    assert time.perf_counter() - t0 < 10, out


def test_a_string_alias_bomb_is_bounded_before_validation(tmp_path):
    """One 400 KB string aliased 50 times: 20 MB of text once validated; refused first, naming the field."""
    big = "x" * 400_000
    cfg = tmp_path / "bomb.yaml"
    cfg.write_text(f'_s: &s "{big}"\nlogging:\n  tags: [' + ", ".join(["*s"] * 50) + "]\n")
    t0 = time.perf_counter()
    _exit_2(runner.invoke(app, ["config", "--config", str(cfg)]), "logging.tags", "characters")
    assert time.perf_counter() - t0 < 10
