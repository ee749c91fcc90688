"""Helpers every `mentorrl` command shares: consoles, quiet transformers, config loading."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

console = Console()
err = Console(stderr=True, soft_wrap=True)  # error messages stay one greppable line

PACKAGED_CONFIGS = Path(__file__).parent / "configs"


def quiet_transformers() -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def output_path(positional: Optional[Path], option: Optional[Path], command: str, metavar: str = "OUT") -> Path:
    """The output of ``command``: ``--out`` (the one convention), or the deprecated positional form,
    still taken with a note on stderr. Neither, or two different ones, exits 2."""
    if positional is not None and option is not None and positional != option:
        err.print(f"[red]{escape(f'{command}: two outputs ({positional} and --out {option}); give --out only')}[/red]")
        raise typer.Exit(2)
    if positional is None and option is None:
        err.print(f"[red]{escape(f'{command}: missing the output: --out {metavar}')}[/red]")
        raise typer.Exit(2)
    if option is None:
        err.print(
            f"[yellow]note: {escape(f'`mentorrl {command} ... {metavar}` (the output as a positional argument) is deprecated; write --out {metavar}')}[/yellow]"
        )
        return positional  # type: ignore[return-value]
    return option


def load_run_config(
    config: Optional[Path],
    overrides: list[str],
    run_dir: Optional[str] = None,
    default: str | None = "demo.yaml",
    plugins: Optional[list[str]] = None,
):
    """A RunConfig from ``config`` (else the packaged ``default``) and ``key=value`` overrides, with
    ``plugins`` (modules) loaded before it is validated, besides the config's own ``plugins``.

    ``run_dir`` is a default: an explicit ``run_dir=...`` override wins. A bad config exits 2
    with the message naming the field.
    """
    from mentorrl.config import ConfigError, load_config

    path = config if config is not None else (PACKAGED_CONFIGS / default if default else None)
    ov = list(overrides)
    if run_dir is not None and not any(o.startswith("run_dir=") for o in ov):
        ov.append(f"run_dir={json.dumps(str(run_dir))}")  # quoted: a path is a string, whatever its characters
    try:
        return load_config(path, ov, plugins=plugins)
    except ConfigError as e:
        err.print(f"[red]{escape(str(e))}[/red]")
        raise typer.Exit(2) from None
