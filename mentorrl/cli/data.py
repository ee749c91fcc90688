"""``mentorrl export`` and ``mentorrl import``: run data <-> Hugging Face datasets in TRL's formats.

* ``mentorrl export RUN_DIR --out OUT --what trajectories|corrections|preferences`` writes
  ``OUT/<what>.parquet`` (or ``OUT/<what>/`` with ``--format disk``): TRL's conversational SFT
  format for trajectories and corrections, its conversational preference format for preference
  pairs (:mod:`mentorrl.datasets_io` says what goes in each column);
* ``mentorrl import DATASET --out demos.jsonl --model DIR`` reads such a dataset (Parquet,
  a ``save_to_disk`` folder or JSON lines) and writes SFT demonstrations (Trajectory JSONL,
  tokenised with DIR's tokenizer); a bad row exits 2 with the row and field named.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer
from rich.markup import escape

from mentorrl.cli_common import console, err, output_path, quiet_transformers
from mentorrl.datasets_io import (
    DEFAULT_MAX_CHARS,
    DEFAULT_MAX_TOKENS,
    KINDS,
    DatasetFormatError,
    export_rows,
    import_demos,
    load_rows,
    write_dataset,
)
from mentorrl.trajectory import write_jsonl


def _fail(msg: str, code: int = 2) -> None:
    err.print(f"[red]{escape(msg)}[/red]")
    raise typer.Exit(code)


def _is_tokenizer_dir(p: Path) -> bool:
    return p.is_dir() and ((p / "tokenizer.json").exists() or (p / "tokenizer_config.json").exists())


def find_tokenizer_dir(run_dir: Path) -> Path | None:
    """The run's tokenizer: ``base_model/``, else a stage's ``final/``, else its newest checkpoint."""
    root = run_dir if run_dir.is_dir() else run_dir.parent
    candidates = [
        root / "base_model",
        *sorted(root.glob("*/final")),
        *sorted(root.glob("*/checkpoints/step-*"), reverse=True),
    ]
    return next((p for p in candidates if _is_tokenizer_dir(p)), None)


def _quiet_datasets() -> None:
    try:
        import datasets
    except ImportError:  # datasets_io says how to install it
        return
    datasets.disable_progress_bars()
    datasets.utils.logging.set_verbosity_error()


def _load_tokenizer(path: Path):
    quiet_transformers()
    _quiet_datasets()
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        _fail(f"{path}: cannot load a tokenizer: {e}")


def env_info_from_registry():
    """``env name -> (system prompt, tool schemas)`` from the registered environments (None if unknown)."""
    from mentorrl.contract import tool_schemas
    from mentorrl.envs import get_env

    cache: dict[str, Any] = {}

    def info(name: str):
        if name not in cache:
            try:
                env = get_env(name).make_env()
            except ValueError:
                cache[name] = None
            else:
                try:
                    cache[name] = (env.system_prompt, tool_schemas(env))
                finally:
                    env.close()
        return cache[name]

    return info


def export_command(
    run_dir: Path = typer.Argument(..., exists=True, help="a run directory (or one JSONL file of records)"),
    old_out: Optional[Path] = typer.Argument(None, help="deprecated: use --out", show_default=False, metavar="[OUT]"),
    out: Optional[Path] = typer.Option(
        None, "--out", "-o", help="output directory: OUT/<what>.parquet (or OUT/<what>/ with --format disk)"
    ),
    what: str = typer.Option("trajectories", "--what", help="trajectories | corrections | preferences"),
    only_success: bool = typer.Option(
        False, "--only-success", help="only trajectories the verifier accepted with no violation"
    ),
    all_splits: bool = typer.Option(
        False, "--all-splits", help="also held-out / hidden evaluation episodes (default: the train split only)"
    ),
    model: Optional[Path] = typer.Option(
        None, "--model", exists=True, file_okay=False, help="checkpoint or tokenizer directory (default: the run's own)"
    ),
    fmt: str = typer.Option("parquet", "--format", help="parquet (Dataset.to_parquet) | disk (save_to_disk)"),
) -> None:
    """Write a run's trajectories, corrections or preference pairs as a Hugging Face dataset in TRL's formats."""
    out = output_path(old_out, out, "export")
    if what not in KINDS:
        _fail(f"--what {what!r}: expected one of {', '.join(KINDS)}")
    if fmt not in ("parquet", "disk"):
        _fail(f"--format {fmt!r}: expected parquet or disk")
    tok_dir = model or find_tokenizer_dir(run_dir)
    if tok_dir is None:
        _fail(f"{run_dir}: no tokenizer found (base_model/, <stage>/final/); pass --model DIR")
    tokenizer = _load_tokenizer(tok_dir)
    try:
        rows, summary = export_rows(
            run_dir,
            what,
            tokenizer,
            env_info=env_info_from_registry(),
            only_success=only_success,
            all_splits=all_splits,
        )
    except (ValueError, OSError) as e:
        _fail(str(e))
    if not summary.files:
        _fail(f"{run_dir}: no {what} files (looked for {', '.join(_globs(what))})")
    if not rows:
        _fail(f"{run_dir}: nothing to export ({_skips(summary.skipped) or 'the files are empty'})", 1)
    try:
        path = write_dataset(rows, what, out, fmt)
    except OSError as e:
        _fail(f"{out}: cannot write: {e.strerror or e}")
    console.print(f"wrote {summary.rows} {what} rows from {len(summary.files)} file(s) -> {escape(str(path))}")
    if summary.skipped:
        console.print(f"left out: {escape(_skips(summary.skipped))}")
    if summary.system_verbatim:
        console.print(
            f"{summary.system_verbatim} row(s) keep the recorded system text verbatim with no tools column "
            "(their tools were listed without descriptions, or the environment is not registered)"
        )


def _globs(what: str) -> tuple[str, ...]:
    from mentorrl.datasets_io import RUN_FILES

    return RUN_FILES[what]


def _skips(skipped: dict[str, int]) -> str:
    return ", ".join(f"{n} {reason}" for reason, n in sorted(skipped.items()))


def import_command(
    dataset: Path = typer.Argument(..., help="Parquet file(s), a save_to_disk folder, or JSON lines"),
    out: Path = typer.Option(..., "--out", "-o", help="demonstrations JSONL (Trajectory records) to write"),
    model: Path = typer.Option(
        ...,
        "--model",
        exists=True,
        file_okay=False,
        help="checkpoint or tokenizer directory of the model the demos will train",
    ),
    split: Optional[str] = typer.Option(None, "--split", help="the split of a DatasetDict (default: train)"),
    all_splits: bool = typer.Option(False, "--all-splits", help="also rows whose split column is not train"),
    max_chars: int = typer.Option(DEFAULT_MAX_CHARS, "--max-chars", min=1, help="most content characters per row"),
    max_tokens: int = typer.Option(DEFAULT_MAX_TOKENS, "--max-tokens", min=16, help="most tokens per conversation"),
    skip_invalid: bool = typer.Option(False, "--skip-invalid", help="leave bad rows out (listed) instead of exiting"),
) -> None:
    """Read a conversational dataset (TRL SFT or preference format) as SFT demonstrations."""
    tokenizer = _load_tokenizer(model)
    errors: list[str] = []
    try:
        data = load_rows(dataset, split)
        demos = import_demos(
            data,
            tokenizer,
            max_chars=max_chars,
            max_tokens=max_tokens,
            all_splits=all_splits,
            skip_invalid=skip_invalid,
            errors=errors,
        )
    except (DatasetFormatError, FileNotFoundError) as e:
        _fail(f"{dataset}: {e}")
    except ValueError as e:  # the tokenizer is not a ChatML one
        _fail(str(e))
    for e in errors[:20]:
        err.print(f"[yellow]skipped {escape(e)}[/yellow]")
    if len(errors) > 20:
        err.print(f"[yellow]... and {len(errors) - 20} more[/yellow]")
    if not demos:
        _fail(f"{dataset}: no usable rows", 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(out, demos)
    console.print(
        f"wrote {len(demos)} demonstrations ({sum(t.num_policy_tokens for t in demos)} policy tokens) "
        f"-> {escape(str(out))}" + (f"; {len(errors)} row(s) skipped" if errors else "")
    )


def register(app: typer.Typer) -> None:
    """Add ``export`` and ``import`` to a Typer app."""
    app.command("export")(export_command)
    app.command("import")(import_command)


__all__ = ["env_info_from_registry", "export_command", "find_tokenizer_dir", "import_command", "register"]
